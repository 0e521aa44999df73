"""Loss-scale optimizers on towers train as on one device, in float16.

Each test trains one device and the towers in the SAME precision from the
same step-0 checkpoint: float16 through grappler's CPU emulation of its
float16 rewrite (`auto_mixed_precision_cpu`, which rounds every converted
op's inputs and outputs through float16, so overflow and rounding behave as
float16 on a GPU; the GPU rewrite itself cannot run on this machine), or
Keras layers with the real 'mixed_float16' policy.

Tolerance: rtol=4e-3, atol=1e-3. float16 keeps 11 significant bits (unit
roundoff 2**-11 ~ 4.9e-4), and the towers round different partial results
(each tower's shard, then the weighted sum of the tower losses) than one
device (the whole batch), so gradients agree to a few float16 roundings;
Adam's normalised step passes such relative differences on to the weights
at about the learning rate times that, per step. The float32 comparisons of
the other tests use 1e-5.
"""

import numpy as np
import pytest
import tensorflow as tf

from helpers import (FinalValues, assert_same_variables, dataset_input_fn,
                     save_start_checkpoint, seeded, variables_of)
import trainer

pytestmark = pytest.mark.training

tf1 = tf.compat.v1
RTOL, ATOL = 4e-3, 1e-3
BATCH = 7  # Uneven over 2 and 3 towers.
_SCALE_VARIABLES = ('current_loss_scale', 'good_steps')


@pytest.fixture(autouse=True)
def fixture_graph_rewrite_off():
  """enable_mixed_precision_graph_rewrite sets a process-wide flag."""
  yield
  tf1.mixed_precision.disable_mixed_precision_graph_rewrite()


def _graph_rewrite():
  return tf1.mixed_precision.enable_mixed_precision_graph_rewrite(
      tf1.train.AdamOptimizer(0.05))


def _fixed_scale():
  return tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
      tf1.train.MomentumOptimizer(0.2, momentum=0.9), loss_scale=128.)


def _dynamic_scale():
  return tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
      tf1.train.GradientDescentOptimizer(0.5), loss_scale='dynamic')


def _keras_scale():
  return tf.keras.mixed_precision.LossScaleOptimizer(
      tf.keras.optimizers.legacy.Adam(0.05))


def float16_model_fn(features, labels, mode, params):
  """Keras layers under the 'mixed_float16' policy (or params['policy'])."""
  policy = params.get('policy', 'mixed_float16')
  hidden = tf.keras.layers.Dense(8, activation='tanh', dtype=policy,
                                 kernel_initializer=seeded(1))(features['x'])
  logits = tf.keras.layers.Dense(2, dtype=policy,
                                 kernel_initializer=seeded(2))(hidden)
  loss = tf1.losses.sparse_softmax_cross_entropy(
      labels, tf.cast(logits, tf.float32))
  optimizer = params['optimizer']()
  step = tf1.train.get_or_create_global_step()
  if isinstance(optimizer, tf1.train.Optimizer):
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=optimizer.minimize(loss, step))
  if params.get('keras_minimize'):
    updates = [optimizer.minimize(loss, tf1.trainable_variables())]
  else:  # A Keras optimizer, as the TF2 canned Estimators drive it.
    updates = optimizer.get_updates(loss, tf1.trainable_variables())
  with tf.control_dependencies(updates):
    train_op = tf1.assign_add(step, 1)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _estimator(model_dir, towers, optimizer, float16_rewrite=False,
               params=None, **kwargs):
  model_fn = float16_model_fn
  if towers > 1 or kwargs:
    model_fn = trainer.replicate_model_fn(model_fn, **kwargs)
  config = trainer.make_run_config(
      str(model_dir), cpu_devices=towers, tf_random_seed=7,
      save_checkpoints_steps=10_000, log_step_count_steps=10_000)
  if float16_rewrite:
    rewrite_options = config.session_config.graph_options.rewrite_options
    rewrite_options.auto_mixed_precision = rewrite_options.ON
  return tf.estimator.Estimator(
      model_fn, config=config, params={'optimizer': optimizer,
                                       **(params or {})})


def _train_both(tmp_path, optimizer, towers, aggregation, input_fn, steps):
  """(one device's variables, the towers' variables) after `steps`."""
  dirs = [tmp_path / 'one', tmp_path / 'towers']
  save_start_checkpoint(float16_model_fn, input_fn, dirs,
                        params={'optimizer': optimizer})
  one = _estimator(dirs[0], 1, optimizer)
  replicated = _estimator(dirs[1], towers, optimizer, aggregation=aggregation)
  for estimator in (one, replicated):
    estimator.train(input_fn, steps=steps)
  return variables_of(one), variables_of(replicated)


@pytest.mark.parametrize('optimizer,towers,aggregation', [
    (_graph_rewrite, 2, 'global_loss'),
    (_fixed_scale, 3, 'round_robin'),
    (_dynamic_scale, 3, 'all_reduce'),
    (_keras_scale, 3, 'global_loss'),
    (_keras_scale, 2, 'all_reduce'),
], ids=['graph_rewrite-2-global_loss', 'fixed-3-round_robin',
        'dynamic-3-all_reduce', 'keras-3-global_loss', 'keras-2-all_reduce'])
def test_loss_scaled_training_matches_one_device(
    tmp_path, data, optimizer, towers, aggregation):
  x, y = data
  expected, actual = _train_both(
      tmp_path, optimizer, towers, aggregation,
      dataset_input_fn({'x': x}, y, batch_size=BATCH), steps=4)
  assert_same_variables(expected, actual, rtol=RTOL, atol=ATOL)
  if optimizer is not _fixed_scale:
    # The dynamic scale advanced once per step, not once per tower.
    assert actual['good_steps'] == expected['good_steps'] == 4


@pytest.mark.parametrize('optimizer,aggregation', [
    (_dynamic_scale, 'global_loss'),
    (_keras_scale, 'all_reduce'),
], ids=['tf1-global_loss', 'keras-all_reduce'])
def test_overflow_on_one_shard_skips_the_step_on_every_tower(
    tmp_path, data, optimizer, aggregation):
  x, y = data
  x = x[:BATCH].copy()
  # In the last of 2 towers' shards (4 + 3 examples): beyond float16's
  # range (65504), so only that tower's gradients overflow.
  x[5, 0] = 1e5
  # One batch: a skipped step leaves global_step as it was, so the Estimator
  # would go on to further batches.
  input_fn = dataset_input_fn({'x': x}, y[:BATCH], batch_size=BATCH,
                              repeat=False)
  dirs = [tmp_path / 'one', tmp_path / 'towers']
  save_start_checkpoint(float16_model_fn, input_fn, dirs,
                        params={'optimizer': optimizer})
  start = tf.train.load_checkpoint(str(dirs[0] / 'model.ckpt-0'))
  finals = []
  for model_dir, towers in zip(dirs, (1, 2)):
    final = FinalValues()
    _estimator(model_dir, towers, optimizer, aggregation=aggregation).train(
        input_fn, steps=1, hooks=[final])
    finals.append(final.values)
  for name in start.get_variable_to_shape_map():
    if name not in ('global_step', *_SCALE_VARIABLES) and 'iter' not in name:
      for values in finals:
        np.testing.assert_array_equal(values[name], start.get_tensor(name),
                                      err_msg=name)
  for values in finals:
    # The scale halved, once, as on one device (2**15 to start).
    assert values['current_loss_scale'] == 2.**14
    assert values['good_steps'] == 0


def _adam():
  return tf1.train.AdamOptimizer(0.05)


def _keras_adam():
  return tf.keras.optimizers.legacy.Adam(0.05)


@pytest.mark.parametrize('optimizer,wrapped,towers,aggregation', [
    (_adam, _graph_rewrite, 3, 'all_reduce'),
    (_keras_adam, _keras_scale, 2, 'global_loss'),
    (_adam, _graph_rewrite, 1, 'global_loss'),
    # Already wrapped: its own scale, not a second one around it.
    (_keras_scale, _keras_scale, 2, 'round_robin'),
], ids=['tf1-3-all_reduce', 'keras-2-global_loss', 'tf1-1-tower',
        'keras_wrapped-2-round_robin'])
def test_float16_rewrite_scales_an_unwrapped_optimizer(
    tmp_path, data, optimizer, wrapped, towers, aggregation):
  # make_run_config(mixed_precision='float16') refuses CPU towers, so the
  # rewrite is switched on by hand here (on CPUs it converts nothing).
  _train_against_one_wrapped(tmp_path, data, wrapped, optimizer, towers,
                             float16_rewrite=True, aggregation=aggregation)


@pytest.mark.parametrize('optimizer,float16_rewrite', [
    (_keras_scale, False),
    (_keras_adam, True),
], ids=['keras_loss_scale', 'float16_rewrite'])
def test_keras_minimize_on_towers_matches_get_updates_on_one_device(
    tmp_path, data, optimizer, float16_rewrite):
  # On one device graph mode has no tape for a Keras minimize of a Tensor
  # loss; on towers it is routed like get_updates, through the wrapper's
  # (or the automatic wrapper's) own _compute_gradients.
  _train_against_one_wrapped(tmp_path, data, _keras_scale, optimizer, 2,
                             float16_rewrite, params={'keras_minimize': True},
                             aggregation='round_robin')


def _train_against_one_wrapped(tmp_path, data, wrapped, optimizer, towers,
                               float16_rewrite, params=None, **kwargs):
  """Trains one device with `wrapped`, the towers with `optimizer`."""
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y, batch_size=BATCH)
  dirs = [tmp_path / 'one', tmp_path / 'towers']
  save_start_checkpoint(float16_model_fn, input_fn, dirs,
                        params={'optimizer': wrapped})
  one = _estimator(dirs[0], 1, wrapped)
  replicated = _estimator(dirs[1], towers, optimizer, float16_rewrite,
                          params=params, **kwargs)
  for estimator in (one, replicated):
    estimator.train(input_fn, steps=3)
  expected, actual = variables_of(one), variables_of(replicated)
  assert_same_variables(expected, actual, rtol=RTOL, atol=ATOL)
  assert actual['good_steps'] == 3


def test_mixed_bfloat16_layers_match_one_device(tmp_path, data):
  # No loss scale: bfloat16 has float32's range. Its 8 significant bits
  # (unit roundoff 2**-8 ~ 3.9e-3) are why the tolerance is 8 times
  # float16's.
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y, batch_size=BATCH)
  params = {'policy': 'mixed_bfloat16'}
  dirs = [tmp_path / 'one', tmp_path / 'towers']
  save_start_checkpoint(float16_model_fn, input_fn, dirs,
                        params={'optimizer': _adam, **params})
  one = _estimator(dirs[0], 1, _adam, params=params)
  replicated = _estimator(dirs[1], 3, _adam, params=params,
                          aggregation='round_robin')
  for estimator in (one, replicated):
    estimator.train(input_fn, steps=3)
  assert_same_variables(variables_of(one), variables_of(replicated),
                        rtol=8 * RTOL, atol=8 * ATOL)
