"""Every tower's loss holds one device's regularization, once.

Each case trains STEPS steps in a Session from the same seeded weights, on
one device and on towers, and compares the loss each step reports (the
merged TRAIN loss hooks and summaries log) and every variable at the end.
"""

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers
from helpers import assert_same_variables, seeded
import trainer

tf1 = tf.compat.v1
STEPS = 3
BATCH = 12
_l2 = lambda v: 0.3 * tf.reduce_sum(tf.square(v))  # pylint: disable=unnecessary-lambda-assignment


def _model_fn(regularized):
  """A two-layer classifier whose regularization comes from `regularized`:

  'kernel': a tf.compat.v1.layers kernel_regularizer (added when the layer
  gets its variable); 'activity': an activity regularizer (added per call);
  'collection': a term the model_fn adds to REGULARIZATION_LOSSES itself;
  'get_variable': tf.compat.v1.get_variable's regularizer (added once,
  read lazily).
  """

  def model_fn(features, labels, mode):
    x = features['x']
    hidden = tf1.layers.dense(
        x, 6, activation=tf.nn.tanh, kernel_initializer=seeded(1),
        kernel_regularizer=_l2 if regularized == 'kernel' else None,
        activity_regularizer=(
            # Keras divides it by the batch's rows: a per-example mean.
            (lambda a: 0.02 * tf.reduce_sum(tf.square(a)))
            if regularized == 'activity' else None))
    w = tf1.get_variable(
        'w', [6, 2], initializer=seeded(2),
        regularizer=_l2 if regularized == 'get_variable' else None)
    if regularized == 'collection':
      tf1.add_to_collection(tf1.GraphKeys.REGULARIZATION_LOSSES, _l2(w))
    logits = tf.matmul(hidden, w)
    tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    loss = tf1.losses.get_total_loss()
    train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _train(model_fn, towers, **wrapper_kwargs):
  """(the loss of each step, every global variable at the end)."""
  rng = np.random.RandomState(0)
  x = rng.randn(BATCH, 5).astype(np.float32)
  y = (x[:, 0] - x[:, 1] > 0).astype(np.int32)
  with tf.Graph().as_default():
    tf1.set_random_seed(3)
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensors(({'x': x}, y)).repeat()).get_next()
    config = trainer.make_run_config(cpu_devices=towers)
    if wrapper_kwargs:
      spec = trainer.replicate_model_fn(model_fn, **wrapper_kwargs)(
          features, labels, tf.estimator.ModeKeys.TRAIN, None, config)
    else:
      spec = model_fn(features, labels, tf.estimator.ModeKeys.TRAIN)
    spec.scaffold.finalize()
    variables = {v.op.name: v for v in tf1.global_variables()}
    with tf1.Session(config=config.session_config) as session:
      session.run(spec.scaffold.init_op)
      session.run(spec.scaffold.local_init_op)
      losses = [session.run([spec.loss, spec.train_op])[0]
                for _ in range(STEPS)]
      return np.array(losses), session.run(variables)


@pytest.mark.fast
@pytest.mark.parametrize('regularized', ['kernel', 'activity', 'collection',
                                         'get_variable'])
@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
def test_towers_count_the_regularization_once(regularized, aggregation):
  model_fn = _model_fn(regularized)
  expected_losses, expected = _train(model_fn, 1)
  losses, actual = _train(model_fn, 3, aggregation=aggregation)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  assert_same_variables(expected, actual, rtol=1e-4, atol=1e-6)


def _everything_model_fn(features, labels, mode):
  """Every way at once (each alone held, together they did not): a kernel
  regularizer, an activity regularizer downstream of it, one layer applied
  twice, an activity regularizer on a layer without variables, and weight
  decay the model_fn adds to the collection for every variable."""
  x = tf1.layers.Dropout(0.0, activity_regularizer=lambda a: 0.05 *
                         tf.reduce_sum(tf.square(a)))(features['x'])
  hidden = tf1.layers.dense(x, 6, activation=tf.nn.tanh,
                            kernel_initializer=seeded(1),
                            kernel_regularizer=_l2)
  shared = tf1.layers.Dense(6, activation=tf.nn.tanh,
                            kernel_initializer=seeded(4),
                            kernel_regularizer=_l2, name='shared')
  hidden = shared(shared(hidden))
  logits = tf1.layers.dense(
      hidden, 2, kernel_initializer=seeded(2),
      activity_regularizer=lambda a: 0.02 * tf.reduce_sum(tf.square(a)))
  for v in tf1.trainable_variables():
    tf1.add_to_collection(tf1.GraphKeys.REGULARIZATION_LOSSES,
                          0.01 * tf.nn.l2_loss(v))
  tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  loss = tf1.losses.get_total_loss()
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
@pytest.mark.parametrize('towers,kwargs', [
    (3, {'aggregation': 'global_loss'}),
    (3, {'aggregation': 'all_reduce'}),
    (2, {'aggregation': 'all_reduce', 'micro_batches': 2}),
    (2, {'aggregation': 'global_loss', 'micro_batches': 3}),
], ids=['global_loss', 'all_reduce', 'all_reduce-2x2', 'global_loss-2x3'])
def test_every_kind_together_counts_each_term_once(towers, kwargs):
  expected_losses, expected = _train(_everything_model_fn, 1)
  losses, actual = _train(_everything_model_fn, towers, **kwargs)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  assert_same_variables(expected, actual, rtol=1e-4, atol=1e-6)


@pytest.mark.fast
def test_the_eval_loss_counts_each_term_once():
  # 7 rows on 3 towers: 3, 2, 2.
  expected = _eval_loss(_everything_model_fn, 1)
  actual = _eval_loss(_everything_model_fn, 3, aggregation='all_reduce')
  np.testing.assert_allclose(actual, expected, rtol=1e-5)


def _eval_loss(model_fn, towers, **wrapper_kwargs):
  rng = np.random.RandomState(1)
  x = rng.randn(7, 5).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  with tf.Graph().as_default():
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensors(({'x': x}, y)).repeat()).get_next()
    config = trainer.make_run_config(cpu_devices=towers)
    mode = tf.estimator.ModeKeys.EVAL
    if wrapper_kwargs:
      spec = trainer.replicate_model_fn(model_fn, **wrapper_kwargs)(
          features, labels, mode, None, config)
    else:
      spec = model_fn(features, labels, mode)
    with tf1.Session(config=config.session_config) as session:
      session.run(tf1.global_variables_initializer())
      return session.run(spec.loss)


@pytest.mark.fast
def test_micro_batches_sharing_a_copy_count_it_once():
  # Two micro-batches per device use that device's copy: before, the second
  # saw the first's l2(copy) beside its own, twice its share of the gradient.
  model_fn = _model_fn('kernel')
  expected_losses, expected = _train(model_fn, 1)
  losses, actual = _train(model_fn, 2, aggregation='all_reduce',
                          micro_batches=2)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  assert_same_variables(expected, actual, rtol=1e-4, atol=1e-6)


@pytest.mark.fast
def test_a_later_tower_sees_only_its_own_entry():
  seen = []

  def model_fn(features, labels, mode):
    spec = _model_fn('kernel')(features, labels, mode)
    seen.append([t.name for t in tf1.losses.get_regularization_losses()])
    return spec

  _train(model_fn, 3, aggregation='all_reduce')
  assert seen == [['dense/kernel/Regularizer/mul:0'],
                  ['tower_1/dense/kernel/Regularizer/mul:0'],
                  ['tower_2/dense/kernel/Regularizer/mul:0']]


def _absolute_scope_model_fn(features, labels, mode):
  """A per-example activity penalty added under an absolute name scope:
  every tower's entry is named outside its tower scope."""
  hidden = tf1.layers.dense(features['x'], 6, activation=tf.nn.tanh,
                            kernel_initializer=seeded(1),
                            kernel_regularizer=_l2)
  with tf.name_scope('penalty/'):
    tf1.add_to_collection(
        tf1.GraphKeys.REGULARIZATION_LOSSES,
        0.05 * tf.reduce_sum(tf.square(hidden)) /
        tf.cast(tf.shape(hidden)[0], tf.float32))
  return _finish(mode, hidden, labels, tf1.losses.get_regularization_loss())


def _counted_before_model_fn(features, labels, mode):
  """Takes the entries its layers add: those after a count taken first."""
  before = len(tf1.losses.get_regularization_losses())
  hidden = tf1.layers.dense(
      features['x'], 6, activation=tf.nn.tanh, kernel_initializer=seeded(1),
      kernel_regularizer=_l2,
      activity_regularizer=lambda a: 0.02 * tf.reduce_sum(tf.square(a)))
  added = tf1.losses.get_regularization_losses()[before:]
  return _finish(mode, hidden, labels, tf.add_n(added))


def _prebuilt_layer_model_fn():
  """One tf.compat.v1.layers object, built by tower 0 and called by every
  tower: its kernel term is added once (tower 0's, on the primary), its
  activity term by every call, under the scope of the first call."""
  built = {}

  def model_fn(features, labels, mode):
    if built.get('graph') is not tf1.get_default_graph():
      built['graph'] = tf1.get_default_graph()
      built['layer'] = tf1.layers.Dense(
          6, activation=tf.nn.tanh, kernel_initializer=seeded(1),
          kernel_regularizer=_l2,
          activity_regularizer=lambda a: 0.02 * tf.reduce_sum(tf.square(a)))
    hidden = built['layer'](features['x'])
    return _finish(mode, hidden, labels,
                   tf1.losses.get_regularization_loss())

  return model_fn


def _finish(mode, hidden, labels, regularization):
  logits = tf1.layers.dense(hidden, 2, kernel_initializer=seeded(2))
  loss = tf1.losses.sparse_softmax_cross_entropy(
      labels, logits, loss_collection=None) + regularization
  train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
@pytest.mark.parametrize('make_model_fn', [
    lambda: _absolute_scope_model_fn, lambda: _counted_before_model_fn,
    _prebuilt_layer_model_fn],
                         ids=['absolute_scope', 'counted_before', 'prebuilt'])
@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
def test_entries_matched_by_build_order(make_model_fn, aggregation):
  # Absolute scope: tower t's entry is not `tower_<t>/X`; it was counted
  # beside tower 0's (global_loss rel 1.27). Counted before: a later tower
  # saw tower 0's entries before building, so its slice missed its own
  # (rel 0.185; tf.add_n of the empty slice failed). Prebuilt: a later
  # tower's activity term stood for tower 0's kernel term, a scalar too
  # (rel 0.25), and under all_reduce the later towers' share of the kernel
  # term tower 0 added alone was not differentiated (rel 0.19).
  expected_losses, expected = _train(make_model_fn(), 1)
  losses, actual = _train(make_model_fn(), 3, aggregation=aggregation)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  assert_same_variables(expected, actual, rtol=1e-5, atol=1e-6)


@pytest.mark.fast
def test_an_unscoped_entry_without_a_counterpart_is_refused():
  def model_fn(features, labels, mode):
    hidden = tf1.layers.dense(features['x'], 6, kernel_initializer=seeded(1))
    if estimator_towers.tower_context().index:  # Only later towers add it.
      with tf.name_scope('penalty/'):
        tf1.add_to_collection(tf1.GraphKeys.REGULARIZATION_LOSSES,
                              tf.reduce_sum(tf.square(hidden)))
    return _finish(mode, hidden, labels, tf1.losses.get_regularization_loss())

  with pytest.raises(ValueError, match='penalty/.*outside its name scope'):
    _train(model_fn, 2, aggregation='global_loss')
