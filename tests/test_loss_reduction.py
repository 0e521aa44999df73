"""How a tower's loss reduces its examples decides how towers add up.

`loss_reduction='auto'` reads it off the loss; these losses are written so
that a wrong weighting changes the trained weights.
"""

import numpy as np
import pytest
import tensorflow as tf

import trainer
from helpers import (assert_same_variables, build_replicated,
                     dataset_input_fn, make_estimator, seeded,
                     train_in_session, variables_of)
import estimator_towers
from estimator_towers.towers import loss_reduction
from estimator_towers.graph import op_ledger

tf1 = tf.compat.v1
Reduction = tf1.losses.Reduction
BATCH = 7


def _logits(features):
  return tf1.layers.dense(features['x'], 1, kernel_initializer=seeded(5))


def model_fn(features, labels, mode, params):
  logits = _logits(features)
  labels = tf.cast(labels[:, None], tf.float32)
  kind = params['loss']
  if kind == 'nonzero_weights':  # Divides by the number of nonzero weights.
    weights = tf.cast(features['x'][:, 1:2] > 0, tf.float32)
    loss = tf1.losses.sigmoid_cross_entropy(
        labels, logits, weights=weights,
        reduction=Reduction.SUM_BY_NONZERO_WEIGHTS)
  elif kind == 'sum_plus_l2':
    loss = tf.reduce_sum(tf.square(logits - labels)) + 0.1 * tf.add_n(
        [tf.nn.l2_loss(v) for v in tf1.trainable_variables()])
  elif kind == 'mean_plus_sum':
    loss = tf.reduce_mean(tf.square(logits - labels)) + tf.reduce_sum(logits)
  elif kind == 'v1_default':
    loss = tf1.losses.sigmoid_cross_entropy(labels, logits)
  elif kind == 'mean':
    loss = tf.reduce_mean(tf.square(logits - labels))
  step = tf1.train.get_or_create_global_step()
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _train(tmp_path, data, name, towers, loss, static_batch=False,
           **wrapper_kwargs):
  x, y = data
  estimator = make_estimator(model_fn, tmp_path / name, towers,
                             {'loss': loss}, **wrapper_kwargs)

  def static_input_fn():
    return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).repeat().batch(
        BATCH, drop_remainder=True)

  estimator.train(static_input_fn if static_batch else
                  dataset_input_fn({'x': x}, y, BATCH), steps=3)
  return estimator


@pytest.mark.training
def test_v1_losses_default_with_a_static_batch_equals_one_device(tmp_path,
                                                                 data):
  # drop_remainder=True: the mean's count is built from static shapes.
  one = _train(tmp_path, data, 'one', 1, 'v1_default', static_batch=True)
  many = _train(tmp_path, data, 'many', 3, 'v1_default', static_batch=True)
  assert_same_variables(variables_of(one), variables_of(many))


@pytest.mark.training
def test_ratio_by_nonzero_weights_equals_one_device(tmp_path, data):
  # The towers' shares of the examples are not the right weights here: each
  # tower weighs by its share of the nonzero weights.
  one = _train(tmp_path, data, 'one', 1, 'nonzero_weights')
  many = _train(tmp_path, data, 'many', 3, 'nonzero_weights')
  assert_same_variables(variables_of(one), variables_of(many))


@pytest.mark.training
def test_sum_with_regularization_is_refused(tmp_path, data):
  with pytest.raises(ValueError, match='sum over the examples plus terms'):
    _train(tmp_path, data, 'many', 2, 'sum_plus_l2')


@pytest.mark.training
def test_explicit_reduction_contradicting_the_loss_is_refused(tmp_path, data):
  with pytest.raises(ValueError, match=r"loss_reduction='sum'.*a mean"):
    _train(tmp_path, data, 'many', 2, 'mean', loss_reduction='sum')


@pytest.mark.training
def test_unreadable_loss_is_an_error_that_says_what_to_pass(tmp_path, data):
  with pytest.raises(ValueError, match="cannot tell how the loss.*"
                     "loss_reduction='mean'.*loss_reduction='sum'"):
    _train(tmp_path, data, 'many', 2, 'mean_plus_sum')


@pytest.mark.training
def test_unreadable_loss_trains_as_told(tmp_path, data):
  x, y = data
  one = _train(tmp_path, data, 'one', 1, 'mean_plus_sum')
  many = _train(tmp_path, data, 'many', 2, 'mean_plus_sum',
                loss_reduction='mean')
  # A mean plus a sum is neither: weighing as a mean differs from one device
  # (which is why 'auto' refuses to guess).
  assert not np.allclose(one.get_variable_value('dense/bias'),
                         many.get_variable_value('dense/bias'))


@pytest.mark.fast
@pytest.mark.parametrize('build,expected', [
    (lambda x: tf.reduce_sum(x), loss_reduction.SUM),
    (lambda x: 0.5 * tf.reduce_sum(tf.square(x)), loss_reduction.SUM),
    (lambda x: tf.reduce_mean(x), loss_reduction.RATIO),
    (lambda x: tf.reduce_sum(x) / tf.cast(tf.shape(x)[0], tf.float32),
     loss_reduction.RATIO),
    (lambda x: tf.reduce_sum(x) / 32.0, loss_reduction.SUM),
    # A negative log-likelihood (the canned timeseries' normal-likelihood
    # loss divides a negated sum by the count; Neg was unreadable).
    (lambda x: -tf.reduce_sum(x) / tf.cast(tf.shape(x)[0], tf.float32),
     loss_reduction.RATIO),
    (lambda x: tf.negative(tf.reduce_mean(x)), loss_reduction.RATIO),
    # A sum of per-column means is the sum over all elements by the rows.
    (lambda x: tf.reduce_sum(tf.reduce_mean(x, 0)), loss_reduction.RATIO),
    (lambda x: tf.reduce_mean(x) * tf.reduce_sum(x), loss_reduction.UNKNOWN),
    # A scaled sum over a count of the rows: Keras' activity regularizer
    # (was unknown: only a bare sum was read).
    (lambda x: 0.5 * tf.reduce_sum(tf.square(x)) /
     tf.cast(tf.shape(x)[0], tf.float32), loss_reduction.RATIO),
    (lambda x: tf.reduce_mean(x) / tf.cast(tf.shape(x)[0], tf.float32),
     loss_reduction.UNKNOWN),
    # L2Loss (tf.nn.l2_loss, Keras' l2 regularizers) is half a sum of
    # squares (was unknown).
    (lambda x: tf.nn.l2_loss(x), loss_reduction.SUM),
    # Per-column means with the columns unknown while building: their
    # first dimension compared equal to the unknown batch (read as a sum).
    (lambda x: tf.reduce_sum(tf.reduce_mean(_dynamic_columns(x), 0)),
     loss_reduction.RATIO),
    (lambda x: tf.reduce_sum(tf.reduce_sum(_dynamic_columns(x), 0)),
     loss_reduction.SUM),
    (lambda x: tf.reduce_sum(tf.reduce_max(_dynamic_columns(x), 0)),
     loss_reduction.UNKNOWN),
])
def test_analyze_reads_the_reduction(build, expected):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3])
    found = loss_reduction.analyze(
        build(x), loss_reduction.ExampleDependence(x, since=op_ledger.GRAPH_START))
  assert found.kind == expected, found.detail


def _from_a_function(value):
  """A constant a graph function returns (tf.get_static_value cannot fold
  it)."""
  return tf.function(lambda: tf.constant(value), autograph=False)()


@pytest.mark.fast
@pytest.mark.parametrize('build,expected', [
    (lambda x: tf.reduce_sum(x), loss_reduction.SUM),
    (lambda x: tf.reduce_mean(x), loss_reduction.RATIO),
    # A sum of per-column means is the sum over all elements by the rows.
    (lambda x: tf.reduce_sum(tf.reduce_mean(x, 0)), loss_reduction.RATIO),
    # tf.compat.v1.losses' default divides by a count built from shapes.
    (lambda x: tf1.losses.mean_squared_error(tf.zeros_like(x), x),
     loss_reduction.RATIO),
    (lambda x: tf.keras.losses.MeanSquaredError()(tf.zeros_like(x), x),
     loss_reduction.RATIO),
    (lambda x: tf.reduce_sum(x) / 64.0, loss_reduction.SUM),  # Not a count.
    # The rows folded to a constant: a scaled sum over them is a mean (Keras
    # divides an activity regularizer so); a mean divided by them again is
    # no share of one device's value (it was taken for a mean: 3x off on 3
    # towers).
    (lambda x: 0.5 * tf.reduce_sum(tf.square(x)) /
     tf.cast(tf.shape(x)[0], tf.float32), loss_reduction.RATIO),
    (lambda x: tf.reduce_mean(x) / tf.cast(tf.shape(x)[0], tf.float32),
     loss_reduction.UNKNOWN),
    # A constant inside the division: each tower divides it by its rows.
    (lambda x: (tf.reduce_sum(x) + 2.0 * tf.reduce_sum(
        tf1.get_variable('w', [2]))) / tf.cast(tf.shape(x)[0], tf.float32),
     loss_reduction.UNKNOWN),
    # A scalar constant equal to the rows (a sequence length) is a scaling.
    (lambda x: tf.reduce_mean(x) / 8.0, loss_reduction.RATIO),
    # One equal to the elements summed is a count (x.shape[0]) or a scaling
    # (sum / GLOBAL_BATCH): nothing tells which, loss_reduction must.
    (lambda x: tf.reduce_sum(x) / 24.0, loss_reduction.UNKNOWN),
    (lambda x: tf.reduce_sum(x) / tf.cast(tf.size(x), tf.float32),
     loss_reduction.RATIO),
    # The same constant from a graph function (PartitionedCall): its value
    # needs the graph's function library.
    (lambda x: tf.reduce_sum(x) / _from_a_function(24.0),
     loss_reduction.UNKNOWN),
])
def test_analyze_with_a_static_batch_size(build, expected):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [8, 3])
    found = loss_reduction.analyze(
        build(x), loss_reduction.ExampleDependence(x, since=op_ledger.GRAPH_START))
  assert found.kind == expected, found.detail


@pytest.mark.fast
def test_a_count_from_a_function_on_a_towers_device_is_read():
  # The function's ops keep tower 1's device, which the scratch session
  # that evaluates the count lacks (it crashed the build).
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [8, 3])
    with tf1.get_default_graph().device(lambda op: '/cpu:1'):  # A tower's.
      loss = tf.reduce_sum(x) / _from_a_function(24.0)
    found = loss_reduction.analyze(
        loss, loss_reduction.ExampleDependence(x, since=op_ledger.GRAPH_START))
  assert found.kind == loss_reduction.UNKNOWN, found.detail


def _guarded_sum(x):
  present = tf.reduce_sum(tf.cast(tf.not_equal(x[:, 0], 0.0), tf.float32))
  return tf.where(present > 0, tf.reduce_sum(tf.square(x)), 0.0)


@pytest.mark.fast
@pytest.mark.parametrize('build,kind,guarded', [
    # tf.compat.v1.losses.mean_pairwise_squared_error's form.
    (_guarded_sum, loss_reduction.SUM, True),
    # The zero on the true branch.
    (lambda x: tf.where(tf.reduce_sum(x) <= 0.0, 0.0, tf.reduce_mean(x)),
     loss_reduction.RATIO, True),
    # A condition that does not depend on the examples needs no rebuild.
    (lambda x: tf.where(tf.constant(True), tf.reduce_sum(x), 0.0),
     loss_reduction.SUM, False),
    # Not a guard: the other branch is no zero (one device adds 1 once, the
    # towers once each).
    (lambda x: tf.where(tf.reduce_sum(x) > 0.0, tf.reduce_sum(x), 1.0),
     loss_reduction.UNKNOWN, False),
    # Not a guard: a condition on a max, no sum over the examples.
    (lambda x: tf.where(tf.reduce_max(x) > 0.0, tf.reduce_sum(x), 0.0),
     loss_reduction.UNKNOWN, False),
])
def test_analyze_reads_guards_only_when_asked(build, kind, guarded):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3])
    loss = build(x)
    depends = loss_reduction.ExampleDependence(x, since=op_ledger.GRAPH_START)
    found = loss_reduction.analyze(loss, depends, guards=True)
    # Other readers (metrics, train_op writes) add the towers' values as
    # they are, which a guard of each shard's own condition breaks.
    unasked = loss_reduction.analyze(loss, depends)
  assert found.kind == kind, found.detail
  assert [g.condition is not None for g in found.guards] == (
      [True] if guarded else [False] * len(found.guards))
  if found.guards:
    assert unasked.kind == loss_reduction.UNKNOWN


@pytest.mark.fast
def test_a_guarded_loss_with_micro_batches_is_refused():
  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features['x'], 2)
    loss = _guarded_sum(logits - labels)
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(ValueError, match='micro_batches > 1 weighs the'):
    train_in_session(model_fn, _X, _Y, 2, 12, 1, micro_batches=2)


@pytest.mark.fast
def test_analyze_tells_constant_terms():
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3])
    w = tf1.get_variable('w', [3])
    found = loss_reduction.analyze(
        tf.reduce_sum(x * w) + tf.nn.l2_loss(w),
        loss_reduction.ExampleDependence(x, since=op_ledger.GRAPH_START))
  assert (found.kind, found.constant_terms) == (loss_reduction.SUM, True)
  np.testing.assert_equal(found.divisors, [])


def _mean_over_rows_model_fn(features, labels, mode, params):
  """A mean divided by the batch's rows again: no split adds up to it."""
  del params
  logits = tf1.layers.dense(features['x'], 2)
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                        logits=logits)
  loss = tf.reduce_mean(xent) / tf.cast(tf.shape(features['x'])[0],
                                        tf.float32)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
@pytest.mark.parametrize('told', ['auto', 'mean', 'sum'])
def test_a_mean_divided_by_the_rows_again_is_refused_whatever_is_told(told):
  # Either reduction it could be told trained 3x off (mean) or 9x (sum).
  with pytest.raises(ValueError, match='divides by a count of the examples '
                     '.*something that is not a sum.*nor does any '
                     'loss_reduction'):
    build_replicated(_mean_over_rows_model_fn, 3, batch_size=12,
                     loss_reduction=told)


def _dynamic_columns(t):
  """`t` as [rows, columns] with the column count unknown while building."""
  return tf.reshape(t, tf.stack([tf.shape(t)[0], -1]))


_RNG = np.random.RandomState(0)
_X = _RNG.randn(42, 5).astype(np.float32)
_Y = _RNG.randn(42, 2).astype(np.float32)


def _linear_model_fn(loss_of):
  """y ~ x @ w + b, trained by SGD on `loss_of(predictions, labels, x)`."""

  def model_fn(features, labels, mode):
    w = tf1.get_variable('w', [5, 2], initializer=seeded(1))
    b = tf1.get_variable('b', [2], initializer=tf1.constant_initializer(0.5))
    loss = loss_of(tf.matmul(features['x'], w) + b, labels, features['x'])
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _assert_trains_as_one_device(model_fn, towers, batch, x=_X, y=_Y,
                                 **kwargs):
  start, _ = train_in_session(model_fn, x, y, 1, batch, 0)
  _, one = train_in_session(model_fn, x, y, 1, batch, 3, start=start)
  _, many = train_in_session(model_fn, x, y, towers, batch, 3, start=start,
                             **kwargs)
  for name, value in one.items():
    np.testing.assert_allclose(many[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.fast
@pytest.mark.parametrize('loss_of', [
    # Old contrib.seq2seq.sequence_loss(average_across_timesteps=False),
    # summed: was read as a sum over examples (1.9x off).
    lambda p, l, x: tf.reduce_sum(tf.reduce_mean(
        _dynamic_columns(tf.square(p - l)), 0)),
    # A mean of per-column means on 7 rows: was weighed by the columns.
    lambda p, l, x: tf.reduce_mean(tf.reduce_mean(
        _dynamic_columns(tf.square(p - l)), 0)),
], ids=['sum_of_column_means', 'mean_of_column_means'])
def test_per_column_means_with_unknown_columns_equal_one_device(loss_of):
  _assert_trains_as_one_device(_linear_model_fn(loss_of), 2, 7)


# A sum of per-column weighted means: each column divides by its own sum of
# weights.
_per_column_weighted_means_model_fn = _linear_model_fn(
    lambda p, l, x: tf.reduce_sum(
        tf.reduce_sum(_dynamic_columns(tf.square(p)) *
                      _dynamic_columns(tf.abs(x[:, :2])), 0) /
        tf.reduce_sum(_dynamic_columns(tf.abs(x[:, :2])), 0)))


@pytest.mark.fast
@pytest.mark.parametrize('told', ['auto', 'mean'])
def test_a_sum_of_per_column_weighted_means_is_refused_whatever_is_told(told):
  # Each column divides by its own sum of weights: no tower weights add up
  # (was read as a sum: 3.2x off).
  with pytest.raises(ValueError, match='reduces the rows per column.*'
                     'nor does any loss_reduction.*all the elements'):
    build_replicated(_per_column_weighted_means_model_fn, 2,
                     loss_reduction=told)


def _static_batch_variables(loss_of, towers, start=None, steps=3,
                            **wrapper_kwargs):
  """(start, end) variables of SGD on static batches of 6."""
  with tf.Graph().as_default():
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(({'x': _X}, _Y)).repeat()
        .batch(6, drop_remainder=True)).get_next()
    config = trainer.make_run_config(cpu_devices=towers)
    model_fn = _linear_model_fn(loss_of)
    spec = (trainer.replicate_model_fn(model_fn, **wrapper_kwargs)(
        features, labels, tf.estimator.ModeKeys.TRAIN, None, config)
            if towers > 1 else model_fn(features, labels, 'train'))
    spec.scaffold.finalize()
    variables = {v.op.name: v for v in tf1.global_variables()}
    with tf1.Session(config=config.session_config) as session:
      session.run(spec.scaffold.init_op)
      for name, value in (start or {}).items():
        variables[name].load(value, session)
      session.run(spec.scaffold.local_init_op)
      first = session.run(variables)
      for _ in range(steps):
        session.run(spec.train_op)
      return first, session.run(variables)


def _assert_static_batch_trains_as_one_device(loss_of, towers,
                                              **wrapper_kwargs):
  """SGD on static batches: `towers` towers end where one device does."""
  start, _ = _static_batch_variables(loss_of, 1, steps=0)
  _, one = _static_batch_variables(loss_of, 1, start)
  _, many = _static_batch_variables(loss_of, towers, start, **wrapper_kwargs)
  for name, value in one.items():
    np.testing.assert_allclose(many[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def _colocated_mse(predictions, labels):
  with tf1.colocate_with(predictions):
    return tf1.losses.mean_squared_error(labels, predictions)


# Constant weights broadcast over a static batch's rows: tf.compat.v1.losses
# divide by the count of nonzero weights, which the static shapes fold to
# each tower's own (3 of a 3-row shard's 6 elements on 2 towers). Taken for
# a fixed scaling, the towers' losses were added: N times one device's step.
_BROADCAST_WEIGHTS = {
    'nonzero': lambda p, l, x: tf1.losses.mean_squared_error(
        l, p, weights=[[1.0, 0.0]]),
    'mean': lambda p, l, x: tf1.losses.mean_squared_error(
        l, p, weights=[[1.0, 0.0]], reduction=tf1.losses.Reduction.MEAN),
    'absolute': lambda p, l, x: tf1.losses.absolute_difference(
        l, p, weights=[[0.0, 2.0]]),
    # The count's ops are colocated with ops outside it, which the copy that
    # evaluates it must drop (the build failed on them).
    'colocated': lambda p, l, x: _colocated_mse(p, l),
}


@pytest.mark.fast
@pytest.mark.parametrize('towers', [2, 3])
@pytest.mark.parametrize('case', sorted(_BROADCAST_WEIGHTS))
def test_constant_weights_over_a_static_batch_equal_one_device(case, towers):
  _assert_static_batch_trains_as_one_device(_BROADCAST_WEIGHTS[case], towers)


def _rows(x):
  return tf.shape(x)[0]


# Folded from the static batch but not a count of the shard's elements:
# each tower's is no share of one device's (the first three trained
# 0.004-0.08 off one device once such sums were read as counts), nor is a
# count plus a constant (0.037 off, older), nor a value of the rows that
# equals the count at the shard's size only (older).
_NOT_A_ROW_COUNT = {
    'rows_by_rows': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                    tf.reduce_sum(tf.ones([_rows(x), _rows(x)])),
    'range_over_rows': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                       tf.reduce_sum(tf.cast(tf.range(_rows(x)), tf.float32)
                                     + 2.0),
    'ones_by_rows': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                    tf.reduce_sum(tf.ones(tf.shape(x)) /
                                  tf.cast(_rows(x), tf.float32)),
    'count_plus_one': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) / (
        tf.reduce_sum(tf.ones(tf.shape(p))) + 1.0),
    # Equal to the 6 elements of a 3-row shard, not to one device's 12:
    # these were taken for the count.
    'range_equal_to_the_count': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / tf.reduce_sum(
            tf.cast(tf.range(_rows(x)), tf.float32) + 1.0),
    'rows_squared_equal_to_the_count': lambda p, l, x: tf.reduce_sum(
        tf.square(p[:, :1] - l[:, :1])) / tf.cast(
            _rows(x) * _rows(x) // 3, tf.float32),
    # The size of another tensor of the batch (5 per row, not the 2 summed)
    # or of pairs of examples ([rows, rows]), folded while building: each
    # was taken for a fixed scaling, the towers' losses added (0.1-0.27 off
    # one device, silently). With the rows known only at run time the first
    # is read as the sum over the rows it is.
    'size_of_the_features': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / tf.cast(tf.size(x), tf.float32),
    'size_of_pairs': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                     tf.cast(tf.size(tf.matmul(x, x, transpose_b=True)),
                             tf.float32),
    'ones_like_pairs': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                       tf.reduce_sum(tf.ones_like(
                           tf.matmul(x, x, transpose_b=True))),
    'outer_ones': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                  tf.reduce_sum(tf.ones_like(p[:, 0])[:, None] *
                                tf.ones_like(p[:, 0])[None, :]),
    # A folded count written other than as a divisor (adversary round 26):
    # each was taken for a fixed scaling, silently.
    'times_a_reciprocal_size': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) * (1.0 / tf.cast(tf.size(p - l), tf.float32)),
    'sum_of_values_over_their_size': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l) / tf.cast(tf.size(p - l), tf.float32)),
    'mean_times_the_rows': lambda p, l, x: tf.reduce_mean(
        tf.square(p - l)) * tf.cast(_rows(x), tf.float32),
    'times_two_over_the_rows': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) * (2.0 / tf.cast(_rows(x), tf.float32)),
    'rows_by_unstack': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                       tf.cast(tf.unstack(tf.shape(x))[0], tf.float32),
    'rows_of_a_transpose': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                           tf.cast(tf.shape(tf.transpose(p - l))[1],
                                   tf.float32),
    'v1_weights_over_the_size': lambda p, l, x: tf1.losses.
                                compute_weighted_loss(
                                    tf.square(p - l),
                                    weights=tf.ones_like(p - l) / tf.cast(
                                        tf.size(p - l), tf.float32),
                                    reduction=tf1.losses.Reduction.SUM),
    # A floor above a shard's count, or an offset no float noise: neither
    # leaves the count as it is (max(6, 8) is 8 for 3 rows of 2).
    'count_floored_above_it': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / tf.maximum(tf.cast(tf.size(p), tf.float32), 8.0),
    'count_plus_a_hundredth': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / (tf.cast(tf.size(p), tf.float32) + 0.01),
}


@pytest.mark.fast
@pytest.mark.parametrize('case', sorted(_NOT_A_ROW_COUNT))
def test_a_folded_divisor_other_than_a_count_of_rows_is_refused(case):
  with pytest.raises(ValueError,
                     match="static size that is not the count of the elem"):
    _static_batch_variables(_NOT_A_ROW_COUNT[case], 2, steps=0)


# Folded from a static shape, but the same for every shard: fixed scalings,
# the towers' losses added as one device's terms are.
_FIXED_SIZES = {
    'size_of_a_weight': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                        tf.cast(tf.size(tf1.trainable_variables()[0]),
                                tf.float32),
    'width_of_the_features': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / tf.cast(tf.shape(x)[1], tf.float32),
    'ones_like_a_weight': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                          tf.reduce_sum(tf.ones_like(
                              tf1.trainable_variables()[0])),
    # The first dimension of a tensor free of the examples, as long as a
    # 2-tower shard (3 rows): it was taken for the shard's row count.
    'rows_of_a_table': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                       tf.cast(tf.shape(tf.ones([3, 7]) * 2.0)[0],
                               tf.float32),
    # Statistics of the shard (3 per-feature means), as long as its rows:
    # the same length on one device (adversary round 26: taken for the rows
    # or for the count, silently).
    'length_of_a_statistic': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / tf.cast(tf.shape(tf.reduce_mean(x[:, :3], 0))[0],
                                    tf.float32),
    'size_of_a_statistic': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)[:, :1]) / tf.cast(tf.size(tf.reduce_mean(
            x[:, :3], 0)), tf.float32),
    'first_axis_of_a_transposed_statistic': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / tf.cast(tf.shape(tf.transpose(x[:, :3]))[0],
                                    tf.float32),
}


# The shard's row count read from tensors shaped by the batch but free of
# its values: a mean over the rows, as on one device (briefly taken for a
# table's length during this round).
_ROW_COUNTS = {
    'rows_of_ones_like': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                         tf.cast(tf.shape(tf.ones_like(x))[0], tf.float32),
    'rows_of_a_range': lambda p, l, x: tf.reduce_sum(tf.square(p - l)) /
                       tf.cast(tf.shape(tf.range(_rows(x)))[0], tf.float32),
    'rows_of_a_mask': lambda p, l, x: tf.reduce_sum(
        tf.reduce_sum(tf.square(p - l), 1) * tf.ones([_rows(x)])) / tf.cast(
            tf.shape(tf.ones([_rows(x)]))[0], tf.float32),
    # Weights of ones shaped like the labels: [2, 2] on 3 towers' 2-row
    # shards, whose width is as long as the rows (briefly refused).
    'v1_weights_shaped_like_the_labels': lambda p, l, x: tf1.losses.
                                         mean_squared_error(
                                             l, p, weights=tf.ones(
                                                 tf.shape(l))),
}


@pytest.mark.fast
@pytest.mark.parametrize('towers', [2, 3])
@pytest.mark.parametrize('case', sorted(_ROW_COUNTS))
def test_the_rows_of_a_tensor_shaped_by_the_batch_count_them(case, towers):
  _assert_static_batch_trains_as_one_device(_ROW_COUNTS[case], towers)


# Counts guarded against zero: each was refused with a static batch size
# (as a value of the static size other than the count) while it trained as
# one device with the batch size known at run time. On 1-row shards the
# floor equals the count (max(1, 1) was read as the written 1).
_GUARDED_COUNTS = {
    'size_floored_at_one': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / tf.maximum(tf.cast(tf.size(p), tf.float32), 1.0),
    'size_plus_an_epsilon': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / (tf.cast(tf.size(p), tf.float32) + 1e-8),
    'rows_floored_at_one': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / tf.maximum(tf.cast(_rows(p), tf.float32), 1.0),
    'size_of_one_row_floored_at_one': lambda p, l, x: tf.reduce_sum(
        tf.square(p[:, 0] - l[:, 0])) / tf.maximum(
            tf.cast(tf.size(p[:, 0]), tf.float32), 1.0),
}


@pytest.mark.fast
@pytest.mark.parametrize('towers', [2, 3])
@pytest.mark.parametrize('case', sorted(_GUARDED_COUNTS))
def test_a_count_guarded_against_zero_counts_the_rows(case, towers):
  _assert_static_batch_trains_as_one_device(_GUARDED_COUNTS[case], towers)


@pytest.mark.fast
def test_a_floored_count_of_one_row_shards_counts_the_rows():
  # 6 towers: 1-row shards, where max(n, 1) holds two ones.
  _assert_static_batch_trains_as_one_device(
      _GUARDED_COUNTS['size_of_one_row_floored_at_one'], 6)


# Sums of per-column statistics (no rows) divided by a written constant:
# scalings of means, whatever the constant equals (refused while every sum
# to a scalar was checked against the shard's sizes).
_STATISTIC_SCALINGS = {
    'mean_of_two_column_means': lambda p, l, x: tf.reduce_sum(
        tf.reduce_mean(tf.square(p - l), 0)) / 2.0,
    'class_weighted_means': lambda p, l, x: tf.reduce_sum(
        tf.reduce_mean(tf.square(p - l), 0) * [0.5, 1.5]) / tf.reduce_sum(
            tf.constant([0.5, 1.5])),
}


@pytest.mark.fast
@pytest.mark.parametrize('towers', [2, 3])
@pytest.mark.parametrize('case', sorted(_STATISTIC_SCALINGS))
def test_a_statistic_over_a_written_constant_scales(case, towers):
  _assert_static_batch_trains_as_one_device(_STATISTIC_SCALINGS[case],
                                            towers)


@pytest.mark.fast
@pytest.mark.parametrize('case', sorted(_FIXED_SIZES))
def test_a_folded_size_of_what_is_no_shard_scales_as_one_device(case):
  _assert_static_batch_trains_as_one_device(_FIXED_SIZES[case], 2)


@pytest.mark.fast
def test_a_guard_on_a_folded_sum_other_than_a_count_is_refused():
  # One device's batch of 6 holds 36 >= 20, each tower's 9: the towers'
  # total (18) would choose the other branch.
  def loss_of(p, l, x):
    cells = tf.reduce_sum(tf.ones([_rows(x), _rows(x)]))
    return tf.where(cells >= 20.0, tf.reduce_sum(tf.square(p - l)), 0.0)

  with pytest.raises(ValueError, match='no function of one sum'):
    _static_batch_variables(loss_of, 2, steps=0)


# Constants equal to a size of a tower's shard (3 rows of a static batch of
# 6 on 2 towers, 6 elements): the shard's size (x.shape[0]) or a scaling,
# which only the user knows.
_CONSTANT_DIVISORS = {
    # The distribution-strategy idiom sum / GLOBAL_BATCH: a shard's [3, 2]
    # squared errors have 6 elements (was read as a mean: 2.3x off).
    'global_batch': ('sum', lambda p, l, x: tf.reduce_sum(tf.square(p - l))
                     / 6.0),
    # A constant 3.0 that equals the shard's rows summed (3.3x off).
    'scaling_as_rows': ('sum', lambda p, l, x: tf.reduce_sum(
        tf.reduce_sum(tf.square(p - l), 1)) / 3.0),
    # The rows written as a number: a mean (was 0.30 off when every
    # constant was taken for a scaling).
    'rows_from_shape': ('mean', lambda p, l, x: tf.reduce_sum(
        tf.reduce_sum(tf.square(p - l), 1)) / x.shape[0]),
    # The rows of [3, 2] squared errors, the mean of the examples' sums:
    # the rows are not their count (taken for a scaling: 0.33 off).
    'rows_of_wider_rows': ('mean', lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / x.shape[0]),
    # The same with a coefficient (the 1 / 2m of a half squared error,
    # 0.32 off), two sums (0.38 off), a sign (0.33 off).
    'half_sum_over_the_rows': ('mean', lambda p, l, x: 0.5 * tf.reduce_sum(
        tf.square(p - l)) / x.shape[0]),
    'two_sums_over_the_rows': ('mean', lambda p, l, x: (
        tf.reduce_sum(tf.square(p - l)) + tf.reduce_sum(tf.abs(p - l)))
                               / x.shape[0]),
    'negative_rows': ('mean', lambda p, l, x: -(
        tf.reduce_sum(tf.square(p - l)) / -x.shape[0])),
    'l2_loss_over_the_rows': ('mean', lambda p, l, x: tf.nn.l2_loss(p - l)
                              / x.shape[0]),
}


@pytest.mark.fast
@pytest.mark.parametrize('case', sorted(_CONSTANT_DIVISORS))
def test_a_constant_equal_to_a_size_of_the_shard_must_be_told(case):
  told, loss_of = _CONSTANT_DIVISORS[case]
  with pytest.raises(ValueError, match="divided by -?[0-9.]+, a size of "
                     "the tower's shard.*loss_reduction='mean'"):
    _static_batch_variables(loss_of, 2, steps=0)
  _assert_static_batch_trains_as_one_device(loss_of, 2, loss_reduction=told)


# Constants that are no size of a 3-row shard of [3, 2] errors: scalings,
# as one device's are.
_CONSTANT_SCALINGS = {
    'divided_by_twice_the_global_batch': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) / 12.0,
    'mean_times_a_weight': lambda p, l, x: tf.reduce_mean(
        tf.square(p - l)) * 5.0,
    'sum_times_a_weight': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) * 0.25,
    # A coefficient of a sum the rows then divide (an activity
    # regularizer's), equal to 1 / the 6 elements: a mean, scaled (was
    # refused while every product was checked).
    'coefficient_of_a_ratios_numerator': lambda p, l, x: (
        tf.reduce_sum(tf.square(p - l)) * (1 / 6.0)) / tf.cast(
            tf.shape(p)[0], tf.float32),
}


@pytest.mark.fast
@pytest.mark.parametrize('case', sorted(_CONSTANT_SCALINGS))
def test_a_constant_other_than_a_size_of_the_shard_scales(case):
  _assert_static_batch_trains_as_one_device(_CONSTANT_SCALINGS[case], 2)


# Coefficients on 3 towers' 2-row shards of [2, 2] errors, equal to a size
# of the shard or its reciprocal: scalings, as one device's are (refused
# while products were checked against the shard's sizes).
_COEFFICIENTS = {
    'half_a_sum': lambda p, l, x: 0.5 * tf.reduce_sum(tf.square(p - l)),
    'twice_a_v1_mean': lambda p, l, x: 2.0 * tf1.losses.mean_squared_error(
        l, p),
    'mean_times_four': lambda p, l, x: tf.reduce_mean(tf.square(p - l)) * 4.0,
    'twice_keras_mse': lambda p, l, x: tf.keras.losses.MeanSquaredError()(
        l, p) * 2.0,
}


@pytest.mark.fast
@pytest.mark.parametrize('case', sorted(_COEFFICIENTS))
def test_a_coefficient_equal_to_a_size_of_the_shard_scales(case):
  _assert_static_batch_trains_as_one_device(_COEFFICIENTS[case], 3)


@pytest.mark.fast
def test_weighted_mean_with_a_shard_of_zero_weights_equals_one_device():
  # Rows 0-2 of each batch of 7 weigh 0: tower 0's own mean is 0 / 0, which
  # its zero weight kept as NaN variables.
  x = _X.copy()
  x[:, 0] = np.tile([-1, -1, -1, 1, 1, 1, 1], 6)

  def loss_of(p, l, x):
    weight = tf.cast(x[:, :1] > 0, tf.float32)
    return (tf.reduce_sum(weight * tf.square(p - l)) / tf.reduce_sum(weight)
            + 0.01 * tf.add_n([tf.nn.l2_loss(v)
                               for v in tf1.trainable_variables()]))

  _assert_trains_as_one_device(_linear_model_fn(loss_of), 3, 7, x=x)


def _keras_activity_model_fn(features, labels, mode):
  layer = tf.keras.layers.Dense(
      2, kernel_initializer=seeded(1),
      activity_regularizer=tf.keras.regularizers.l2(0.3))
  predictions = layer(features['x'])
  loss = tf.reduce_mean(tf.square(predictions - labels)) + tf.add_n(
      layer.losses)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
@pytest.mark.parametrize('model_fn', [
    # Keras computes l2 with the L2Loss op: was refused as unknown.
    _keras_activity_model_fn,
    _linear_model_fn(lambda p, l, x: tf.nn.l2_loss(p - l)),
], ids=['keras_activity_l2', 'l2_loss_sum'])
def test_l2_loss_is_read_as_a_sum(model_fn):
  _assert_trains_as_one_device(model_fn, 2, 6)


_rmse_model_fn = _linear_model_fn(
    lambda p, l, x: tf.sqrt(tf.reduce_mean(tf.square(p))))


@pytest.mark.fast
@pytest.mark.parametrize('told', ['auto', 'mean'])
def test_the_square_root_of_a_mean_is_refused_whatever_is_told(told):
  # Told 'mean', an RMSE trained 0.61x off; 'auto' suggested telling it.
  with pytest.raises(ValueError, match='nonlinear function.*nor does any '
                     'loss_reduction.*mean squared error') as raised:
    build_replicated(_rmse_model_fn, 2, loss_reduction=told)
  assert "Pass loss_reduction='mean'" not in str(raised.value)


def _metric_after_one_batch(metric_fn, towers):
  """An EVAL metric's value after one batch of 10 rows (3 towers: 4, 3, 3)."""
  with tf.Graph().as_default():
    x = (np.arange(30, dtype=np.float32).reshape(10, 3) % 7) / 3.0
    y = np.array([1, 0, 0, 1, 1, 1, 0, 0, 0, 1], np.float32)
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensors(({'x': x}, y))).get_next()

    def model_fn(features, labels, mode):
      w = tf1.get_variable('w', [], initializer=tf1.constant_initializer(.5))
      scores = features['x'][:, 0] * w
      return tf.estimator.EstimatorSpec(
          mode, loss=tf.reduce_mean(scores),
          eval_metric_ops={'m': metric_fn(scores, features['x'][:, 1],
                                          labels)})

    config = estimator_towers.make_run_config(cpu_devices=towers)
    kwargs = {}
    if towers > 1:
      model_fn = estimator_towers.replicate_model_fn(model_fn)
      kwargs['config'] = config
    spec = model_fn(features=features, labels=labels,
                    mode=tf.estimator.ModeKeys.EVAL, **kwargs)
    value, update = spec.eval_metric_ops['m']
    with tf1.Session(config=config.session_config) as session:
      session.run([tf1.global_variables_initializer(),
                   tf1.local_variables_initializer()])
      session.run(update)
      return session.run(value)


@pytest.mark.fast
@pytest.mark.parametrize('towers', [2, 3])
def test_a_metric_of_a_difference_of_means_equals_one_device(towers):
  # TF-GAN's GANEstimator reports its Wasserstein critic loss,
  # mean(D(fake)) - mean(D(real)), as tf.compat.v1.metrics.mean: two means
  # per tower, which was refused ("a sum of several means").
  def critic(fake, real, unused_labels):
    return tf1.metrics.mean(tf.reduce_mean(fake) - tf.reduce_mean(real))

  expected = _metric_after_one_batch(critic, 1)
  np.testing.assert_allclose(_metric_after_one_batch(critic, towers),
                             expected, rtol=1e-6)


@pytest.mark.fast
@pytest.mark.parametrize('towers', [2, 3])
def test_a_metric_of_means_whose_counts_split_unlike_equals_one_device(
    towers):
  # A plain mean minus a mean weighted by the labels: the weights' sums do
  # not split over the towers as the rows do, so no one tower weighting is
  # exact (it was refused at run time); each mean is now divided by its
  # own whole-batch divisor.
  def skewed(fake, real, labels):
    weighted = tf.reduce_sum(real * labels) / tf.reduce_sum(labels)
    return tf1.metrics.mean(tf.reduce_mean(fake) - weighted)

  expected = _metric_after_one_batch(skewed, 1)
  np.testing.assert_allclose(_metric_after_one_batch(skewed, towers),
                             expected, rtol=1e-6)


def _weights_only_model_fn(features, labels, mode):
  """A loss of the weights alone (estimator_test's model_fns use a constant
  one): every tower computes the same value."""
  del features, labels
  w = tf1.get_variable('w', [3], initializer=tf1.constant_initializer(2.0))
  loss = tf.reduce_sum(tf.square(w - 1.0))
  train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
@pytest.mark.parametrize('towers,batch', [(2, 6), (3, 2)])
def test_a_loss_free_of_the_examples_trains_as_one_device(towers, batch):
  # It was refused ('no reduction over the examples') although any weights
  # that add up to 1 give one device's value; 3 towers on 2 rows: one idle.
  _assert_trains_as_one_device(_weights_only_model_fn, towers, batch)


@pytest.mark.fast
def test_a_loss_free_of_the_examples_told_sum_is_refused():
  # Added over the towers, the same value would count once per tower.
  with pytest.raises(ValueError, match="loss_reduction='sum', but the loss "
                     "'.*' does not depend on the examples"):
    build_replicated(_weights_only_model_fn, 2, loss_reduction='sum')


# Products by x.shape[0] (or its reciprocal) of a static batch are read as
# fixed coefficients (refusing every coefficient equal to a shard's size
# refused common losses), but named in a warning.
_SIZE_PRODUCTS = {
    'sum_times_the_rows_reciprocal': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) * (1.0 / x.shape[0]),
    'mean_times_the_rows': lambda p, l, x: tf.reduce_mean(
        tf.square(p - l)) * x.shape[0],
    # A constant tf.get_static_value does not fold: it went unnamed.
    'sum_times_a_reciprocal_op': lambda p, l, x: tf.reduce_sum(
        tf.square(p - l)) * tf.math.reciprocal(float(x.shape[0])),
}


@pytest.mark.fast
@pytest.mark.parametrize('case', sorted(_SIZE_PRODUCTS))
def test_a_product_by_a_size_of_the_shard_is_named_in_a_warning(case,
                                                                  caplog):
  with caplog.at_level('WARNING'):
    _static_batch_variables(_SIZE_PRODUCTS[case], 2, steps=0)
  assert "a size of each tower's shard" in caplog.text
  assert 'write tf.shape(x)[0]' in caplog.text
  assert f"loss_reduction='{case.split('_')[0]}'" in caplog.text


@pytest.mark.fast
def test_a_told_reduction_or_another_coefficient_warns_of_nothing(caplog):
  with caplog.at_level('WARNING'):
    _static_batch_variables(_SIZE_PRODUCTS['mean_times_the_rows'], 2,
                            steps=0, loss_reduction='mean')
    _static_batch_variables(
        lambda p, l, x: tf.reduce_sum(tf.square(p - l)) * 0.25, 2, steps=0)
  assert "a size of each tower's shard" not in caplog.text
