"""Towers share tower 0's variables; a tower that differs is an error."""

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


def classifier_spec(mode, logits, labels):
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
