"""A later tower reads only its own entries of the model_fn's collections.

A loss summed from a collection the model_fn fills itself
(`add_to_collection('my_losses', ce)`, `add_n(get_collection('my_losses'))`)
held tower 0's term too in tower 1, and a penalty over a collection of
shared weights counted them once per tower: both trained off one device
silently (own_collections).
"""

import numpy as np
import pytest
import tensorflow as tf

import helpers
from helpers import seeded
import trainer

tf1 = tf.compat.v1

_X = (np.arange(120, dtype=np.float32).reshape(24, 5) % 7) - 3
_Y = (np.arange(24) % 3).astype(np.int32)


def _classifier(features, labels):
  hidden = tf1.layers.dense(features['x'], 4, kernel_initializer=seeded(1),
                            name='hidden')
  logits = tf1.layers.dense(hidden, 3, kernel_initializer=seeded(2),
                            name='logits')
  return logits, tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                     logits=logits))


def _trained(loss, mode):
  train_op = None
  if mode == tf.estimator.ModeKeys.TRAIN:
    train_op = tf1.train.MomentumOptimizer(0.3, 0.9).minimize(
        loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _collected_loss_model_fn(features, labels, mode):
  """The loss is whatever the model_fn filed under 'my_losses'."""
  _, cross_entropy = _classifier(features, labels)
  tf1.add_to_collection('my_losses', cross_entropy)
  return _trained(tf.add_n(tf1.get_collection('my_losses')), mode)


def _filed_weights_model_fn(key):
  """A penalty over the kernels the model_fn files under `key`."""

  def model_fn(features, labels, mode):
    _, cross_entropy = _classifier(features, labels)
    for name in ('hidden', 'logits'):
      with tf1.variable_scope(name, reuse=True):
        tf1.add_to_collection(key, tf1.get_variable('kernel'))
    penalty = tf.add_n([tf.nn.l2_loss(w) for w in tf1.get_collection(key)])
    return _trained(cross_entropy + 0.05 * penalty, mode)

  return model_fn


def _filed_once_model_fn(features, labels, mode):
  """Example weights made by the first call that finds the collection
  empty: on one device, the model_fn's own."""
  logits, _ = _classifier(features, labels)
  if not tf1.get_collection('example_weights'):
    tf1.add_to_collection('example_weights',
                          1.0 + tf.abs(features['x'][:, 0]))
  weights = tf1.get_collection('example_weights')[0]
  return _trained(tf1.losses.sparse_softmax_cross_entropy(
      labels, logits, weights=weights), mode)


def _filed_at_creation_model_fn(features, labels, mode):
  """A penalty over the variables get_variable filed when it made them:
  a later tower reuses them and files nothing."""
  hidden = tf1.get_variable(
      'w', [5, 4], initializer=seeded(3),
      collections=[tf1.GraphKeys.GLOBAL_VARIABLES,
                   tf1.GraphKeys.TRAINABLE_VARIABLES, 'my_vars'])
  _, cross_entropy = _classifier({'x': tf.matmul(features['x'], hidden)},
                                 labels)
  penalty = tf.add_n([tf.nn.l2_loss(v) for v in tf1.get_collection('my_vars')])
  return _trained(cross_entropy + 0.05 * penalty, mode)


def _variable_made_once_model_fn(features, labels, mode):
  """A scale variable made by the first call that finds the collection
  empty: on one device, before its own reads."""
  if not tf1.get_collection('scale'):
    tf1.add_to_collection('scale', tf.Variable(1.5, name='scale'))
  logits, _ = _classifier(features, labels)
  scaled = logits * tf1.get_collection('scale')[0]
  return _trained(tf1.losses.sparse_softmax_cross_entropy(labels, scaled),
                  mode)


_MODEL_FNS = {
    'variable_made_once_if_missing': _variable_made_once_model_fn,
    'penalty_over_variables_filed_at_creation': _filed_at_creation_model_fn,
    'loss_from_collection': _collected_loss_model_fn,
    'penalty_over_filed_weights': _filed_weights_model_fn('my_weights'),
    'penalty_over_graphkeys_weights': _filed_weights_model_fn(
        tf1.GraphKeys.WEIGHTS),
    'made_once_if_missing': _filed_once_model_fn,
}


@pytest.mark.training
@pytest.mark.parametrize('towers,aggregation', [
    (2, 'global_loss'), (3, 'global_loss'), (2, 'all_reduce')])
@pytest.mark.parametrize('name', sorted(_MODEL_FNS))
def test_a_model_fn_reading_its_collections_trains_as_one_device(
    name, towers, aggregation):
  model_fn = _MODEL_FNS[name]
  start, expected = helpers.train_in_session(model_fn, _X, _Y, 1, 9, 3)
  # Momentum's slots carry the steps: two runs, as a race passes one in two.
  for _ in range(2):
    _, actual = helpers.train_in_session(
        model_fn, _X, _Y, towers, 9, 3, start=start,
        aggregation=aggregation)
    helpers.assert_same_variables(
        expected, {k: actual[k] for k in expected}, rtol=2e-5)


@pytest.mark.training
def test_an_evaluated_loss_from_a_collection_is_one_devices(tmp_path):
  input_fn = helpers.dataset_input_fn({'x': _X}, _Y, batch_size=12,
                                      repeat=False)
  one = helpers.make_estimator(_collected_loss_model_fn, tmp_path, 1)
  one.train(input_fn, steps=2)
  towers = helpers.make_estimator(_collected_loss_model_fn, tmp_path, 2)
  expected, actual = one.evaluate(input_fn), towers.evaluate(input_fn)
  np.testing.assert_allclose(actual['loss'], expected['loss'], rtol=1e-5)


@pytest.mark.fast
def test_after_the_towers_a_collection_holds_each_towers_entries_once():
  def both(features, labels, mode):
    _, cross_entropy = _classifier(features, labels)
    tf1.add_to_collection('my_losses', cross_entropy)
    for name in ('hidden', 'logits'):
      with tf1.variable_scope(name, reuse=True):
        tf1.add_to_collection('my_weights', tf1.get_variable('kernel'))
    return _trained(tf.add_n(tf1.get_collection('my_losses')), mode)

  graph, _ = helpers.build_replicated(both, 3)
  # A loss per tower; the shared kernels once each, as on one device.
  assert len(graph.get_collection('my_losses')) == 3
  assert [v.op.name for v in graph.get_collection('my_weights')] == [
      'hidden/kernel', 'logits/kernel']


@pytest.mark.fast
def test_entries_made_before_the_towers_are_seen_by_every_tower():
  seen = []

  def model_fn(features, labels, mode):
    seen.append([t.op.name for t in tf1.get_collection('config')])
    return _collected_loss_model_fn(features, labels, mode)

  graph = tf.Graph()
  with graph.as_default():
    tf1.add_to_collection('config', tf.constant(2.0, name='outside'))
    features = {'x': tf.constant(_X[:6])}
    trainer.replicate_model_fn(model_fn)(
        features, tf.constant(_Y[:6]), tf.estimator.ModeKeys.TRAIN, {},
        trainer.make_run_config(cpu_devices=2))
  assert seen == [['outside'], ['outside']]
  assert [t.op.name for t in graph.get_collection('config')] == ['outside']


@pytest.mark.training
def test_shared_embedding_columns_train_as_one_device():
  """The v1 feature columns keep a shared embedding in a collection that
  must hold it once."""
  ids = (np.arange(24) % 7).astype(np.int64)
  features = {'a': ids, 'b': ids[::-1].copy()}

  def model_fn(features, labels, mode):
    columns = [tf1.feature_column.categorical_column_with_identity(k, 7)
               for k in ('a', 'b')]
    shared = tf1.feature_column.shared_embedding_columns(
        columns, 3, initializer=tf1.glorot_uniform_initializer(seed=3))
    inputs = tf1.feature_column.input_layer(features, shared)
    _, loss = _classifier({'x': inputs}, labels)
    return _trained(loss, mode)

  start, expected = helpers.train_in_session(model_fn, features, _Y, 1, 9, 3)
  _, actual = helpers.train_in_session(model_fn, features, _Y, 2, 9, 3,
                                       start=start)
  helpers.assert_same_variables(expected,
                                {k: actual[k] for k in expected}, rtol=2e-5)


def _collected_past_a_function_model_fn(features, labels, mode):
  """A collected loss computed past a numpy_function, per row: checked
  against the model_fn's copy on the whole batch before step 1."""
  logits, _ = _classifier(features, labels)
  per_row = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                           logits=logits)
  ones = tf.reshape(tf.numpy_function(np.ones_like, [per_row], tf.float32),
                    [-1])
  tf1.add_to_collection('my_losses', tf.reduce_mean(per_row * ones))
  return _trained(tf.add_n(tf1.get_collection('my_losses')), mode)


@pytest.mark.training
def test_the_first_step_copy_reads_and_leaves_only_its_own_entries(
    tmp_path, caplog):
  input_fn = helpers.dataset_input_fn({'x': _X}, _Y, batch_size=9)
  one = helpers.make_estimator(_collected_past_a_function_model_fn,
                               tmp_path / 'one', 1)
  one.train(input_fn, steps=2)
  towers = helpers.make_estimator(_collected_past_a_function_model_fn,
                                  tmp_path / 'towers', 2)
  # Same start: the one-device checkpoint of step 0 is not kept, so both
  # start from the seeded initializers.
  towers.train(input_fn, steps=2)
  helpers.assert_same_variables(helpers.variables_of(one),
                                helpers.variables_of(towers), rtol=2e-5)
  with tf.Graph().as_default() as graph:
    features = {'x': tf.constant(_X[:9])}
    spec = trainer.replicate_model_fn(_collected_past_a_function_model_fn)(
        features, tf.constant(_Y[:9]), tf.estimator.ModeKeys.TRAIN, {},
        trainer.make_run_config(cpu_devices=2))
  assert any(type(h).__name__ == 'FirstStepCheck'
             for h in spec.training_hooks)
  assert [t.op.name.startswith('one_device_check')
          for t in graph.get_collection('my_losses')] == [False, False]
