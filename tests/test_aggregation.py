"""Every aggregation strategy trains what one device trains.

`replicate_model_fn(aggregation=...)` changes where variables live and how
the towers' gradients meet, never the numbers: each strategy is compared
with a plain one-device Estimator from the same start, on batches that do
not divide by the tower count, and its checkpoints must carry exactly the
one-device names and resume under every other strategy.
"""

import json
import shutil

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers
import helpers
from helpers import (OPTIMIZERS, assert_same_variables, build_replicated,
                     classifier_model_fn, dataset_input_fn, make_estimator,
                     run_config, save_start_checkpoint, train_in_session,
                     variables_of)

tf1 = tf.compat.v1
AGGREGATIONS = ['global_loss', 'round_robin', 'all_reduce']
STEPS = 4
BATCH = 7  # Divides by neither 2 nor 3 towers.
COLUMNS = [tf.feature_column.numeric_column('x', shape=(5,))]


def _train(tmp_path, name, towers, data, params, steps=STEPS, **kwargs):
  x, y = data
  estimator = make_estimator(classifier_model_fn, tmp_path / name, towers,
                             params, **kwargs)
  estimator.train(dataset_input_fn({'x': x}, y, BATCH), steps=steps)
  return estimator


@pytest.fixture(scope='module')
def one_device(tmp_path_factory):
  """`one_device(key, train)`: a one-device reference run, once per key.

  The parametrized cases compare each strategy and tower count with the
  same one-device run, which is deterministic (seeded initializers and
  `tf_random_seed`, data in order; a canned model from a saved start): it
  runs once per `key` in this module, `train(model_dir)` returning what the
  cases compare with (its variables), instead of once per case. Each case
  still trains its own replicated run.
  """
  runs = {}

  def get(key, train):
    if key not in runs:
      runs[key] = train(tmp_path_factory.mktemp('one_device'))
    return runs[key]

  return get


def _one_classifier(one_device, data, optimizer, steps=STEPS, **params):
  """classifier_model_fn trained `steps` on one device, through the cache."""
  key = ('classifier', optimizer, steps, tuple(sorted(params.items())))
  params = {'optimizer': OPTIMIZERS[optimizer], **params}
  return one_device(key, lambda model_dir: variables_of(
      _train(model_dir, 'one', 1, data, params, steps=steps)))


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
@pytest.mark.parametrize('towers', [2, 3])
@pytest.mark.parametrize('optimizer', ['momentum', 'adam'])
def test_training_equals_one_device(tmp_path, data, one_device, aggregation,
                                    towers, optimizer):
  params = {'optimizer': OPTIMIZERS[optimizer]}
  one = _one_classifier(one_device, data, optimizer)
  many = _train(tmp_path, 'many', towers, data, params,
                aggregation=aggregation)
  # Same names (slots and Adam's powers too) and values; one global_step.
  assert_same_variables(one, variables_of(many))
  assert many.get_variable_value('global_step') == STEPS


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_clipped_gradients_equal_one_device(tmp_path, data, one_device,
                                            aggregation):
  params = {'optimizer': OPTIMIZERS['momentum'], 'clip_norm': 0.05}
  one = _one_classifier(one_device, data, 'momentum', clip_norm=0.05)
  many = _train(tmp_path, 'many', 3, data, params, aggregation=aggregation)
  unclipped = _one_classifier(one_device, data, 'momentum')
  assert_same_variables(one, variables_of(many))
  # The clip is active, so the comparison is not vacuous.
  assert not np.allclose(one['dense/kernel'], unclipped['dense/kernel'])


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
@pytest.mark.parametrize('version', ['v1', 'tf2_keras_optimizer'])
def test_canned_dnn_classifier_equals_one_device(tmp_path, data, one_device,
                                                 aggregation, version):
  # v1: summed loss, tf.compat.v1 Adagrad; TF2: a legacy Keras Adagrad.
  x, y = data
  canned = (tf1.estimator.DNNClassifier if version == 'v1'
            else tf.estimator.DNNClassifier)
  input_fn = dataset_input_fn({'x': x}, y[:, None], BATCH)
  towers = 2 if version == 'v1' else 3

  def model_fn():
    return canned(hidden_units=[4], feature_columns=COLUMNS).model_fn

  def start_and_one(root):
    # The canned initializers are not seeded: the start checkpoint is saved
    # once per version, and the one-device run trains from it once; each
    # case trains its replicated run from a copy of that start.
    save_start_checkpoint(model_fn(), input_fn, [root / 'one', root / 'start'])
    one = tf.estimator.Estimator(
        model_fn(),
        config=run_config(root / 'one', 1))
    one.train(input_fn, steps=STEPS)
    return root / 'start', variables_of(one)

  start, one = one_device(('canned', version), start_and_one)
  shutil.copytree(start, tmp_path / 'many')
  many = tf.estimator.Estimator(
      estimator_towers.replicate_model_fn(model_fn(), aggregation=aggregation),
      config=run_config(tmp_path / 'many', towers))
  many.train(input_fn, steps=STEPS)
  assert_same_variables(one, variables_of(many))
  assert any('Adagrad' in name for name in variables_of(many))


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_eval_and_predict_equal_one_device(tmp_path, data, aggregation):
  x, y = data
  params = {'optimizer': OPTIMIZERS['momentum']}
  one = _train(tmp_path, 'one', 1, data, params)
  many = make_estimator(classifier_model_fn, tmp_path / 'one', 3, params,
                        aggregation=aggregation)
  eval_input = dataset_input_fn({'x': x}, y, BATCH, repeat=False)
  expected, actual = one.evaluate(eval_input), many.evaluate(eval_input)
  assert sorted(expected) == sorted(actual)
  for key in expected:
    np.testing.assert_allclose(actual[key], expected[key], rtol=1e-5,
                               err_msg=key)
  predict_input = dataset_input_fn({'x': x[:17]}, None, BATCH, repeat=False)
  expected = list(one.predict(predict_input))
  actual = list(many.predict(predict_input))
  assert len(actual) == 17
  for e, a in zip(expected, actual):
    np.testing.assert_allclose(a['logits'], e['logits'], rtol=1e-5, atol=1e-6)


def _checkpoint_names(model_dir):
  return sorted(name for name, _ in tf.train.list_variables(str(model_dir))
                if name != '_CHECKPOINTABLE_OBJECT_GRAPH')


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_checkpoints_hold_exactly_the_one_device_names(tmp_path, data,
                                                        one_device,
                                                        aggregation):
  params = {'optimizer': OPTIMIZERS['adam']}

  def one_names(model_dir):
    _train(model_dir, 'one', 1, data, params, steps=1)
    return _checkpoint_names(model_dir / 'one')

  _train(tmp_path, 'many', 3, data, params, steps=1, aggregation=aggregation)
  names = _checkpoint_names(tmp_path / 'many')
  assert names == one_device('adam_checkpoint_names', one_names)
  assert not any('replica' in name for name in names)


@pytest.mark.training
@pytest.mark.parametrize('first', AGGREGATIONS)
def test_checkpoint_resumes_under_every_strategy_and_tower_count(
    tmp_path, data, first):
  # One model_dir trained in turn by `first` on 2 towers, the other two
  # strategies on 3 and 2 towers and a plain Estimator equals one device
  # trained for as many steps (the input restarts at each train() call).
  x, y = data
  params = {'optimizer': OPTIMIZERS['momentum']}
  others = [a for a in AGGREGATIONS if a != first]
  plan = [(first, 2), (others[0], 3), (None, 1), (others[1], 2)]
  shared = tmp_path / 'shared'
  reference = make_estimator(classifier_model_fn, tmp_path / 'ref', 1, params)
  for i, (aggregation, towers) in enumerate(plan):
    kwargs = {'aggregation': aggregation} if aggregation else {}
    estimator = make_estimator(classifier_model_fn, shared, towers, params,
                               **kwargs)
    estimator.train(dataset_input_fn({'x': x}, y, BATCH), max_steps=2 * i + 2)
    reference.train(dataset_input_fn({'x': x}, y, BATCH), max_steps=2 * i + 2)
  assert estimator.get_variable_value('global_step') == 8
  assert_same_variables(variables_of(reference), variables_of(estimator))


def _variable_devices(graph, names):
  by_name = {op.name: op for op in graph.get_operations()}
  return {name: tf.DeviceSpec.from_string(by_name[name].device).to_string()
          for name in names}


@pytest.mark.fast
def test_round_robin_spreads_variables_over_the_towers():
  graph, _ = build_replicated(classifier_model_fn, 3,
                              params={'optimizer': OPTIMIZERS['momentum']},
                              aggregation='round_robin')
  names = ['dense/kernel', 'dense/bias', 'dense_1/kernel', 'dense_1/bias']
  devices = _variable_devices(graph, names)
  assert len(set(devices.values())) == 3, devices
  # Each slot lives with its variable, whatever the device function said.
  by_name = {op.name: op for op in graph.get_operations()}
  for name in names:
    slot = by_name[f'{name}/Momentum']
    assert f'loc:@{name}'.encode() in slot.colocation_groups()
    assert slot.device == by_name[name].device


@pytest.mark.fast
def test_global_loss_keeps_every_variable_on_variables_device():
  graph, _ = build_replicated(classifier_model_fn, 3,
                              aggregation='global_loss')
  devices = _variable_devices(graph, ['dense/kernel', 'dense_1/kernel'])
  assert set(devices.values()) == {'/device:CPU:0'}


@pytest.mark.fast
def test_all_reduce_has_one_copy_per_device_and_sums_with_collectives():
  graph, _ = build_replicated(classifier_model_fn, 3,
                              params={'optimizer': OPTIMIZERS['momentum']},
                              aggregation='all_reduce')
  names = ['dense/kernel', 'tower_1_replica/dense/kernel',
           'tower_2_replica/dense/kernel']
  devices = _variable_devices(graph, names)
  assert list(devices.values()) == [
      '/device:CPU:0', '/device:CPU:1', '/device:CPU:2']
  with graph.as_default():
    saved = {v.op.name for v in tf1.global_variables()}
    local = {v.op.name for v in tf1.local_variables()}
    trainable = {v.op.name for v in tf1.trainable_variables()}
  assert 'tower_1_replica/dense/kernel/Momentum' in local
  assert not any('replica' in name for name in saved | trainable)
  reduce_devices = {op.device for op in graph.get_operations()
                    if op.type == 'CollectiveReduce'}
  assert len(reduce_devices) == 3


@pytest.mark.fast
def test_all_reduce_copies_stay_identical_to_the_primary(data):
  x, y = data
  graph = tf.Graph()
  with graph.as_default():
    features, labels = tf1.data.make_one_shot_iterator(
        dataset_input_fn({'x': x}, y, BATCH)()).get_next()
    tf1.train.get_or_create_global_step()
    config = estimator_towers.make_run_config(cpu_devices=3)
    spec = estimator_towers.replicate_model_fn(
        classifier_model_fn, aggregation='all_reduce')(
            features, labels, tf.estimator.ModeKeys.TRAIN,
            {'optimizer': OPTIMIZERS['adam']}, config)
    copies = {v.op.name: v for v in tf1.local_variables()
              if 'replica' in v.op.name}
    primaries = {v.op.name: v for v in tf1.global_variables()}
    with tf1.train.MonitoredSession(
        tf1.train.ChiefSessionCreator(scaffold=spec.scaffold,
                                      config=config.session_config)) as sess:
      start = sess.run(primaries['dense/kernel'])
      for _ in range(STEPS):
        sess.run(spec.train_op)
      values = sess.run({**copies, **primaries})
  assert len(copies) == 2 * (4 + 4 * 2)  # 2 towers: 4 variables, 8 slots.
  for name in copies:
    primary = name.split('/', 1)[1]
    np.testing.assert_array_equal(values[name], values[primary],
                                  err_msg=name)
  assert not np.allclose(values['dense/kernel'], start)  # It trained.


@pytest.mark.fast
def test_bad_aggregation_is_named_with_the_choices():
  with pytest.raises(ValueError, match=r"aggregation='ring'.*'global_loss', "
                     r"'round_robin', 'all_reduce'"):
    estimator_towers.replicate_model_fn(classifier_model_fn,
                                        aggregation='ring')
  with pytest.raises(TypeError, match='aggregation must be one of'):
    estimator_towers.replicate_model_fn(classifier_model_fn, aggregation=None)


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', ['round_robin', 'all_reduce'])
def test_variables_device_with_a_placing_strategy_is_refused(aggregation):
  with pytest.raises(ValueError, match=r"variables_device='/cpu:0' cannot be "
                     rf"combined with aggregation='{aggregation}'"):
    estimator_towers.replicate_model_fn(
        classifier_model_fn, variables_device='/cpu:0',
        aggregation=aggregation)


@pytest.mark.fast
def test_all_reduce_refuses_a_model_fn_that_writes_its_weights():

  def model_fn(features, labels, mode):
    layer = tf.keras.layers.Dense(2)
    logits = layer(features['x'])
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    with tf.control_dependencies([train_op]):
      # Weight decay by hand: would reach only the last tower's copy.
      decay = layer.kernel.assign(layer.kernel * 0.99)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=decay.op)

  with pytest.raises(ValueError, match=r'writes the trainable variable '
                     r'dense/kernel itself'):
    build_replicated(model_fn, 2, aggregation='all_reduce')
  build_replicated(model_fn, 2, aggregation='global_loss')  # Fine there.


@pytest.mark.training
def test_one_explicit_device_with_all_reduce_is_plain(tmp_path, data,
                                                      one_device):
  params = {'optimizer': OPTIMIZERS['momentum']}
  one = _one_classifier(one_device, data, 'momentum')
  pinned = _train(tmp_path, 'pinned', 2, data, params, devices=['/cpu:1'],
                  aggregation='all_reduce')
  assert_same_variables(one, variables_of(pinned))


def _two_optimizers_model_fn(features, labels, mode):
  """A GAN-style model_fn: two losses, two optimizers, one with slots."""
  with tf1.variable_scope('a'):
    logits_a = tf1.layers.dense(
        features['x'], 2,
        kernel_initializer=tf1.glorot_uniform_initializer(seed=21))
  with tf1.variable_scope('b'):
    logits_b = tf1.layers.dense(
        features['x'], 2,
        kernel_initializer=tf1.glorot_uniform_initializer(seed=22))
  loss_a = tf1.losses.sparse_softmax_cross_entropy(labels, logits_a)
  loss_b = tf1.losses.sparse_softmax_cross_entropy(labels, logits_b * 2.0)
  step = tf1.train.get_or_create_global_step()
  train_a = tf1.train.GradientDescentOptimizer(0.3).minimize(
      loss_a, var_list=tf1.trainable_variables('a'))
  train_b = tf1.train.MomentumOptimizer(0.1, 0.5).minimize(
      loss_b, step, var_list=tf1.trainable_variables('b'))
  return tf.estimator.EstimatorSpec(mode, loss=loss_a + loss_b,
                                    train_op=tf.group(train_a, train_b))


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_two_optimizers_equal_one_device(tmp_path, data, one_device,
                                         aggregation):
  x, y = data

  def train(model_dir, towers, **kwargs):
    estimator = make_estimator(_two_optimizers_model_fn, model_dir, towers,
                               **kwargs)
    estimator.train(dataset_input_fn({'x': x}, y, BATCH), steps=3)
    return variables_of(estimator)

  runs = {1: one_device('two_optimizers', lambda d: train(d, 1)),
          3: train(tmp_path / '3', 3, aggregation=aggregation)}
  assert_same_variables(runs[1], runs[3])
  assert runs[3]['global_step'] == 3


def _embedding_model_fn(features, labels, mode):
  """Sparse gradients: an embedding trained by Momentum's sparse update."""
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
  train_op = tf1.train.MomentumOptimizer(0.5, 0.9).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_sparse_embedding_gradients_equal_one_device(tmp_path, one_device,
                                                     aggregation):
  rng = np.random.RandomState(1)
  words = np.array([b'cat', b'dog', b'fish', b'bird', b'cow'])[
      rng.randint(0, 5, 40)]
  amount = rng.randn(40, 1).astype(np.float32)
  labels = (amount[:, 0] > 0).astype(np.int32)

  def input_fn():
    ds = tf.data.Dataset.from_tensor_slices(
        ({'word': words, 'amount': amount}, labels))
    ds = ds.map(lambda f, l: ({'word': tf.sparse.from_dense(
        tf.reshape(f['word'], [1])), 'amount': f['amount']}, l))
    return ds.batch(BATCH).repeat()

  def train(model_dir, towers, **kwargs):
    estimator = make_estimator(_embedding_model_fn, model_dir, towers,
                               **kwargs)
    estimator.train(input_fn, steps=STEPS)
    return variables_of(estimator)

  runs = {1: one_device('embedding', lambda d: train(d, 1)),
          3: train(tmp_path / '3', 3, aggregation=aggregation)}
  assert_same_variables(runs[1], runs[3])
  assert any('embedding_weights/Momentum' in name for name in runs[3])


def _ref_variables_model_fn(features, labels, mode):
  """TF1 ref variables (what `tf.compat.v1.disable_v2_behavior()` makes),
  updated in place by Momentum's kernels."""
  scope = tf1.get_variable_scope()
  with tf1.variable_scope(scope, use_resource=False):
    hidden = tf1.layers.dense(features['x'], 8, activation=tf.nn.tanh,
                              kernel_initializer=tf1.glorot_uniform_initializer(
                                  seed=1))
    logits = tf1.layers.dense(hidden, 2, kernel_initializer=
                              tf1.glorot_uniform_initializer(seed=2))
  assert tf1.trainable_variables()[0].dtype._is_ref_dtype  # pylint: disable=protected-access
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf1.train.MomentumOptimizer(0.5, 0.9).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.training
@pytest.mark.parametrize('towers,aggregation', [
    (2, 'all_reduce'), (3, 'all_reduce'), (3, 'global_loss')])
def test_ref_variables_equal_one_device(tmp_path, data, one_device, towers,
                                        aggregation):
  # A copy set from a ref variable shared its memory: the primary's
  # in-place update moved the copy too, which then stepped twice (about
  # one step in two).
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y, BATCH)

  def train(model_dir, count, **kwargs):
    estimator = make_estimator(_ref_variables_model_fn, model_dir, count,
                               **kwargs)
    estimator.train(input_fn, steps=4 * STEPS)
    return variables_of(estimator)

  one = one_device('ref', lambda d: train(d, 1))
  assert_same_variables(one, train(tmp_path / 'many', towers,
                                   aggregation=aggregation))


def _decayed(in_cond=False):
  """A model_fn with weight decay the TF1 way (official ResNet): an L2 term
  over the variables `tf.compat.v1.trainable_variables()` lists; with
  `in_cond`, switched on by a tf.cond on the step (its reads of the
  variables then sit in the cond's branch function)."""

  def model_fn(features, labels, mode):
    hidden = tf1.layers.dense(
        features['x'], 8, activation=tf.nn.tanh,
        kernel_initializer=tf1.glorot_uniform_initializer(seed=1))
    logits = tf1.layers.dense(hidden, 2, kernel_initializer=
                              tf1.glorot_uniform_initializer(seed=2))
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    step = tf1.train.get_or_create_global_step()
    decay = lambda: 0.05 * tf.add_n(  # pylint: disable=unnecessary-lambda-assignment
        [tf.nn.l2_loss(v) for v in tf1.trainable_variables()])
    loss += (tf.cond(step >= 0, decay, lambda: tf.constant(0.)) if in_cond
             else decay())
    train_op = tf1.train.MomentumOptimizer(0.5, 0.9).minimize(loss, step)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.training
@pytest.mark.parametrize('towers', [2, 3])
def test_weight_decay_over_the_trainable_collection_equals_one_device(
    tmp_path, data, one_device, towers):
  # The collection lists the primaries: under all_reduce the towers after
  # the first read them directly, and their decay gradient was lost (0.05
  # off in a kernel after a few steps, in every run).
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y, BATCH)

  def train(model_dir, count, **kwargs):
    estimator = make_estimator(_decayed(), model_dir, count, **kwargs)
    estimator.train(input_fn, steps=STEPS)
    return variables_of(estimator)

  one = one_device('decayed', lambda d: train(d, 1))
  assert_same_variables(one, train(tmp_path / 'many', towers,
                                   aggregation='all_reduce'))


def _keras_get_gradients_model_fn(features, labels, mode):
  """A Keras legacy optimizer's get_gradients, which refuses a variable
  without a gradient, then apply_gradients."""
  hidden = tf1.layers.dense(features['x'], 4, kernel_initializer=
                            tf1.glorot_uniform_initializer(seed=1))
  loss = tf.reduce_mean(tf.square(tf1.layers.dense(
      hidden, 1, kernel_initializer=tf1.glorot_uniform_initializer(seed=2))
                                  - tf.cast(labels[:, None], tf.float32)))
  optimizer = tf.keras.optimizers.legacy.SGD(0.1)
  variables = tf1.trainable_variables()
  gradients = optimizer.get_gradients(loss, variables)
  train_op = tf.group(optimizer.apply_gradients(zip(gradients, variables)),
                      tf1.assign_add(tf1.train.get_or_create_global_step(), 1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
def test_keras_get_gradients_equals_one_device_under_all_reduce():
  # The later towers' gradients through reads of the primaries were taken
  # with the model_fn's own method: get_gradients refused the primaries
  # the tower's loss does not read ("has no gradient").
  rng = np.random.RandomState(0)
  x = rng.randn(24, 5).astype(np.float32)
  y = rng.randint(0, 2, 24).astype(np.int32)
  start, _ = train_in_session(_keras_get_gradients_model_fn, x, y, 1, 6, 0)
  _, one = train_in_session(_keras_get_gradients_model_fn, x, y, 1, 6, 2,
                            start=start)
  _, many = train_in_session(_keras_get_gradients_model_fn, x, y, 2, 6, 2,
                             start=start, aggregation='all_reduce')
  assert_same_variables(one, {k: many[k] for k in one})


@pytest.mark.training
def test_weight_decay_inside_a_cond_equals_one_device(tmp_path, data,
                                                      one_device):
  # Its reads of the primaries sit in the cond's function, where a walk
  # over the graph's read ops did not see them: the later towers' share
  # of their gradient was lost (0.29 of the update off).
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y, BATCH)

  def train(model_dir, count, **kwargs):
    estimator = make_estimator(_decayed(in_cond=True), model_dir, count,
                               **kwargs)
    estimator.train(input_fn, steps=STEPS)
    return variables_of(estimator)

  one = one_device('decayed_in_cond', lambda d: train(d, 1))
  assert_same_variables(one, train(tmp_path / 'many', 3,
                                   aggregation='all_reduce'))


def _batch_norm_model_fn(features, labels, mode):
  training = mode == tf.estimator.ModeKeys.TRAIN
  net = tf1.layers.batch_normalization(features['x'], training=training,
                                       momentum=0.5)
  logits = tf1.layers.dense(net, 2, kernel_initializer=
                            tf1.glorot_uniform_initializer(seed=8))
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
        loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.training
def test_batch_norm_trains_alike_under_every_strategy(tmp_path, data):
  # Batch statistics are per tower under any in-graph replication, so the
  # reference is global_loss: the strategies must agree with each other.
  x, y = data
  runs = {}
  for aggregation in AGGREGATIONS:
    estimator = make_estimator(_batch_norm_model_fn, tmp_path / aggregation,
                               3, aggregation=aggregation)
    estimator.train(dataset_input_fn({'x': x}, y, BATCH), steps=STEPS)
    runs[aggregation] = variables_of(estimator)
  for aggregation in AGGREGATIONS[1:]:
    assert_same_variables(runs['global_loss'], runs[aggregation])
  assert 'batch_normalization/moving_mean' in runs['all_reduce']


def _sgd_spec(mode, labels, logits):
  """TRAIN spec: cross entropy minimized by SGD."""
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf1.train.GradientDescentOptimizer(0.5).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _constrained_model_fn(features, labels, mode):
  """A Keras kernel constraint, which the optimizer applies after updating."""
  logits = tf.keras.layers.Dense(
      2, kernel_initializer=tf1.glorot_uniform_initializer(seed=9),
      kernel_constraint=tf.keras.constraints.MaxNorm(0.3))(features['x'])
  return _sgd_spec(mode, labels, logits)


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_variable_constraints_apply_to_every_copy(tmp_path, data,
                                                  one_device, aggregation):
  x, y = data

  def train(model_dir, towers, **kwargs):
    estimator = make_estimator(_constrained_model_fn, model_dir, towers,
                               **kwargs)
    estimator.train(dataset_input_fn({'x': x}, y, BATCH), steps=STEPS)
    return variables_of(estimator)

  runs = {1: one_device('constrained', lambda d: train(d, 1)),
          3: train(tmp_path / '3', 3, aggregation=aggregation)}
  assert_same_variables(runs[1], runs[3])
  # The constraint binds, so a copy that ignored it would differ.
  norms = np.linalg.norm(runs[1]['dense/kernel'], axis=0)
  np.testing.assert_allclose(norms, 0.3, rtol=1e-4)


def _as_task(monkeypatch, cluster):
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': cluster, 'task': {'type': 'chief', 'index': 0}}))


@pytest.mark.fast
def test_all_reduce_with_ps_tasks_is_refused(monkeypatch):
  # Its per-device copies cannot hold the ps's variables.
  _as_task(monkeypatch, {'chief': ['127.0.0.1:1'], 'ps': ['127.0.0.1:3']})
  with pytest.raises(ValueError, match=r'1 ps task.*Remove the ps tasks'):
    build_replicated(classifier_model_fn, 2, aggregation='all_reduce')


@pytest.mark.fast
@pytest.mark.parametrize('strategy', ['global_loss', 'round_robin'])
def test_shared_variable_strategies_without_ps_tasks_are_refused(
    monkeypatch, strategy):
  # Each task would train its own variables; the workers' steps were lost.
  _as_task(monkeypatch, {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']})
  with pytest.raises(ValueError, match=r"2 training tasks and no ps task.*"
                     r"aggregation='all_reduce'"):
    build_replicated(classifier_model_fn, 2, aggregation=strategy)


@pytest.mark.fast
def test_all_reduce_on_a_lone_chief_and_other_strategies_in_clusters_build(
    monkeypatch):
  names = ['dense/kernel', 'dense_1/kernel', 'tower_1_replica/dense/kernel']
  # A lone chief sums over its own two devices only.
  _as_task(monkeypatch, {'chief': ['127.0.0.1:1']})
  graph, _ = build_replicated(classifier_model_fn, 2, aggregation='all_reduce')
  assert list(_variable_devices(graph, names).values()) == [
      '/device:CPU:0', '/device:CPU:0', '/device:CPU:1']
  assert _collective_reduces(graph) == {('/device:CPU:0', 2),
                                        ('/device:CPU:1', 2)}
  # With a ps task round_robin still spreads over the towers, no collectives.
  _as_task(monkeypatch, {'chief': ['127.0.0.1:1'], 'ps': ['127.0.0.1:3']})
  graph, _ = build_replicated(classifier_model_fn, 2,
                              aggregation='round_robin')
  assert list(_variable_devices(graph, names[:2]).values()) == [
      '/device:CPU:0', '/device:CPU:1']
  assert not _collective_reduces(graph)
  # Without ps: synchronous, the sum spans both tasks (tests/test_task_sync.py
  # trains it).
  _as_task(monkeypatch, {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']})
  graph, _ = build_replicated(classifier_model_fn, 2, aggregation='all_reduce')
  assert list(_variable_devices(graph, names).values()) == [
      '/device:CPU:0', '/device:CPU:0', '/device:CPU:1']
  assert _collective_reduces(graph) == {
      ('/job:chief/replica:0/task:0/device:CPU:0', 2)}


def _collective_reduces(graph):
  """{(device, group size)} of the graph's CollectiveReduce ops."""
  return {(op.device, op.get_attr('group_size'))
          for op in graph.get_operations() if op.type == 'CollectiveReduce'}


def _apply_every_other_step_model_fn(features, labels, mode):
  """Gradient accumulation's shape: apply_gradients inside a tf.cond."""
  logits = tf1.layers.dense(features['x'], 2)
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  variables = tf1.trainable_variables()
  grads = tf.gradients(loss, variables)
  step = tf1.train.get_or_create_global_step()
  optimizer = tf1.train.GradientDescentOptimizer(0.5)
  apply = tf.cond(
      tf.equal(step % 2, 1),
      lambda: optimizer.apply_gradients(
          [(g * 0.5, v) for g, v in zip(grads, variables)]),
      tf.no_op)
  with tf.control_dependencies([apply]):
    train_op = step.assign_add(1)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
def test_an_update_inside_a_cond_is_refused(aggregation):
  # Unrouted there, each tower would apply its own (zero) gradients: the
  # copies drift, or the all-reduce waits forever. The advice must not name
  # another aggregation, which refuses it too.
  with pytest.raises(ValueError, match='apply_gradients inside a tf.cond.*'
                     'Make the call outside') as refused:
    build_replicated(_apply_every_other_step_model_fn, 2,
                     aggregation=aggregation)
  assert 'aggregation=' not in str(refused.value)


@pytest.mark.fast
def test_all_reduce_gradient_fetched_alone_completes():
  """A routed gradient run without the update (a hook's fetch) completes:
  tower 0's all-reduce result runs every device's, as a collective needs."""

  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features['x'], 2)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    grads = tf.gradients(loss, tf1.trainable_variables())
    tf1.add_to_collection('routed_gradients', grads[-1])  # The bias's.
    train_op = tf1.train.GradientDescentOptimizer(0.5).apply_gradients(
        [(g * 0.5, v) for g, v in zip(grads, tf1.trainable_variables())],
        tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  graph, spec = build_replicated(model_fn, 2, aggregation='all_reduce')
  config = estimator_towers.make_run_config(cpu_devices=2).session_config
  config.operation_timeout_in_ms = 60_000  # A hang fails, not blocks.
  with graph.as_default(), tf1.train.MonitoredSession(
      tf1.train.ChiefSessionCreator(scaffold=spec.scaffold,
                                    config=config)) as sess:
    gradient = sess.run(tf1.get_collection('routed_gradients')[-1])
  assert np.abs(gradient).sum() > 0


@pytest.mark.fast
def test_unmarked_files_skip_the_graph_rewrites(tmp_path):
  # No `graph_rewrites` mark: the helpers' Estimators start their sessions
  # without Grappler's rewrites (tests/README.md, "Where the time goes").
  options = helpers.run_config(tmp_path, 2).session_config.graph_options
  assert options.rewrite_options.disable_meta_optimizer


def _branch_variable_model_fn(features, labels, mode):
  """A scale created inside a tf.cond branch (layers built lazily in a
  conditional path do so)."""
  hidden = tf1.layers.dense(features['x'], 4, activation=tf.nn.tanh,
                            kernel_initializer=helpers.seeded(1))

  def scaled():
    scale = tf1.get_variable('branch_scale', [4],
                             initializer=tf1.random_uniform_initializer(
                                 0.5, 1.5, seed=3))
    return hidden * scale

  hidden = tf1.cond(tf1.placeholder_with_default(True, []), scaled,
                    lambda: hidden)
  logits = tf1.layers.dense(hidden, 2, kernel_initializer=helpers.seeded(2))
  return _sgd_spec(mode, labels, logits)


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_a_variable_created_in_a_branch_trains_as_one_device(data,
                                                            aggregation):
  # all_reduce's copy of it was made from a tensor built in the branch,
  # which TensorFlow cannot lift out of it: its own error, no refusal.
  x, y = data
  start, _ = train_in_session(_branch_variable_model_fn, x, y, 1, BATCH, 0)
  _, one = train_in_session(_branch_variable_model_fn, x, y, 1, BATCH, 3,
                            start=start)
  _, many = train_in_session(_branch_variable_model_fn, x, y, 2, BATCH, 3,
                             start=start, aggregation=aggregation)
  assert_same_variables(one, {name: many[name] for name in one})
