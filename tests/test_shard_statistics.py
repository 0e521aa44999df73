"""A loss whose rows meet a statistic of their own shard is refused.

One device computes a batch statistic (a sum, mean, max or count over the
examples) over the whole batch, a tower over its shard. Each model below
trained silently on 2 towers before the check (max variable difference
from one device after 3 steps: normalised weights 0.33, centred losses
0.087, a softmax over the batch 0.54, scaled by the batch max 0.024, by
the shard's row count 0.31); now the build refuses them, naming the op,
and the forms the message proposes train as one device. Statistics that
stay apart from the rows (a count used as a shape, whole_batch's
positions, a ratio of two sums) are not refused.
"""

import numpy as np
import pytest
import tensorflow as tf

from helpers import build_replicated, seeded, train_in_session
import trainer

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys


def _model_fn(loss_of, hidden=None):
  """A classifier whose loss is `loss_of(per-example losses, weights,
  features)`; `hidden` maps its first dense layer's output before the
  second (a batch norm)."""

  def model_fn(features, labels, mode):
    net = tf1.layers.dense(features['x'], 4, kernel_initializer=seeded(1))
    if hidden is not None:
      net = hidden(net)
    logits = tf1.layers.dense(net, 3, kernel_initializer=seeded(2))
    per = tf1.losses.sparse_softmax_cross_entropy(
        labels, logits, reduction=tf1.losses.Reduction.NONE)
    w = tf.cast(labels, tf.float32) + 0.5
    loss = loss_of(per, w, features['x'])
    train_op = tf1.train.GradientDescentOptimizer(0.5).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _moments(net):
  """Batch norm by hand, as tf_slim's non-fused batch_norm computes it."""
  mean, variance = tf.nn.moments(net, [0])
  return tf.nn.batch_normalization(net, mean, variance, None, None, 1e-3)


def _standardised(net):
  """The shard's moments used outside batch norm (advantages)."""
  mean, variance = tf.nn.moments(net, [0])
  return (net - mean) * tf.math.rsqrt(variance + 1e-3)


def _fused(net):
  """`tf.compat.v1.nn.fused_batch_norm` in training, by hand."""
  images = tf.reshape(net, [-1, 1, 1, 4])
  normalised, _, _ = tf1.nn.fused_batch_norm(
      images, tf.ones([4]), tf.zeros([4]), is_training=True)
  return tf.reshape(normalised, [-1, 4])


def _mean(per, unused_w, unused_x):
  return tf.reduce_mean(per)


_S = tf.reduce_sum
# name: (loss, the op the refusal names).
_REFUSED = {
    'normalised_weights': (lambda p, w, x: _S(p * (w / _S(w))),
                           "RealDiv 'truediv' combines the rows with Sum"),
    'centred': (lambda p, w, x: tf.reduce_mean(tf.square(
        p - tf.reduce_mean(p))), "Sub 'sub' combines the rows with Mean"),
    'softmax_over_the_batch': (lambda p, w, x: _S(tf.nn.softmax(p) * p),
                               'Softmax .* normalises over the examples'),
    'scaled_by_the_max': (lambda p, w, x: tf.reduce_mean(
        p / tf.stop_gradient(tf.reduce_max(p))),
                          'combines the rows with Max'),
    'divided_by_the_row_count': (lambda p, w, x: _S(
        p / tf.cast(tf.shape(p)[0], tf.float32)),
                                 'combines the rows with StridedSlice'),
    'divided_by_a_sum_of_ones': (lambda p, w, x: _S(p / _S(tf.ones_like(p))),
                                 'combines the rows with Sum'),
    'class_weights_from_the_batch': (lambda p, w, x: _S(p * tf.gather(
        1.0 / (_S(tf.one_hot(tf.cast(w - 0.5, tf.int32), 3), 0) + 1.0),
        tf.cast(w - 0.5, tf.int32))), 'combines the rows with'),
}
# name: (the hidden layer, the op the refusal names).
_BATCH_NORMS = {
    'hand_written_moments': (_moments, 'combines the rows with Mean'),
    'hand_written_fused_batch_norm': (
        _fused, "FusedBatchNormV3 .* batch_norm='global' does not reach"),
}


_REFUSAL = (r'combines examples with a statistic of their batch: .*{}'
            r'.*tf.reduce_sum\(loss \* w\) / tf.reduce_sum\(w\)')


@pytest.mark.fast
@pytest.mark.parametrize('mode', [ModeKeys.TRAIN, ModeKeys.EVAL])
@pytest.mark.parametrize('name', sorted(_REFUSED))
def test_rows_meeting_a_statistic_of_their_shard_are_refused(name, mode):
  loss_of, op = _REFUSED[name]
  with pytest.raises(ValueError, match=_REFUSAL.format(op)):
    # A batch of unknown size, as most input_fns give: a count folded from
    # a static shape is a constant (see shard_statistics).
    build_replicated(_model_fn(loss_of), 2, mode=mode, static_batch=False)


@pytest.mark.fast
@pytest.mark.parametrize('mode', [ModeKeys.TRAIN, ModeKeys.EVAL])
def test_a_row_count_folded_from_a_static_batch_is_refused_too(mode):
  # drop_remainder=True (BERT's training input): tf.shape(p)[0] is a
  # constant the static shape folded into, the shard's row count. In TRAIN
  # the loss's reading refuses it first, naming the folded count's op (EVAL
  # shards have no static rows).
  loss_of, op = _REFUSED['divided_by_the_row_count']
  refusal = (_REFUSAL.format(op) if mode == ModeKeys.EVAL else
             r"static size that is not the count of the elements it sums.*"
             r': strided_slice\.')
  with pytest.raises(ValueError, match=refusal):
    build_replicated(_model_fn(loss_of), 2, mode=mode, static_batch=True)


@pytest.mark.fast
def test_a_constant_equal_to_the_rows_by_chance_is_no_count():
  # The shard has 5 rows and the features 5 columns: tf.shape(x)[1] folds
  # to 5 too, but it is a column count, a fixed scaling.
  build_replicated(_model_fn(lambda p, w, x: _S(
      p / tf.cast(tf.shape(x)[1], tf.float32))), 2, batch_size=10,
                   loss_reduction='sum')


@pytest.mark.fast
@pytest.mark.parametrize('name', sorted(_BATCH_NORMS))
def test_batch_norm_the_library_does_not_reach_is_refused(name):
  hidden, op = _BATCH_NORMS[name]
  with pytest.raises(ValueError, match=_REFUSAL.format(op) +
                     r".*batch_norm='per_tower'"):
    build_replicated(_model_fn(_mean, hidden), 2)


@pytest.mark.fast
@pytest.mark.parametrize('name', sorted(_BATCH_NORMS))
def test_per_tower_batch_norm_accepts_the_shards_moments(name):
  build_replicated(_model_fn(_mean, _BATCH_NORMS[name][0]), 2,
                   batch_norm='per_tower')


@pytest.mark.fast
def test_per_tower_batch_norm_accepts_them_in_batch_norm_only():
  with pytest.raises(ValueError, match=_REFUSAL.format(
      "Sub 'sub' combines the rows with Mean 'moments/mean'")):
    build_replicated(_model_fn(_mean, _standardised), 2,
                     batch_norm='per_tower')


def _positions(per, w, x):
  """A count read from the shard's shape, used as a shape and to number
  rows (as whole_batch's labels do), not as a value."""
  rows = tf.shape(x)[0]
  flat = tf.reshape(x, [rows, -1])
  first = tf.one_hot(tf.range(rows), tf.shape(flat)[1])
  w += 0.0 * first[:, 0] * flat[:, 0]
  return _S(per * w) / _S(w)


@pytest.mark.fast
@pytest.mark.parametrize('loss_of', [
    lambda p, w, x: _S(p * w) / _S(w),
    lambda p, w, x: tf.reduce_mean(p) + 0.1 * tf.reduce_mean(tf.square(x)),
    _positions,
], ids=['ratio_of_sums', 'two_means', 'count_as_shape_and_positions'])
def test_statistics_apart_from_the_rows_are_built(loss_of):
  build_replicated(_model_fn(loss_of), 2, static_batch=False)


@pytest.mark.training
def test_the_proposed_forms_train_as_one_device():
  rng = np.random.RandomState(0)
  x = rng.randn(48, 5).astype(np.float32)
  y = rng.randint(0, 3, 48).astype(np.int32)
  for loss_of in (lambda p, w, x: _S(p * w) / _S(w), _mean):
    start, one_device = train_in_session(_model_fn(loss_of), x, y, 1, 12, 3)
    _, towers = train_in_session(_model_fn(loss_of), x, y, 2, 12, 3,
                                 start=start)
    for name, value in one_device.items():
      np.testing.assert_allclose(towers[name], value, rtol=1e-5, atol=1e-6,
                                 err_msg=name)


def _rnn_model_fn(run):
  """A classifier of the final state of `run(cell, x, lengths)`, trained
  by Adam (its slots carry the steps)."""

  def model_fn(features, labels, mode):
    cell = tf1.nn.rnn_cell.LSTMCell(4, initializer=seeded(1))
    state = run(cell, features['x'], features['len'])
    logits = tf1.layers.dense(state, 3, kernel_initializer=seeded(2))
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf1.train.AdamOptimizer(0.05).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _dynamic_rnn(cell, x, lengths):
  outputs, state = tf1.nn.dynamic_rnn(cell, x, sequence_length=lengths,
                                      dtype=tf.float32)
  # The outputs past a row's length are zeros, as on one device.
  return tf.concat([state.h, tf.reduce_sum(outputs, 1)], 1)


def _bidirectional(cell, x, lengths):
  backward = tf1.nn.rnn_cell.GRUCell(4, kernel_initializer=seeded(3))
  (forward_out, backward_out), (forward, back) = (
      tf1.nn.bidirectional_dynamic_rnn(cell, backward, x,
                                       sequence_length=lengths,
                                       dtype=tf.float32))
  return tf.concat([forward.h, back,
                    tf.reduce_sum(forward_out + backward_out, 1)], 1)


def _static_rnn(cell, x, lengths):
  _, state = tf1.nn.static_rnn(cell, tf.unstack(x, 5, 1),
                               sequence_length=lengths, dtype=tf.float32)
  return state.h


def _loop_to_the_longest(cell, x, lengths):
  """A loop to the shard's longest length that does not mask the rows
  past their own: each row reads the padding up to that length."""
  del cell
  steps = tf.reduce_max(lengths)
  _, total = tf.while_loop(lambda t, s: t < steps,
                           lambda t, s: (t + 1, s + x[:, t]),
                           [tf.constant(0), tf.zeros_like(x[:, 0])])
  return total


def _sequences():
  x = ((np.arange(240, dtype=np.float32).reshape(16, 5, 3) % 7) - 3) / 3
  lengths = np.array([5, 1, 2, 1, 3, 2, 1, 2, 4, 1, 2, 3, 1, 5, 2, 1],
                     np.int32)
  return {'x': x, 'len': lengths}, (np.arange(16) % 3).astype(np.int32)


@pytest.mark.training
@pytest.mark.parametrize('run,towers', [
    (_dynamic_rnn, 2), (_dynamic_rnn, 3), (_bidirectional, 2)])
def test_dynamic_rnn_bounded_by_the_shards_longest_trains_as_one_device(
    run, towers):
  # A batch of 8 splits into shards whose longest sequences differ (5 and
  # 4 on 2 towers): dynamic_rnn's loop runs to each shard's longest, and
  # masks every row past its own length.
  features, labels = _sequences()
  model_fn = _rnn_model_fn(run)
  start, one_device = train_in_session(model_fn, features, labels, 1, 8, 3)
  for _ in range(2):
    _, actual = train_in_session(model_fn, features, labels, towers, 8, 3,
                                 start=start)
    for name, value in one_device.items():
      np.testing.assert_allclose(actual[name], value, rtol=2e-5, atol=1e-6,
                                 err_msg=name)


@pytest.mark.fast
def test_a_loop_bounded_by_the_shards_longest_without_masks_is_refused():
  def model_fn(features, labels, mode):
    total = _loop_to_the_longest(None, tf.reshape(features['x'], [-1, 5, 1]),
                                 tf.cast(features['x'][:, 0] % 5,
                                         tf.int32) + 1)
    logits = tf1.layers.dense(total, 3)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=tf1.train.GradientDescentOptimizer(
            0.1).minimize(loss, tf1.train.get_or_create_global_step()))

  with pytest.raises(ValueError, match=r"a statistic of the shard's rows"):
    build_replicated(model_fn, 2, static_batch=False)


@pytest.mark.fast
def test_static_rnn_with_lengths_is_refused_with_the_rnn_to_use():
  # Its tf.cond shortcuts on the shard's shortest and longest lengths are
  # not followed; the refusal names dynamic_rnn.
  features, labels = _sequences()
  with tf.Graph().as_default(), pytest.raises(
      ValueError, match=r"Max 'rnn/Max'.*static_rnn with sequence_length.*"
      r'dynamic_rnn'):
    trainer.replicate_model_fn(_rnn_model_fn(_static_rnn))(
        {k: tf.constant(v[:6]) for k, v in features.items()},
        tf.constant(labels[:6]), ModeKeys.TRAIN, {},
        trainer.make_run_config(cpu_devices=2))


@pytest.mark.fast
def test_a_loop_dividing_by_a_max_named_like_dynamic_rnns_is_refused():
  # Named as dynamic_rnn names its checked lengths, but not its structure:
  # the body divides every row by the shard's longest length.
  def model_fn(features, labels, mode):
    x = tf.reshape(features['x'], [-1, 5, 1])
    lengths = tf.cast(features['x'][:, 0] % 5, tf.int32) + 1
    longest = tf.reduce_max(tf.identity(lengths, name='CheckSeqLen'))
    _, total = tf.while_loop(
        lambda t, s: t < 5,
        lambda t, s: (t + 1, s + x[:, t] / tf.cast(longest, tf.float32)),
        [tf.constant(0), tf.zeros_like(x[:, 0])])
    logits = tf1.layers.dense(total, 3)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=tf1.train.GradientDescentOptimizer(
            0.1).minimize(loss, tf1.train.get_or_create_global_step()))

  with pytest.raises(ValueError, match=r"Max 'Max', a statistic of the "
                     r"shard's rows"):
    build_replicated(model_fn, 2, static_batch=False, micro_batches=2)
