"""Train ops built from tf.gradients, overriding optimizers and wrappers train
one device's numbers; what cannot be routed is refused by name.

The BERT-style model_fn below has the structure of the classic fine-tuning
model_fn: transformer-ish layers with layer norm, `tf.gradients` of the loss,
clipping by global norm, a weight-decay Adam that overrides
`apply_gradients` with its own update and slots, and a hand-made
`global_step` increment grouped into the train op.
"""

import shutil

import numpy as np
import pytest
import tensorflow as tf

from helpers import (assert_same_variables, build_replicated,
                     dataset_input_fn, make_estimator, save_start_checkpoint,
                     seeded, variables_of)

tf1 = tf.compat.v1
BATCH = 7  # Divides by neither 2 nor 3 towers.
STEPS = 3
WIDTH = 4
# Adam divides each gradient by its own magnitude, so the float32 round-off
# of the towers' other summation order becomes ~1e-4 of a step.
ADAM_TOLERANCE = {'rtol': 1e-4, 'atol': 1e-5}


class WeightDecayAdam(tf1.train.Optimizer):
  """Adam with decoupled weight decay, its own slots and its own update.

  Only `apply_gradients` is its own: it neither calls the base class's nor
  advances global_step (the model_fn does).
  """

  def __init__(self, learning_rate, decay=0.01, beta1=0.9, beta2=0.999,
               epsilon=1e-6, no_decay=('layer_norm', 'bias')):
    super().__init__(use_locking=False, name='WeightDecayAdam')
    self._rate, self._decay = learning_rate, decay
    self._betas, self._epsilon, self._no_decay = (beta1, beta2), epsilon, (
        no_decay)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    del global_step  # Advanced by the model_fn.
    beta1, beta2 = self._betas
    writes = []
    for grad, var in grads_and_vars:
      if grad is None:
        continue
      moments = [tf1.get_variable(
          f'{var.op.name}/wd_adam_{slot}', var.shape, var.dtype.base_dtype,
          tf1.zeros_initializer(), trainable=False) for slot in ('m', 'v')]
      first = beta1 * moments[0] + (1.0 - beta1) * grad
      second = beta2 * moments[1] + (1.0 - beta2) * tf.square(grad)
      step = first / (tf.sqrt(second) + self._epsilon)
      if not any(part in var.op.name for part in self._no_decay):
        step += self._decay * var
      writes += [var.assign(var - self._rate * step),
                 moments[0].assign(first), moments[1].assign(second)]
    return tf.group(*writes, name=name)


def _layer_norm(x, scope):
  with tf1.variable_scope(scope):
    gain = tf1.get_variable('gamma', [WIDTH],
                            initializer=tf1.ones_initializer())
    shift = tf1.get_variable('beta', [WIDTH],
                             initializer=tf1.zeros_initializer())
  mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
  return (x - mean) * tf.math.rsqrt(variance + 1e-6) * gain + shift


def _encoder_layer(x, index):
  with tf1.variable_scope(f'layer_{index}'):
    # No bias on the keys: softmax ignores it, and Adam would turn its
    # round-off gradient into steps.
    query, key, value = (tf1.layers.dense(x, WIDTH, name=n, use_bias=n != 'key',
                                          kernel_initializer=seeded(30 + i))
                         for i, n in enumerate(('query', 'key', 'value')))
    scores = tf.matmul(query, key, transpose_b=True) / np.sqrt(WIDTH)
    attended = tf.matmul(tf.nn.softmax(scores), value)
    x = _layer_norm(x + attended, 'attention_layer_norm')
    hidden = tf1.layers.dense(x, 2 * WIDTH, tf.nn.gelu, name='intermediate',
                              kernel_initializer=seeded(34))
    out = tf1.layers.dense(hidden, WIDTH, name='output',
                           kernel_initializer=seeded(35))
    return _layer_norm(x + out, 'output_layer_norm')


def bert_like_model_fn(features, labels, mode, params):
  """Each of the 5 features is a token; two encoder layers; first token."""
  tokens = features['x'][:, :, None]  # [batch, 5 tokens, 1]
  x = tf1.layers.dense(tokens, WIDTH, name='embeddings',
                       kernel_initializer=seeded(29))
  for index in range(2):
    x = _encoder_layer(x, index)
  logits = tf1.layers.dense(x[:, 0], 2, name='classifier',
                            kernel_initializer=seeded(36))
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  step = tf1.train.get_or_create_global_step()
  variables = tf1.trainable_variables()
  gradients = {'tf.gradients': tf.gradients,
               'tf.compat.v1.gradients': tf1.gradients}[params['gradients']]
  grads = gradients(loss, variables)
  grads, _ = tf.clip_by_global_norm(grads, clip_norm=0.1)
  rate = tf1.train.polynomial_decay(0.05, step, 100, end_learning_rate=0.0)
  update = WeightDecayAdam(rate).apply_gradients(zip(grads, variables), step)
  with tf.control_dependencies([update]):  # The rate reads the step first.
    increment = step.assign(step + 1)
  train_op = tf.group(update, increment)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _input_fn(data):
  x, y = data
  return dataset_input_fn({'x': x}, y, BATCH)


@pytest.fixture(scope='module')
def bert_start(tmp_path_factory, data):
  """A step-0 checkpoint of the BERT-like model, and one device's training
  from it: (start dir, {variable: value after STEPS})."""
  start = tmp_path_factory.mktemp('bert_start')
  params = {'gradients': 'tf.compat.v1.gradients'}
  save_start_checkpoint(bert_like_model_fn, _input_fn(data), [start], params)
  one_dir = tmp_path_factory.mktemp('bert_one')
  shutil.copytree(start, one_dir, dirs_exist_ok=True)
  one = make_estimator(bert_like_model_fn, one_dir, 1, params)
  one.train(_input_fn(data), steps=STEPS)
  return start, one


@pytest.mark.training
@pytest.mark.parametrize('towers,aggregation,gradients,micro_batches', [
    (2, 'global_loss', 'tf.gradients', 1),
    (3, 'round_robin', 'tf.compat.v1.gradients', 1),
    (2, 'all_reduce', 'tf.compat.v1.gradients', 1),
    # 2 x 2 micro-batches of 2, 2, 2, 1 rows, one after another per device.
    (2, 'global_loss', 'tf.gradients', 2),
])  # 3 towers under all_reduce: see the resume test. round_robin builds
# global_loss's backward pass; its 3 towers stand for both (test time).
def test_bert_style_training_equals_one_device(tmp_path, data, bert_start,
                                               towers, aggregation, gradients,
                                               micro_batches):
  start, one = bert_start
  shutil.copytree(start, tmp_path, dirs_exist_ok=True)
  many = make_estimator(bert_like_model_fn, tmp_path, towers,
                        {'gradients': gradients}, aggregation=aggregation,
                        micro_batches=micro_batches)
  many.train(_input_fn(data), steps=STEPS)
  trained = variables_of(many)
  assert trained['global_step'] == STEPS
  # The optimizer's own slots, under one-device names.
  assert 'layer_0/query/kernel/wd_adam_m' in trained
  assert_same_variables(variables_of(one), trained, **ADAM_TOLERANCE)


@pytest.mark.training
def test_bert_style_training_resumes_under_all_reduce(tmp_path, data,
                                                      bert_start):
  # Resumes one device's checkpoint on 3 towers: the copies are set from the
  # restored primaries; the optimizer's own slots, which the copies do not
  # have, come back from the checkpoint.
  _, one = bert_start
  shutil.copytree(one.model_dir, tmp_path / 'one', dirs_exist_ok=True)
  resumed_one = make_estimator(bert_like_model_fn, tmp_path / 'one', 1,
                               {'gradients': 'tf.gradients'})
  shutil.copytree(one.model_dir, tmp_path / 'many', dirs_exist_ok=True)
  many = make_estimator(bert_like_model_fn, tmp_path / 'many', 3,
                        {'gradients': 'tf.gradients'},
                        aggregation='all_reduce')
  resumed_one.train(_input_fn(data), steps=2)
  many.train(_input_fn(data), steps=2)
  assert many.get_variable_value('global_step') == STEPS + 2
  assert_same_variables(variables_of(resumed_one), variables_of(many),
                        **ADAM_TOLERANCE)


# ---------------------------------------------------------------------------
# Optimizers that override minimize or get_updates, and wrappers.

class LossCheckingSGD(tf1.train.GradientDescentOptimizer):
  """Asserts that minimize gets the loss one device would give it."""

  def __init__(self, expected_first_loss):
    super().__init__(0.2)
    self._expected = expected_first_loss

  def minimize(self, loss, global_step=None, **kwargs):
    first_step = tf.equal(global_step, 0)
    check = tf.debugging.Assert(
        tf.logical_or(tf.logical_not(first_step),
                      tf.abs(loss - self._expected) < 1e-5),
        ['minimize got loss', loss, 'expected', self._expected])
    with tf.control_dependencies([check]):
      return super().minimize(loss, global_step, **kwargs)


class LossCheckingKerasSGD(tf.keras.optimizers.legacy.SGD):
  """The same check, in a Keras optimizer overriding get_updates."""

  def __init__(self, expected_first_loss):
    super().__init__(0.2)
    self._expected = expected_first_loss

  def get_updates(self, loss, params):
    check = tf.debugging.Assert(
        tf.logical_or(tf.not_equal(self.iterations, 0),
                      tf.abs(loss - self._expected) < 1e-5),
        ['get_updates got loss', loss, 'expected', self._expected])
    with tf.control_dependencies([check]):
      return super().get_updates(loss, params)


class ScalingWrapper(tf1.train.Optimizer):
  """Scales the loss, unscales the gradients, delegates the rest."""

  def __init__(self, inner, scale=64.0):
    super().__init__(use_locking=False, name='ScalingWrapper')
    self._inner, self._scale = inner, scale

  def compute_gradients(self, loss, *args, **kwargs):
    pairs = self._inner.compute_gradients(loss * self._scale, *args, **kwargs)
    return [(None if g is None else g / self._scale, v) for g, v in pairs]

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    return self._inner.apply_gradients(grads_and_vars, global_step, name)


def overriding_model_fn(features, labels, mode, params):
  """A summed loss: at zero weights it is BATCH * log(2) for the whole batch,
  but only a tower's share of that for a tower's shard."""
  logits = tf1.layers.dense(features['x'], 2,
                            kernel_initializer=tf1.zeros_initializer())
  loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  step = tf1.train.get_or_create_global_step()
  expected = BATCH * np.log(2.0)
  kind = params['optimizer']
  if kind == 'minimize':
    train_op = LossCheckingSGD(expected).minimize(loss, step)
  elif kind == 'get_updates':
    updates = LossCheckingKerasSGD(expected).get_updates(
        loss, tf1.trainable_variables())
    train_op = tf.group(*updates, step.assign_add(1))
  elif kind == 'by_hand':
    variables = tf1.trainable_variables()
    grads = tf.gradients(loss, variables)
    train_op = tf.group(*[v.assign_sub(0.2 * g)
                          for g, v in zip(grads, variables)],
                        step.assign_add(1))
  else:
    optimizer = ScalingWrapper(tf1.train.AdamOptimizer(0.1))
    train_op = optimizer.minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.training
@pytest.mark.parametrize('optimizer,aggregation', [
    ('minimize', 'global_loss'),
    ('get_updates', 'all_reduce'),
    ('wrapper', 'all_reduce'),
    ('wrapper', 'round_robin'),
    ('by_hand', 'global_loss'),
])
def test_overriding_optimizers_see_and_train_one_device(tmp_path, data,
                                                        optimizer,
                                                        aggregation):
  params = {'optimizer': optimizer}
  runs = {}
  for towers in (1, 3):
    estimator = make_estimator(overriding_model_fn, tmp_path / str(towers),
                               towers, params, aggregation=aggregation)
    estimator.train(_input_fn(data), steps=2)
    runs[towers] = variables_of(estimator)
  assert runs[3]['global_step'] == 2
  assert_same_variables(runs[1], runs[3])


# ---------------------------------------------------------------------------
# tf.gradients inside the loss.

def gradient_penalty_model_fn(features, labels, mode, params):
  """A critic with a WGAN-GP-like penalty on its gradient w.r.t. inputs, or
  (params['penalty'] == 'weights') on its gradient w.r.t. the weights."""
  x = features['x']
  hidden = tf1.layers.dense(x, 4, tf.nn.tanh, kernel_initializer=seeded(41))
  logits = tf1.layers.dense(hidden, 2, kernel_initializer=seeded(42))
  xent = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  if params['penalty'] == 'inputs':
    (slope,) = tf.gradients(logits[:, 1], [x])  # Per example: the tower's.
    penalty = tf.reduce_mean(tf.square(tf.norm(slope, axis=1) - 1.0))
  else:
    penalty = tf.linalg.global_norm(
        tf1.gradients(xent, tf1.trainable_variables())) ** 2
  loss = xent + 0.1 * penalty
  train_op = tf1.train.AdamOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.training
def test_gradient_penalty_on_inputs_equals_one_device(tmp_path, data):
  params = {'penalty': 'inputs'}
  runs = {}
  for towers in (1, 3):
    estimator = make_estimator(gradient_penalty_model_fn,
                               tmp_path / str(towers), towers, params)
    estimator.train(_input_fn(data), steps=STEPS)
    runs[towers] = variables_of(estimator)
  assert_same_variables(runs[1], runs[3])


@pytest.mark.fast
def test_gradient_penalty_on_the_weights_is_refused():
  with pytest.raises(ValueError, match='depends on gradients of the loss'):
    build_replicated(gradient_penalty_model_fn, 2,
                     params={'penalty': 'weights'})


# ---------------------------------------------------------------------------
# Refusals.

def _plain_model_fn(optimizer_fn, gradients=None):

  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features['x'], 2)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    if gradients is not None:
      gradients(loss, logits)
    train_op = optimizer_fn().minimize(loss,
                                       tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.fast
def test_cross_shard_optimizer_is_refused_with_what_to_use():
  model_fn = _plain_model_fn(lambda: tf1.tpu.CrossShardOptimizer(
      tf1.train.GradientDescentOptimizer(0.1)))
  with pytest.raises(ValueError, match=(
      'CrossShardOptimizer sums gradients across TPU shards.*Use the '
      'optimizer it wraps directly')):
    build_replicated(model_fn, 2)


@pytest.mark.fast
@pytest.mark.parametrize('gradients,message', [
    (lambda loss, logits: tf.gradients(
        loss, tf1.trainable_variables() + [logits]),
     'both variables and tensors'),
    (lambda loss, logits: tf1.gradients(
        [loss, loss], tf1.trainable_variables()), 'one scalar loss'),
    (lambda loss, logits: tf.gradients(
        loss, tf1.trainable_variables(), stop_gradients=[logits]),
     'stop_gradients'),
])
def test_tf_gradients_that_cannot_be_routed_are_refused(gradients, message):
  model_fn = _plain_model_fn(lambda: tf1.train.GradientDescentOptimizer(0.1),
                             gradients)
  with pytest.raises(ValueError, match=message):
    build_replicated(model_fn, 2)


@pytest.mark.fast
def test_gradients_functions_are_restored_and_plain_afterwards():
  originals = (tf.gradients, tf1.gradients, tf1.train.Optimizer.minimize)
  build_replicated(_plain_model_fn(
      lambda: tf1.train.GradientDescentOptimizer(0.1)), 2)
  assert (tf.gradients, tf1.gradients,
          tf1.train.Optimizer.minimize) == originals
  assert '__init_subclass__' not in vars(tf1.train.Optimizer)


@pytest.mark.fast
def test_optimizer_class_defined_inside_the_model_fn_is_routed():
  seen = []

  def model_fn(features, labels, mode):

    class Recording(tf1.train.GradientDescentOptimizer):

      def minimize(self, loss, global_step=None):
        seen.append(loss)
        return super().minimize(loss, global_step)

    logits = tf1.layers.dense(features['x'], 2)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = Recording(0.1).minimize(loss,
                                       tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  build_replicated(model_fn, 3)
  # Called once, by the last tower, with the towers' weighted sum.
  assert len(seen) == 1
  assert seen[0].op.name.startswith('global_loss/AddN')


@pytest.mark.fast
def test_summary_of_routed_gradients_warns_that_it_shows_zeros(caplog):

  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features['x'], 2)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    variables = tf1.trainable_variables()
    grads = tf.gradients(loss, variables)
    tf1.summary.histogram('kernel_gradient', grads[0])
    train_op = tf1.train.GradientDescentOptimizer(0.1).apply_gradients(
        zip(grads, variables), tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  build_replicated(model_fn, 2)
  assert 'TensorBoard shows zeros' in caplog.text
