"""Ratio losses whose divisor is not a plain sum, on towers.

One device divides by its batch's divisor once; each tower divides its
numerator by the whole batch's divisor (divisor_totals), so a divisor that
is a sum plus, or bounded by, a constant (max(positives, 1)) applies the
constant once, and so does any expression of that one sum (tf.where(s > 0,
s, 1), max(s, 1) used twice). A divisor the towers cannot rebuild that way
(two different sums, a square root of the rows, a mean) is refused while
the graph is built, as is a static row count plus a constant; before, each
silently divided by its own shard's value (max variable difference after 3
SGD steps on 2 towers in the comments, measured at f537efa). A ratio
written as a product ((1 / normaliser) * sum, the Object Detection API's
SSD loss), several ratios in a metric, and micro-batches under a bounded
divisor are exact or refused, never off one device.
"""

import numpy as np
import pytest
import tensorflow as tf

import trainer
from helpers import largest_difference, seeded, train_in_session

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys


def _data(zero_first_half=True, fractional=False):
  """48 examples; 'w' is a 0/1 weight (positives), 0 on each batch's first
  6 rows (tower 0's shard of a batch of 12 has no positive)."""
  rng = np.random.RandomState(0)
  x = rng.randn(48, 5).astype(np.float32)
  y = rng.randint(0, 3, 48).astype(np.int32)
  if fractional:
    w = (rng.rand(48) * 0.1).astype(np.float32)
  else:
    w = (rng.rand(48) > 0.6).astype(np.float32)
    if zero_first_half:
      w[np.arange(48) % 12 < 6] = 0
  return {'x': x, 'w': w}, y


def _model_fn(loss_of, metrics_of=None):
  def model_fn(features, labels, mode):
    hidden = tf1.layers.dense(features['x'], 4, kernel_initializer=seeded(1))
    logits = tf1.layers.dense(hidden, 3, kernel_initializer=seeded(2))
    loss = loss_of(features, labels, logits, hidden)
    if mode == ModeKeys.EVAL:
      ops = metrics_of(features, labels, logits, hidden) if metrics_of else {}
      return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops=ops)
    train_op = tf1.train.GradientDescentOptimizer(0.5).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def _next(features, labels, batch, static):
  ds = tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(
      batch, drop_remainder=static)
  return tf1.data.make_one_shot_iterator(ds).get_next()


def _train(model_fn, data, towers, batch, steps, start, static, kwargs):
  return train_in_session(model_fn, *data, towers, batch, steps, start=start,
                          static_batch=static, **kwargs)


def _exact_or_refused(loss_of, data=None, towers=2, batch=12, static=False,
                      **kwargs):
  """Passes when the towers refuse (ValueError while building, an
  InvalidArgumentError at a step) or train one device's variables."""
  data = data or _data()
  start, one = _train(_model_fn(loss_of), data, 1, batch, 3, None, static, {})
  try:
    _, towers_end = _train(_model_fn(loss_of), data, towers, batch, 3, start,
                           static, kwargs)
  except (ValueError, tf.errors.InvalidArgumentError):
    return
  difference = largest_difference(one, towers_end)
  assert difference < 1e-4, f'trained {difference:g} off one device silently'


def _eval_metric(loss_of, metrics_of, towers, batch, steps, data):
  """(one device's metric values, the towers'), after `steps` batches."""
  values = []
  for count in (1, towers):
    with tf.Graph().as_default():
      features, labels = _next(*data, batch, False)
      config = trainer.make_run_config(cpu_devices=count)
      model_fn = _model_fn(loss_of, metrics_of)
      if count > 1:
        spec = trainer.replicate_model_fn(model_fn)(
            features, labels, ModeKeys.EVAL, None, config)
      else:
        spec = model_fn(features=features, labels=labels, mode=ModeKeys.EVAL)
      names = sorted(spec.eval_metric_ops)
      with tf1.Session(config=config.session_config) as session:
        session.run([tf1.global_variables_initializer(),
                     tf1.local_variables_initializer()])
        for _ in range(steps):
          session.run([spec.eval_metric_ops[n][1] for n in names])
        values.append(session.run({n: spec.eval_metric_ops[n][0]
                                   for n in names}))
  return values


def _xent(labels, logits):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                        logits=logits)


def _normalised_by(normaliser):
  """A focal-style loss: every example's loss over a normaliser of the
  positives' count (0 in tower 0's shard)."""
  def loss_of(features, labels, logits, unused_hidden):
    positives = features['w']
    return (tf.reduce_sum(_xent(labels, logits) * (1.0 + positives)) /
            normaliser(tf.reduce_sum(positives), features, logits))
  return loss_of


# --------------------------------------------------------------------------
# Divisors that are no sum (nor a sum plus / bounded by a constant): the
# towers divide by the sum of their own divisors, silently.

_NOT_A_SUM = {
    # Two different sums over the examples: no one total to rebuild from.
    'two_sums': lambda s, f, l: tf.maximum(s, tf.reduce_sum(f['x'][:, 0])),
    # The max as a reduction of a stack: 5.81.
    'reduce_max_of_stack': lambda s, f, l: tf.reduce_max(tf.stack([s, 1.0])),
    # A square root of the rows: 0.48.
    'sqrt_of_rows': lambda s, f, l: tf.sqrt(tf.cast(tf.shape(l)[0],
                                                    tf.float32)),
    # A mean of the weights plus one: 58.7.
    'mean_plus_one': lambda s, f, l: tf.reduce_mean(f['w']) + 1.0,
    # The bounded divisor squared: 0.29.
    'max_squared': lambda s, f, l: tf.square(tf.maximum(s, 1.0)),
}


@pytest.mark.fast
@pytest.mark.parametrize('name', sorted(_NOT_A_SUM))
def test_a_divisor_that_is_no_sum_is_refused(name):
  with pytest.raises(ValueError, match='neither a sum over the examples'):
    _train(_model_fn(_normalised_by(_NOT_A_SUM[name])), _data(), 2, 12, 1,
           None, False, {})


# --------------------------------------------------------------------------
# Divisors written as several uses of one sum: "avoid a division by zero"
# with a select (5.81 off before they were refused, then refused), the
# tf.contrib.losses `_safe_div` form, a bounded sum used twice (0.44). The
# towers divide by the expression rebuilt on the whole batch's sum.

_ONE_SUM = {
    'where_positive_else_one': lambda s, f, l: tf.where(s > 0.0, s, 1.0),
    'safe_div': lambda s, f, l: tf.where(tf.equal(s, 0.0), tf.ones_like(s),
                                         s),
    'max_twice': lambda s, f, l: tf.maximum(s, 1.0) + tf.maximum(s, 1.0),
}


@pytest.mark.training
@pytest.mark.parametrize('name', sorted(_ONE_SUM))
def test_a_divisor_of_one_sum_used_twice_trains_as_one_device(name):
  data = _data()
  loss_of = _normalised_by(_ONE_SUM[name])
  start, one = _train(_model_fn(loss_of), data, 1, 12, 3, None, False, {})
  _, towers = _train(_model_fn(loss_of), data, 2, 12, 3, start, False, {})
  difference = largest_difference(one, towers)
  assert difference < 1e-4, difference


# --------------------------------------------------------------------------
# A static batch folds the shard's row count to a constant: a constant
# added to it makes the divisor read as a fixed scaling (a SUM), and each
# tower divides by its own rows + c.

_STATIC_COUNT_PLUS = {
    # 0.14
    'rows_plus_one': lambda y, l: tf.cast(tf.shape(l)[0], tf.float32) + 1.0,
    # An offset beyond float noise (1e-5 and below are epsilons that keep
    # the count: test_loss_reduction's guarded counts).
    'size_plus_eps': lambda y, l: tf.cast(tf.size(y), tf.float32) + 1e-3,  # .20
    'rows_plus_one_times_two': lambda y, l: (
        tf.cast(tf.shape(l)[0], tf.float32) + 1.0) * 2.0,   # 0.08
}


@pytest.mark.fast
@pytest.mark.parametrize('name', sorted(_STATIC_COUNT_PLUS))
def test_a_static_count_plus_a_constant_is_refused(name):
  def loss_of(unused_features, labels, logits, unused_hidden):
    return (tf.reduce_sum(_xent(labels, logits)) /
            _STATIC_COUNT_PLUS[name](labels, logits))
  with pytest.raises(ValueError, match="from the shard's static size"):
    _train(_model_fn(loss_of), _data(), 2, 12, 1, None, True, {})


# --------------------------------------------------------------------------
# micro_batches > 1 keeps the checked example shares: max(sum(w), 1) is 1
# in every micro-batch whose weights sum below 1, so the divisors look
# proportional to the examples and the check passes: 49.6 off (weights in
# [0, 0.1)), 41.5 (no positives at all).


@pytest.mark.training
def test_micro_batches_never_train_a_bounded_divisor_wrong():
  _exact_or_refused(_normalised_by(lambda s, f, l: tf.maximum(s, 1.0)),
                    data=_data(fractional=True), micro_batches=2)


@pytest.mark.training
def test_micro_batches_never_train_a_bounded_divisor_wrong_no_positives():
  features, labels = _data()
  features = dict(features, w=np.zeros_like(features['w']))
  _exact_or_refused(_normalised_by(lambda s, f, l: tf.maximum(s, 1.0)),
                    data=(features, labels), micro_batches=2)


# --------------------------------------------------------------------------
# The TF Object Detection API's SSD loss: (weight / normaliser) * sum, with
# normaliser = max(number of matches, 1). Refused as unknown (a false
# refusal: a ratio written as a product); passing loss_reduction='mean' as
# the error suggests trains 37.9 off one device silently.


def _ssd_loss(features, labels, logits, unused_hidden):
  normalizer = tf.maximum(tf.cast(tf.reduce_sum(features['w']), tf.float32),
                          1.0)
  classification = tf.reduce_sum(_xent(labels, logits))
  localization = tf.reduce_sum(tf.square(logits[:, 0]) * features['w'])
  return (tf.multiply(1.0 / normalizer, classification) +
          tf.multiply(2.0 / (normalizer * 4.0), localization))


@pytest.mark.training
def test_object_detection_normalised_loss_trains_as_one_device():
  data = _data()
  start, one = _train(_model_fn(_ssd_loss), data, 1, 12, 3, None, False, {})
  _, towers = _train(_model_fn(_ssd_loss), data, 2, 12, 3, start, False, {})
  assert largest_difference(one, towers) < 1e-4


@pytest.mark.training
def test_object_detection_loss_stated_a_mean_trains_as_one_device():
  data = _data()
  start, one = _train(_model_fn(_ssd_loss), data, 1, 12, 3, None, False, {})
  _, towers = _train(_model_fn(_ssd_loss), data, 2, 12, 3, start, False,
                     {'loss_reduction': 'mean'})
  assert largest_difference(one, towers) < 1e-4


# --------------------------------------------------------------------------
# EVAL: tf.compat.v1.metrics.mean of a loss of several ratios.


def _focal_plus_mean(features, labels, logits, hidden):
  return (_normalised_by(lambda s, f, l: tf.maximum(s, 1.0))(
      features, labels, logits, hidden) + tf.reduce_mean(tf.square(hidden)))


@pytest.mark.fast
def test_metric_mean_of_a_bounded_ratio_plus_a_mean_is_one_devices():
  # 7.11 below one device's value after 3 batches of 12 on 2 towers:
  # max(sum, 1) is 1 in each tower
  # without positives, so the run-time check of the shares passes.
  features, labels = _data()
  features = dict(features, w=np.zeros_like(features['w']))
  metrics_of = lambda f, y, l, h: {'m': tf1.metrics.mean(  # pylint: disable=g-long-lambda
      _focal_plus_mean(f, y, l, h))}
  one, towers = _eval_metric(_focal_plus_mean, metrics_of, 2, 12, 3,
                             (features, labels))
  np.testing.assert_allclose(towers['m'], one['m'], rtol=1e-5)


def _bert_pretraining(features, labels, logits, unused_hidden):
  weights = features['w']
  masked_lm = (tf.reduce_sum(_xent(labels, logits) * weights) /
               (tf.reduce_sum(weights) + 1e-5))
  next_sentence = tf.reduce_mean(
      _xent(tf.cast(tf.equal(labels, 0), tf.int32), logits[:, :2]))
  return masked_lm + next_sentence


@pytest.mark.fast
def test_metric_mean_of_bert_pretraining_loss_is_one_devices():
  # Its mean as an EVAL metric failed at the first step (f537efa): "The
  # metric 'm' adds several means whose divisors do not split over the
  # towers alike".
  metrics_of = lambda f, y, l, h: {'m': tf1.metrics.mean(  # pylint: disable=g-long-lambda
      _bert_pretraining(f, y, l, h))}
  one, towers = _eval_metric(_bert_pretraining, metrics_of, 2, 12, 3, _data())
  np.testing.assert_allclose(towers['m'], one['m'], rtol=1e-5)
