"""Batch norm in training normalises every tower's shard with the global batch.

With batch_norm='global' (the default), the towers exchange their shards'
per-channel moments at every batch-norm call, so a few training steps
(learning rate and momentum on) end with one device's variables: weights,
optimizer slots and moving statistics, within float32 rounding. The same
runs with batch_norm='per_tower' end elsewhere (the proof that the
comparison can fail). Models: a Keras CNN (fused BatchNormalization), a
`tf.compat.v1.layers.batch_normalization` dense net (not fused), the block
structure of tensorflow/models' official r1 ResNet (conv, fused batch norm
at momentum 0.997 and epsilon 1e-5, relu, projection shortcut), a canned
DNNClassifier(batch_norm=True), a masked Keras layer and a Keras layer
whose `training` is a tensor; batches of 7 are uneven on 2 and 3 towers,
and 2 examples on 3 towers leave one tower idle. A synchronous cluster
exchanges the moments between its tasks too (tests/test_task_sync.py).
"""

import json

import numpy as np
import pytest
import tensorflow as tf

from helpers import assert_same_variables, build_replicated, seeded
from helpers import train_in_session

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys
NUM_FEATURES = 48  # Reshaped to [4, 4, 3] images.
STEPS = 3
SEED = 1  # The graph seed of every start (see _differences).


def _minimize(mode, loss):
  """Momentum (a slot per variable) after the batch-norm updates."""
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
        loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _images(features):
  return tf.reshape(features['x'], [-1, 4, 4, 3])


def _keras_updates(layer):
  for update in layer.updates:  # Keras keeps them out of UPDATE_OPS.
    tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)


def _keras_cnn(training_tensor=False):
  """Conv2D, fused BatchNormalization, relu, dense."""
  def model_fn(features, labels, mode):
    net = tf.keras.layers.Conv2D(4, 3, padding='same',
                                 kernel_initializer=seeded(1))(
                                     _images(features))
    training = mode == ModeKeys.TRAIN
    if training_tensor:  # Keras then chooses the path at run time.
      training = tf1.placeholder_with_default(training, [])
    layer = tf.keras.layers.BatchNormalization(momentum=0.5)
    net = tf.nn.relu(layer(net, training=training))
    _keras_updates(layer)
    logits = tf.keras.layers.Dense(2, kernel_initializer=seeded(2))(
        tf.keras.layers.Flatten()(net))
    return _minimize(mode, tf1.losses.sparse_softmax_cross_entropy(
        labels, logits))
  return model_fn


def _v1_dense(features, labels, mode):
  """Dense, tf.compat.v1.layers.batch_normalization (axis=-1, not fused)."""
  net = tf1.layers.dense(features['x'], 6, kernel_initializer=seeded(3))
  net = tf1.layers.batch_normalization(net, axis=-1, fused=False,
                                       momentum=0.5,
                                       training=mode == ModeKeys.TRAIN)
  logits = tf1.layers.dense(tf.nn.tanh(net), 2, kernel_initializer=seeded(4))
  return _minimize(mode, tf1.losses.sparse_softmax_cross_entropy(
      labels, logits))


def _keras_masked(features, labels, mode):
  """A non-fused Keras layer whose mask weighs the time steps."""
  steps = tf.reshape(features['x'], [-1, 16, 3])
  net = tf.keras.layers.Dense(3, kernel_initializer=seeded(5))(steps)
  layer = tf.keras.layers.BatchNormalization(momentum=0.5)
  net = layer(net, training=mode == ModeKeys.TRAIN, mask=steps[..., 0] > 0.5)
  _keras_updates(layer)
  logits = tf.keras.layers.Dense(2, kernel_initializer=seeded(6))(
      tf.reduce_mean(net, 1))
  return _minimize(mode, tf1.losses.sparse_softmax_cross_entropy(
      labels, logits))


def _resnet_batch_norm(inputs, training):
  """tensorflow/models official/r1/resnet's batch_norm, channels_last."""
  return tf1.layers.batch_normalization(
      inputs, axis=3, momentum=0.997, epsilon=1e-5, center=True, scale=True,
      training=training, fused=True)


def _resnet_conv(inputs, filters, kernel_size, strides, seed):
  if strides > 1:  # r1's fixed padding, independent of the input size.
    begin = (kernel_size - 1) // 2
    end = kernel_size - 1 - begin
    inputs = tf.pad(inputs, [[0, 0], [begin, end], [begin, end], [0, 0]])
  return tf1.layers.conv2d(
      inputs, filters, kernel_size, strides,
      padding='SAME' if strides == 1 else 'VALID', use_bias=False,
      kernel_initializer=tf1.variance_scaling_initializer(seed=seed))


def _resnet_r1(features, labels, mode):
  """An initial conv and batch norm, then one r1 building block (v1) with a
  projection shortcut at stride 2, as official/r1/resnet builds them."""
  training = mode == ModeKeys.TRAIN
  net = _resnet_conv(_images(features), 4, 3, 1, 11)
  net = tf.nn.relu(_resnet_batch_norm(net, training))
  shortcut = _resnet_batch_norm(_resnet_conv(net, 8, 1, 2, 12), training)
  net = tf.nn.relu(_resnet_batch_norm(_resnet_conv(net, 8, 3, 2, 13),
                                      training))
  net = _resnet_batch_norm(_resnet_conv(net, 8, 3, 1, 14), training)
  net = tf.nn.relu(net + shortcut)
  logits = tf1.layers.dense(tf.reduce_mean(net, [1, 2]), 2,
                            kernel_initializer=seeded(15))
  return _minimize(mode, tf1.losses.sparse_softmax_cross_entropy(
      labels, logits))


def _canned_dnn(features, labels, mode):
  """A tf.compat.v1 DNNClassifier(batch_norm=True)'s model_fn."""
  columns = [tf.feature_column.numeric_column('x', shape=(NUM_FEATURES,))]
  canned = tf1.estimator.DNNClassifier(
      hidden_units=[4], feature_columns=columns, batch_norm=True,
      optimizer=lambda: tf1.train.MomentumOptimizer(0.1, 0.9))
  return canned.model_fn(features, labels[:, None], mode,
                         tf.estimator.RunConfig())


@pytest.fixture(scope='module')
def examples():
  rng = np.random.RandomState(5)
  x = rng.randn(21, NUM_FEATURES).astype(np.float32) * 2 + 1
  return x, (x[:, :3].sum(1) > 3).astype(np.int32)


_one_device = {}


def _differences(model_fn, examples, towers, batch, **wrapper_kwargs):
  """(expected, actual): one device's and the towers' variables after
  STEPS steps from the same start."""
  x, y = examples
  key = (model_fn, batch)
  if key not in _one_device:  # The start and one device's end, per model.
    # Seeded: the canned DNN's unseeded start changed per process, and
    # with it how far round-off is amplified (1e-3 in a Momentum slot once).
    _one_device[key] = train_in_session(model_fn, x, y, 1, batch, STEPS,
                                        graph_seed=SEED)
  start, expected = _one_device[key]
  _, actual = train_in_session(model_fn, x, y, towers, batch, STEPS, start,
                               **wrapper_kwargs)
  return expected, actual


def _assert_as_one_device(model_fn, examples, towers, batch, aggregation,
                          atol=None):
  expected, actual = _differences(model_fn, examples, towers, batch,
                                  aggregation=aggregation)
  # A batch smaller than the tower count leaves one example per tower: the
  # moments of two examples make the gradients ill-conditioned, and float32
  # round-off reaches 7e-6 in dense/kernel on AVX2 CPUs (normalising per
  # tower instead differs by 0.58).
  if atol is None:
    atol = 1e-5 if batch < towers else 1e-6
  assert_same_variables(expected, actual, rtol=1e-4, atol=atol)
  assert any(name.endswith('moving_mean') for name in expected)


# model, towers, batch, aggregation: each model on 2 or 3 towers, each
# aggregation for the Keras CNN.
RUNS = [
    ('keras_cnn', 3, 7, 'global_loss'),
    ('keras_cnn', 3, 7, 'round_robin'),
    ('keras_cnn', 3, 7, 'all_reduce'),
    ('keras_cnn_training_tensor', 3, 2, 'global_loss'),  # An idle tower.
    ('v1_dense', 2, 7, 'global_loss'),
    ('v1_dense', 3, 2, 'all_reduce'),  # An idle tower.
    ('resnet_r1', 2, 7, 'all_reduce'),
    ('canned_dnn', 3, 7, 'global_loss'),
    ('keras_masked', 2, 7, 'all_reduce'),
]
MODELS = {
    'keras_cnn': _keras_cnn(),
    'keras_cnn_training_tensor': _keras_cnn(training_tensor=True),
    'v1_dense': _v1_dense,
    'resnet_r1': _resnet_r1,
    'canned_dnn': _canned_dnn,
    'keras_masked': _keras_masked,
}
# Momentum 0.9 at rate 0.1 amplifies float32 round-off in the canned DNN:
# 5e-6 in a Momentum slot here, 2.1e-5 on the CI's CPU, both within 1e-4 of
# the element's 1e-4 relative bound; normalising per tower differs by 1 to 3.
ATOL = {'canned_dnn': 1e-4}


@pytest.mark.training
@pytest.mark.parametrize('name,towers,batch,aggregation', RUNS)
def test_towers_train_as_one_device(examples, name, towers, batch,
                                    aggregation):
  _assert_as_one_device(MODELS[name], examples, towers, batch, aggregation,
                        ATOL.get(name))


@pytest.mark.training
def test_per_tower_normalisation_trains_another_model(examples):
  # What the default avoids, and the proof that the comparison can fail.
  expected, actual = _differences(MODELS['resnet_r1'], examples, 2, 7,
                                  batch_norm='per_tower')
  with pytest.raises(AssertionError):
    assert_same_variables(expected, actual, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------
# Graph-only checks.


def _collectives(graph):
  return [op for op in graph.get_operations()
          if op.type == 'CollectiveReduce' and 'global_moments' in op.name]


@pytest.mark.fast
def test_one_collective_per_call_and_tower_and_none_per_tower():
  # ResNet's 4 batch-norm calls on 2 towers: one exchange each, and one for
  # its gradient.
  graph, _ = build_replicated(_resnet_r1, 2, batch_size=7,
                              num_features=NUM_FEATURES)
  forward = [op for op in _collectives(graph) if 'gradients' not in op.name]
  assert len(forward) == 4 * 2
  assert len(_collectives(graph)) == 2 * 4 * 2
  assert {op.device for op in forward} == {'/device:CPU:0', '/device:CPU:1'}
  graph, _ = build_replicated(_v1_dense, 2, batch_norm='per_tower')
  assert not _collectives(graph)
  graph, _ = build_replicated(_v1_dense, 2, mode=ModeKeys.EVAL)
  assert not _collectives(graph)


@pytest.mark.fast
@pytest.mark.parametrize('value,error', [('globl', ValueError),
                                         (None, TypeError)])
def test_an_unknown_batch_norm_is_refused(value, error):
  with pytest.raises(error, match=r"batch_norm.*'global', 'per_tower'"):
    build_replicated(_v1_dense, 2, batch_norm=value)


def _conditional(features, labels, mode):
  """Batch norm inside a tf.cond, which some towers could skip."""
  net = tf1.layers.dense(features['x'], 3)
  net = tf.cond(tf.reduce_sum(net) > 0,
                lambda: tf1.layers.batch_normalization(net, training=True),
                lambda: net)
  return _minimize(mode, tf1.losses.sparse_softmax_cross_entropy(
      labels, tf1.layers.dense(net, 2)))


@pytest.mark.fast
def test_batch_norm_inside_control_flow_is_refused():
  # (batch_norm='per_tower' refuses it too: its moving statistics would be
  # updated inside the branch.)
  with pytest.raises(ValueError, match=r"'batch_normalization\w*' is called in "
                                       r'training inside a tf.cond.*hang'):
    build_replicated(_conditional, 2)


@pytest.mark.fast
def test_a_synchronous_cluster_exchanges_between_the_tasks_too(monkeypatch):
  # Each tower first with this task's towers, then with the towers of its
  # index on the other tasks (test_task_sync trains it against one process).
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']},
       'task': {'type': 'worker', 'index': 0}}))
  graph, _ = build_replicated(_v1_dense, 2, aggregation='all_reduce')
  forward = [op for op in _collectives(graph) if 'gradients' not in op.name]
  assert len(forward) == 2 * 2  # One batch-norm call, 2 towers, 2 stages.
  assert {(op.device, op.get_attr('group_size')) for op in forward} == {
      (f'/job:worker/replica:0/task:0/device:CPU:{i}', 2) for i in (0, 1)}
  # This task's own group, and a group per tower index across the tasks.
  assert len({op.get_attr('group_key') for op in forward}) == 3


@pytest.mark.fast
def test_the_backward_pass_waits_for_the_updates_through_one_op():
  # _minimize builds under control_dependencies(UPDATE_OPS): without
  # control_gate every backward op got one control input per update op
  # (8 here, 54 in MobileNet: 205k of its 230k edges on 2 towers).
  graph, spec = build_replicated(_resnet_r1, 2, batch_size=7,
                                 num_features=NUM_FEATURES)
  updates = {op for op in graph.get_operations()
             if op.type == 'AssignSubVariableOp' and 'AssignMovingAvg' in
             op.name and op.name.startswith('tower_1/')}
  assert len(updates) == 4 * 2
  backward = [op for op in graph.get_operations()
              if op.name.startswith('gradients/')]
  assert backward
  assert not [op.name for op in backward
              if updates & set(op.control_inputs)]
  ancestors, pending = set(), [getattr(spec.train_op, 'op', spec.train_op)]
  while pending:
    op = pending.pop()
    if op not in ancestors:
      ancestors.add(op)
      pending.extend([t.op for t in op.inputs] + list(op.control_inputs))
  assert updates <= ancestors
