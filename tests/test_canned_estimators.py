"""The canned Estimators' own model_fns, replicated, equal one device.

The `tf.compat.v1.estimator` canned Estimators sum their loss over the batch
and DNNLinearCombined advances global_step itself; both must come out as on
one device, from the same start checkpoint, on batches that do not divide by
the tower count.
"""

import shutil

import numpy as np
import pytest
import tensorflow as tf

import trainer
from helpers import (assert_same_variables, dataset_input_fn,
                     run_config, save_start_checkpoint, variables_of)

pytestmark = pytest.mark.training

tf1 = tf.compat.v1
STEPS = 4
BATCH = 7  # Divides by neither 2 nor 3 towers.
COLUMNS = [tf.feature_column.numeric_column('x', shape=(5,))]


def _v1_canned(kind):
  v1 = tf1.estimator
  if kind == 'dnn':
    return v1.DNNClassifier(hidden_units=[4], feature_columns=COLUMNS)
  if kind == 'linear':
    return v1.LinearClassifier(feature_columns=COLUMNS)
  if kind == 'combined':
    return v1.DNNLinearCombinedClassifier(
        linear_feature_columns=COLUMNS, dnn_feature_columns=COLUMNS,
        dnn_hidden_units=[4])
  if kind == 'baseline':
    return v1.BaselineClassifier()
  if kind == 'dnn_regressor':
    return v1.DNNRegressor(hidden_units=[4], feature_columns=COLUMNS)
  raise ValueError(kind)


def _pair(tmp_path, model_fn, towers, input_fn, params=None, **wrapper_kwargs):
  """(one-device, replicated) Estimators that start from one checkpoint."""
  dirs = [tmp_path / 'one', tmp_path / 'many']
  save_start_checkpoint(model_fn, input_fn, dirs, params)
  one = tf.estimator.Estimator(
      model_fn, config=run_config(dirs[0], 1),
      params=params)
  many = tf.estimator.Estimator(
      trainer.replicate_model_fn(model_fn, **wrapper_kwargs), params=params,
      config=run_config(dirs[1], towers))
  return one, many


def _labels(data, kind):
  x, y = data
  labels = y[:, None].astype(np.float32 if 'regressor' in kind else np.int32)
  return {'x': x}, labels


@pytest.fixture(scope='module')
def canned_one_device(tmp_path_factory, data):
  """`canned_one_device(kind)`: (start checkpoint dir, one-device variables).

  Canned initializers are not seeded, so the start checkpoint is random:
  each kind saves one once and trains the one-device Estimator from it once
  (deterministic from there); each tower count's case trains its replicated
  run from a copy of that start.
  """
  runs = {}

  def get(kind):
    if kind not in runs:
      root = tmp_path_factory.mktemp(f'canned_{kind}')
      features, labels = _labels(data, kind)
      input_fn = dataset_input_fn(features, labels, BATCH)
      model_fn = _v1_canned(kind).model_fn
      save_start_checkpoint(model_fn, input_fn, [root / 'one', root / 'start'])
      one = tf.estimator.Estimator(
          model_fn,
          config=run_config(root / 'one', 1))
      one.train(input_fn, steps=STEPS)
      runs[kind] = root / 'start', variables_of(one)
    return runs[kind]

  return get


@pytest.mark.parametrize('kind', ['dnn', 'linear', 'combined', 'baseline',
                                  'dnn_regressor'])
@pytest.mark.parametrize('towers', [2, 3])
def test_v1_canned_training_equals_one_device(tmp_path, data,
                                              canned_one_device, kind, towers):
  features, labels = _labels(data, kind)
  input_fn = dataset_input_fn(features, labels, BATCH)
  start, one = canned_one_device(kind)
  shutil.copytree(start, tmp_path / 'many')
  many = tf.estimator.Estimator(
      trainer.replicate_model_fn(_v1_canned(kind).model_fn),
      config=run_config(tmp_path / 'many', towers))
  many.train(input_fn, steps=STEPS)
  # global_step advances once per step, also where the model_fn advances it
  # itself (DNNLinearCombined), and every variable and slot matches.
  assert many.get_variable_value('global_step') == STEPS
  assert_same_variables(one, variables_of(many))


def test_v1_canned_with_a_static_batch_size_equals_one_device(tmp_path, data):
  # drop_remainder=True makes every shard's size static; the summed loss
  # must still be read as a sum.
  features, labels = _labels(data, 'dnn')

  def input_fn():
    ds = tf.data.Dataset.from_tensor_slices((features, labels))
    return ds.repeat().batch(BATCH, drop_remainder=True)

  one, many = _pair(tmp_path, _v1_canned('dnn').model_fn, 2, input_fn)
  one.train(input_fn, steps=STEPS)
  many.train(input_fn, steps=STEPS)
  assert_same_variables(variables_of(one), variables_of(many))


def test_v1_canned_eval_and_predict_equal_one_device(tmp_path, data):
  features, labels = _labels(data, 'combined')
  train_fn = dataset_input_fn(features, labels, BATCH)
  one, many = _pair(tmp_path, _v1_canned('combined').model_fn, 3, train_fn)
  one.train(train_fn, steps=2)
  many.train(train_fn, steps=2)
  eval_fn = dataset_input_fn(features, labels, BATCH, repeat=False)
  expected, actual = one.evaluate(eval_fn), many.evaluate(eval_fn)
  assert sorted(expected) == sorted(actual)
  for name in expected:
    np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5,
                               atol=1e-6, err_msg=name)
  predict_fn = dataset_input_fn(features, None, BATCH, repeat=False)
  expected, actual = list(one.predict(predict_fn)), list(many.predict(predict_fn))
  assert len(actual) == len(expected) == len(features["x"])
  for a, b in zip(expected, actual):
    np.testing.assert_allclose(b['logits'], a['logits'], rtol=1e-5, atol=1e-6)


def test_sum_loss_is_detected_so_gradients_are_not_shrunk(tmp_path, data):
  # Forcing the mean weighting on a summed loss is refused, not run.
  features, labels = _labels(data, 'dnn')
  input_fn = dataset_input_fn(features, labels, BATCH)
  _, many = _pair(tmp_path, _v1_canned('dnn').model_fn, 2, input_fn,
                  loss_reduction='mean')
  with pytest.raises(ValueError, match=r"loss_reduction='mean'.*is a sum"):
    many.train(input_fn, steps=1)


def _token_input_fn():
  """Sequences of 3 token ids, 7 per batch: SparseTensor features."""
  ids = np.random.RandomState(4).randint(0, 10, size=(7, 3)).astype(np.int64)
  dense = tf.constant(ids)
  indices = tf.where(tf.ones_like(dense, tf.bool))
  tokens = tf.SparseTensor(indices, tf.gather_nd(dense, indices), [7, 3])
  labels = tf.constant((ids[:, 0] > 4).astype(np.int64)[:, None])
  context = tf.constant(np.arange(7, dtype=np.float32)[:, None])
  return tf.data.Dataset.from_tensors(
      ({'tokens': tokens, 'context': context}, labels)).repeat()


def test_canned_rnn_with_sequence_columns_equals_one_device(tmp_path):
  # Its SequenceFeatures Keras layer makes its embedding through
  # get_variable under the layer's name; tower 1's layer was named
  # sequence_features_1 and its embedding refused as a new variable.
  column = tf.feature_column.embedding_column(
      tf.feature_column.sequence_categorical_column_with_identity(
          'tokens', num_buckets=10), dimension=4)
  # Evaluating it on the static batch of 7 counted only tower 0's examples
  # in its Keras metrics (accuracy 0.5 for 0.29) or refused its
  # 'prediction/mean' as a per-batch value.
  model_fn = tf.estimator.experimental.RNNClassifier(
      sequence_feature_columns=[column], units=[5], cell_type='lstm',
      context_feature_columns=[tf.feature_column.numeric_column('context')]
  ).model_fn
  one, many = _pair(tmp_path, model_fn, 2, _token_input_fn)
  one.train(_token_input_fn, steps=STEPS)
  many.train(_token_input_fn, steps=STEPS)
  assert_same_variables(variables_of(one), variables_of(many))
  expected = one.evaluate(_token_input_fn, steps=2)
  actual = many.evaluate(_token_input_fn, steps=2)
  assert sorted(actual) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5,
                               atol=1e-6, err_msg=name)


def _ragged_tokens(rows):
  """An input_fn of sequences of 1-3 tokens, `rows` per batch, as parsing
  VarLen features gives them: the SparseTensor is as wide as the batch's
  longest sequence, and every shard on 2 or 3 towers but the first has a
  shorter longest one."""
  lengths = [3, 3, 1, 1, 2, 1][:rows]
  indices = [[row, k] for row, n in enumerate(lengths) for k in range(n)]
  values = np.random.RandomState(5).randint(1, 10, len(indices))

  def input_fn():
    tokens = tf.SparseTensor(indices, tf.constant(values, tf.int64),
                             [rows, 3])
    labels = tf.constant([[0], [1], [1], [0], [1], [0]][:rows], tf.int64)
    return tf.data.Dataset.from_tensors(({'tokens': tokens}, labels)).repeat()

  return input_fn


@pytest.mark.parametrize('towers,rows', [(2, 6), (3, 6), (3, 5)])
def test_canned_rnn_on_variable_length_sequences_equals_one_device(
    tmp_path, towers, rows):
  # Its tf.sequence_mask(lengths) was as wide as the shard's longest
  # sequence, the sequences as wide as the batch's: the RNN's loop failed
  # ("Trying to access element 2 in a list with 2 elements"). With 5 rows
  # on 3 towers, the last tower's single row kept its static size while
  # its loss, past the RNN, did not: its mean was taken for no reduction
  # ("towers reduce differently").
  column = tf.feature_column.embedding_column(
      tf.feature_column.sequence_categorical_column_with_identity(
          'tokens', num_buckets=10), dimension=4)
  model_fn = tf.estimator.experimental.RNNClassifier(
      sequence_feature_columns=[column], units=[5], cell_type='gru').model_fn
  input_fn = _ragged_tokens(rows)
  one, many = _pair(tmp_path, model_fn, towers, input_fn)
  one.train(input_fn, steps=STEPS)
  many.train(input_fn, steps=STEPS)
  assert_same_variables(variables_of(one), variables_of(many))
  take = lambda: input_fn().take(1)  # pylint: disable=unnecessary-lambda-assignment
  expected = [row['logits'] for row in one.predict(take)]
  actual = [row['logits'] for row in many.predict(take)]
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
