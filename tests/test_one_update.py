"""The towers' optimizer calls become one update of one set of variables."""

import numpy as np
import pytest
import tensorflow as tf

import helpers
from helpers import (assert_same_variables, build_replicated,
                     dataset_input_fn, make_estimator, seeded,
                     train_in_session, variables_of)

tf1 = tf.compat.v1

# What runs once per step, and in which tower: in the graph the product runs,
# Grappler's rewrites on (tests/README.md, "Where the time goes").
pytestmark = pytest.mark.graph_rewrites
TRAIN = tf.estimator.ModeKeys.TRAIN


def _linear(features):
  return tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(21))


@pytest.mark.fast
def test_one_apply_op_and_one_global_step_increment():

  def model_fn(features, labels, mode):
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, _linear(features))
    train_op = tf1.train.AdamOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  graph, _ = build_replicated(model_fn, 4)
  applies = [op for op in graph.get_operations()
             if op.type == 'ResourceApplyAdam']
  assert len(applies) == 2  # kernel and bias, once each, not per tower.
  increments = [op for op in graph.get_operations()
                if op.type == 'AssignAddVariableOp' and
                'global_step' in op.inputs[0].op.name]
  assert len(increments) == 1
  slots = sorted(v.op.name for v in graph.get_collection('variables')
                 if 'Adam' in v.op.name or 'power' in v.op.name)
  assert slots == ['beta1_power', 'beta2_power', 'dense/bias/Adam',
                   'dense/bias/Adam_1', 'dense/kernel/Adam',
                   'dense/kernel/Adam_1']


@pytest.mark.training
def test_two_optimizers_per_tower_each_make_one_update(tmp_path, data):
  # A GAN-style model_fn: two losses, two optimizers, calls matched in order.
  x, y = data

  def model_fn(features, labels, mode):
    with tf1.variable_scope('a'):
      logits_a = _linear(features)
    with tf1.variable_scope('b'):
      logits_b = _linear(features)
    loss_a = tf1.losses.sparse_softmax_cross_entropy(labels, logits_a)
    loss_b = tf1.losses.sparse_softmax_cross_entropy(labels, logits_b * 2.0)
    step = tf1.train.get_or_create_global_step()
    train_a = tf1.train.GradientDescentOptimizer(0.3).minimize(
        loss_a, var_list=tf1.trainable_variables('a'))
    train_b = tf1.train.MomentumOptimizer(0.1, 0.5).minimize(
        loss_b, step, var_list=tf1.trainable_variables('b'))
    return tf.estimator.EstimatorSpec(mode, loss=loss_a + loss_b,
                                      train_op=tf.group(train_a, train_b))

  runs = {}
  for towers in (1, 3):
    estimator = make_estimator(model_fn, tmp_path / str(towers), towers)
    estimator.train(dataset_input_fn({'x': x}, y, 10), steps=3)
    runs[towers] = variables_of(estimator)
  assert_same_variables(runs[1], runs[3])
  assert runs[3]['global_step'] == 3


@pytest.mark.fast
def test_gradients_not_from_a_routed_call_are_a_clear_error():
  # A GradientTape's gradients are the tower's own: each tower would apply
  # only its shard's.

  def model_fn(features, labels, mode):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_linear(features))
    variables = tf1.trainable_variables()
    grads = tape.gradient(loss, variables)
    train_op = tf1.train.GradientDescentOptimizer(0.1).apply_gradients(
        zip(grads, variables), tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(ValueError, match='one gradient call of its own'):
    build_replicated(model_fn, 2)


@pytest.mark.fast
def test_compute_without_apply_is_a_clear_error():

  def model_fn(features, labels, mode):
    loss = tf.reduce_mean(_linear(features))
    optimizer = tf1.train.GradientDescentOptimizer(0.1)
    grads_and_vars = optimizer.compute_gradients(loss)
    train_op = tf.group(*[tf1.assign_sub(v, 0.1 * g)
                          for g, v in grads_and_vars])
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(ValueError, match='apply_gradients 0 times'):
    build_replicated(model_fn, 2)


@pytest.mark.fast
def test_optimizer_is_left_unpatched_afterwards_even_on_error():
  original = tf1.train.Optimizer.compute_gradients

  def failing_model_fn(features, labels, mode):
    raise RuntimeError('boom in the user model_fn')

  with pytest.raises(RuntimeError, match='boom'):
    build_replicated(failing_model_fn, 2)
  assert tf1.train.Optimizer.compute_gradients is original
  # And plain graphs still get ordinary gradients.
  with tf.Graph().as_default():
    v = tf1.get_variable('v', initializer=3.0)
    ((grad, _),) = tf1.train.GradientDescentOptimizer(1.0).compute_gradients(
        v * v, [v])
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      assert np.isclose(session.run(grad), 6.0)


@pytest.mark.fast
def test_sync_replicas_optimizer_is_refused_with_what_to_use():
  # It aggregates across workers itself: the towers would wait forever. An
  # optimizer overriding apply_gradients with only its own update is fine
  # (test_gradient_routing).

  def model_fn(features, labels, mode):
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, _linear(features))
    optimizer = tf1.train.SyncReplicasOptimizer(
        tf1.train.GradientDescentOptimizer(0.1), replicas_to_aggregate=1)
    train_op = optimizer.minimize(loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  original = tf1.train.SyncReplicasOptimizer.apply_gradients
  with pytest.raises(ValueError, match=(
      'SyncReplicasOptimizer aggregates gradients across worker replicas '
      r'itself.*Use the optimizer it wraps directly')):
    build_replicated(model_fn, 2)
  assert tf1.train.SyncReplicasOptimizer.apply_gradients is original


def batch_sized_model_fn(features, labels, mode, params):
  """Uses the (dynamic) batch size outside the loss: a learning rate scaled
  by it, or gradients of a summed loss divided by it."""
  logits = tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(7))
  examples = tf.cast(tf.shape(labels)[0], tf.float32)
  step = tf1.train.get_or_create_global_step()
  if params['form'] == 'learning_rate':
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf1.train.GradientDescentOptimizer(
        0.1 * examples).minimize(loss, step)
  else:
    loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    variables = tf1.trainable_variables()
    grads = [g / examples for g in tf.gradients(loss, variables)]
    train_op = tf1.train.GradientDescentOptimizer(0.5).apply_gradients(
        zip(grads, variables), step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.training
@pytest.mark.parametrize('form', ['learning_rate', 'gradients'])
def test_update_computed_from_the_batch_size_is_refused(tmp_path, data, form):
  x, y = data
  estimator = make_estimator(batch_sized_model_fn, tmp_path, 2,
                             {'form': form})
  with pytest.raises(ValueError, match="only that tower's share"):
    estimator.train(dataset_input_fn({'x': x}, y, 7), steps=1)


@pytest.mark.fast
def test_one_gradient_call_split_over_two_optimizers_says_so():

  def model_fn(features, labels, mode):
    hidden = tf1.layers.dense(features['x'], 3, name='h')
    loss = tf1.losses.sparse_softmax_cross_entropy(
        labels, tf1.layers.dense(hidden, 2, name='o'))
    first = tf1.train.MomentumOptimizer(0.1, 0.9)
    pairs = first.compute_gradients(loss)
    train_op = tf.group(
        first.apply_gradients(pairs[:2], tf1.train.get_global_step()),
        tf1.train.MomentumOptimizer(0.01, 0.9).apply_gradients(pairs[2:]))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(ValueError, match='one compute_gradients per optimizer'):
    build_replicated(model_fn, 2)


def _state_update_model_fn(features, labels, mode, params):
  """No optimizer: the train_op advances the step and counts labels, as
  tf.estimator's own tests and KMeans-like model_fns do."""
  logits = tf1.layers.dense(features['x'], 2,
                            kernel_initializer=tf1.constant_initializer(0.1))
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  positives = tf1.get_variable('positives', [], tf.float32,
                               initializer=tf.zeros_initializer(),
                               trainable=False)
  counted = positives.assign_add(tf.reduce_sum(tf.cast(labels, tf.float32)))
  step = tf1.assign_add(tf1.train.get_or_create_global_step(), 1)
  train_op = tf.group(step, counted) if params.get('count') else step
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.training
@pytest.mark.parametrize('count', [False, True])
def test_a_train_op_without_an_optimizer_runs_once_per_step(tmp_path, data,
                                                            count):
  x, y = data
  results = []
  for towers in (1, 3):
    estimator = make_estimator(_state_update_model_fn, tmp_path / str(towers),
                               towers=towers, params={'count': count})
    estimator.train(dataset_input_fn({'x': x}, y, batch_size=10), steps=4)
    results.append(variables_of(estimator))
  assert results[1]['global_step'] == 4
  assert_same_variables(results[0], results[1])


@pytest.mark.fast
def test_an_update_the_towers_do_not_see_is_refused():
  # GradientTape gradients applied by hand: the last tower's update would
  # come from its shard alone; only routed optimizer calls make one update.
  def model_fn(features, labels, mode):
    layer = tf.keras.layers.Dense(2)
    with tf.GradientTape() as tape:
      logits = layer(features['x'])
      loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    grads = tape.gradient(loss, layer.trainable_variables)
    train_op = tf.group(*[v.assign_sub(0.1 * g) for g, v in
                          zip(grads, layer.trainable_variables)])
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(ValueError, match=r"writes the trainable variables "
                     r"\['dense/bias', 'dense/kernel'\] without an optimizer"):
    build_replicated(model_fn, 2)


@pytest.mark.fast
def test_canned_kmeans_centre_updates_are_refused_naming_them():
  # KMeans assigns its centres from the batch's per-cluster sums, with no
  # optimizer: each tower would move them by its shard alone.
  kmeans = tf1.estimator.experimental.KMeans(
      num_clusters=2, use_mini_batch=True,
      initial_clusters=np.eye(2, helpers.NUM_FEATURES, dtype=np.float32),
      feature_columns=[tf.feature_column.numeric_column(
          'x', shape=[helpers.NUM_FEATURES])])
  with pytest.raises(ValueError, match=r"writes the trainable variables "
                     r"\[.*'clusters'\] .*KMeans' centre updates"):
    build_replicated(_with_global_step(kmeans.model_fn), 2,
                     with_labels=False)


def _with_global_step(model_fn):
  """`model_fn` after the global step Estimator would have made."""
  def stepped(features, labels, mode, config):
    tf1.train.get_or_create_global_step()
    return model_fn(features, labels, mode, config)
  return stepped


class _RunBeforeEachStep(tf1.train.SessionRunHook):
  """Runs `ops` in a session.run of their own before each step
  (TF-GAN's RunTrainOpsHook)."""

  def __init__(self, ops):
    self._ops = ops

  def before_run(self, run_context):
    run_context.session.run(self._ops)


def _generator_then_critic(features, targets):
  """A GAN-like pair: the critic's loss reads the generator's output."""
  with tf1.variable_scope('generator', reuse=tf1.AUTO_REUSE):
    made = tf1.layers.dense(features['x'], 3, kernel_initializer=seeded(3))
  with tf1.variable_scope('critic', reuse=tf1.AUTO_REUSE):
    score = tf1.layers.dense(made, 1, kernel_initializer=seeded(4))[:, 0]
  return tf.reduce_mean(tf.square(score - tf.cast(targets, tf.float32)))


def _fooling(features, labels):
  """The generator's loss: the critic should score every example 1."""
  return _generator_then_critic(features, tf.ones_like(labels))


def _minimize(loss, scope, step=None):
  optimizer = tf1.train.MomentumOptimizer(0.02, 0.5, name=scope)
  return optimizer.minimize(loss, step,
                            var_list=tf1.trainable_variables(scope))


def _updates_in_hooks_model_fn(features, labels, mode, params):
  """TF-GAN's GANEstimator's way: the train_op only advances global_step,
  training hooks run the generator's then the critic's update."""
  del params
  loss = _generator_then_critic(features, labels)
  hooks = [_RunBeforeEachStep(_minimize(_fooling(features, labels),
                                         'generator')),
           _RunBeforeEachStep(_minimize(loss, 'critic'))]
  step = tf1.train.get_or_create_global_step()
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=step.assign_add(1), training_hooks=hooks)


@pytest.mark.training
def test_updates_run_by_hooks_train_as_one_device(tmp_path, data):
  # Tower 0's hooks ran stand-ins of the update that changed nothing: every
  # weight stayed at its start, silently (TF-GAN on towers). They run the
  # one update now.
  x, y = data
  runs = {}
  for towers in (1, 3):
    estimator = make_estimator(_updates_in_hooks_model_fn,
                               tmp_path / str(towers), towers)
    estimator.train(dataset_input_fn({'x': x}, y, 10), steps=3)
    runs[towers] = variables_of(estimator)
  assert_same_variables(runs[1], runs[3])
  assert runs[3]['global_step'] == 3


def _critic_after_generator_model_fn(features, labels, mode):
  """One train_op, two updates in order: the critic's loss is computed
  after the generator's update, from the updated generator."""
  step = tf1.train.get_or_create_global_step()
  generator_update = _minimize(_fooling(features, labels), 'generator')
  with tf.control_dependencies([generator_update]):
    loss = _generator_then_critic(features, labels)
    train_op = _minimize(loss, 'critic', step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
@pytest.mark.parametrize('towers,aggregation', [(2, 'global_loss'),
                                                (3, 'all_reduce')])
def test_an_update_chained_after_another_sees_its_writes(data, towers,
                                                         aggregation):
  # Earlier towers computed the critic's loss from the generator's weights
  # before its update (their stand-in for it was a bare no-op): 0.11 off
  # after 3 steps on 2 towers, with no error.
  x, y = data
  _, one = train_in_session(_critic_after_generator_model_fn, x, y, 1, 12, 3)
  _, many = train_in_session(_critic_after_generator_model_fn, x, y, towers,
                             12, 3, aggregation=aggregation)
  assert set(one) == set(many)
  for name, value in one.items():
    np.testing.assert_allclose(many[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.fast
def test_an_update_waiting_for_its_own_stand_in_is_refused():
  # A model_fn that keeps its first call's update and makes its later
  # calls' losses wait for it: the one update would wait for itself.
  kept = []

  def model_fn(features, labels, mode):
    with tf.control_dependencies(kept[:1]):
      loss = tf1.losses.sparse_softmax_cross_entropy(labels,
                                                     _linear(features))
    kept.append(tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step()))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=kept[-1])

  with pytest.raises(ValueError, match="waits for 'update_in_last_tower'.*"
                     'would wait for itself'):
    build_replicated(model_fn, 2)


def _inner_steps_model_fn(form):
  """SGD on y ~ x @ w whose minimize sits in a tf.while_loop (two inner
  steps per train step) or in one branch of a tf.cond."""

  def model_fn(features, labels, mode):
    w = tf1.get_variable('w', [5, 2], initializer=seeded(3))
    labels = tf.one_hot(labels, 2)
    loss_of = lambda: tf.reduce_mean(  # pylint: disable=g-long-lambda
        tf.square(tf.matmul(features['x'], w) - labels))
    step = tf1.train.get_or_create_global_step()
    optimizer = tf1.train.GradientDescentOptimizer(0.1)
    if form == 'while_loop':
      def body(i):
        with tf.control_dependencies([optimizer.minimize(loss_of())]):
          return i + 1
      done = tf1.while_loop(lambda i: i < 2, body, [tf.constant(0)])
    else:
      done = tf.cond(tf.equal(step % 2, 0),
                     lambda: tf.group(optimizer.minimize(loss_of())),
                     tf.no_op)
    train_op = tf.group(done, tf1.assign_add(step, 1))
    return tf.estimator.EstimatorSpec(mode, loss=loss_of(),
                                      train_op=train_op)

  return model_fn


@pytest.mark.fast
@pytest.mark.parametrize('form', ['while_loop', 'cond'])
@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
def test_an_optimizer_call_inside_control_flow_is_refused(form, aggregation):
  # Unrouted, each tower's loop updated w from its own shard: 'global_loss'
  # trained on the last tower's rows only (w[0] -0.097 against one
  # device's -0.120), and a tf.cond was refused as "no such call".
  with pytest.raises(ValueError, match=r'Optimizer\.minimize inside a '
                     r'tf\.cond, tf\.while_loop.*Make the call outside'):
    build_replicated(_inner_steps_model_fn(form), 2, aggregation=aggregation)


@pytest.mark.fast
def test_this_file_runs_the_graph_rewrites_the_product_runs(tmp_path):
  # The `graph_rewrites` mark (tests/conftest.py): what runs once per step
  # is checked in the graph Grappler rewrote, as the product's.
  options = helpers.run_config(tmp_path, 2).session_config.graph_options
  assert not options.rewrite_options.disable_meta_optimizer
