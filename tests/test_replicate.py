"""replicate_model_fn computes what one device computes on the same batch.

Each equivalence test trains a plain one-device Estimator and a replicated
one from the same seeded weights on the same batches, then compares every
checkpointed variable.
"""

import functools
import inspect
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import trainer
from helpers import (NUM_FEATURES, OPTIMIZERS, assert_same_variables,
                     build_replicated, classifier_model_fn, dataset_input_fn,
                     make_estimator, normalising_model_fn, variables_of)

tf1 = tf.compat.v1
STEPS = 3


def _train(tmp_path, name, towers, batch_size, data, params, steps=STEPS,
           model_fn=classifier_model_fn, **kwargs):
  x, y = data
  estimator = make_estimator(model_fn, tmp_path / name, towers, params,
                             **kwargs)
  estimator.train(dataset_input_fn({'x': x}, y, batch_size), steps=steps)
  return estimator


@pytest.fixture(scope='module')
def sgd_one_device(tmp_path_factory, data):
  """`sgd_one_device(batch_size)`: the variables of the one-device SGD run.

  Deterministic (seeded initializers and `tf_random_seed`, data in order),
  so it trains once per batch size in this module instead of once per tower
  count; each case still trains its own towered run.
  """
  runs = {}

  def get(batch_size):
    if batch_size not in runs:
      runs[batch_size] = variables_of(_train(
          tmp_path_factory.mktemp('one_device'), 'one', 1, batch_size, data,
          {'optimizer': OPTIMIZERS['sgd']}))
    return runs[batch_size]

  return get


@pytest.mark.training
@pytest.mark.parametrize('towers,batch_size', [
    (2, 12), (3, 12), (4, 12),   # divides
    (2, 10), (3, 10), (4, 10),   # does not divide
    (4, 3),                      # fewer examples than towers
])
def test_sgd_training_equals_one_device(tmp_path, data, sgd_one_device,
                                        towers, batch_size):
  params = {'optimizer': OPTIMIZERS['sgd']}
  one = sgd_one_device(batch_size)
  many = _train(tmp_path, 'many', towers, batch_size, data, params)
  assert_same_variables(one, variables_of(many))
  assert many.get_variable_value('global_step') == STEPS


@pytest.mark.training
@pytest.mark.parametrize('optimizer', ['momentum', 'adam', 'adagrad'])
def test_stateful_optimizers_equal_one_device(tmp_path, data, optimizer):
  params = {'optimizer': OPTIMIZERS[optimizer]}
  one = _train(tmp_path, 'one', 1, 10, data, params)
  many = _train(tmp_path, 'many', 4, 10, data, params)
  # Slot variables too: same names (e.g. dense/kernel/Adam) and values.
  assert_same_variables(variables_of(one), variables_of(many))


@pytest.mark.training
def test_transformed_gradients_are_global_batch_gradients(tmp_path, data):
  # Clipping by global norm only matches one device if the towers' gradients
  # are combined before the user's transformation sees them.
  params = {'optimizer': OPTIMIZERS['sgd'], 'clip_norm': 0.05}
  one = _train(tmp_path, 'one', 1, 10, data, params)
  many = _train(tmp_path, 'many', 3, 10, data, params)
  unclipped = _train(tmp_path, 'unclipped', 1, 10, data,
                     {'optimizer': OPTIMIZERS['sgd']})
  assert_same_variables(variables_of(one), variables_of(many))
  # The clip is active, so the comparison above is not vacuous.
  assert not np.allclose(one.get_variable_value('dense/kernel'),
                         unclipped.get_variable_value('dense/kernel'))


@pytest.mark.training
def test_sum_loss_reduction_equals_one_device(tmp_path, data):

  def sum_loss_model_fn(features, labels, mode):
    logits = tf.keras.layers.Dense(
        2, kernel_initializer=tf1.glorot_uniform_initializer(seed=3))(
            features['x'])
    loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    train_op = tf1.train.GradientDescentOptimizer(0.05).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  one = _train(tmp_path, 'one', 1, 10, data, None, model_fn=sum_loss_model_fn)
  many = _train(tmp_path, 'many', 4, 10, data, None,
                model_fn=sum_loss_model_fn, loss_reduction='sum')
  assert_same_variables(variables_of(one), variables_of(many))


@pytest.mark.training
@pytest.mark.parametrize('towers,batch_size', [(4, 10), (4, 3), (3, 12)])
def test_eval_metrics_equal_one_device(tmp_path, data, towers, batch_size):
  x, y = data
  params = {'optimizer': OPTIMIZERS['sgd']}
  one = _train(tmp_path, 'one', 1, 12, data, params)
  many = make_estimator(classifier_model_fn, tmp_path / 'one', towers, params)
  eval_input = dataset_input_fn({'x': x}, y, batch_size, repeat=False)
  expected = one.evaluate(eval_input)
  actual = many.evaluate(eval_input)
  assert sorted(expected) == sorted(actual)
  for key in expected:
    np.testing.assert_allclose(actual[key], expected[key], rtol=1e-5,
                               err_msg=key)
  assert 0.5 < expected['accuracy'] < 1.0  # The metrics are informative.


@pytest.mark.training
@pytest.mark.parametrize('towers,batch_size', [(4, 7), (4, 1), (3, 10)])
def test_predictions_equal_one_device_in_input_order(tmp_path, data, towers,
                                                     batch_size):
  x, y = data
  params = {'optimizer': OPTIMIZERS['sgd']}
  one = _train(tmp_path, 'one', 1, 12, data, params)
  many = make_estimator(classifier_model_fn, tmp_path / 'one', towers, params)
  predict_input = dataset_input_fn({'x': x[:17]}, None, batch_size,
                                   repeat=False)
  expected = list(one.predict(predict_input))
  actual = list(many.predict(predict_input))
  assert len(actual) == 17
  for e, a in zip(expected, actual):
    np.testing.assert_allclose(a['logits'], e['logits'], rtol=1e-5, atol=1e-6)
    assert a['classes'] == e['classes']


@pytest.mark.training
def test_checkpoints_move_between_tower_counts(tmp_path, data):
  params = {'optimizer': OPTIMIZERS['momentum']}
  reference = _train(tmp_path, 'reference', 1, 12, data, params, steps=6)
  x, y = data
  shared_dir = tmp_path / 'shared'
  for towers, steps in ((4, 2), (1, 4), (3, 6)):  # 4 towers, plain, 3 towers
    estimator = make_estimator(classifier_model_fn, shared_dir, towers, params)
    estimator.train(dataset_input_fn({'x': x}, y, 12), max_steps=steps)
  # The data restarts at each train() call, so feed the reference the same.
  reference = make_estimator(classifier_model_fn, tmp_path / 'ref2', 1, params)
  for steps in (2, 4, 6):
    reference.train(dataset_input_fn({'x': x}, y, 12), max_steps=steps)
  assert_same_variables(variables_of(reference), variables_of(estimator))


@pytest.mark.training
def test_feature_columns_with_hashed_categorical(tmp_path):
  rng = np.random.RandomState(1)
  words = np.array([b'cat', b'dog', b'fish', b'bird', b'cow'])[
      rng.randint(0, 5, 40)]
  amount = rng.randn(40, 1).astype(np.float32)
  labels = (amount[:, 0] > 0).astype(np.int32)

  def model_fn(features, labels, mode):
    word = tf1.feature_column.categorical_column_with_hash_bucket('word', 20)
    columns = [
        tf1.feature_column.embedding_column(
            word, 3, initializer=tf1.truncated_normal_initializer(seed=4)),
        tf1.feature_column.numeric_column('amount'),
    ]
    net = tf1.feature_column.input_layer(features, columns)
    logits = tf1.layers.dense(net, 2, kernel_initializer=
                              tf1.glorot_uniform_initializer(seed=5))
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf1.train.AdagradOptimizer(0.5).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  def input_fn():
    ds = tf.data.Dataset.from_tensor_slices(
        ({'word': words, 'amount': amount}, labels))
    # A SparseTensor feature, as parsed tf.Examples give feature columns.
    ds = ds.map(lambda f, l: ({'word': tf.sparse.from_dense(
        tf.reshape(f['word'], [1])), 'amount': f['amount']}, l))
    return ds.batch(10).repeat()

  runs = {}
  for towers in (1, 4):
    estimator = make_estimator(model_fn, tmp_path / str(towers), towers)
    estimator.train(input_fn, steps=STEPS)
    runs[towers] = variables_of(estimator)
  assert_same_variables(runs[1], runs[4])
  assert any('embedding_weights' in name for name in runs[4])


@pytest.mark.training
def test_keras_layers_unnamed_are_shared_not_duplicated(tmp_path, data):
  x, y = data

  def model_fn(features, labels, mode):
    net = features['x']
    for units, seed in ((6, 11), (4, 12)):
      net = tf.keras.layers.Dense(
          units, activation='relu',
          kernel_initializer=tf.keras.initializers.GlorotUniform(seed))(net)
    logits = tf.keras.layers.Dense(
        2, kernel_initializer=tf.keras.initializers.GlorotUniform(13))(net)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf1.train.GradientDescentOptimizer(0.3).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  runs, counts = {}, {}
  for towers in (1, 3):
    estimator = make_estimator(model_fn, tmp_path / str(towers), towers)
    estimator.train(dataset_input_fn({'x': x}, y, 10), steps=STEPS)
    runs[towers] = variables_of(estimator)
    counts[towers] = len(runs[towers])
  assert counts[1] == counts[3] == 7  # 3 kernels, 3 biases, global_step.
  assert_same_variables(runs[1], runs[3])


@pytest.mark.training
def test_batch_norm_statistics_move_once_per_step(tmp_path, data):
  x, y = data

  def model_fn(features, labels, mode):
    training = mode == tf.estimator.ModeKeys.TRAIN
    # A constant input: every shard's batch mean is 2 and its variance 0.
    constant = tf.zeros_like(features['x'][:, :2]) + 2.0
    net = tf1.layers.batch_normalization(constant, training=training,
                                         momentum=0.5)
    logits = tf1.layers.dense(tf.concat([net, features['x']], 1), 2)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(update_ops):
      train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
          loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  estimator = make_estimator(model_fn, tmp_path, 4)
  estimator.train(dataset_input_fn({'x': x}, y, 12), steps=4)
  # 4 steps = 4 updates of momentum 0.5 from 0 (mean) and 1 (variance), as
  # on one device; one update per tower would make it 16.
  moving_mean = estimator.get_variable_value(
      'batch_normalization/moving_mean')
  np.testing.assert_allclose(moving_mean, 2 * (1 - 0.5**4), atol=1e-5)
  moving_variance = estimator.get_variable_value(
      'batch_normalization/moving_variance')
  np.testing.assert_allclose(moving_variance, 0.5**4, atol=1e-6)
  assert estimator.get_variable_value('global_step') == 4


@pytest.mark.training
def test_tower_context_tells_index_and_count(tmp_path, data):
  seen = []

  def model_fn(features, labels, mode):
    context = trainer.tower_context()
    seen.append((context.index, context.num_towers, context.device))
    return classifier_model_fn(features, labels, mode,
                               {'optimizer': OPTIMIZERS['sgd']})

  _train(tmp_path, 'towers', 3, 12, data, None, steps=1, model_fn=model_fn)
  assert seen == [(i, 3, f'/device:CPU:{i}') for i in range(3)]
  assert trainer.tower_context() == trainer.TowerContext(0, 1, None)


@pytest.mark.fast
def test_each_tower_computes_forward_and_gradients_on_its_device():
  graph, _ = build_replicated(classifier_model_fn, 3)
  matmuls = [op for op in graph.get_operations() if op.type == 'MatMul']
  by_device = {}
  for op in matmuls:
    by_device.setdefault(op.device, []).append(op.name)
  # Forward and backward matmuls of 2 layers (1 forward + 2 backward for the
  # first layer's inputs are not needed, so 1 + 1) land on every tower.
  assert sorted(by_device) == [f'/device:CPU:{i}' for i in range(3)]
  counts = {device: len(names) for device, names in by_device.items()}
  assert len(set(counts.values())) == 1, counts
  assert all(name.startswith('tower_1/') or 'gradients' in name
             for name in by_device['/device:CPU:1']), by_device
  variables = [op for op in graph.get_operations() if op.type == 'VarHandleOp']
  assert variables and all(op.device == '/device:CPU:0' for op in variables)


@pytest.mark.fast
@pytest.mark.parametrize('kwargs,error,match', [
    ({'devices': '/cpu:0'}, TypeError, 'list of device strings'),
    ({'devices': []}, ValueError, 'devices is empty'),
    ({'devices': ['/cpu:0', '/device:CPU:0']}, ValueError, 'repeats'),
    ({'devices': ['/tpu:0']}, ValueError, 'CPU or GPU'),
    ({'devices': ['/cpu']}, ValueError, 'with its index'),
    ({'devices': [0, 1]}, TypeError, 'must hold strings'),
    ({'loss_reduction': 'avg'}, ValueError, "loss_reduction='avg'"),
    ({'variables_device': 0}, TypeError, 'variables_device must be'),
    ({'variables_device': 'cpu zero'}, ValueError, "'cpu zero' is not"),
    ({'variables_device': '/tpu:0'}, ValueError, 'a CPU or a GPU'),
])
def test_bad_arguments_fail_at_once(kwargs, error, match):
  with pytest.raises(error, match=match):
    trainer.replicate_model_fn(classifier_model_fn, **kwargs)


@pytest.mark.fast
def test_model_fn_must_be_callable():
  with pytest.raises(TypeError, match='model_fn must be callable'):
    trainer.replicate_model_fn('classifier_model_fn')


@pytest.mark.fast
def test_devices_the_session_lacks_are_named():
  with pytest.raises(ValueError, match=r'/device:CPU:5.*2 CPU device'):
    build_replicated(classifier_model_fn, 2, devices=['/cpu:0', '/cpu:5'])


@pytest.mark.fast
def test_variables_device_the_session_lacks_is_named():
  with pytest.raises(ValueError, match=r"variables_device='/device:GPU:0'.*0 "
                     'GPU device'):
    build_replicated(classifier_model_fn, 2, variables_device='/gpu:0')


@pytest.mark.fast
def test_variables_device_is_normalised_and_used():
  graph, _ = build_replicated(classifier_model_fn, 2, variables_device='/cpu:1')
  variables = [op for op in graph.get_operations() if op.type == 'VarHandleOp']
  assert variables and all(op.device == '/device:CPU:1' for op in variables)


@pytest.mark.fast
def test_one_explicit_device_is_pinned():
  graph, _ = build_replicated(classifier_model_fn, 2, devices=['/cpu:1'])
  matmuls = [op for op in graph.get_operations() if op.type == 'MatMul']
  assert matmuls and all(op.device == '/device:CPU:1' for op in matmuls)
  variables = [op for op in graph.get_operations() if op.type == 'VarHandleOp']
  assert variables and all(op.device == '/device:CPU:0' for op in variables)


@pytest.mark.training
def test_model_fn_arguments_in_any_order(tmp_path, data):
  # The Estimator passes features by keyword; so must the wrapper.

  def model_fn(mode, features, labels, params):
    return classifier_model_fn(features, labels, mode, params)

  params = {'optimizer': OPTIMIZERS['sgd']}
  one = _train(tmp_path, 'one', 1, 10, data, params)
  many = _train(tmp_path, 'many', 3, 10, data, params, model_fn=model_fn)
  assert_same_variables(variables_of(one), variables_of(many))


@pytest.mark.fast
def test_model_fn_without_features_argument_is_refused():
  with pytest.raises(ValueError, match='no `features` argument'):
    trainer.replicate_model_fn(lambda inputs, labels, mode: None)


@pytest.mark.training
def test_predictions_not_one_row_per_example_fail_at_run_time(tmp_path, data):
  x, _ = data

  def model_fn(features, mode):
    logits = tf1.layers.dense(features['x'], 2)
    return tf.estimator.EstimatorSpec(
        mode, predictions={'flat': tf.reshape(logits, [-1])})

  estimator = make_estimator(model_fn, tmp_path, 2)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"(?s)predictions\[.{1,2}flat.{1,2}\] does not "
                     r'have one row per example.*Rows per tower:.*\[10 10\].*'
                     r'examples fed per tower:.*\[5 5\]'):
    list(estimator.predict(dataset_input_fn({'x': x}, batch_size=10,
                                            repeat=False)))


def _scores_and(extra_predictions):
  """A model_fn predicting per-example scores and `extra_predictions(x,
  bias)` beside them."""

  def model_fn(features, mode):
    bias = tf1.get_variable('bias', [2, 1], initializer=tf1.ones_initializer())
    scores = tf1.layers.dense(features['x'], 1,
                              kernel_initializer=tf1.constant_initializer(0.5))
    loss = tf.reduce_mean(scores)
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=train_op,
        predictions={'scores': scores,
                     **extra_predictions(features['x'], bias)})

  return model_fn


@pytest.mark.training
def test_predictions_free_of_the_examples_are_one_devices(tmp_path, data):
  # tf.estimator's own predict tests return constants of the batch's rows
  # and a weight: one device's value, which no tower can split.
  x, _ = data
  model_fn = _scores_and(lambda x, bias: {
      'constant': tf.constant([[10.0], [12.0]]), 'bias': bias * 3.0})

  input_fn = dataset_input_fn({'x': x[:6]}, batch_size=2, repeat=False)
  rows = []
  for towers in (1, 2):
    estimator = make_estimator(model_fn, tmp_path / str(towers), towers)
    estimator.train(input_fn, steps=2)
    rows.append(list(estimator.predict(input_fn)))
  assert [row['constant'].item() for row in rows[1]] == [10.0, 12.0] * 3
  assert [row['bias'].item() for row in rows[1]] == [3.0] * 6
  for one, many in zip(*rows):
    assert one.keys() == many.keys()
    for key in one:
      np.testing.assert_allclose(many[key], one[key], rtol=1e-5, atol=1e-6)


@pytest.mark.training
@pytest.mark.parametrize('towers', [2, 3])
def test_predictions_shaped_by_a_static_shard_are_split(tmp_path, data,
                                                       towers):
  # With a static batch size, tf.fill([x.shape[0]], b) is a constant of
  # the shard's rows: kept whole as one free of the examples, one device's
  # 6 rows came back as 3 (2 towers) or 2 (3 towers), silently.
  x, _ = data
  model_fn = _scores_and(lambda x, bias: {
      'bias': tf.fill([x.shape[0]], bias[0, 0])})

  def input_fn():
    return tf.data.Dataset.from_tensor_slices({'x': x[:12]}).batch(
        6, drop_remainder=True)

  batches = []
  for count in (1, towers):
    estimator = make_estimator(model_fn, tmp_path / str(count), count)
    estimator.train(input_fn, steps=1)
    batches.append(list(estimator.predict(input_fn,
                                          yield_single_examples=False)))
  for one, many in zip(*batches):
    assert many['bias'].shape == one['bias'].shape == (6,)
    np.testing.assert_allclose(many['scores'], one['scores'], rtol=1e-5)


@pytest.mark.training
def test_explicit_devices_pick_the_towers(tmp_path, data):
  params = {'optimizer': OPTIMIZERS['sgd']}
  one = _train(tmp_path, 'one', 1, 10, data, params)
  x, y = data
  config = trainer.make_run_config(str(tmp_path / 'two'), cpu_devices=4,
                                   tf_random_seed=7)
  estimator = tf.estimator.Estimator(
      trainer.replicate_model_fn(classifier_model_fn,
                                 devices=['/cpu:3', '/cpu:1']),
      config=config, params=params)
  estimator.train(dataset_input_fn({'x': x}, y, 10), steps=STEPS)
  assert_same_variables(variables_of(one), variables_of(estimator))


@pytest.mark.training
def test_features_as_bare_tensor_and_labels_as_dict(tmp_path, data):
  x, y = data

  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features, 2, kernel_initializer=
                              tf1.glorot_uniform_initializer(seed=9))
    loss = tf1.losses.sparse_softmax_cross_entropy(
        labels['class'], logits, weights=labels['weight'])
    train_op = tf1.train.GradientDescentOptimizer(0.5).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  weight = np.linspace(0.5, 1.5, len(y)).astype(np.float32)
  runs = {}
  for towers in (1, 4):
    estimator = make_estimator(model_fn, tmp_path / str(towers), towers)
    estimator.train(dataset_input_fn(x, {'class': y, 'weight': weight}, 10),
                    steps=STEPS)
    runs[towers] = variables_of(estimator)
  assert_same_variables(runs[1], runs[4])


@pytest.mark.fast
def test_model_fn_without_labels_argument_but_labels_given():

  def model_fn(features, mode):
    return tf.estimator.EstimatorSpec(mode, predictions=features['x'])

  with pytest.raises(ValueError, match='does not take labels'):
    build_replicated(model_fn, 2, mode='infer')


_SERVE_SCRIPT = '''
import sys
import functools
import inspect
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures['serving_default']
for n in (1, 7):
  x = np.arange(n * 5, dtype=np.float32).reshape(n, 5) / 10
  np.save(f'{sys.argv[2]}/served_{n}.npy', serve(x=tf.constant(x))['logits'])
'''


@pytest.mark.training
@pytest.mark.parametrize('replicate_serving', [False, True])
def test_exported_saved_model_serves_batches_of_1_and_7(tmp_path, data,
                                                        replicate_serving):
  params = {'optimizer': OPTIMIZERS['sgd']}
  _train(tmp_path, 'model', 1, 12, data, params)
  towers = make_estimator(classifier_model_fn, tmp_path / 'model', 4, params,
                          replicate_serving=replicate_serving)
  receiver = tf.estimator.export.build_raw_serving_input_receiver_fn(
      {'x': tf.zeros([1, 5])}, default_batch_size=None)
  export_dir = towers.export_saved_model(str(tmp_path / 'export'),
                                         receiver).decode()
  # A fresh process with one CPU device, as a serving machine would be.
  subprocess.run([sys.executable, '-c', _SERVE_SCRIPT, export_dir,
                  str(tmp_path)], check=True, env={**os.environ,
                                                   'TF_CPP_MIN_LOG_LEVEL': '3'})
  plain = make_estimator(classifier_model_fn, tmp_path / 'model', 1, params)
  for n in (1, 7):
    x = np.arange(n * 5, dtype=np.float32).reshape(n, 5) / 10
    expected = [p['logits'] for p in plain.predict(
        dataset_input_fn({'x': x}, None, n, repeat=False))]
    served = np.load(tmp_path / f'served_{n}.npy')
    assert served.shape == (n, 2)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.training
def test_idle_towers_with_a_plain_mean_loss_contribute_nothing(tmp_path, data):
  # tf.reduce_mean over an empty shard is NaN, and NaN * 0 is NaN: idle
  # towers must not see an empty batch in training.
  x, y = data

  def model_fn(features, labels, mode):
    logits = tf.keras.layers.Dense(
        2, kernel_initializer=tf.keras.initializers.GlorotUniform(31))(
            features['x'])
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    train_op = tf1.train.GradientDescentOptimizer(0.5).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  runs = {}
  for towers in (1, 4):
    estimator = make_estimator(model_fn, tmp_path / str(towers), towers)
    estimator.train(dataset_input_fn({'x': x}, y, 2), steps=STEPS)
    runs[towers] = variables_of(estimator)
  assert_same_variables(runs[1], runs[4])


@pytest.mark.training
def test_idle_towers_leave_batch_norm_statistics_finite(tmp_path, data):
  # An empty shard's batch mean is NaN; an idle tower must not feed it to
  # the moving averages.
  x, y = data

  model_fn = normalising_model_fn(
      lambda x: tf1.layers.batch_normalization(x, training=True))
  estimator = make_estimator(model_fn, tmp_path, 4)
  estimator.train(dataset_input_fn({'x': x}, y, 2), steps=STEPS)
  values = variables_of(estimator)
  assert 'batch_normalization/moving_mean' in values
  for name, value in values.items():
    assert np.all(np.isfinite(value)), name


@pytest.mark.training
def test_training_hooks_are_kept_and_run_once_per_step(tmp_path, data):
  calls = []

  class CountingHook(tf1.train.SessionRunHook):

    def after_run(self, run_context, run_values):
      calls.append(1)

  def model_fn(features, labels, mode, params):
    spec = classifier_model_fn(features, labels, mode, params)
    return spec._replace(training_hooks=[CountingHook()])

  _train(tmp_path, 'hooks', 3, 12, data, {'optimizer': OPTIMIZERS['sgd']},
         model_fn=model_fn)
  assert len(calls) == STEPS  # Tower 0's hook, not one per tower.


def _model_fn_without_params(features, labels, mode):
  logits = tf1.layers.dense(features['x'], 2)
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.no_op())


def _model_fn_with_an_unknown_argument(features, labels, mode, extra):
  del extra
  return _model_fn_without_params(features, labels, mode)


@pytest.mark.parametrize('model_fn,params,message', [
    (_model_fn_without_params, {'a': 1}, 'does not include params'),
    (_model_fn_with_an_unknown_argument, None, 'not expected args'),
])
@pytest.mark.fast
def test_estimator_checks_the_model_fns_own_arguments(tmp_path, model_fn,
                                                      params, message):
  # As for the unwrapped model_fn, at construction: params are not dropped
  # silently, an unknown argument does not wait for the first call.
  config = trainer.make_run_config(str(tmp_path), cpu_devices=2)
  for fn in (model_fn, trainer.replicate_model_fn(model_fn)):
    with pytest.raises(ValueError, match=message):
      tf.estimator.Estimator(fn, config=config, params=params)


@pytest.mark.fast
def test_an_eager_call_runs_the_model_fn_as_written():
  # tf.estimator's own tests call estimator.model_fn outside a graph.
  def model_fn(features, labels, mode):
    layer = tf.keras.layers.Dense(
        1, kernel_initializer=tf.keras.initializers.Constant(0.5))
    predictions = layer(features['x'])
    return tf.estimator.EstimatorSpec(
        mode, predictions={'y': predictions},
        loss=tf.reduce_mean(tf.square(predictions[:, 0] - labels)))

  features = {'x': tf.ones([4, 3])}
  labels = tf.zeros([4])
  config = trainer.make_run_config(None, cpu_devices=2)
  spec = trainer.replicate_model_fn(model_fn)(
      features, labels, tf.estimator.ModeKeys.EVAL, config=config)
  expected = model_fn(features, labels, tf.estimator.ModeKeys.EVAL)
  np.testing.assert_allclose(spec.loss.numpy(), expected.loss.numpy())
  assert spec.loss.numpy() == pytest.approx(2.25)


@pytest.mark.training
def test_int_feature_keys_train_as_one_device(tmp_path, data):
  x, y = data

  def model_fn(features, labels, mode, params):
    both = {'x': tf.concat([features[7], features['rest']], 1)}
    return classifier_model_fn(both, labels, mode, params)

  def input_fn():
    return {7: tf.constant(x[:, :1]), 'rest': tf.constant(x[:, 1:])}, (
        tf.constant(y))

  results = []
  for towers in (1, 2):
    estimator = make_estimator(model_fn, tmp_path / str(towers),
                               towers=towers,
                               params={'optimizer': OPTIMIZERS['sgd']})
    estimator.train(input_fn, steps=3)
    results.append(variables_of(estimator))
  assert_same_variables(*results)


@pytest.mark.training
def test_an_extra_argument_with_a_default_keeps_its_default(tmp_path, data):
  # Wrapped model_fns with such arguments (a test's knobs, a factory's
  # options) trained before the model_fn's own arguments were presented.
  def model_fn(features, labels, mode, params, hidden=3):
    assert hidden == 3
    return classifier_model_fn(features, labels, mode, params)

  config = trainer.make_run_config(str(tmp_path), cpu_devices=2)
  estimator = tf.estimator.Estimator(trainer.replicate_model_fn(model_fn),
                                     config=config,
                                     params={'optimizer': OPTIMIZERS['sgd']})
  estimator.train(dataset_input_fn(*data), steps=2)
  assert estimator.get_variable_value('global_step') == 2


@pytest.mark.training
def test_a_partial_model_fn_binds_its_params(tmp_path, data):
  # Estimator gives params only to a model_fn whose params are not bound.
  model_fn = functools.partial(classifier_model_fn,
                               params={'optimizer': OPTIMIZERS['sgd']})
  replicated = trainer.replicate_model_fn(model_fn)
  assert 'params' not in inspect.signature(replicated).parameters
  config = trainer.make_run_config(str(tmp_path), cpu_devices=2)
  estimator = tf.estimator.Estimator(replicated, config=config)
  estimator.train(dataset_input_fn(*data), steps=2)
  assert estimator.get_variable_value('global_step') == 2


def _with_labels(features, labels, mode, config):
  del config
  return classifier_model_fn(features, labels, mode,
                             {'optimizer': OPTIMIZERS['sgd']})


def _without_labels(features, mode, config):
  del config
  logits = tf1.layers.dense(features['x'], 2)
  return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})


@pytest.mark.fast
@pytest.mark.parametrize('model_fn, presented', [
    (_with_labels, ['features', 'labels', 'mode', 'config']),
    (_without_labels, ['features', 'mode', 'config'])])
def test_a_positional_call_by_the_presented_signature_builds_towers(
    model_fn, presented):
  # A model_fn without params is presented without them: its fourth
  # positional argument (third, without labels) is the config. Bound in
  # Estimator's full order instead, the config was taken for params and
  # one device was built, silently (or mode for labels: a wrong error).
  replicated = trainer.replicate_model_fn(model_fn)
  assert list(inspect.signature(replicated).parameters) == presented
  graph = tf.Graph()
  with graph.as_default():
    data = tf.data.Dataset.from_tensors(
        ({'x': np.zeros((6, NUM_FEATURES), np.float32)},
         np.zeros((6,), np.int32))).repeat()
    features, labels = tf1.data.make_one_shot_iterator(data).get_next()
    config = trainer.make_run_config(cpu_devices=2)
    if 'labels' in presented:
      replicated(features, labels, tf.estimator.ModeKeys.TRAIN, config)
    else:
      replicated(features, tf.estimator.ModeKeys.PREDICT, config)
  assert {'/device:CPU:0', '/device:CPU:1'} <= {
      op.device for op in graph.get_operations()}


def _nested_cond_summary_model_fn(features, labels, mode, params):
  """classifier_model_fn with LinearClassifierV2's summary of the fraction
  of zero weights: a variable read inside a tf.cond nested in another
  (tf.math.zero_fraction holds a third)."""
  spec = classifier_model_fn(features, labels, mode, params)
  kernel = tf1.trainable_variables()[0]
  fraction = tf1.cond(
      tf.constant(True),
      lambda: tf1.cond(tf.constant(True),
                       lambda: tf.math.zero_fraction(kernel),
                       lambda: tf.constant(0.0)),
      lambda: tf.constant(0.0))
  tf1.summary.scalar('fraction_of_zero_weights', fraction)
  return spec


@pytest.mark.training
@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
def test_a_variable_read_in_nested_conds_trains_without_soft_placement(
    tmp_path, data, aggregation):
  # The read inside tower 1's branches was placed on tower 1's device by
  # the function inlining, away from its variable: without soft placement
  # the session refused to start ("Cannot colocate nodes").
  x, y = data
  variables = []
  for towers in (1, 2):
    config = trainer.make_run_config(
        str(tmp_path / str(towers)), cpu_devices=towers,
        allow_soft_placement=False, tf_random_seed=7,
        checkpoint_save_graph_def=False)
    model_fn = _nested_cond_summary_model_fn
    if towers > 1:
      model_fn = trainer.replicate_model_fn(model_fn, aggregation=aggregation)
    estimator = tf.estimator.Estimator(
        model_fn, config=config, params={'optimizer': OPTIMIZERS['sgd']})
    estimator.train(dataset_input_fn({'x': x}, y, 12), steps=STEPS)
    variables.append(variables_of(estimator))
  assert_same_variables(*variables)
