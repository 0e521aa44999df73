"""nan and inf never train a model silently.

Non-finite feature values stop the input with an error naming file and row
(unless allowed); a weight that becomes non-finite stops the run before
anything more is saved or exported.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import input_fns
from trainer import finite_weights
from cli_helpers import CSV_FLAGS, run_module, write_tabular_csv
from input_helpers import (example, float_feature, int_feature,
                           run_input_fn, write_records)

tf1 = tf.compat.v1


@pytest.mark.fast
@pytest.mark.parametrize('value', ['nan', '-inf', '1e39'])
def test_csv_non_finite_value_names_file_and_line(tmp_path, value):
  path = write_tabular_csv(tmp_path / 'data.csv', 10,
                           extra_lines=[f'0.5,{value},red,1'])
  data = input_fns.csv_data([path], [path], label_column='label',
                            categorical_columns={'colour': ['red', 'green',
                                                            'blue']},
                            n_classes=2)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r'data.csv:12.*not a finite.*--allow-non-finite'):
    run_input_fn(data.eval_input_fn(20))
  allowed = input_fns.csv_data(
      [path], [path], label_column='label', n_classes=2,
      categorical_columns={'colour': ['red', 'green', 'blue']},
      allow_non_finite=True)
  (features, _), = run_input_fn(allowed.eval_input_fn(20))
  assert not np.isfinite(features['x2'][-1])


@pytest.mark.fast
def test_tfrecord_non_finite_value_names_file_and_record(tmp_path):
  spec = {'x': tf.io.FixedLenFeature([], tf.float32),
          'label': tf.io.FixedLenFeature([], tf.int64)}
  path = write_records(tmp_path / 'data.tfrecord', [
      example(x=float_feature([value]), label=int_feature([0]))
      for value in (1.0, 2.0, float('nan'))])
  data = input_fns.tfrecord_data([path], [path], feature_spec=spec,
                                 label_key='label', n_classes=2)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=f'Feature x of TFRecord {path}:2 is nan or inf'):
    run_input_fn(data.eval_input_fn(3))


@pytest.mark.cli
def test_task_rejects_nan_data_and_fails_on_nan_weights(tmp_path):
  path = write_tabular_csv(tmp_path / 'data.csv', 60,
                           extra_lines=['0.5,nan,red,1'] * 4)
  args = (f'--train-files={path}', '--train-steps=30', *CSV_FLAGS)
  rejected = run_module('trainer.task', f'--job-dir={tmp_path / "a"}', *args,
                        check=False)
  assert rejected.returncode == 1
  # The first bad row the (shuffled) input reaches: any of lines 62-65.
  assert re.search(r'data\.csv:6[2-5]: ', rejected.stderr), rejected.stderr
  assert '--allow-non-finite' in rejected.stderr
  # Allowed in, the nan reaches the weights: the run fails, exports nothing.
  allowed = run_module('trainer.task', f'--job-dir={tmp_path / "b"}', *args,
                       '--allow-non-finite', check=False)
  assert allowed.returncode == 1, allowed.stderr[-2000:]
  assert 'task: error: ' in allowed.stderr and 'nan' in allowed.stderr.lower()
  assert 'Traceback' not in allowed.stderr
  assert not (tmp_path / 'b' / 'export').exists()
  assert 'eval:' not in allowed.stdout


@pytest.mark.fast
def test_weights_turning_nan_stop_training_before_the_next_save():
  # A nan the loss does not show (e.g. behind a ReLU) still stops the run.
  with tf.Graph().as_default():
    step = tf1.train.get_or_create_global_step()
    weight = tf1.get_variable('w', initializer=[1.0, 2.0])
    poison = tf1.assign(weight, tf.where(step >= 2, [1.0, np.nan],
                                         [1.0, 2.0]))
    train_op = tf.group(poison, tf1.assign_add(step, 1))
    hook = finite_weights.FiniteWeightsHook()
    with tf1.train.MonitoredSession(hooks=[hook]) as session:
      session.run(train_op)
      session.run(train_op)
      with pytest.raises(finite_weights.NonFiniteWeightsError,
                         match=r'1 variable\(s\) nan or inf at step 3 \(w\)'):
        session.run(train_op)
