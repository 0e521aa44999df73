"""micro_batches=M: each tower's shard as M micro-batches, one after another,
is still one device's step on the global batch.

The equality tests train one device and the micro-batched towers from the
same seeded weights on the same batches (several steps: the optimizers
carry state) and compare every variable. The graph tests check the time
order the micro-batches need to save memory: micro-batch m + 1's first ops
wait for micro-batch m's backward pass on its device, and only there.
"""

import numpy as np
import pytest
import tensorflow as tf

from helpers import (OPTIMIZERS, FinalValues, assert_same_variables,
                     build_replicated, classifier_model_fn, dataset_input_fn,
                     make_estimator, normalising_model_fn,
                     save_start_checkpoint, seeded, variables_of)
import trainer

tf1 = tf.compat.v1
STEPS = 3
# Adam divides each gradient by its magnitude: the micro-batches' other
# summation order shows as ~1e-6 of a step.
RTOL, ATOL = 1e-4, 1e-6


def _train(model_dir, towers, batch, data, params, model_fn=classifier_model_fn,
           **kwargs):
  x, y = data
  estimator = make_estimator(model_fn, model_dir, towers, params,
                             replicate=towers > 1 or bool(kwargs), **kwargs)
  estimator.train(dataset_input_fn({'x': x}, y, batch), steps=STEPS)
  return variables_of(estimator)


@pytest.fixture(scope='module')
def one_device(tmp_path_factory, data):
  """`one_device(batch, params)`: one device's variables, trained once."""
  runs = {}

  def get(batch, params):
    key = (batch, tuple(sorted(params.items())))
    if key not in runs:
      runs[key] = _train(tmp_path_factory.mktemp('one'), 1, batch, data,
                         _params(params))
    return runs[key]

  return get


def _params(params):
  return {**params, 'optimizer': OPTIMIZERS[params['optimizer']]}


@pytest.mark.training
@pytest.mark.parametrize('towers,micro_batches,batch,params,aggregation', [
    (2, 2, 12, {'optimizer': 'adam'}, 'global_loss'),
    # compute_gradients, clip by global norm, apply_gradients: the clip sees
    # the sum over every micro-batch.
    (1, 3, 12, {'optimizer': 'momentum', 'clip_norm': 0.05}, 'global_loss'),
    # Uneven: 2, 2, 2, 1 rows.
    (2, 2, 7, {'optimizer': 'momentum'}, 'global_loss'),
    (3, 2, 7, {'optimizer': 'adam'}, 'global_loss'),  # 2, 1, 1, 1, 1, 1.
    # Empty micro-batches weigh 0.
    (2, 3, 4, {'optimizer': 'adam'}, 'global_loss'),
    # A device's micro-batches share its copies; their gradients are added
    # there before the one all-reduce of the step.
    (2, 2, 12, {'optimizer': 'adam'}, 'all_reduce'),
    (3, 2, 7, {'optimizer': 'momentum', 'clip_norm': 0.05}, 'all_reduce'),
    (2, 3, 4, {'optimizer': 'adam'}, 'all_reduce'),
], ids=['2x2-adam', '1x3-clip-momentum', '2x2-uneven-momentum',
        '3x2-uneven-adam', '2x3-empty-adam', '2x2-adam-all_reduce',
        '3x2-uneven-clip-momentum-all_reduce', '2x3-empty-adam-all_reduce'])
def test_training_equals_one_device(tmp_path, data, one_device, towers,
                                    micro_batches, batch, params, aggregation):
  trained = _train(tmp_path, towers, batch, data, _params(params),
                   micro_batches=micro_batches, aggregation=aggregation)
  assert trained['global_step'] == STEPS
  assert_same_variables(one_device(batch, params), trained, RTOL, ATOL)


def _embedding_model_fn(features, labels, mode):
  """An embedding of a bucketised feature: sparse (IndexedSlices) gradients
  summed over micro-batches; a sum loss (weights known from the split)."""
  ids = tf.clip_by_value(tf.cast(tf.floor(features['x'][:, 0] * 3 + 10),
                                 tf.int32), 0, 19)
  table = tf1.get_variable('table', [20, 3], initializer=seeded(5))
  embedded = tf.nn.embedding_lookup(table, ids)
  logits = tf1.layers.dense(tf.concat([embedded, features['x']], 1), 2,
                            kernel_initializer=seeded(6))
  loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  train_op = tf1.train.AdagradOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.training
def test_embedding_gradients_equal_one_device(tmp_path, data):
  one = _train(tmp_path / 'one', 1, 10, data, None, _embedding_model_fn)
  for aggregation in ('round_robin', 'all_reduce'):
    many = _train(tmp_path / aggregation, 2, 10, data, None,
                  _embedding_model_fn, micro_batches=2,
                  aggregation=aggregation)
    assert_same_variables(one, many, RTOL, ATOL)


@pytest.mark.training
def test_weighted_mean_is_refused_before_the_update_writes(tmp_path, data):
  # Weights not proportional to the micro-batches' rows: shares of the
  # examples would give another loss, and the check stops the step.
  x, y = data

  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(3))
    # A masked mean (BERT's masked LM): divided by the sum of the weights.
    weights = tf.cast(features['x'][:, 1] > 0, tf.float32) + 0.5
    loss = tf.reduce_sum(weights * tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)) / tf.reduce_sum(weights)
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  estimator = make_estimator(model_fn, tmp_path, 1, micro_batches=2,
                             replicate=True)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='not proportional to the micro-batches'):
    estimator.train(dataset_input_fn({'x': x}, y, 12), steps=1)


def _ancestors(op):
  pending, seen = [op], set()
  while pending:
    op = pending.pop()
    if op.name not in seen:
      seen.add(op.name)
      pending.extend(t.op for t in op.inputs)
      pending.extend(op.control_inputs)
  return seen


def _build(towers, batch, **kwargs):
  """The TRAIN graph of classifier_model_fn on `towers` CPUs, whose batch
  size is known only at run time, as from an input_fn's Dataset.batch
  (a mean's divisor then depends on the forward pass)."""
  graph = tf.Graph()
  with graph.as_default():
    x = np.zeros((batch, 5), np.float32)
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(({'x': x}, np.zeros(
            batch, np.int32))).batch(batch).repeat()).get_next()
    trainer.replicate_model_fn(classifier_model_fn, **kwargs)(
        features, labels, tf.estimator.ModeKeys.TRAIN,
        {'optimizer': OPTIMIZERS['sgd']},
        trainer.make_run_config(cpu_devices=towers))
  return graph


@pytest.mark.fast
def test_micro_batches_of_a_device_run_one_after_another():
  # 2 devices x 2 micro-batches: towers 0, 1 on CPU:0 and 2, 3 on CPU:1.
  graph = _build(2, 8, micro_batches=2)
  first = 'gradients/dense/MatMul_grad/MatMul_1'  # Tower 0's backward.
  assert graph.get_operation_by_name(first).device == '/device:CPU:0'
  later = _ancestors(graph.get_operation_by_name('tower_1/dense/MatMul'))
  assert first in later
  # The other device's micro-batches do not wait for this one's.
  other = _ancestors(graph.get_operation_by_name('tower_2/dense/MatMul'))
  assert first not in other
  assert 'gradients/tower_2/dense/MatMul_grad/MatMul_1' in _ancestors(
      graph.get_operation_by_name('tower_3/dense/MatMul'))


def _tower_of_gradient(op):
  """0 for gradients/dense/..., k for gradients/tower_k/..."""
  scope = (op.name.split('/') + [''])[1]
  return int(scope[len('tower_'):]) if scope.startswith('tower_') else 0


@pytest.mark.fast
def test_gradients_of_micro_batches_are_added_as_they_come():
  # tf.gradients sums a variable's contributions with one AddN, which would
  # keep every micro-batch's until the last: a chain of adds replaces it.
  graph = _build(1, 9, micro_batches=3)
  mixed = [op for op in graph.get_operations() if op.type == 'AddN' and len(
      {_tower_of_gradient(t.op) for t in op.inputs}) > 1]
  assert mixed
  assert not any(op.outputs[0].consumers() for op in mixed)


@pytest.mark.fast
def test_all_reduce_orders_micro_batches_and_reduces_once_per_step():
  graph = _build(2, 8, micro_batches=2, aggregation='all_reduce')
  later = _ancestors(graph.get_operation_by_name('tower_1/dense/MatMul'))
  assert any(name.startswith('gradients') for name in later)
  # One collective per dense variable for the step, as without
  # micro-batches, each summing one tensor per device.
  reduces = [op for op in graph.get_operations()
             if op.type.startswith('CollectiveReduce')]
  plain = _build(2, 8, aggregation='all_reduce')
  assert len(reduces) == len([
      op for op in plain.get_operations()
      if op.type.startswith('CollectiveReduce')]) == 2 * 4


@pytest.mark.fast
def test_towers_without_micro_batches_run_in_parallel():
  # The path the test above finds is not there by construction.
  graph = _build(2, 8)
  later = _ancestors(graph.get_operation_by_name('tower_1/dense/MatMul'))
  assert 'gradients/dense/MatMul_grad/MatMul_1' not in later


@pytest.mark.fast
def test_tower_context_tells_the_micro_batch():
  seen = []

  def model_fn(features, labels, mode, params):
    context = trainer.tower_context()
    seen.append((context.index, context.num_towers, context.micro_batch,
                 context.num_micro_batches))
    return classifier_model_fn(features, labels, mode, params)

  build_replicated(model_fn, 2, micro_batches=2)
  assert seen == [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]


@pytest.mark.fast
def test_batch_norm_in_training_is_refused_layer_norm_is_not():
  batch_norm = normalising_model_fn(
      lambda x: tf.keras.layers.BatchNormalization()(x, training=True))
  with pytest.raises(ValueError, match='trains batch norm.*moving mean and '
                     'variance would still get one exact update'):
    build_replicated(batch_norm, 1, micro_batches=2)
  # Keras' layer norm runs the fused batch-norm kernel on one row per
  # channel: it mixes no examples.
  build_replicated(normalising_model_fn(
      lambda x: tf.keras.layers.LayerNormalization()(x)), 1, micro_batches=2)


@pytest.mark.fast
@pytest.mark.parametrize('kwargs,match', [
    ({'micro_batches': 0}, 'micro_batches=0; it must be a positive int'),
    ({'micro_batches': 1.5}, 'micro_batches=1.5'),
    ({'micro_batches': True}, 'micro_batches=True'),
])
def test_bad_micro_batches_fail_at_once(kwargs, match):
  with pytest.raises(ValueError, match=match):
    trainer.replicate_model_fn(classifier_model_fn, **kwargs)


@pytest.mark.training
def test_float16_overflow_in_one_micro_batch_skips_the_step(tmp_path, data):
  # A dynamic loss scale checks the gradients of all micro-batches at once:
  # an overflow in one of them skips the whole step and halves the scale.
  x, y = data
  x = x[:7].copy()
  x[5, 0] = 1e5  # Beyond float16: only micro-batch 1 (rows 4-6) overflows.

  def model_fn(features, labels, mode):
    hidden = tf.keras.layers.Dense(8, activation='tanh', dtype='mixed_float16',
                                   kernel_initializer=seeded(1))(features['x'])
    logits = tf.keras.layers.Dense(2, dtype='mixed_float16',
                                   kernel_initializer=seeded(2))(hidden)
    loss = tf1.losses.sparse_softmax_cross_entropy(
        labels, tf.cast(logits, tf.float32))
    optimizer = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        tf1.train.GradientDescentOptimizer(0.5), loss_scale='dynamic')
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=(
        optimizer.minimize(loss, tf1.train.get_or_create_global_step())))

  input_fn = dataset_input_fn({'x': x}, y[:7], batch_size=7, repeat=False)
  dirs = [tmp_path / 'start', tmp_path / 'run']
  save_start_checkpoint(model_fn, input_fn, dirs)
  start = tf.train.load_checkpoint(str(dirs[0] / 'model.ckpt-0'))
  estimator = make_estimator(model_fn, dirs[1], 1, micro_batches=2,
                             replicate=True)
  final = FinalValues()
  # A skipped step leaves global_step at 0, so no checkpoint is written
  # after it: the hook reads the variables at the end of the session.
  estimator.train(input_fn, steps=1, hooks=[final])
  trained = final.values
  for name in start.get_variable_to_shape_map():
    if name not in ('global_step', 'current_loss_scale', 'good_steps'):
      np.testing.assert_array_equal(trained[name], start.get_tensor(name),
                                    err_msg=name)
  assert trained['current_loss_scale'] == 2.**14
  assert trained['good_steps'] == 0
