"""trainer.data_errors: input_fns' data checks as one line with task flags.

The errors come from real pipelines: an Estimator training on a bad CSV, and
one-shot iterators over bad CSV and TFRecord files.
"""

import numpy as np
import pytest
import tensorflow as tf

import input_fns
from cli_helpers import write_tabular_csv
from trainer import data_errors

tf1 = tf.compat.v1


def _write(path, text):
  path.write_text(text)
  return str(path)


def _error_of(input_fn):
  """The error of reading input_fn to its end in a session, as Estimator."""
  with tf.Graph().as_default():
    next_batch = tf1.data.make_one_shot_iterator(input_fn()).get_next()
    with tf1.Session() as session:
      with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        while True:
          session.run(next_batch)
  return caught.value


@pytest.mark.training
def test_malformed_csv_row_during_training_names_the_flag(tmp_path):
  path = _write(tmp_path / 'bad.csv', 'a,b,label\n1,2,0\nx,3,1\n')
  data = input_fns.csv_data([path], [path], label_column='label',
                            n_classes=2)
  estimator = tf.estimator.LinearClassifier(
      data.feature_columns, model_dir=str(tmp_path / 'model'))
  with pytest.raises(tf.errors.InvalidArgumentError) as caught:
    estimator.train(data.train_input_fn(2, shuffle=False), steps=3)
  assert data_errors.cli_message(caught.value) == (
      f'Malformed CSV row {path}:3: column `a`: `x` is not a number. Fix the '
      'row, or pass --skip-malformed to skip such rows.')


@pytest.mark.fast
def test_non_finite_csv_and_tfrecord_values_name_the_flag(tmp_path):
  path = _write(tmp_path / 'nan.csv', 'a,b,label\n1,nan,0\n')
  data = input_fns.csv_data([path], [path], label_column='label',
                            n_classes=2)
  message = data_errors.cli_message(_error_of(data.eval_input_fn(1)))
  assert message == (
      f'Malformed CSV row {path}:2: column `b`: `nan` is not a finite float32 '
      '(pass --allow-non-finite to keep such values). Fix the row, or pass '
      '--skip-malformed to skip such rows.')

  record = tf.train.Example(features=tf.train.Features(feature={
      'x': tf.train.Feature(float_list=tf.train.FloatList(value=[np.inf])),
      'label': tf.train.Feature(int64_list=tf.train.Int64List(value=[7]))}))
  records = str(tmp_path / 'data.tfrecord')
  with tf.io.TFRecordWriter(records) as writer:
    writer.write(record.SerializeToString())
  spec = {'x': tf.io.FixedLenFeature([], tf.float32),
          'label': tf.io.FixedLenFeature([], tf.int64)}
  data = input_fns.tfrecord_data([records], [records], feature_spec=spec,
                                 label_key='label', n_classes=2)
  message = data_errors.cli_message(_error_of(data.eval_input_fn(1)))
  # Either check may fire first; each is one line naming the record.
  assert message is not None and '\n' not in message
  assert f'TFRecord {records}:0' in message
  assert message in (
      f'Bad label 7 in TFRecord {records}:0: class ids must be in [0, 2).',
      f'Feature x of TFRecord {records}:0 is nan or inf; pass '
      '--allow-non-finite to keep such values.')


@pytest.mark.fast
def test_other_errors_are_not_data_errors():
  with tf.Graph().as_default(), tf1.Session() as session:
    check = tf.debugging.Assert(False, ['some other assertion'])
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
      session.run(check)
  assert data_errors.cli_message(caught.value) is None
  assert data_errors.cli_message(ValueError('Malformed CSV row x')) is None


@pytest.mark.fast
@pytest.mark.parametrize('kwargs,expected', [
    ({'columns': ['label'], 'header': False},
     "--columns=['label'] has no feature besides the label."),
    ({'label_column': 'y'}, "--label-column='y' is not a column; columns "
     "are ['x1', 'x2', 'colour', 'label']."),
    ({'train_files': ['/nonexistent/*.csv']},
     "--train-files: the glob '/nonexistent/*.csv' matches no file"),
])
def test_input_errors_name_the_task_flags(tmp_path, kwargs, expected):
  # The command line showed `columns=[...]`, which no flag spells.
  path = write_tabular_csv(tmp_path / 'data.csv', 5)
  arguments = {'train_files': [path], 'eval_files': [path],
               'label_column': 'label', 'n_classes': 2, **kwargs}
  with pytest.raises(ValueError) as caught:
    input_fns.csv_data(**arguments)
  assert data_errors.in_flag_terms(str(caught.value)).startswith(expected)


@pytest.mark.fast
def test_a_malformed_predict_row_names_the_flag(tmp_path):
  path = write_tabular_csv(tmp_path / 'data.csv', 3)
  data = input_fns.csv_data([path], [path], label_column='label', n_classes=2)
  with pytest.raises(ValueError) as caught:
    data.example_ids()
  message = data_errors.in_flag_terms(str(caught.value),
                                      eval_files='--predict-files')
  assert message.startswith(f'Malformed CSV row {path}:2: ')
  assert message.endswith('Fix the row, or pass --skip-malformed.')
