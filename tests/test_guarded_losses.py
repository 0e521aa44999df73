"""Losses guarded by tf.where on the examples, and the divisors they meet.

A guarded loss `tf.where(c, loss, 0)` trains as one device when every
tower applies the whole batch's condition, rebuilt from one sum over the
examples (loss_reduction.Guard; TF's and tf-slim's own guarded losses are
in test_real_losses.py). A condition the towers cannot rebuild (a static
shape folded to the tower's size, a time-major batch size, two sums) is
refused while the graph is built, whatever loss_reduction says. Each case
below trained silently off one device in the adversary round on the first
version of the guards (max variable difference after 3 SGD steps at
learning rate 0.01 on 2 towers, batches of 12, in the comments). Tower 0's
shard of every batch of 12 weighs 0 (`helpers.half_weighted_data`).
"""

import numpy as np
import pytest
import tensorflow as tf

from helpers import (build_replicated, half_weighted_data,
                     largest_difference, loss_model_fn, train_in_session)

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys


def _model_fn(loss_of, metrics_of=None):
  """A classifier on `loss_of(x, labels, logits)`, by SGD at 0.01."""
  return loss_model_fn(
      lambda x, y, logits, unused_hidden: loss_of(x, y, logits),
      metrics_of and (lambda x, y, logits, unused_hidden: metrics_of(
          x, y, logits)), learning_rate=0.01)


def _present(x):
  return tf.cast(x[:, 4] > 0, tf.float32)


def _xent(y, logits):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                        logits=logits)


def _weighted_xent_and_l2(x, y, logits):
  """tf.compat.v1.losses' default reduction (div_no_nan(sum, num_present))
  plus an L2 regularization loss, as get_total_loss adds them."""
  tf1.losses.sparse_softmax_cross_entropy(y, logits, weights=_present(x))
  tf1.losses.add_loss(
      0.1 * tf.add_n([tf.nn.l2_loss(v) for v in tf1.trainable_variables()]),
      tf1.GraphKeys.REGULARIZATION_LOSSES)
  return tf1.losses.get_total_loss()


def _difference(loss_of, towers=2, batch=12, data=None, static_batch=False,
                **wrapper_kwargs):
  """Max variable difference from one device after 3 steps."""
  x, y = data if data is not None else half_weighted_data()
  model_fn = _model_fn(loss_of)
  start, one = train_in_session(model_fn, x, y, 1, batch, 3,
                                static_batch=static_batch)
  _, many = train_in_session(model_fn, x, y, towers, batch, 3, start=start,
                             static_batch=static_batch, **wrapper_kwargs)
  return largest_difference(one, many)


def _assert_refused(loss_of, match, **kwargs):
  with pytest.raises(ValueError, match=match):
    _difference(loss_of, **kwargs)


_NOT_ONE_SUM = 'no function of one sum over them'


# --------------------------------------------------------------------------
# Conditions the towers cannot rebuild: refused.


@pytest.mark.training
def test_a_condition_on_the_static_row_count_is_refused():
  # 0.0456 (also on 3 towers, and with tf.size(w)): with a static batch,
  # tf.shape(x)[0] folds to the tower's 6 rows while the graph is built;
  # the rebuilt condition compared the whole batch's sum with 0.75 * 6.
  def loss_of(x, y, logits):
    w = _present(x)
    rows = tf.cast(tf.shape(x)[0], tf.float32)
    return tf.where(tf.reduce_sum(w) > 0.75 * rows,
                    tf.reduce_sum(_xent(y, logits) * w), 0.0)

  _assert_refused(loss_of, _NOT_ONE_SUM, static_batch=True)


@pytest.mark.training
def test_a_full_batch_gate_on_the_static_row_count_is_refused():
  # 0.00756, the towers training nothing: "train on full batches only",
  # tf.equal(tf.shape(x)[0], 12), folds to False in each tower (6 rows)
  # and was read as a condition the same in every tower. 0.0384 on 3
  # towers with batches of 7 and tf.shape(y)[0] >= 7.
  def loss_of(x, y, logits):
    return tf.where(tf.equal(tf.shape(x)[0], 12),
                    tf.reduce_mean(_xent(y, logits)), 0.0)

  _assert_refused(loss_of, _NOT_ONE_SUM, static_batch=True)


@pytest.mark.training
def test_a_condition_on_a_time_major_batch_size_is_refused():
  # 0.0456: a time-major model reads its batch size as
  # tf.shape(outputs)[1] (tensorflow/nmt does), which was taken for a
  # dimension other than the rows, the same in every tower (tower 0's 6).
  def loss_of(x, y, logits):
    w = _present(x)
    time_major = tf.transpose(logits)  # [classes, batch]
    batch_size = tf.cast(tf.shape(time_major)[1], tf.float32)
    return tf.where(tf.reduce_sum(w) > 0.75 * batch_size,
                    tf.reduce_sum(_xent(y, logits) * w), 0.0)

  _assert_refused(loss_of, _NOT_ONE_SUM)


@pytest.mark.training
def test_a_divisor_bounded_by_a_time_major_batch_size_is_refused():
  # 0.00264, before the guards too: max(sum(w), 0.75 * batch size) with the
  # batch size read time-major was rebuilt as max(S, 0.75 * 6).
  def loss_of(x, y, logits):
    w = _present(x)
    batch_size = tf.cast(tf.shape(tf.transpose(logits))[1], tf.float32)
    return tf.reduce_sum(_xent(y, logits) * w) / tf.maximum(
        tf.reduce_sum(w), 0.75 * batch_size)

  _assert_refused(loss_of, 'neither a sum over the examples')


@pytest.mark.training
@pytest.mark.parametrize('told', ['sum', 'mean'])
def test_a_condition_on_two_sums_is_refused_whatever_is_told(told):
  # 0.0465 told 'sum': an unreadable guard was trusted to the told
  # reduction, each tower keeping its own condition.
  def loss_of(x, y, logits):
    w = _present(x)
    both = tf.logical_and(tf.reduce_sum(w) > 0, tf.reduce_sum(logits) > 0)
    return tf.where(both, tf.reduce_sum(_xent(y, logits)), 0.0)

  _assert_refused(loss_of, _NOT_ONE_SUM, loss_reduction=told)


# --------------------------------------------------------------------------
# Exact.


@pytest.mark.training
def test_a_float64_sum_in_a_condition_keeps_its_precision():
  # 0.0813: the towers' sums were totalled in float32, where weights of
  # 1e-60 add up to 0: the condition went false and nothing trained.
  def loss_of(x, y, logits):
    w = tf.cast(_present(x), tf.float64) * 1e-60
    return tf.where(tf.reduce_sum(w) > 0, tf.reduce_sum(_xent(y, logits)),
                    0.0)

  assert _difference(loss_of) < 1e-5


@pytest.mark.training
@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
def test_a_float64_weighted_mean_of_tiny_weights_equals_one_device(
    aggregation):
  # 0.0089: the towers' divisors were totalled in float32, where weights
  # of 1e-60 add up to 0, and the towers were weighed equally although
  # their shards hold 0 and 4 of a batch's 4 weighted examples.
  def loss_of(x, y, logits):
    w = tf.cast(_present(x), tf.float64) * 1e-60
    per_example = tf.cast(_xent(y, logits), tf.float64)
    return tf.reduce_sum(per_example * w) / tf.reduce_sum(w)

  x, y = half_weighted_data()
  x[np.arange(48) % 12 < 8, 4] = -1.0
  assert _difference(loss_of, data=(x, y), aggregation=aggregation) < 1e-6


@pytest.mark.training
def test_regularization_on_a_batch_of_zero_weights_equals_one_device():
  # 7.7e-4, before the guards too: tf.compat.v1.losses' default reduction
  # (div_no_nan(sum, num_present)) plus an L2 regularization loss, on a
  # batch whose weights are all 0. One device steps on the regularization
  # alone; the towers weighed it by num_present_t / total = 0 / 0 -> 0
  # and dropped it. They now weigh it equally when the total is 0.
  x, y = half_weighted_data()
  x[:12, 4] = -1.0  # The first batch: every weight 0.
  assert _difference(_weighted_xent_and_l2, data=(x, y)) < 1e-5


@pytest.mark.training
@pytest.mark.parametrize('towers,batch,kwargs', [
    (3, 7, {'aggregation': 'all_reduce'}),
    (3, 2, {'aggregation': 'round_robin'}),  # An idle tower.
])
def test_nested_guards_with_regularization_equal_one_device(towers, batch,
                                                            kwargs):
  # A guard on the logits' sum inside a guard on the weights' sum, around
  # a mean with divisor where(s > 0, s, 1), plus L2 outside the guards.
  def loss_of(x, y, logits):
    w = _present(x)
    s = tf.reduce_sum(w)
    mean = tf.reduce_sum(_xent(y, logits) * w) / tf.where(s > 0, s, 1.0)
    inner = tf.where(tf.reduce_sum(logits) > 0.0, 0.0, mean)
    reg = 0.1 * tf.add_n([tf.nn.l2_loss(v)
                          for v in tf1.trainable_variables()])
    return tf.where(s > 0, inner, tf.zeros_like(inner)) + reg

  assert _difference(loss_of, towers=towers, batch=batch, **kwargs) < 1e-5


@pytest.mark.fast
def test_a_metric_of_a_guarded_value_is_refused():
  # Metrics add the towers' values as they are: a guard would keep each
  # shard's own condition.
  def loss_of(x, y, logits):
    return tf.reduce_mean(_xent(y, logits))

  def metrics_of(x, y, logits):
    w = _present(x)
    s = tf.reduce_sum(w)
    guarded = tf.where(s > 0, tf.reduce_sum(_xent(y, logits) * w) /
                       tf.where(tf.equal(s, 0), tf.ones_like(s), s), 0.0)
    return {'guarded': tf1.metrics.mean(guarded)}

  with pytest.raises(ValueError, match='guarded'):
    build_replicated(_model_fn(loss_of, metrics_of), 2, mode=ModeKeys.EVAL,
                     static_batch=False)


# --------------------------------------------------------------------------
# Widths of the shard (a dimension other than the rows) are the same in
# every tower: a fixed scaling, a constant of a guard's condition. The
# second adversary round (2 towers, 3 steps at 0.01).


def _per_output_squared_error(x, y, logits):
  """A sum of squared errors over the number of outputs (3)."""
  del x
  width = tf.cast(tf.shape(logits)[1], tf.float32)
  return tf.reduce_sum(tf.square(logits - tf.one_hot(y, 3))) / width


@pytest.mark.training
def test_a_sum_over_a_width_equal_to_the_rows_equals_one_device():
  # 0.0496: static batches of 6 give shards of 3 rows, and the logits'
  # folded width 3 was taken for the shard's row count (a mean).
  assert _difference(_per_output_squared_error, batch=6,
                     static_batch=True) < 1e-5


@pytest.mark.training
def test_a_sum_over_a_known_width_equals_one_device():
  # Refused with batches of unknown size ("divides by 'Cast', which is
  # neither a sum over the examples ..."): a divisor of the shard's shape
  # was taken for a count of its examples.
  assert _difference(_per_output_squared_error) < 1e-5


def _guard_on_the_width(x, y, logits):
  w = _present(x)
  width = tf.cast(tf.shape(x)[1], tf.float32)
  return tf.where(tf.reduce_sum(w) > 0.5 * width,
                  tf.reduce_sum(_xent(y, logits) * w), 0.0)


@pytest.mark.training
@pytest.mark.parametrize('static_batch', [False, True])
def test_a_guard_on_a_known_width_equals_one_device(static_batch):
  # Refused with a static batch: every folded shape was taken for one that
  # may hold the tower's rows, whatever dimension it picked.
  assert _difference(_guard_on_the_width, static_batch=static_batch) < 1e-5


def _zero_weights_first(x):
  x = x.copy()
  x[:, 4] = 1.0
  x[:12, 4] = -1.0  # The first 12 examples weigh 0.
  return x


@pytest.mark.training
def test_micro_batches_with_a_batch_of_zero_weights_equal_one_device():
  # Failed at run time ("divides by a count that is not proportional to
  # the micro-batches' numbers of examples"): with every weight 0 the
  # divisors' shares are 0 / 0, and any weights adding up to one are
  # exact; the check now passes such a batch.
  x, y = half_weighted_data()
  assert _difference(_weighted_xent_and_l2, data=(_zero_weights_first(x), y),
                     micro_batches=2) < 1e-5


@pytest.mark.training
@pytest.mark.parametrize('towers,batch,kwargs', [
    (3, 7, {'aggregation': 'all_reduce'}),
    (3, 2, {'aggregation': 'round_robin'}),  # An idle tower per batch.
])
def test_a_bounded_mean_with_l2_on_zero_weight_batches_equals_one_device(
    towers, batch, kwargs):
  x, y = half_weighted_data()

  def loss_of(x, y, logits):
    w = _present(x)
    reg = 0.1 * tf.add_n([tf.nn.l2_loss(v) for v in tf1.trainable_variables()])
    return tf.reduce_sum(_xent(y, logits) * w) / tf.maximum(
        tf.reduce_sum(w), 1.0) + reg

  assert _difference(loss_of, towers=towers, batch=batch,
                     data=(_zero_weights_first(x), y), **kwargs) < 1e-5
