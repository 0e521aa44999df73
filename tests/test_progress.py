"""Progress lines of long evaluations and predictions."""

import logging

from absl import logging as absl_logging
import numpy as np
import pytest
import tensorflow as tf

from trainer import progress


@pytest.fixture(autouse=True)
def info_logs(caplog):
  """absl INFO lines reach caplog, whatever other tests set the level to."""
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.INFO)
  yield
  absl_logging.set_verbosity(verbosity)


def _lines(caplog):
  return [r.getMessage() for r in caplog.records
          if r.getMessage().startswith(('predicted', 'evaluating'))]


@pytest.mark.fast
def test_counted_logs_how_far_it_is(caplog):
  items = progress.counted(iter('abc'), progress.Progress(
      'predicted', 'rows', total=3, every_secs=0))
  assert list(items) == ['a', 'b', 'c']
  assert _lines(caplog) == ['predicted: 1 of 3 rows', 'predicted: 2 of 3 rows',
                            'predicted: 3 of 3 rows']


@pytest.mark.fast
def test_no_line_before_the_period(caplog):
  assert list(progress.counted(range(50), progress.Progress(
      'predicted', 'rows', every_secs=3600))) == list(range(50))
  assert not _lines(caplog)


def _model_fn(features, labels, mode):
  logits = tf.compat.v1.layers.dense(features['x'], 2)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  step = tf.compat.v1.train.get_global_step()
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=tf.compat.v1.assign_add(step, 1),
      evaluation_hooks=[progress.EvalProgressHook(
          every_secs=0)])


@pytest.mark.training
def test_evaluation_logs_its_batches(tmp_path, caplog):

  def input_fn():
    x = np.zeros((10, 3), np.float32)
    return tf.data.Dataset.from_tensor_slices(
        ({'x': x}, np.zeros(10, np.int32))).batch(4)

  estimator = tf.estimator.Estimator(_model_fn, model_dir=str(tmp_path))
  estimator.train(input_fn, steps=1)
  estimator.evaluate(input_fn)
  assert _lines(caplog) == ['evaluating: 1 batches', 'evaluating: 2 batches',
                            'evaluating: 3 batches']
