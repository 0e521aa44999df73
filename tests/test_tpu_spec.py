"""Model_fns written for TPUEstimator (returning TPUEstimatorSpec) on towers.

The reference is TensorFlow's own off-TPU conversion: the unwrapped model_fn
under `TPUEstimator(use_tpu=False)` on one device. Replicated, the same
model_fn must give its numbers both under TPUEstimator(use_tpu=False) and
under a plain Estimator: scaffold_fn (here `init_from_checkpoint`, as BERT
does) applied once, eval_metrics and host_call computed on the whole batch.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import trainer
from helpers import assert_same_variables, seeded, variables_of

tf1 = tf.compat.v1
BATCH = 7  # Divides by neither 2 nor 3 towers.
STEPS = 3
TOWERS_SEEN = []


def tpu_model_fn(features, labels, mode, params):
  """A BERT-style model_fn: per-example tensors go to eval_metrics."""
  TOWERS_SEEN.append(trainer.tower_context().num_towers)
  assert params['batch_size'] == BATCH  # TPUEstimator passes the global one.
  hidden = tf1.layers.dense(features['x'], 4, tf.nn.tanh, name='encoder',
                            kernel_initializer=seeded(1))
  logits = tf1.layers.dense(hidden, 1, kernel_initializer=seeded(2))
  probabilities = tf.sigmoid(logits)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf1.estimator.tpu.TPUEstimatorSpec(
        mode, predictions={'probabilities': probabilities})
  per_example = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
      labels=labels, logits=logits), axis=1)
  loss = tf.reduce_mean(per_example)

  def scaffold_fn():  # Starts the encoder from a "pre-trained" checkpoint.
    tf1.train.init_from_checkpoint(
        params['init_checkpoint'],
        {name: name for name in ('encoder/kernel', 'encoder/bias')})
    return tf1.train.Scaffold()

  if mode == tf.estimator.ModeKeys.EVAL:
    def metric_fn(per_example, labels, probabilities):
      return {
          'xent': tf1.metrics.mean(per_example),
          'accuracy': tf1.metrics.accuracy(
              labels, tf.cast(probabilities > 0.5, tf.float32)),
          # A mean of batch means: right only if fn sees the whole batch.
          'batch_mean': tf1.metrics.mean(tf.reduce_mean(per_example)),
      }
    return tf1.estimator.tpu.TPUEstimatorSpec(
        mode, loss=loss, scaffold_fn=scaffold_fn,
        eval_metrics=(metric_fn, [per_example, labels, probabilities]))
  train_op = tf1.train.AdamOptimizer(0.05).minimize(
      loss, tf1.train.get_or_create_global_step())

  def host_fn(per_example):  # Sum of squared per-batch means, over steps.
    total = tf1.get_variable('host_total', [], tf.float32,
                             tf1.zeros_initializer(), trainable=False)
    return total.assign_add(tf.square(tf.reduce_mean(per_example)))

  return tf1.estimator.tpu.TPUEstimatorSpec(
      mode, loss=loss, train_op=train_op, scaffold_fn=scaffold_fn,
      host_call=(host_fn, {'per_example': per_example}))


@pytest.fixture(scope='module')
def init_checkpoint(tmp_path_factory):
  """A checkpoint holding an encoder unlike the seeded initial one."""
  path = str(tmp_path_factory.mktemp('pretrained') / 'model.ckpt')
  with tf.Graph().as_default():
    tf1.layers.dense(tf.zeros([1, 5]), 4, name='encoder',
                     kernel_initializer=tf1.constant_initializer(0.3),
                     bias_initializer=tf1.constant_initializer(-0.2))
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      tf1.train.Saver().save(session, path)
  return path


def _input_fn(data, repeat=True):
  def input_fn(params):
    x, y = data
    ds = tf.data.Dataset.from_tensor_slices(
        ({'x': x}, y[:, None].astype(np.float32)))
    ds = ds.repeat() if repeat else ds
    return ds.batch(params['batch_size'])
  return input_fn


def _estimator(kind, model_dir, towers, init_checkpoint, **wrapper_kwargs):
  """TPUEstimator(use_tpu=False) or Estimator on `towers` virtual CPUs."""
  run_config = trainer.make_run_config(
      str(model_dir), cpu_devices=towers, tf_random_seed=7,
      save_checkpoints_steps=10_000, log_step_count_steps=10_000)
  model_fn = tpu_model_fn
  if towers > 1:
    model_fn = trainer.replicate_model_fn(tpu_model_fn, **wrapper_kwargs)
  params = {'init_checkpoint': init_checkpoint}
  if kind == 'estimator':
    return tf.estimator.Estimator(model_fn, config=run_config,
                                  params=dict(params, batch_size=BATCH))
  config = tf1.estimator.tpu.RunConfig(
      model_dir=str(model_dir), session_config=run_config.session_config,
      tf_random_seed=7, save_checkpoints_steps=10_000,
      log_step_count_steps=10_000)
  return tf1.estimator.tpu.TPUEstimator(
      model_fn, config=config, use_tpu=False, params=params,
      train_batch_size=BATCH, eval_batch_size=BATCH,
      predict_batch_size=BATCH)


@pytest.mark.training
@pytest.mark.parametrize('kind,towers,aggregation', [
    ('tpu_estimator', 3, 'global_loss'),
    ('estimator', 2, 'all_reduce'),
    ('tpu_estimator', 2, 'round_robin'),
])
def test_tpu_spec_equals_one_device(tmp_path, data, init_checkpoint, kind,
                                    towers, aggregation):
  one = _estimator('tpu_estimator', tmp_path / 'one', 1, init_checkpoint)
  many = _estimator(kind, tmp_path / 'many', towers, init_checkpoint,
                    aggregation=aggregation)
  del TOWERS_SEEN[:]
  for estimator in (one, many):
    estimator.train(_input_fn(data), steps=STEPS)
  # The towers ran: the RunConfig's virtual CPUs reached the model_fn.
  assert TOWERS_SEEN == [1] + [towers] * towers
  expected = variables_of(one)
  assert expected['host_total'] > 0
  assert_same_variables(expected, variables_of(many))
  expected = one.evaluate(_input_fn(data, repeat=False))
  actual = many.evaluate(_input_fn(data, repeat=False))
  assert sorted(actual) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5,
                               err_msg=name)
  expected = [p['probabilities'] for p in
              one.predict(_input_fn(data, repeat=False))]
  actual = [p['probabilities'] for p in
            many.predict(_input_fn(data, repeat=False))]
  np.testing.assert_allclose(actual, expected, rtol=1e-5)


@pytest.mark.fast
def test_session_config_of_a_tpu_run_config_has_the_virtual_cpus():
  run_config = trainer.make_run_config(cpu_devices=3)
  config = tf1.estimator.tpu.RunConfig(session_config=run_config.session_config)
  with tf.Graph().as_default(), tf1.Session(config=config.session_config) as s:
    cpus = [d.name for d in s.list_devices() if d.device_type == 'CPU']
  assert len(cpus) == 3


@pytest.mark.training
def test_scalar_eval_metrics_tensor_is_refused(tmp_path, data,
                                               init_checkpoint):
  def model_fn(features, labels, mode, params):
    del params
    logits = tf1.layers.dense(features['x'], 1)
    loss = tf1.losses.sigmoid_cross_entropy(labels, logits)
    return tf1.estimator.tpu.TPUEstimatorSpec(
        mode, loss=loss,
        eval_metrics=(lambda l: {'loss': tf1.metrics.mean(l)}, [loss]))

  estimator = tf.estimator.Estimator(
      trainer.replicate_model_fn(model_fn), params={'batch_size': BATCH},
      config=trainer.make_run_config(str(tmp_path), cpu_devices=2))
  with pytest.raises(ValueError, match=r'eval_metrics tensor 0 is a scalar'):
    estimator.evaluate(_input_fn(data, repeat=False))


@pytest.mark.training
def test_per_step_host_call_tensor_is_refused(tmp_path, data):
  # TPU model_fns pass e.g. tf.reshape(loss, [1]): one row per tower, not
  # per example; fn would read one tower's loss as the batch's.
  def model_fn(features, labels, mode, params):
    del params
    logits = tf1.layers.dense(features['x'], 1)
    loss = tf1.losses.sigmoid_cross_entropy(labels, logits)
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf1.estimator.tpu.TPUEstimatorSpec(
        mode, loss=loss, train_op=train_op,
        host_call=(lambda loss: tf.identity(loss[0]),
                   [tf.reshape(loss, [1])]))

  estimator = tf.estimator.Estimator(
      trainer.replicate_model_fn(model_fn), params={'batch_size': BATCH},
      config=trainer.make_run_config(str(tmp_path), cpu_devices=2))
  with pytest.raises(ValueError, match=r'host_call\[0\] has 1 row\(s\) in '
                     'tower 0'):
    estimator.train(_input_fn(data), steps=1)
