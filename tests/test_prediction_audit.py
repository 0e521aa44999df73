"""Predictions the graph walk cannot follow are checked against one device.

Past an op `batch_mixing` does not know (a tf.function or py_function body,
a while loop, a scatter) a prediction that reorders, drops or mixes its
batch's rows merged silently on towers (adversary round 30). The model_fn
now also runs once on the whole batch, on the first batch only, and
estimator.predict fails before handing out a row when the two differ.
"""

import numpy as np
import pytest
import tensorflow as tf

from helpers import seeded
from estimator_towers.merge import prediction_audit
import trainer

tf1 = tf.compat.v1

_X = (np.arange(30, dtype=np.float32).reshape(10, 3) % 7) - 3


def _first_rows_in_a_loop(h):
  """At most 6 rows, copied one by one in a tf.while_loop."""
  rows = tf.TensorArray(tf.float32, size=0, dynamic_size=True)
  _, rows = tf.while_loop(
      lambda i, _: i < tf.minimum(tf.shape(h)[0], 6),
      lambda i, rows: (i + 1, rows.write(i, h[i])), [0, rows])
  return rows.stack()


def _scattered_in_reverse(h):
  positions = tf.reverse(tf.range(tf.shape(h)[0]), [0])[:, None]
  return tf.scatter_nd(positions, h, tf.shape(h))


def _numpy(fn):
  return lambda h: tf.reshape(
      tf.numpy_function(fn, [h], tf.float32), [-1, 2])


def _convolved_over_the_rows(h):
  rows_as_width = h[None]  # [1, rows, 2]: each window spans 3 rows.
  return tf.nn.conv1d(rows_as_width, tf.ones([3, 2, 2]), 1, 'SAME')[0]


# Each merged silently on towers before; its one-device answer differs.
# Batches of unknown size, unless the name says static.
_DIFFER = {
    'tf_function_reverse': lambda h: tf.function(
        lambda a: tf.reverse(a, [0]))(h),
    'tf_function_batch_mean': lambda h: tf.function(
        lambda a: a - tf.reduce_mean(a, 0))(h),
    'numpy_function_reverse': _numpy(lambda a: a[::-1].copy()),
    'while_loop_first_rows': _first_rows_in_a_loop,
    'scatter_in_reverse': _scattered_in_reverse,
    'cumulative_sum_over_rows': lambda h: tf.scan(lambda a, r: a + r, h),
    'convolution_over_the_rows': _convolved_over_the_rows,
    'slice_to_an_unread_end': lambda h: h[:tf.reduce_max([6, 1])],
    'pairs_through_tensordot': lambda h: tf.tensordot(h, h, [[1], [1]]),
    'static_python_rows': lambda h: h * h.shape[0],
    'static_size_of_the_rows': lambda h: h * tf.cast(tf.size(h), tf.float32),
}
# Per example through the same opaque ops: one device's rows.
_SAME = {
    'tf_function_scaled': lambda h: tf.function(lambda a: 2.0 * a + 1.0)(h),
    'numpy_function_scaled': _numpy(lambda a: 2.0 * a),
    'map_fn': lambda h: tf.map_fn(lambda row: tf.reverse(row, [0]), h),
    'scan_within_rows': lambda h: tf.transpose(tf.scan(
        lambda a, column: a + column, tf.transpose(h))),
}


def _model_fn(rows, record=None):

  def model_fn(features, mode):
    h = tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(1))
    if record is not None:
      h = tf.numpy_function(record, [h], tf.float32)
      h.set_shape([None, 2])
    return tf.estimator.EstimatorSpec(mode, predictions={'p': rows(h)})

  return model_fn


def _predict(tmp_path, model_fn, towers, batch=8, static=False, **kwargs):
  """`model_fn`'s predictions of _X in batches of `batch`: itself
  (`towers=0`) or on `towers` virtual CPUs (`kwargs` for
  replicate_model_fn)."""
  config = trainer.make_run_config(str(tmp_path / f'{towers}'),
                                   cpu_devices=max(towers, 1))
  if towers:
    model_fn = trainer.replicate_model_fn(model_fn, **kwargs)

  def input_fn():
    return tf.data.Dataset.from_tensor_slices({'x': _X}).batch(
        batch, drop_remainder=static)

  estimator = tf.estimator.Estimator(model_fn, config=config)
  return np.array([row['p'] for row in estimator.predict(input_fn)])


@pytest.mark.training
@pytest.mark.parametrize('case', sorted(_DIFFER))
def test_predictions_past_the_walk_that_differ_from_one_device_fail(
    tmp_path, case):
  with pytest.raises(ValueError, match=(
      r"(?s)The prediction 'p' is not one device's: on the first batch "
      r'(row \d+ is .* on the towers and .* on one device|the towers give '
      r'shape).*cannot follow.*Do it after predicting')):
    _predict(tmp_path, _model_fn(_DIFFER[case]), 2,
             static=case.startswith('static'))


@pytest.mark.training
@pytest.mark.parametrize('towers,static', [(2, False), (3, True)],
                         ids=['2_towers', '3_towers_static_batch'])
@pytest.mark.parametrize('case', sorted(_SAME))
def test_per_example_predictions_past_the_walk_are_one_devices(
    tmp_path, case, towers, static):
  one = _predict(tmp_path, _model_fn(_SAME[case]), 0, batch=6,
                 static=static)
  many = _predict(tmp_path, _model_fn(_SAME[case]), towers, batch=6,
                  static=static)
  assert len(np.unique(one)) > 4  # Distinct rows: an order would show.
  np.testing.assert_allclose(many, one, rtol=1e-6)


@pytest.mark.training
def test_the_one_device_copy_runs_on_the_first_batch_only(tmp_path):
  seen = []

  def record(h):
    seen.append(len(h))
    return h

  predicted = _predict(tmp_path, _model_fn(_SAME['tf_function_scaled'],
                                           record), 2, batch=4)
  assert len(predicted) == 10
  # Batches of 4, 4, 2 on 2 towers (2, 2, 1 rows each); the copy once, on
  # the whole first batch. (A tower's order of running is free.)
  assert sorted(seen) == sorted([2, 2, 4, 2, 2, 1, 1])


@pytest.mark.fast
def test_export_outputs_past_the_walk_are_refused_when_towers_serve():
  def model_fn(features, mode):
    h = tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(1))
    p = _SAME['tf_function_scaled'](h)
    return tf.estimator.EstimatorSpec(mode, predictions={'p': p})

  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3])
    with pytest.raises(ValueError, match=(
        r"(?s)The serving output 'p' is computed through "
        r"PartitionedCall .*no first batch.*replicate_serving=False")):
      trainer.replicate_model_fn(model_fn, replicate_serving=True)(
          features={'x': x}, mode=tf.estimator.ModeKeys.PREDICT,
          config=trainer.make_run_config(cpu_devices=2))


@pytest.mark.fast
@pytest.mark.parametrize('towers,one,dtype,expected', [
    ([[1.0, 2.0]], [[1.0, 2.0 + 1e-6]], tf.float32, ''),
    ([[1.0, 2.0]], [[1.0, 2.01]], tf.float32, 'row 0 is'),
    ([[1.0, 2.0]], [[1.0, 2.01]], tf.float16, ''),
    ([[1.0], [2.0]], [[1.0]], tf.float32, 'shape [2, 1] and one device '
     '[1, 1]'),
    ([b'a', b'b'], [b'a', b'c'], tf.string, "row 1 is [b'b']"),
    ([3, 4], [3, 4], tf.int64, ''),
    ([np.nan], [np.nan], tf.float32, ''),
])
def test_difference_names_the_first_row_that_differs(towers, one, dtype,
                                                     expected):
  found = prediction_audit.difference(np.array(towers), np.array(one), dtype)
  assert (expected in found) if expected else found == ''


def _lstm_model_fn(features, mode):
  # Keras' LSTM runs a while loop over the steps: past the walk, per example.
  steps = tf.reshape(features['x'], [-1, 3, 1])
  h = tf.keras.layers.LSTM(
      4, kernel_initializer=seeded(2), recurrent_initializer=seeded(3))(steps)
  return tf.estimator.EstimatorSpec(mode, predictions={
      'p': tf.keras.layers.Dense(2, kernel_initializer=seeded(4))(h)})


@pytest.mark.training
def test_a_keras_lstm_predicts_as_one_device_under_the_check(tmp_path):
  with tf.Graph().as_default():
    x = tf.data.Dataset.from_tensor_slices({'x': _X}).batch(4)
    spec = trainer.replicate_model_fn(_lstm_model_fn)(
        features=tf1.data.make_one_shot_iterator(x).get_next(),
        mode=tf.estimator.ModeKeys.PREDICT,
        config=trainer.make_run_config(cpu_devices=2))
    assert any(isinstance(hook, prediction_audit.FirstBatchCheck)
               for hook in spec.prediction_hooks)
  one = _predict(tmp_path, _lstm_model_fn, 0, batch=7)
  many = _predict(tmp_path, _lstm_model_fn, 3, batch=7)
  assert len(np.unique(one)) > 10
  np.testing.assert_allclose(many, one, rtol=1e-5)


@pytest.mark.training
def test_the_check_can_be_turned_off(tmp_path):
  # The user's choice: the towers' rows, each shard reversed on its own.
  reversed_shards = _predict(tmp_path, _model_fn(_DIFFER['scatter_in_reverse']),
                             2, check_first_batch=False)
  rows = _predict(tmp_path, _model_fn(lambda h: h), 0)
  np.testing.assert_allclose(reversed_shards[:4], rows[:4][::-1], rtol=1e-6)


@pytest.mark.fast
def test_check_first_batch_must_be_a_bool():
  with pytest.raises(TypeError, match="check_first_batch must be True or "
                     "False, got 'yes'"):
    trainer.replicate_model_fn(_model_fn(lambda h: h),
                               check_first_batch='yes')


def _loss_model_fn(loss_of):

  def model_fn(features, labels, mode):
    h = tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(1))
    loss = loss_of(h) + 0.0 * tf.reduce_mean(labels)
    train_op = None
    if mode == tf.estimator.ModeKeys.TRAIN:
      train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
          loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _evaluate(tmp_path, model_fn, towers):
  config = trainer.make_run_config(str(tmp_path / f'eval_{towers}'),
                                   cpu_devices=max(towers, 1))
  if towers:
    model_fn = trainer.replicate_model_fn(model_fn)

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(
        ({'x': _X}, np.zeros(10, np.float32))).batch(6)

  return tf.estimator.Estimator(model_fn, config=config).evaluate(input_fn)


@pytest.mark.training
@pytest.mark.parametrize('case', ['numpy_function_reverse',
                                  'cumulative_sum_over_rows'])
def test_an_eval_loss_past_the_walk_that_differs_from_one_device_fails(
    tmp_path, case):
  # Both trained silently 0.25-0.51 off one device's weights in 2 steps.
  def loss_of(h):
    return tf.reduce_mean(tf.square(h - _DIFFER[case](h)))

  with pytest.raises(ValueError, match=(
      r"(?s)The loss is not one device's: on the first batch the towers "
      r'give [-\d.e]+ and one device [-\d.e]+\. .*cannot follow.*in training '
      'too: train and evaluate it on one device')):
    _evaluate(tmp_path, _loss_model_fn(loss_of), 2)


@pytest.mark.training
def test_an_eval_loss_past_the_walk_per_example_is_one_devices(tmp_path):
  def loss_of(h):
    return tf.reduce_mean(h * _SAME['numpy_function_scaled'](h))

  one = _evaluate(tmp_path, _loss_model_fn(loss_of), 0)['loss']
  np.testing.assert_allclose(
      _evaluate(tmp_path, _loss_model_fn(loss_of), 3)['loss'], one,
      rtol=1e-5)
