"""Batch-norm moving statistics get one update per step, from the global batch.

Whether the towers normalise with the global batch's moments (the default,
see test_global_batch_norm.py) or each with its shard's
(batch_norm='per_tower'), the moving mean and variance must move once per
step towards the whole batch's statistics, as on one device. The session
tests train with a learning rate of zero, so that the weights (which
per-tower normalisation changes) stay equal and every variable and the
evaluation loss can be compared with one device.
"""

import numpy as np
import pytest
import tensorflow as tf

import trainer
from helpers import (assert_same_variables, build_replicated, dataset_input_fn,
                     make_estimator, seeded, variables_of)
from helpers import train_in_session

tf1 = tf.compat.v1

# Which moving-statistic updates run, and how often: in the graph the product
# runs, Grappler's rewrites on (tests/README.md, "Where the time goes").
pytestmark = pytest.mark.graph_rewrites
ModeKeys = tf.estimator.ModeKeys
AGGREGATIONS = ['global_loss', 'round_robin', 'all_reduce']
ISSUE_BATCH = np.array([1, 3, 4, 8, 2, 7], np.float32)
NUM_FEATURES = 12  # Reshaped to [2, 2, 3] images for the fused layers.


def _keras_layer(cls, training_tensor=False, masked=False, **kwargs):
  def build(x, training):
    layer = cls(momentum=0.5, **kwargs)
    if training_tensor:  # The update then sits in a conditional's branch.
      training = tf1.placeholder_with_default(training, [])
    # A mask weighs the values of the statistics (here per time step).
    mask = x[..., 0] > 0 if masked else None
    out = layer(x, training=training, mask=mask)
    for update in layer.updates:  # Keras keeps them out of UPDATE_OPS.
      tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
    return out
  return build


def _v1_layer(x, training):
  return tf1.layers.batch_normalization(x, training=training, momentum=0.5)


# name: (builds the layer, input shape after the batch, fused?)
LAYERS = {
    'v1_layers': (_v1_layer, [NUM_FEATURES], False),
    'v1_layers_fused': (_v1_layer, [2, 2, 3], True),
    'keras': (_keras_layer(tf.keras.layers.BatchNormalization),
              [NUM_FEATURES], False),
    'keras_fused': (_keras_layer(tf.keras.layers.BatchNormalization,
                                 fused=True), [2, 2, 3], True),
    'keras_unfused_4d_training_tensor': (
        _keras_layer(tf.keras.layers.BatchNormalization, fused=False,
                     training_tensor=True), [2, 2, 3], False),
    'keras_masked': (_keras_layer(tf.keras.layers.BatchNormalization,
                                  masked=True), [4, 3], False),
    'keras_legacy_fused': (
        _keras_layer(tf1.keras.layers.BatchNormalization), [2, 2, 3], True),
}


def _model_fn(layer, shape):
  def model_fn(features, labels, mode):
    x = tf.reshape(features['x'], [-1] + shape)
    net = tf1.layers.dense(x, 3, kernel_initializer=seeded(3))
    net = layer(net, mode == ModeKeys.TRAIN)
    logits = tf1.layers.dense(tf1.layers.flatten(net), 2,
                              kernel_initializer=seeded(4))
    # Rate zero: per-tower normalisation would make the weights differ.
    return _spec(mode, labels, logits, 0.0)
  return model_fn


def _spec(mode, labels, logits, rate):
  """Cross entropy, minimized after running UPDATE_OPS."""
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = tf1.train.GradientDescentOptimizer(rate).minimize(
        loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _evaluate(model_fn, variables, x, y):
  """One device's evaluation loss with the given variable values."""
  with tf.Graph().as_default():
    spec = model_fn({'x': tf.constant(x)}, tf.constant(y), ModeKeys.EVAL)
    with tf1.Session() as session:
      for variable in tf1.global_variables():
        variable.load(variables[variable.op.name], session)
      return session.run(spec.loss)


@pytest.mark.training
@pytest.mark.parametrize('fused', [False, True])
@pytest.mark.parametrize('towers', [1, 2, 3])
def test_issue_example_moves_as_one_device(towers, fused):
  # Issue 17: one step at momentum 0.5 on [1, 3, 4, 8, 2, 7] left the moving
  # mean at 2.083 on one device but 3.5 on 2 towers and 4.0 on 3.
  shape = [1, 1, 1] if fused else [1]

  def model_fn(features, labels, mode):
    del labels
    x = tf.reshape(features['x'], [-1] + shape)
    net = tf1.layers.batch_normalization(x, training=True, momentum=0.5)
    weight = tf1.get_variable('w', [], initializer=tf1.ones_initializer())
    loss = tf.reduce_mean(net * weight)
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
      train_op = tf1.train.GradientDescentOptimizer(0.0).minimize(
          loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  _, values = train_in_session(model_fn, ISSUE_BATCH, np.zeros(6, np.int32),
                               towers, 6, 1)
  mean = values['batch_normalization/moving_mean']
  variance = values['batch_normalization/moving_variance']
  np.testing.assert_allclose(mean, [0.5 * ISSUE_BATCH.mean()], rtol=1e-6)
  np.testing.assert_allclose(mean, [2.0833333], rtol=1e-6)
  # The fused kernel's batch variance carries Bessel's correction, the
  # other path's does not; the towers must match each path's one device.
  one_device = ISSUE_BATCH.var(ddof=1 if fused else 0)
  np.testing.assert_allclose(variance, [0.5 + 0.5 * one_device], rtol=1e-6)


@pytest.fixture(scope='module')
def examples():
  rng = np.random.RandomState(3)
  x = rng.randn(21, NUM_FEATURES).astype(np.float32) * 2 + 1
  return x, (x[:, 0] > 1).astype(np.int32)


def _assert_as_one_device(model_fn, examples, runs, steps=2):
  """Each (towers, batch, aggregation[, batch_norm]) run ends with one
  device's variables and evaluation loss."""
  x, y = examples
  start, expected = None, {}
  for towers, batch, aggregation, *batch_norm in runs:
    if batch not in expected:
      start, expected[batch] = train_in_session(model_fn, x, y, 1, batch,
                                                steps)
    _, actual = train_in_session(model_fn, x, y, towers, batch, steps, start,
                                 aggregation=aggregation,
                                 batch_norm=(batch_norm or ['global'])[0])
    assert_same_variables(expected[batch], actual)
  np.testing.assert_allclose(_evaluate(model_fn, actual, x, y),
                             _evaluate(model_fn, expected[batch], x, y),
                             rtol=1e-5)
  for name, value in expected[batch].items():
    if name.endswith('moving_mean'):
      assert np.abs(value).max() > 1e-5, name  # The statistics moved.


@pytest.mark.training
@pytest.mark.parametrize('name', sorted(LAYERS))
def test_every_batch_norm_layer_moves_as_one_device(examples, name):
  layer, shape, fused = LAYERS[name]
  # A batch of 7 is uneven on 2 towers; a batch of 2 leaves one of 3 towers
  # idle, training on a padding copy that must weigh nothing. Per-tower
  # normalisation combines the shards' statistics for the update; global
  # normalisation updates with the moments it exchanged.
  _assert_as_one_device(_model_fn(layer, shape), examples, [
      (2, 7, 'global_loss', 'per_tower'), (3, 2, 'global_loss', 'global')])
  with tf.Graph().as_default():
    _model_fn(layer, shape)({'x': tf.zeros([7, NUM_FEATURES])},
                            tf.zeros([7], tf.int32), ModeKeys.TRAIN)
    types = {op.type for op in tf1.get_default_graph().get_operations()}
  assert ('FusedBatchNormV3' in types) == fused


@pytest.mark.training
@pytest.mark.parametrize('name', ['v1_layers', 'keras_fused'])
def test_every_aggregation_gives_the_same_statistics(examples, name):
  layer, shape, _ = LAYERS[name]
  _assert_as_one_device(_model_fn(layer, shape), examples, [
      (3, 7, 'round_robin'), (3, 7, 'all_reduce')])


def _canned_dnn(version):
  """A canned DNNClassifier(batch_norm=True)'s model_fn, trained at rate 0."""
  columns = [tf.feature_column.numeric_column('x', shape=(NUM_FEATURES,))]
  if version == 'v1':  # tf.compat.v1.layers.BatchNormalization inside.
    canned = tf1.estimator.DNNClassifier(
        hidden_units=[4], feature_columns=columns, batch_norm=True,
        optimizer=lambda: tf1.train.GradientDescentOptimizer(0.0))
  else:  # tf.keras.layers.BatchNormalization inside.
    canned = tf.estimator.DNNClassifier(
        hidden_units=[4], feature_columns=columns, batch_norm=True,
        optimizer=lambda: tf.keras.optimizers.legacy.SGD(0.0))

  def model_fn(features, labels, mode):
    return canned.model_fn(features, labels[:, None], mode,
                           tf.estimator.RunConfig())
  return model_fn


@pytest.mark.training
@pytest.mark.parametrize('version,runs', [
    ('v1', [(2, 7, 'global_loss'), (3, 7, 'all_reduce')]),
    ('tf2', [(3, 7, 'round_robin')])])
def test_canned_dnn_with_batch_norm_moves_as_one_device(examples, version,
                                                         runs):
  _assert_as_one_device(_canned_dnn(version), examples, runs)


def _refused_model_fn(case):
  def model_fn(features, labels, mode):
    x = features['x']
    if case == 'renorm':
      x = tf.keras.layers.BatchNormalization(renorm=True)(x, training=True)
    elif case == 'virtual_batch_size':
      x = tf1.layers.batch_normalization(x, training=True,
                                         virtual_batch_size=5)
    else:  # A moving average of the user's own.
      average = tf1.get_variable('batch_mean', [x.shape[1]],
                                 initializer=tf1.zeros_initializer(),
                                 trainable=False)
      tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(
          average, (average - tf.reduce_mean(x, 0)) * 0.5))
    return _spec(mode, labels, tf1.layers.dense(x, 2), 0.1)
  return model_fn


@pytest.mark.fast
@pytest.mark.parametrize('case,message', [
    ('renorm', r"'batch_normalization\w*' uses renorm=True"),
    ('virtual_batch_size', r"'batch_normalization\w*' sets virtual_batch_size"),
    ('own_average', r'towers 0 and 1 both write batch_mean .*'
                    r'tower_context\(\).index == 0'),
])
def test_inexact_moving_statistics_are_refused(case, message):
  with pytest.raises(ValueError, match=message):
    build_replicated(_refused_model_fn(case), 2)


def _statistics_outside_the_train_op(run_by_hook):
  """A v1 batch-norm model_fn whose train_op does not run UPDATE_OPS:
  either nothing runs them, or a hook runs them with the optimizer update
  (TF-GAN's generator step: its train_op only advances global_step)."""

  def model_fn(features, labels, mode):
    normalised = tf1.layers.batch_normalization(features['x'], training=True)
    logits = tf1.layers.dense(normalised, 2, kernel_initializer=seeded(5))
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    step = tf1.train.get_or_create_global_step()
    update = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    if not run_by_hook:
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=tf.group(update, step.assign_add(1)))
    with tf.control_dependencies(
        tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
      generator_step = tf.group(update)
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=step.assign_add(1),
        training_hooks=[_RunFirst(generator_step)])

  return model_fn


class _RunFirst(tf1.train.SessionRunHook):
  """Runs `op` in a session.run of its own before each step."""

  def __init__(self, op):
    self._op = op

  def before_run(self, run_context):
    run_context.session.run(self._op)


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
def test_statistics_the_model_fn_never_updates_stay(examples, aggregation):
  # The merged train_op ran every tower's UPDATE_OPS: the towers moved
  # statistics one device leaves at their start.
  x, y = examples
  model_fn = _statistics_outside_the_train_op(run_by_hook=False)
  start, one = train_in_session(model_fn, x, y, 1, 7, 2)
  _, many = train_in_session(model_fn, x, y, 3, 7, 2, start,
                             aggregation=aggregation)
  assert_same_variables(one, many)
  np.testing.assert_array_equal(many['batch_normalization/moving_mean'], 0.)


@pytest.mark.training
def test_statistics_updated_from_a_hook_move_as_one_device(tmp_path, data):
  # The update ran in the train_op's session.run, on the next batch, and
  # tower 0's UPDATE_OPS the hook ran were bare reads: 1.4x off (TF-GAN).
  x, y = data
  runs = {}
  for towers in (1, 2):
    estimator = make_estimator(_statistics_outside_the_train_op(True),
                               tmp_path / str(towers), towers)
    estimator.train(dataset_input_fn({'x': x}, y, 10), steps=3)
    runs[towers] = variables_of(estimator)
  assert_same_variables(runs[1], runs[2])
  assert np.abs(runs[2]['batch_normalization/moving_mean']).max() > 1e-3
