"""Towers share tower 0's variables; a tower that differs is an error."""

import numpy as np
import pytest
import tensorflow as tf

import trainer
from helpers import build_replicated, classifier_model_fn, OPTIMIZERS

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1


def _names(graph, collection='variables'):
  return sorted(v.op.name for v in graph.get_collection(collection))


def _plain_graph(model_fn, mode=tf.estimator.ModeKeys.TRAIN):
  graph = tf.Graph()
  with graph.as_default():
    features = {'x': tf.zeros([10, 5])}
    model_fn(features, tf.zeros([10], tf.int32), mode,
             {'optimizer': OPTIMIZERS['adam']})
  return graph


@pytest.mark.parametrize('mode', ['train', 'eval'])
def test_variable_names_and_count_equal_unwrapped(mode):
  plain = _plain_graph(classifier_model_fn, mode)
  graph, _ = build_replicated(classifier_model_fn, 4, mode=mode,
                              params={'optimizer': OPTIMIZERS['adam']})
  assert _names(graph) == _names(plain)
  # Metric variables are shared too: one accuracy/total, not four.
  assert _names(graph, 'local_variables') == _names(plain, 'local_variables')


def test_tower_creating_a_variable_tower_0_did_not_is_an_error():

  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features['x'], 2)
    if trainer.tower_context().index == 1:
      logits += tf1.get_variable('tower_bias', [2])
    return classifier_spec(mode, logits, labels)

  with pytest.raises(ValueError, match="Tower 1 created variable 'tower_bias'"):
    build_replicated(model_fn, 2)


def test_keras_layer_of_another_shape_in_a_later_tower_is_an_error():

  def model_fn(features, labels, mode):
    units = 2 + trainer.tower_context().index
    logits = tf.keras.layers.Dense(units)(features['x'])[:, :2]
    return classifier_spec(mode, logits, labels)

  with pytest.raises(ValueError, match='Tower 1 asked for variable .*shape'):
    build_replicated(model_fn, 2)


def test_later_tower_making_fewer_variables_is_an_error():

  def model_fn(features, labels, mode):
    net = features['x']
    if trainer.tower_context().index == 0:
      net = tf.keras.layers.Dense(5)(net)
    return classifier_spec(mode, tf.keras.layers.Dense(2)(net), labels)

  with pytest.raises(ValueError, match='Tower 1 .*(asked for|did not ask)'):
    build_replicated(model_fn, 2)


def test_a_keras_layer_kept_across_model_fn_calls_is_named_as_the_cause():
  # One device runs it; the later towers read tower 0's variables through
  # the object without asking, which the message now says.
  kept = {}

  def model_fn(features, labels, mode):
    if kept.get('graph') is not tf1.get_default_graph():
      kept.update(graph=tf1.get_default_graph(),
                  layer=tf.keras.layers.Dense(2))
    return classifier_spec(mode, kept['layer'](features['x']), labels)

  with pytest.raises(ValueError, match='did not ask for .* Tower 1 read them '
                     'without asking: it called a layer or model object that '
                     'tower 0 built'):
    build_replicated(model_fn, 2)


@pytest.mark.parametrize('mode', ['train', 'eval'])
def test_a_model_fn_importing_its_variables_is_refused(tmp_path, mode):
  # SavedModelEstimator's pattern: every call imports the saved graph with
  # its variables, which no creator sees. Tower 1's import failed with its
  # own "global step before the SavedModel is loaded" error.
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 4], name='x')
    tf1.layers.dense(x, 2, name='saved')
    meta = str(tmp_path / 'model.meta')
    tf1.train.export_meta_graph(meta)

  def model_fn(features, labels, mode):
    tf1.train.import_meta_graph(meta, input_map={'x:0': features['x']})
    graph = tf1.get_default_graph()
    scope = graph.get_name_scope()  # Imported names take the tower's.
    logits = graph.get_tensor_by_name(
        f'{scope}/saved/BiasAdd:0' if scope else 'saved/BiasAdd:0')
    return classifier_spec(mode, logits, labels)

  with pytest.raises(ValueError, match=r'made variables without tf\.Variable '
                     r'or get_variable \(saved/kernel, saved/bias\).*imports '
                     r'a graph.*without replicate_model_fn'):
    build_replicated(model_fn, 2, mode=mode, num_features=4)


def classifier_spec(mode, logits, labels):
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _teacher_model_fn(features, labels, mode, ordered=False):
  """Mean-teacher style: the forward pass reads an EMA shadow of the
  weights. `ordered` fixes the order one device leaves open (the shadow is
  read, then the EMA reads the weights, then the update writes them)."""
  del mode
  step = tf1.train.get_or_create_global_step()
  w = tf1.get_variable('w', [5, 1], initializer=tf1.constant_initializer(0.1))
  ema = tf1.train.ExponentialMovingAverage(0.5)
  ema_op = ema.apply([w])
  teacher = ema.average(w)
  logits = tf.matmul(features['x'], 0.5 * (w + teacher))[:, 0]
  loss = tf1.losses.mean_squared_error(tf.cast(labels, tf.float32), logits)
  if ordered:
    ema_op._add_control_input(loss.op)  # pylint: disable=protected-access
  with tf.control_dependencies([ema_op] if ordered else []):
    update = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, step)
  return tf.estimator.EstimatorSpec(
      tf.estimator.ModeKeys.TRAIN, loss=loss, train_op=tf.group(update, ema_op))


def _after_steps(model_fn, names, towers, aggregation=None, steps=3):
  rng = np.random.RandomState(3)
  x = rng.randn(9, 5).astype(np.float32)
  y = rng.randint(0, 3, size=9).astype(np.int32)
  graph = tf.Graph()
  with graph.as_default():
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensors(({'x': x}, y)).repeat()).get_next()
    step = tf1.train.get_or_create_global_step()
    if towers:
      spec = trainer.replicate_model_fn(
          model_fn, aggregation=aggregation)(
              features, labels, tf.estimator.ModeKeys.TRAIN, {},
              trainer.make_run_config(cpu_devices=towers))
    else:
      spec = model_fn(features, labels, None, ordered=True)
    scaffold = spec.scaffold
    scaffold.finalize()
    with tf1.Session(config=tf1.ConfigProto(
        device_count={'CPU': max(towers, 1)})) as session:
      session.run(scaffold.init_op)
      session.run(scaffold.local_init_op)  # all_reduce: copies from it.
      for _ in range(steps):
        session.run(spec.train_op)
      assert session.run(step) == steps
      named = {v.op.name: v for v in tf1.global_variables()}
      return session.run([named[name] for name in names])


@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
def test_an_ema_shadow_read_in_the_forward_pass_is_one_shadow(aggregation):
  # all_reduce: the EMA of tower 1's copy of w was named after the copy
  # (tower_1_replica/w/ExponentialMovingAverage) and refused as a variable
  # tower 0 did not create; it is tower 0's shadow, as on one device.
  names = ['w', 'w/ExponentialMovingAverage']
  expected = _after_steps(_teacher_model_fn, names, 0)
  for _ in range(3):  # The step orders reads and writes: several runs.
    actual = _after_steps(_teacher_model_fn, names, 2, aggregation)
    for want, got in zip(expected, actual):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _replica_named_model_fn(features, labels, mode, ordered=False):
  """A user's own variable whose name looks like a tower copy's."""
  del mode, ordered
  step = tf1.train.get_or_create_global_step()
  w = tf1.get_variable('w', [5, 1], initializer=tf1.constant_initializer(0.1))
  scale = tf1.get_variable('scale', initializer=2.0, trainable=False)
  odd = tf1.get_variable('tower_1_replica/scale', initializer=3.0,
                         trainable=False)
  logits = tf.matmul(features['x'], w)[:, 0] * odd / scale
  loss = tf1.losses.mean_squared_error(tf.cast(labels, tf.float32), logits)
  update = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, step)
  return tf.estimator.EstimatorSpec(tf.estimator.ModeKeys.TRAIN, loss=loss,
                                    train_op=update)


def test_a_users_variable_named_like_a_copy_keeps_its_name():
  # Tower 1's request for it was read as one for 'scale' (silently).
  expected = _after_steps(_replica_named_model_fn, ['w'], 0)
  actual = _after_steps(_replica_named_model_fn, ['w'], 2, 'all_reduce')
  np.testing.assert_allclose(actual[0], expected[0], rtol=1e-5, atol=1e-7)


def _ema_by_name_model_fn(features, labels, mode, ordered=False):
  """EfficientNet's EMA: the trainable variables plus every global variable
  named like a batch-norm moving statistic, chosen from the collections
  before the EMA makes its shadows, then applied after the update."""
  del mode, ordered
  step = tf1.train.get_or_create_global_step()
  hidden = tf1.layers.dense(
      features['x'], 3, kernel_initializer=tf1.constant_initializer(0.1))
  hidden = tf1.layers.batch_normalization(hidden, training=True)
  logits = tf1.layers.dense(
      hidden, 1, kernel_initializer=tf1.constant_initializer(0.2))[:, 0]
  loss = tf1.losses.mean_squared_error(tf.cast(labels, tf.float32), logits)
  averaged = tf1.trainable_variables() + [
      v for v in tf1.global_variables()
      if 'moving_mean' in v.name or 'moving_variance' in v.name]
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    update = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, step)
  ema = tf1.train.ExponentialMovingAverage(0.5, num_updates=step)
  with tf.control_dependencies([update]):
    train_op = ema.apply(list(set(averaged)))
  return tf.estimator.EstimatorSpec(tf.estimator.ModeKeys.TRAIN, loss=loss,
                                    train_op=train_op)


@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
def test_an_ema_chosen_from_the_collections_averages_one_devices_variables(
    aggregation):
  # tower 1 read the collections after tower 0 had made its shadows, so it
  # averaged them too ('batch_normalization/moving_mean/
  # ExponentialMovingAverage/ExponentialMovingAverage'), refused as a
  # variable tower 0 did not create. It sees what tower 0 saw.
  names = ['dense/kernel', 'dense_1/kernel',
           'batch_normalization/moving_mean',
           'dense/kernel/ExponentialMovingAverage',
           'batch_normalization/moving_mean/ExponentialMovingAverage',
           'batch_normalization/moving_variance/ExponentialMovingAverage']
  expected = _after_steps(_ema_by_name_model_fn, names, 0)
  actual = _after_steps(_ema_by_name_model_fn, names, 3, aggregation)
  for name, want, got in zip(names, expected, actual):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
