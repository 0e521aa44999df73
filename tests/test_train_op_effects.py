"""What a model_fn chains around its update happens once per step, as on one
device: a manual global_step increment, a second optimizer, an EMA of the
weights, a Saver of its own; and every tower's asserts run.
"""

import numpy as np
import pytest
import tensorflow as tf

from estimator_towers.graph import op_ledger
from helpers import (assert_same_variables, build_replicated, dataset_input_fn,
                     make_estimator, seeded, variables_of)

# What the towers' train_ops run, and how often: in the graph the product runs,
# Grappler's rewrites on (tests/README.md, "Where the time goes").
pytestmark = [pytest.mark.training, pytest.mark.graph_rewrites]

tf1 = tf.compat.v1
STEPS = 3
BATCH = 7


def _net(x, name, dtype=tf.float32, outputs=1):
  with tf1.variable_scope(name):
    hidden = tf1.layers.Dense(4, tf.nn.tanh, kernel_initializer=seeded(3),
                              dtype=dtype)(x)
    return tf1.layers.Dense(outputs, kernel_initializer=seeded(4),
                            dtype=dtype)(hidden)


def _loss(features, labels, dtype=tf.float32):
  x = tf.cast(features['x'], dtype)
  logits = _net(x, 'net', dtype)
  return tf1.losses.sigmoid_cross_entropy(
      tf.cast(labels[:, None], dtype), logits)


def gan_style_model_fn(features, labels, mode):
  """Two losses, two optimizers, global_step advanced by hand."""
  x = features['x']
  generated = _net(x, 'generator', outputs=5)
  real = _net(x, 'discriminator')
  with tf1.variable_scope('', reuse=True):
    fake = _net(generated, 'discriminator')
  d_loss = tf.reduce_mean(tf.square(real - tf.cast(labels[:, None], tf.float32))
                          + tf.square(fake))
  g_loss = tf.reduce_mean(tf.square(fake - 1.0))
  step = tf1.train.get_or_create_global_step()
  d_vars = tf1.trainable_variables('discriminator')
  g_vars = tf1.trainable_variables('generator')
  train_op = tf.group(
      tf1.train.AdamOptimizer(0.05, name='d_adam').minimize(
          d_loss, var_list=d_vars),
      tf1.train.GradientDescentOptimizer(0.3).minimize(g_loss,
                                                        var_list=g_vars),
      step.assign_add(1))
  return tf.estimator.EstimatorSpec(mode, loss=d_loss + g_loss,
                                    train_op=train_op)


def ema_model_fn(features, labels, mode, params):
  """An exponential moving average applied after the update."""
  loss = _loss(features, labels, params['dtype'])
  step = tf1.train.get_or_create_global_step()
  update = tf1.train.MomentumOptimizer(0.3, 0.9).minimize(loss, step)
  ema = tf1.train.ExponentialMovingAverage(0.8)
  with tf.control_dependencies([update]):
    train_op = ema.apply(tf1.trainable_variables())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def saver_model_fn(features, labels, mode):
  """Its own Saver, built after the optimizer as model_fns do."""
  loss = _loss(features, labels)
  train_op = tf1.train.AdamOptimizer(0.05).minimize(
      loss, tf1.train.get_or_create_global_step())
  scaffold = tf1.train.Scaffold(saver=tf1.train.Saver(max_to_keep=2))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    scaffold=scaffold)


def asserting_model_fn(features, labels, mode, params):
  """Asserts on each tower's shard around the optimizer calls."""
  loss = _loss(features, labels)
  optimizer = tf1.train.GradientDescentOptimizer(0.1)
  check = tf.debugging.assert_less(features['x'], 50.0,
                                   message='feature out of range')
  step = tf1.train.get_or_create_global_step()
  if params['where'] == 'minimize':
    with tf.control_dependencies([check]):
      train_op = optimizer.minimize(loss, step)
  else:  # Only around compute_gradients; apply_gradients outside.
    with tf.control_dependencies([check]):
      grads = optimizer.compute_gradients(loss)
    train_op = optimizer.apply_gradients(grads, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _train_both(tmp_path, data, model_fn, towers, params=None, steps=STEPS):
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y, BATCH)
  trained = []
  for name, count in (('one', 1), ('many', towers)):
    estimator = make_estimator(model_fn, tmp_path / name, count, params)
    estimator.train(input_fn, steps=steps)
    trained.append(estimator)
  return trained


@pytest.mark.parametrize('towers', [2, 3])
def test_manual_global_step_and_two_optimizers_equal_one_device(
    tmp_path, data, towers):
  one, many = _train_both(tmp_path, data, gan_style_model_fn, towers)
  assert many.get_variable_value('global_step') == STEPS
  assert_same_variables(variables_of(one), variables_of(many))


@pytest.mark.parametrize('dtype', [tf.float32, tf.float64])
def test_ema_after_the_update_equals_one_device(tmp_path, data, dtype):
  one, many = _train_both(tmp_path, data, ema_model_fn, 3, {'dtype': dtype})
  names = variables_of(many)
  assert any(n.endswith('ExponentialMovingAverage') for n in names)
  assert_same_variables(variables_of(one), names)


def test_saver_of_the_model_fn_saves_slots_and_resumes(tmp_path, data):
  one, many = _train_both(tmp_path, data, saver_model_fn, 2)
  assert any(n.endswith('/Adam') for n in variables_of(many))
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y, BATCH)
  one.train(input_fn, steps=2)
  many.train(input_fn, steps=2)  # Resumes: restores the slots too.
  assert many.get_variable_value('global_step') == STEPS + 2
  assert_same_variables(variables_of(one), variables_of(many))


@pytest.mark.parametrize('where', ['minimize', 'compute_gradients'])
def test_assert_on_the_first_towers_shard_fires(tmp_path, data, where):
  x, y = data
  x = x.copy()
  x[0, 0] = 1000.0  # First example of the first batch: tower 0's shard.
  estimator = make_estimator(asserting_model_fn, tmp_path / where, 2,
                             {'where': where})
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='feature out of range'):
    estimator.train(dataset_input_fn({'x': x}, y, BATCH), steps=1)


def _statistic_write(kind, moving, mean):
  """A write of a batch statistic that one device makes once per step."""
  if kind == 'assign_sub':
    return moving.assign_sub((moving - mean) * 0.5)
  if kind == 'assign':
    return moving.assign(moving * 0.5 + mean * 0.5)
  if kind == 'in_tf_function':
    return tf.function(lambda m: moving.assign(moving * 0.5 + m * 0.5))(mean)
  return moving.assign_add(mean)  # 'mean_added': not a sum over examples.


def statistic_model_fn(features, labels, mode, params):
  """Chains its own write of the batch mean after the optimizer."""
  loss = _loss(features, labels)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  moving = tf1.get_variable('moving', [], initializer=tf1.zeros_initializer(),
                            trainable=False)
  mean = tf.reduce_mean(features['x'])
  with tf.control_dependencies([train_op]):
    train_op = tf.group(_statistic_write(params['kind'], moving, mean))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def accumulating_model_fn(features, labels, mode):
  """Counts the examples and sums a feature after the optimizer."""
  loss = _loss(features, labels)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  seen = tf1.get_variable('seen', [], tf.int32, tf1.zeros_initializer(),
                          trainable=False, use_resource=False)
  total = tf1.get_variable('total', [], initializer=tf1.zeros_initializer(),
                           trainable=False, use_resource=True)
  with tf.control_dependencies([train_op]):
    train_op = tf.group(
        seen.assign_add(tf.size(labels)),
        total.assign_add(tf.reduce_sum(features['x'][:, 0]) * 2.0))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('kind', ['assign_sub', 'assign', 'mean_added',
                                  'in_tf_function'])
def test_write_of_a_batch_statistic_is_refused(tmp_path, data, kind):
  x, y = data
  estimator = make_estimator(statistic_model_fn, tmp_path, 2, {'kind': kind})
  with pytest.raises(ValueError, match=r'(?s)once per tower.*whole batch'
                     '.*BatchNormalization') as refused:
    estimator.train(dataset_input_fn({'x': x}, y, BATCH), steps=1)
  assert kind == 'in_tf_function' or 'variable moving' in str(refused.value)


@pytest.mark.parametrize('towers,aggregation', [
    (2, 'global_loss'), (3, 'round_robin'), (3, 'all_reduce')])
def test_count_and_sum_in_the_train_op_equal_one_device(tmp_path, data,
                                                        towers, aggregation):
  x, y = data
  x, y = x[:15], y[:15]  # Batches of 7, 7 and 1: idle towers add nothing.
  input_fn = dataset_input_fn({'x': x}, y, BATCH)
  trained = []
  for name, count in (('one', 1), ('many', towers)):
    estimator = make_estimator(accumulating_model_fn, tmp_path / name, count,
                               **({'aggregation': aggregation} if count > 1
                                  else {}))
    estimator.train(input_fn, steps=STEPS)
    trained.append(variables_of(estimator))
  one, many = trained
  assert one['seen'] == 15
  np.testing.assert_allclose(one['total'], 2 * x[:, 0].sum(), rtol=1e-5)
  assert_same_variables(one, many)


def test_towers_add_into_a_variable_in_tower_order():
  # An add into a ref variable does not lock it: towers adding at once lost
  # a shard (a loaded CI run counted 13 of the 15 examples above). In tower
  # order no add is lost, and float sums round alike in every run.
  graph, spec = build_replicated(accumulating_model_fn, 3)
  with graph.as_default():
    adds = [op for op in op_ledger.ancestors([spec.train_op])
            if op.type in ('AssignAdd', 'AssignAddVariableOp')]
  by_variable = {}
  for add in adds:
    by_variable.setdefault(add.inputs[0].op.name, []).append(add)
  del by_variable['global_step']  # The one update's: once per step.
  for writes in by_variable.values():
    writes.sort(key=lambda op: op.name)  # AssignAdd, tower_1/..., tower_2/...
    assert len(writes) == 3
    for earlier, later in zip(writes, writes[1:]):
      assert earlier in op_ledger.ancestors([later]), (earlier.name,
                                                       later.name)


# Writes from the shard's static size: with a static batch size tf.size and
# tf.shape fold into constants holding each tower's own count. Until
# 2026-11 they were taken for values free of the shard and written once, by
# the last tower: a counter counted 12 of 40 examples, silently.
_COUNTS = {
    'size_of_labels': lambda x, labels: tf.size(labels),
    'rows': lambda x, labels: tf.shape(x)[0],
    'twice_the_rows': lambda x, labels: tf.shape(x)[0] * 2,
    'sum_of_ones': lambda x, labels: tf.reduce_sum(tf.ones_like(labels)),
    'elements': lambda x, labels: tf.size(x),
    # Not counts: the same in every tower, added once per step.
    'width': lambda x, labels: tf.shape(x)[1],
    'python_width': lambda x, labels: x.shape[1],
}
_NOT_COUNTS = {
    'assigned_size': lambda v, x: v.assign(tf.size(x)),
    'size_plus_one': lambda v, x: v.assign_add(tf.size(x) + 1),
}


def static_count_model_fn(features, labels, mode, params):
  """Adds counts of its static shard into counters after the update."""
  x = features['x']
  loss = _loss(features, labels)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  writes = []
  with tf.control_dependencies([train_op]):
    for name, count in _COUNTS.items():
      counter = tf1.get_variable(name, [], tf.int32, tf1.zeros_initializer(),
                                 trainable=False)
      writes.append(counter.assign_add(count(x, labels)))
    if params:
      counter = tf1.get_variable('refused', [], tf.int32,
                                 tf1.zeros_initializer(), trainable=False)
      writes.append(_NOT_COUNTS[params['refused']](counter, x))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(writes))


def _static_batches(x, y, batch):
  def input_fn():
    return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(
        batch, drop_remainder=True).repeat()
  return input_fn


def test_counts_of_a_static_shard_equal_one_device(tmp_path, data):
  x, y = data
  input_fn = _static_batches(x, y, 10)  # Shards of 4, 3 and 3 rows.
  trained = []
  for name, towers in (('one', 1), ('many', 3)):
    estimator = make_estimator(static_count_model_fn, tmp_path / name, towers)
    estimator.train(input_fn, steps=STEPS)
    trained.append(variables_of(estimator))
  one, many = trained
  assert one['size_of_labels'] == 10 * STEPS
  assert one['width'] == x.shape[1] * STEPS
  assert_same_variables(one, many)


@pytest.mark.parametrize('refused', sorted(_NOT_COUNTS))
def test_other_writes_of_a_static_shards_size_are_refused(tmp_path, data,
                                                           refused):
  x, y = data
  estimator = make_estimator(static_count_model_fn, tmp_path, 3,
                             {'refused': refused})
  with pytest.raises(ValueError, match=r"(?s)variable refused .*tower's "
                     r'shard.*once per tower'):
    estimator.train(_static_batches(x, y, 10), steps=1)


# Counts of the static shard that read none of its tensors: Python numbers
# from its static shape, and tf.size inside a function (folded there while
# the call read nothing of the shard). Until 2026-11 written once, by the
# last tower, silently (12 of 40 for `x.shape[0]`).
_HIDDEN_COUNTS = {
    'python_rows': (lambda v, x: v.assign_add(x.shape[0]),
                    r"from no value of the tower's shard, yet tower 0 "
                    r'computes it from the constant 4 and tower 1 from the '
                    r"constant 3: it comes from the shard's static shape"),
    'ones_of_python_rows': (
        lambda v, x: v.assign_add(tf.reduce_sum(tf.ones(x.shape[:1],
                                                        tf.int32))),
        r'tower 0 computes it from the constant 4 and tower 1 from the '
        r'constant 3'),
    'size_in_a_tf_function': (
        lambda v, x: tf.function(lambda: v.assign_add(tf.size(x)))(),
        r"runs StatefulPartitionedCall .* on the tower's shard, and its "
        r'function writes a variable'),
    'size_in_a_cond': (
        lambda v, x: tf.cond(tf1.train.get_global_step() >= 0,
                             lambda: v.assign_add(tf.size(x)),
                             lambda: tf.identity(v.read_value())),
        r"runs If .* on the tower's shard, and its function writes a "
        r'variable'),
}


def hidden_count_model_fn(features, labels, mode, params):
  loss = _loss(features, labels)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  counter = tf1.get_variable('counter', [], tf.int32, tf1.zeros_initializer(),
                             trainable=False)
  with tf.control_dependencies([train_op]):
    count = _HIDDEN_COUNTS[params['count']][0](counter, features['x'])
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(train_op, count))


@pytest.mark.parametrize('count', sorted(_HIDDEN_COUNTS))
def test_counts_of_a_static_shard_hidden_from_the_walk_are_refused(
    tmp_path, data, count):
  x, y = data
  estimator = make_estimator(hidden_count_model_fn, tmp_path, 3,
                             {'count': count})
  with pytest.raises(ValueError, match=_HIDDEN_COUNTS[count][1]):
    estimator.train(_static_batches(x, y, 10), steps=1)


def test_a_towers_adds_into_a_ref_variable_lock_it():
  # A tower's own two adds into one ref variable run at once: one device's
  # do too, but four towers lost 4 of 42 counts in one run of 3 steps.
  def model_fn(features, labels, mode):
    loss = _loss(features, labels)
    seen = tf1.get_variable('seen', [], tf.int32, tf1.zeros_initializer(),
                            trainable=False, use_resource=False)
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(
        train_op, seen.assign_add(tf.size(labels)),
        seen.assign_add(tf.shape(features['x'])[0])))

  graph, spec = build_replicated(model_fn, 3)
  with graph.as_default():
    adds = [op for op in op_ledger.ancestors([spec.train_op])
            if op.type == 'AssignAdd']
  assert len(adds) == 6
  assert all(add.get_attr('use_locking') for add in adds)


# Per-example adds into a vector of counts: each example adds its own row,
# so the towers' adds are the whole batch's. Refused until 2026-11, though
# one device runs them.
_HISTOGRAMS = {
    'per_class': lambda v, x, labels: v.assign_add(
        tf.reduce_sum(tf.one_hot(labels, 4), 0)),
    'scattered_ones': lambda v, x, labels: tf1.scatter_add(
        v, labels, tf.ones_like(labels, tf.float32)),
    'scattered_values': lambda v, x, labels: tf1.scatter_add(
        v, labels, x[:, 0] * 2.0 + 1.0),
    # Refused as well until the adversary's round 31.
    'segment_sums': lambda v, x, labels: v.assign_add(
        tf.math.unsorted_segment_sum(x[:, 0], labels, 4)),
    'bincount': lambda v, x, labels: v.assign_add(tf.math.bincount(
        labels, minlength=4, maxlength=4, dtype=tf.float32)),
    'outer_products': lambda v, x, labels: v.assign_add(tf.reshape(
        tf.matmul(x[:, :2], x[:, :2], transpose_a=True), [4])),
    'subtracted': lambda v, x, labels: v.assign_sub(
        tf.reduce_sum(tf.one_hot(labels, 4), 0)),
}
_NOT_HISTOGRAMS = {
    # At the rows' positions: each shard's rows from 0.
    'at_positions': lambda v, x, labels: tf1.scatter_add(
        v, tf.range(tf.size(labels)) % 4, tf.ones_like(labels, tf.float32)),
    # Values centred on the shard's mean, not the batch's.
    'centred': lambda v, x, labels: tf1.scatter_add(
        v, labels, x[:, 0] - tf.reduce_mean(x[:, 0])),
    'per_class_mean': lambda v, x, labels: v.assign_add(
        tf.reduce_mean(tf.one_hot(labels, 4), 0)),
    # Whether a class occurs in the shard: not a sum over examples.
    'classes_present': lambda v, x, labels: v.assign_add(tf.math.bincount(
        labels, minlength=4, maxlength=4, binary_output=True,
        dtype=tf.float32)),
}


def histogram_model_fn(features, labels, mode, params):
  """Adds per-class counts and sums of its shard after the update."""
  loss = _loss(features, labels)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  labels = labels * 3  # Classes 0 and 3 of 4.
  forms = params['forms']
  writes = []
  with tf.control_dependencies([train_op]):
    for name in sorted(forms):
      counts = tf1.get_variable(name, [4], initializer=tf1.zeros_initializer(),
                                trainable=False,
                                use_resource=params['resource'])
      writes.append(forms[name](counts, features['x'], labels))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(writes))


@pytest.mark.parametrize('static', [False, True])
def test_per_example_adds_into_a_vector_equal_one_device(tmp_path, data,
                                                         static):
  x, y = data
  input_fn = (_static_batches(x, y, 10) if static else
              dataset_input_fn({'x': x}, y, 10))
  trained = []
  for name, towers in (('one', 1), ('many', 3)):
    estimator = make_estimator(
        histogram_model_fn, tmp_path / name, towers,
        {'forms': _HISTOGRAMS, 'resource': static})
    estimator.train(input_fn, steps=STEPS)
    trained.append(variables_of(estimator))
  one, many = trained
  assert one['per_class'].sum() == 10 * STEPS
  assert_same_variables(one, many)


@pytest.mark.parametrize('form', sorted(_NOT_HISTOGRAMS))
def test_adds_of_a_shards_positions_or_statistics_are_refused(tmp_path, data,
                                                              form):
  x, y = data
  estimator = make_estimator(histogram_model_fn, tmp_path, 3, {
      'forms': {form: _NOT_HISTOGRAMS[form]}, 'resource': True})
  with pytest.raises(ValueError, match=rf"(?s)variable {form} .*tower's "
                     r'shard.*once per tower'):
    estimator.train(dataset_input_fn({'x': x}, y, 10), steps=1)


# Adds a one-device model_fn may make into a counter, by what each adds up
# to over the towers. Exact: each example adds its own part.
_PER_EXAMPLE_ADDS = {
    'fill_of_the_rows': lambda x, labels: tf.reduce_sum(
        tf.fill([tf.shape(x)[0]], 1.0)),
    'ones_shaped_like_labels': lambda x, labels: tf.reduce_sum(
        tf.ones(tf.shape(labels))),
    'count_of_a_class': lambda x, labels: tf.cast(
        tf.size(tf.where(tf.equal(labels, 0))), tf.float32),
    'sum_of_a_partition': lambda x, labels: tf.reduce_sum(
        tf.dynamic_partition(x[:, 0], labels, 2)[1]),
}
# Each silently added its own shard's part until 2026-11 (adversary round
# 31): values of several rows of the shard, or of their positions.
_MIXED_ADDS = {
    'distinct_labels': lambda x, labels: tf.cast(
        tf.size(tf.unique(labels).y), tf.float32),
    'softmax_over_the_rows': lambda x, labels: tf.reduce_sum(
        tf.nn.softmax(x[:, 0]) * x[:, 0]),
    'cumulative_sum': lambda x, labels: tf.reduce_sum(tf.cumsum(x[:, 0])),
    'rolled_pairs': lambda x, labels: tf.reduce_sum(
        tf.roll(x[:, 0], 1, 0) * x[:, 0]),
    'minus_the_first_row': lambda x, labels: tf.reduce_sum(x - x[0]),
    'weighed_by_position': lambda x, labels: tf.reduce_sum(
        x[:, 0] * tf.cast(tf.range(tf.shape(x)[0]), tf.float32)),
    'count_above_the_mean': lambda x, labels: tf.reduce_sum(
        tf.cast(x[:, 0] > tf.reduce_mean(x[:, 0]), tf.float32)),
    'first_row': lambda x, labels: tf.reduce_sum(x[:1]),
    'gram_matrix': lambda x, labels: tf.reduce_sum(
        tf.matmul(x, x, transpose_b=True)),
    'rows_squared': lambda x, labels: tf.reduce_sum(
        tf.ones([tf.shape(x)[0], tf.shape(x)[0]])),
}


def added_model_fn(features, labels, mode, params):
  """Adds each of `params['forms']` into a counter of its own."""
  loss = _loss(features, labels)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  writes = []
  with tf.control_dependencies([train_op]):
    for name, form in sorted(params['forms'].items()):
      counter = tf1.get_variable(name, [], initializer=tf1.zeros_initializer(),
                                 trainable=False)
      writes.append(counter.assign_add(form(features['x'], labels)))
    if params.get('truncated'):
      counter = tf1.get_variable('truncated', [], tf.int32,
                                 tf1.zeros_initializer(), trainable=False)
      writes.append(counter.assign_add(
          tf.cast(tf.reduce_sum(features['x']), tf.int32)))
    if params.get('read_back'):
      # A total scaled by a counter the towers add into: each tower reads
      # the earlier towers' adds.
      count = tf1.get_variable('count', [], initializer=tf1.zeros_initializer(),
                               trainable=False)
      total = tf1.get_variable('read_back', [],
                               initializer=tf1.zeros_initializer(),
                               trainable=False)
      counted = count.assign_add(tf.cast(tf.size(labels), tf.float32))
      with tf.control_dependencies([counted]):
        writes.append(total.assign_add(
            tf.reduce_sum(features['x'][:, 0]) * count.read_value()))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(writes))


def test_per_example_counts_and_sums_equal_one_device(tmp_path, data):
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y, 10)
  trained = []
  for name, towers in (('one', 1), ('many', 3)):
    estimator = make_estimator(added_model_fn, tmp_path / name, towers,
                               {'forms': _PER_EXAMPLE_ADDS})
    estimator.train(input_fn, steps=STEPS)
    trained.append(variables_of(estimator))
  one, many = trained
  assert one['fill_of_the_rows'] == 10 * STEPS
  assert_same_variables(one, many)


@pytest.mark.parametrize('form', sorted(_MIXED_ADDS) + ['truncated',
                                                         'read_back'])
def test_adds_of_values_that_mix_the_shards_rows_are_refused(tmp_path, data,
                                                             form):
  x, y = data
  params = ({'forms': {}, form: True} if form in ('truncated', 'read_back')
            else {'forms': {form: _MIXED_ADDS[form]}})
  estimator = make_estimator(added_model_fn, tmp_path, 3, params)
  with pytest.raises(ValueError, match=rf"(?s)variable {form} .*tower"):
    estimator.train(dataset_input_fn({'x': x}, y, 10), steps=1)


def test_a_write_in_a_tf1_cond_on_the_shard_is_refused(tmp_path, data):
  # With control flow v1 the branch is no If op: the write's value (a
  # constant) hid that the shard chose it, and the last tower's choice
  # stood for the batch (3 for one device's 1, adversary round 31).
  def model_fn(features, labels, mode):
    loss = _loss(features, labels)
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    hits = tf1.get_variable('hits', [], initializer=tf1.zeros_initializer(),
                            trainable=False)
    with tf.control_dependencies([train_op]):
      counted = tf1.cond(tf.reduce_any(tf.equal(labels, 0)),
                         lambda: hits.assign_add(1.0),
                         lambda: tf.identity(hits))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=counted.op)

  x, y = data
  estimator = make_estimator(model_fn, tmp_path, 3)
  tf1.disable_control_flow_v2()
  try:
    with pytest.raises(ValueError, match=r"(?s)variable hits .*tf.compat.v1"
                       r".cond whose predicate .*depends on the tower's "
                       'shard'):
      estimator.train(dataset_input_fn({'x': x}, y, 10), steps=1)
  finally:
    tf1.enable_control_flow_v2()


class _SignDescent(tf1.train.GradientDescentOptimizer):
  """Its own dense update: a write the one update makes, not a tower."""

  def _apply_dense(self, grad, var):
    return var.assign_sub(0.05 * tf.sign(grad))

  _resource_apply_dense = _apply_dense


class _KerasSignDescent(tf.keras.optimizers.legacy.SGD):

  def _resource_apply_dense(self, grad, var, apply_state=None):
    return var.assign_sub(0.05 * tf.sign(grad))


def own_update_model_fn(features, labels, mode, params):
  """An optimizer subclass whose update is its own assign_sub."""
  loss = _loss(features, labels)
  step = tf1.train.get_or_create_global_step()
  if params['keras']:
    updates = _KerasSignDescent(0.1).get_updates(
        loss, tf1.trainable_variables())
    train_op = tf.group(updates, step.assign_add(1))
  else:
    train_op = _SignDescent(0.1).minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('keras', [False, True])
def test_optimizer_with_its_own_update_equals_one_device(tmp_path, data,
                                                         keras):
  one, many = _train_both(tmp_path, data, own_update_model_fn, 2,
                          {'keras': keras})
  assert_same_variables(variables_of(one), variables_of(many))


def written_loss_model_fn(features, labels, mode, params):
  """A loss read back from a variable the model_fn writes in each call.

  tensorflow/estimator's own `test_loss_metric_is_reported` does it with an
  example-free loss: `2 * assign_add(local_weight, 1)`, 2, 4, 6, ...
  """
  write = params['write']
  shape = [2] if write == 'slice_from_the_shard' else []
  kept = tf1.get_variable(
      'kept', shape, initializer=tf1.zeros_initializer(), trainable=False,
      collections=[tf1.GraphKeys.LOCAL_VARIABLES],
      dtype=tf.int64 if write == 'count_up_to' else tf.float32,
      use_resource=params.get('resource', True))
  if write == 'add':
    value = tf1.assign_add(kept, 1.0)
  elif write == 'from_the_shard':
    value = tf1.assign(kept, tf.reduce_mean(features['x'][:, 0]))
  elif write == 'from_itself':
    value = tf1.assign(kept, kept * 2.0 + 1.0)
  elif write == 'in_a_cond':
    value = tf.cond(tf.constant(True), lambda: kept.assign_add(1.0),
                    lambda: tf.identity(kept))
  elif write == 'in_a_function':
    value = tf.function(lambda: kept.assign_add(1.0))()
  elif write == 'slice_from_the_shard':
    value = kept[0].assign(tf.reduce_mean(features['x'][:, 0]))[0]
  elif write == 'count_up_to':
    value = tf.cast(tf1.count_up_to(kept, 100), tf.float32)
  elif write == 'optimizer_kernel':
    stepped = tf.raw_ops.ResourceApplyGradientDescent(
        var=kept.handle, alpha=1.0, delta=-1.0)
    with tf.control_dependencies([stepped]):
      value = kept.read_value()
  else:  # 'snapshot': the same value whichever tower writes it.
    step = tf.cast(tf1.train.get_or_create_global_step(), tf.float32)
    value = tf1.assign(kept, step + 1.0)
  loss = 2.0 * value
  if params['with_examples']:
    loss = _loss(features, labels) * value
  step = tf1.train.get_or_create_global_step()
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf1.assign_add(step, 1))


@pytest.mark.parametrize('write,resource', [
    ('add', True), ('add', False), ('from_the_shard', True),
    ('from_itself', True), ('in_a_cond', True), ('in_a_function', True),
    ('slice_from_the_shard', True), ('count_up_to', True),
    ('optimizer_kernel', True)])
@pytest.mark.parametrize('with_examples', [False, True])
def test_a_loss_read_from_a_write_each_call_repeats_is_refused(
    tmp_path, data, write, resource, with_examples):
  # Each tower's loss would advance the counter: on 2 towers the mean loss
  # of 5 evaluation batches was 11 where one device reports 6, silently
  # (also inside a tf.cond or tf.function, by a slice's assign, count_up_to
  # or an optimizer kernel the model_fn runs itself: 3, 6, 9 steps).
  x, y = data
  params = {'write': write, 'resource': resource,
            'with_examples': with_examples}
  input_fn = dataset_input_fn({'x': x}, y, BATCH, repeat=False)
  one = make_estimator(written_loss_model_fn, tmp_path / 'one', 1, params)
  one.train(input_fn, steps=1)
  if write == 'add' and not with_examples:
    assert one.evaluate(input_fn, steps=3)['loss'] == pytest.approx(4.0)
  many = make_estimator(written_loss_model_fn, tmp_path / 'many', 2, params)
  for run in (lambda: many.train(input_fn, steps=1),
              lambda: many.evaluate(input_fn, steps=3,
                                    checkpoint_path=one.latest_checkpoint())):
    with pytest.raises(ValueError, match=r"(?s)The loss '.*' is computed "
                       r'after the model_fn writes (kept|a variable inside a '
                       r'function).*once per tower'):
      run()


def counter_update_op_model_fn(features, labels, mode):
  """A counter in UPDATE_OPS, the loss ordered after UPDATE_OPS."""
  count = tf1.get_variable('count', [], initializer=tf1.zeros_initializer(),
                           trainable=False)
  tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, count.assign_add(1.0))
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    loss = _loss(features, labels) * count.read_value()
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_a_counter_in_update_ops_read_by_the_eval_loss_is_refused(
    tmp_path, data):
  # UPDATE_OPS are made one device's (moving_statistics) in TRAIN only: in
  # EVAL every tower advanced the counter (loss 1.77-2.03 for 1.45).
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y, BATCH, repeat=False)
  one = make_estimator(counter_update_op_model_fn, tmp_path / 'one', 1)
  one.train(input_fn, steps=1)
  many = make_estimator(counter_update_op_model_fn, tmp_path / 'many', 2)
  with pytest.raises(ValueError, match=r"(?s)The loss '.*' is computed after "
                     'the model_fn writes count.*once per tower'):
    many.evaluate(input_fn, steps=2, checkpoint_path=one.latest_checkpoint())


def slice_assign_model_fn(features, labels, mode):
  """A slice of a variable assigned from the shard, beside the update."""
  kept = tf1.get_variable('kept', [2], initializer=tf1.zeros_initializer(),
                          trainable=False, use_resource=True)
  loss = _loss(features, labels)
  update = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  written = kept[0].assign(tf.reduce_mean(features['x'][:, 0]))
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(update, written))


def test_a_slice_assigned_from_the_shard_in_the_train_op_is_refused(
    tmp_path, data):
  # A ResourceStridedSliceAssign was no write to tower_effects: the last
  # tower's shard wrote it (-0.031 where one device has 0.184).
  x, y = data
  many = make_estimator(slice_assign_model_fn, tmp_path, 2)
  with pytest.raises(ValueError, match=r'(?s)writes variable kept .*'
                     'ResourceStridedSliceAssign does not add up'):
    many.train(dataset_input_fn({'x': x}, y, BATCH), steps=1)


def test_a_loss_read_from_a_snapshot_each_tower_repeats_equals_one_device(
    tmp_path, data):
  # The same value whichever tower writes it: written twice is written once.
  x, y = data
  params = {'write': 'snapshot', 'with_examples': True}
  input_fn = dataset_input_fn({'x': x}, y, BATCH, repeat=False)
  losses = []
  for name, towers in (('one', 1), ('many', 2)):
    estimator = make_estimator(written_loss_model_fn, tmp_path / name, towers,
                               params)
    estimator.train(input_fn, steps=2)
    losses.append(estimator.evaluate(input_fn, steps=3)['loss'])
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def update_ops_before_loss_model_fn(features, labels, mode):
  """Batch norm whose UPDATE_OPS the loss is ordered after, as some
  model_fns write it."""
  x = tf1.layers.batch_normalization(features['x'], training=True)
  loss = tf1.losses.sigmoid_cross_entropy(
      tf.cast(labels[:, None], tf.float32), _net(x, 'net'))
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    loss = tf.identity(loss)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_a_loss_after_its_update_ops_still_equals_one_device(tmp_path, data):
  one, many = _train_both(tmp_path, data, update_ops_before_loss_model_fn, 2)
  assert_same_variables(variables_of(one), variables_of(many))
