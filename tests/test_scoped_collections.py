"""Scoped collection queries in later towers (TF-GAN's pattern)."""

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1


def _network(scope, inputs, training):
  with tf1.variable_scope(scope) as variable_scope:
    hidden = tf1.layers.dense(inputs, 4)
    hidden = tf1.layers.batch_normalization(hidden, training=training)
    return tf1.layers.dense(hidden, 1), variable_scope


def _gan_like_model_fn(features, labels, mode):
  """Two networks whose batch-norm updates are picked by scope, with
  TF-GAN's check that no update op is left out."""
  del labels
  step = tf1.train.get_or_create_global_step()
  fake, generator = _network('Generator', features['x'], True)
  score, discriminator = _network('Discriminator', fake, True)
  loss = tf.reduce_mean(tf.square(score))
  update_ops = {name: tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope.name)
                for name, scope in (('gen', generator),
                                    ('dis', discriminator))}
  every = set(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
  if every != set(update_ops['gen']) | set(update_ops['dis']):
    raise ValueError('update ops outside the networks: '
                     f'{sorted(op.name for op in every)}')
  train_ops = []
  for name, scope in (('gen', generator), ('dis', discriminator)):
    with tf.control_dependencies(update_ops[name]):
      train_ops.append(tf1.train.GradientDescentOptimizer(0.1).minimize(
          loss, var_list=tf1.trainable_variables(scope.name)))
  train_op = tf.group(*train_ops, step.assign_add(1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('towers', [2, 3])
def test_update_ops_picked_by_scope_include_every_tower(towers):
  graph = tf.Graph()
  with graph.as_default():
    features = {'x': tf.constant(np.ones((6, 3), np.float32))}
    spec = estimator_towers.replicate_model_fn(_gan_like_model_fn)(
        features, None, tf.estimator.ModeKeys.TRAIN, {},
        estimator_towers.make_run_config(cpu_devices=towers))
  # Every tower's moving-statistics updates are in the step (the last
  # tower applies the one global-batch update): none was left out.
  assert spec.train_op is not None
  names = [op.name for op in graph.get_operations()]
  assert any(n.startswith(f'tower_{towers - 1}/Generator/') for n in names)


def test_a_scope_outside_the_tower_still_matches_as_before():
  graph = tf.Graph()
  with graph.as_default():
    tf1.add_to_collection('things', tf.constant(1.0, name='other/a'))

    def model_fn(features, labels, mode):
      del labels
      found = tf1.get_collection('things', scope='other')
      assert [t.op.name for t in found] == ['other/a']
      assert tf1.get_collection('things', scope='tower_1') == []
      loss = tf.reduce_mean(tf1.layers.dense(features['x'], 1))
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=tf1.train.GradientDescentOptimizer(
              0.1).minimize(loss, tf1.train.get_or_create_global_step()))

    estimator_towers.replicate_model_fn(model_fn)(
        {'x': tf.ones((4, 3))}, None, tf.estimator.ModeKeys.TRAIN, {},
        estimator_towers.make_run_config(cpu_devices=2))
