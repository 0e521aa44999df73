"""Reads within a step see the values from before its writes (write_order).

The failure this guards against was intermittent: BERT's optimizer reads
`global_step` for its learning rate and advances it by hand beside the
update, with nothing ordering the two, and on towers about half the runs
used the next step's learning rate. So every test here either checks the
graph - no read of a variable the step runs is left unordered with a write
of it, which fails every time - or compares with one device over many runs.
"""

import contextlib
import functools
import json

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers
import executed_order

tf1 = tf.compat.v1
TRAIN = tf.estimator.ModeKeys.TRAIN
AGGREGATIONS = ('global_loss', 'round_robin', 'all_reduce')
_BATCH, _STEPS, _RUNS = 10, 6, 10
# Substrings of the op types that write the variables they take.
_WRITE_MARKS = ('Assign', 'Apply', 'Scatter', 'Insert')


def _fixed(*shape):
  """The same start in every graph and at every re-initialisation (a
  seeded random initializer draws anew each time it runs)."""
  return np.random.RandomState(sum(shape)).randn(*shape).astype(np.float32)


def _advanced_by_hand(update, step, ordered):
  """BERT's train_op: the update and `step + 1`, grouped side by side.

  With `ordered`, the increment waits for the update: the one-device
  reference, free of any race, that every run must equal.
  """
  with tf.control_dependencies([update] if ordered else []):
    return tf.group(update, [step.assign(step + 1)])


def _hand_stepped_model_fn(features, labels, mode, ordered=False):
  """The 30-line pattern: a learning rate read from a step advanced by hand."""
  step = tf1.train.get_or_create_global_step()
  predictions = tf1.layers.dense(
      features['x'], 1, kernel_initializer=tf1.constant_initializer(0.1))
  loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
  learning_rate = 0.05 * tf.cast(step + 1, tf.float32)
  variables = tf1.trainable_variables()
  gradients = tf.gradients(loss, variables)
  update = tf1.train.GradientDescentOptimizer(learning_rate).apply_gradients(
      zip(gradients, variables))
  train_op = _advanced_by_hand(update, step, ordered)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


class _AdamWithDecay(tf1.train.Optimizer):
  """BERT's kind of optimizer, written here: Adam with decoupled weight
  decay, slots made with get_variable, and no global_step of its own."""

  def __init__(self, learning_rate, decay=0.01):
    super().__init__(False, 'AdamWithDecay')
    self._rate, self._decay = learning_rate, decay

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    del global_step, name  # The model_fn advances the step itself.
    assignments = []
    for grad, var in grads_and_vars:
      base = var.op.name
      m = tf1.get_variable(f'{base}/adam_m', var.shape, trainable=False,
                           initializer=tf.zeros_initializer())
      v = tf1.get_variable(f'{base}/adam_v', var.shape, trainable=False,
                           initializer=tf.zeros_initializer())
      grad = tf.convert_to_tensor(grad)  # Embedding rows come as slices.
      next_m = 0.9 * m + 0.1 * grad
      next_v = 0.999 * v + 0.001 * tf.square(grad)
      update = next_m / (tf.sqrt(next_v) + 1e-6)
      if 'LayerNorm' not in base and 'bias' not in base:
        update += self._decay * var
      assignments += [var.assign(var - self._rate * update),
                      m.assign(next_m), v.assign(next_v)]
    return tf.group(*assignments)


def _bert_style_model_fn(features, labels, mode, ordered=False):
  """Embeddings, layer norm, a dense head; warmup then decay from the step;
  clipped tf.gradients; the step advanced by hand, as BERT does."""
  step = tf1.train.get_or_create_global_step()
  table = tf1.get_variable('embeddings', initializer=_fixed(7, 4))
  hidden = tf.nn.embedding_lookup(table, features['ids']) + features['x']
  with tf1.variable_scope('LayerNorm'):
    gamma = tf1.get_variable('gamma', [4], initializer=tf.ones_initializer())
    beta = tf1.get_variable('beta', [4], initializer=tf.zeros_initializer())
    mean, variance = tf.nn.moments(hidden, [1], keepdims=True)
    hidden = (hidden - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta
  predictions = tf1.layers.dense(
      hidden, 1, kernel_initializer=tf1.constant_initializer(_fixed(4, 1)))
  loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
  warmup, total, base_rate = 3.0, 10.0, 0.05
  position = tf.cast(step, tf.float32)
  decayed = base_rate * (1.0 - tf.minimum(position, total) / total)
  learning_rate = tf.where(position < warmup,
                           base_rate * (position + 1) / warmup, decayed)
  variables = tf1.trainable_variables()
  gradients, _ = tf.clip_by_global_norm(tf.gradients(loss, variables), 1.0)
  update = _AdamWithDecay(learning_rate).apply_gradients(
      zip(gradients, variables), global_step=step)
  train_op = _advanced_by_hand(update, step, ordered)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _ema_beside_update_model_fn(features, labels, mode):
  """An EMA of the weights grouped beside (not after) the update."""
  predictions = tf1.layers.dense(features['x'], 1)
  loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
  update = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  ema = tf1.train.ExponentialMovingAverage(0.9)
  train_op = tf.group(update, ema.apply(tf1.trainable_variables()))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _batch_norm_keras_schedule_model_fn(features, labels, mode):
  """Batch norm's moving statistics and a Keras optimizer whose own
  `iterations` counter drives its learning-rate schedule."""
  hidden = tf1.layers.dense(features['x'], 3)
  hidden = tf1.layers.batch_normalization(hidden, training=True)
  predictions = tf1.layers.dense(hidden, 1)
  loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
  schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
  optimizer = tf.keras.optimizers.legacy.SGD(schedule)
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    update = optimizer.get_updates(loss, tf1.trainable_variables())
  step = tf1.train.get_or_create_global_step()
  train_op = tf.group(*update, step.assign_add(1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _table_counter_model_fn(features, labels, mode):
  """Counts examples in a mutable table (read, then written, each step)."""
  counts = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)
  key = tf.constant([0], tf.int64)
  seen = tf.cast(tf.shape(features['x'])[:1], tf.float32)
  predictions = tf1.layers.dense(features['x'], 1)
  loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
  with tf.control_dependencies([counts.insert(key, counts.lookup(key) + seen)]):
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _running_max_model_fn(features, labels, mode):
  """A ceiling the forward pass reads and a scatter_nd_max raises after."""
  ceiling = tf1.get_variable('ceiling', initializer=_fixed(1))
  predictions = tf1.layers.dense(features['x'], 1) * ceiling
  loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
  step = tf1.train.get_or_create_global_step()
  update = tf1.train.GradientDescentOptimizer(0.01).minimize(loss, step)
  raised = ceiling.scatter_nd_max([[0]],
                                  [1.0 + 0.1 * tf.cast(step, tf.float32)])
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(update, raised))


def _cond_snapshot_model_fn(features, labels, mode, ordered=False):
  """Lookahead-style slow weights: every other step a tf.cond copies the
  weights beside the update (one device: before it)."""
  step = tf1.train.get_or_create_global_step()
  weights = tf1.get_variable('w', initializer=_fixed(4, 1))
  slow = tf1.get_variable('slow', [4, 1], initializer=tf.zeros_initializer(),
                          trainable=False)
  loss = tf1.losses.mean_squared_error(
      labels, tf.matmul(features['x'], weights)[:, 0])
  snapshot = tf.cond(tf.equal(step % 2, 0),
                     lambda: tf.group(slow.assign(weights.read_value())),
                     tf.no_op)
  with tf.control_dependencies([snapshot] if ordered else []):
    update = tf1.train.GradientDescentOptimizer(0.05).minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(update, snapshot))


def _forward_snapshot_model_fn(features, labels, mode, ordered=False):
  """The forward pass uses what an assigning tf.cond returns: on even
  steps it snapshots the weights and returns them, else the mean of both.
  The update already waits for the cond through its data."""
  del ordered
  step = tf1.train.get_or_create_global_step()
  weights = tf1.get_variable('w', initializer=_fixed(4, 1))
  slow = tf1.get_variable('slow', [4, 1], initializer=tf.zeros_initializer(),
                          trainable=False)

  def snapshot():
    with tf.control_dependencies([slow.assign(weights.read_value())]):
      return tf.identity(weights.read_value())

  used = tf.cond(tf.equal(step % 2, 0), snapshot,
                 lambda: 0.5 * (slow.read_value() + weights.read_value()))
  loss = tf1.losses.mean_squared_error(
      labels, tf.matmul(features['x'], used)[:, 0])
  update = tf1.train.GradientDescentOptimizer(0.05).minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=update)


def _nested_function_snapshot_model_fn(features, labels, mode,
                                       ordered=False):
  """A tf.function calling another that snapshots the weights."""
  step = tf1.train.get_or_create_global_step()
  weights = tf1.get_variable('w', initializer=_fixed(4, 1))
  slow = tf1.get_variable('slow', [4, 1], initializer=tf.zeros_initializer(),
                          trainable=False)
  loss = tf1.losses.mean_squared_error(
      labels, tf.matmul(features['x'], weights)[:, 0])

  @tf.function
  def copy():
    slow.assign(weights.read_value())

  @tf.function
  def snapshot():
    copy()

  snapshot()
  call = [op for op in tf1.get_default_graph().get_operations()
          if op.type == 'StatefulPartitionedCall'][-1]
  with tf.control_dependencies([call] if ordered else []):
    update = tf1.train.GradientDescentOptimizer(0.05).minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(update, call))


def _nested_cond_snapshot_model_fn(features, labels, mode, ordered=False):
  """A snapshot under a tf.cond nested in another; both read the step
  (placed by the placer) beside the weights (placed on a device)."""
  step = tf1.train.get_or_create_global_step()
  weights = tf1.get_variable('w', initializer=_fixed(4, 1))
  slow = tf1.get_variable('slow', [4, 1], initializer=tf.zeros_initializer(),
                          trainable=False)
  loss = tf1.losses.mean_squared_error(
      labels, tf.matmul(features['x'], weights)[:, 0])
  inner = lambda: tf.cond(tf.equal(step % 3, 0), lambda: tf.group(
      slow.assign(weights.read_value())), tf.no_op)
  snapshot = tf.cond(tf.equal(step % 2, 0), lambda: tf.group(inner()),
                     tf.no_op)
  with tf.control_dependencies([snapshot] if ordered else []):
    update = tf1.train.GradientDescentOptimizer(0.05).minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(update, snapshot))


# Ways to read a ref variable that pass its buffer on (no copy).
_REF_VIEWS = {
    'read': lambda kernel: kernel,
    'strided_slice': lambda kernel: kernel[:2],
    'check_numerics': lambda kernel: tf.debugging.check_numerics(kernel, 'w'),
    'print': lambda kernel: tf1.Print(kernel, [], 'w'),
}


def _ref_sum_beside_update_model_fn(features, labels, mode, ordered=False,
                                    view='read'):
  """Sums a ref variable's weights beside the update that changes them in
  place; `ordered` sums first, the order one device's step runs."""
  with tf1.variable_scope(tf1.get_variable_scope(), use_resource=False):
    predictions = tf1.layers.dense(
        features['x'], 1, kernel_initializer=tf1.constant_initializer(0.1))
    total = tf1.get_variable('total', [], trainable=False,
                             initializer=tf1.zeros_initializer())
  loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
  kernel = tf1.trainable_variables('dense/kernel')[0]
  # Reads the `read` Identity, a ref alias, through the view.
  summed = tf.reduce_sum(_REF_VIEWS[view](kernel), name='kernel_total')
  with tf.control_dependencies([summed] if ordered else []):
    update = tf1.train.GradientDescentOptimizer(0.5).minimize(loss)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=tf.group(update, total.assign_add(summed)))


def _batches():
  rng = np.random.RandomState(0)
  x = rng.randn(_BATCH * _STEPS, 4).astype(np.float32)
  ids = rng.randint(0, 7, size=_BATCH * _STEPS).astype(np.int64)
  y = (x.sum(-1) + 0.1 * rng.randn(_BATCH * _STEPS)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices(
      ({'x': x, 'ids': ids}, y)).batch(_BATCH).repeat()


@contextlib.contextmanager
def _v1_control_flow():
  """Builds TF1 conds and while_loops inside (disable_v2_behavior's)."""
  tf1.disable_control_flow_v2()
  try:
    yield
  finally:
    tf1.enable_control_flow_v2()

def _build(model_fn, towers, aggregation='global_loss'):
  """(graph, spec, session config): `model_fn` on `towers` virtual CPUs,
  replicated unless towers == 0 (then as one device, unwrapped)."""
  graph = tf.Graph()
  with graph.as_default():
    tf1.train.get_or_create_global_step()
    features, labels = tf1.data.make_one_shot_iterator(_batches()).get_next()
    config = estimator_towers.make_run_config(cpu_devices=max(towers, 1))
    if towers:
      model_fn = estimator_towers.replicate_model_fn(
          model_fn, aggregation=aggregation)
      spec = model_fn(features, labels, TRAIN, {}, config)
    else:
      spec = model_fn(features, labels, TRAIN)
  return graph, spec, config.session_config


def _final_variables(model_fn, towers, aggregation='global_loss',
                     runs=_RUNS):
  """Per run, the variables after `_STEPS` steps from the same start."""
  graph, spec, session_config = _build(model_fn, towers, aggregation)
  with graph.as_default():
    variables = [v for v in tf1.global_variables()
                 if '_replica' not in v.op.name]
    # The scaffold's local_init_op also sets all_reduce's copies.
    scaffold = spec.scaffold
    scaffold.finalize()
    finals = []
    with tf1.Session(config=session_config) as session:
      for _ in range(runs):  # _STEPS batches are one pass of the input.
        session.run(scaffold.init_op)
        session.run(scaffold.local_init_op)
        for _ in range(_STEPS):
          session.run(spec.train_op)
        finals.append(dict(zip([v.op.name for v in variables],
                               session.run(variables))))
  return finals


def _variable_of(tensor):
  op = tensor.op
  while op.type in ('Identity', 'Enter', 'Switch') and op.inputs:
    op = op.inputs[0].op
  return op.name


def _ancestors(ops):
  found, pending = set(), list(ops)
  while pending:
    op = pending.pop()
    if op not in found:
      found.add(op)
      pending.extend([t.op for t in op.inputs] + list(op.control_inputs))
  return found


def unordered_accesses(fetches):
  """(read, write) op names of one variable with no order between them,
  among the ops the fetches run."""
  step = _ancestors(getattr(f, 'op', f) for f in fetches)
  reads, writes = {}, {}
  for op in step:
    for tensor in op.inputs:
      if tensor.dtype == tf.resource or tensor.dtype._is_ref_dtype:  # pylint: disable=protected-access
        kind = writes if any(m in op.type for m in _WRITE_MARKS) else reads
        kind.setdefault(_variable_of(tensor), set()).add(op)
  unordered = []
  for variable, writers in writes.items():
    for write in writers:
      before = _ancestors([write])
      for read in reads.get(variable, ()):
        if read not in before and write not in _ancestors([read]):
          unordered.append((read.name, write.name))
  return unordered


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
@pytest.mark.parametrize('towers', [2, 3])
@pytest.mark.parametrize('model_fn', [_hand_stepped_model_fn,
                                      _bert_style_model_fn])
def test_a_hand_advanced_step_is_read_before_it_is_written(
    model_fn, towers, aggregation):
  _, spec, _ = _build(model_fn, towers, aggregation)
  assert unordered_accesses([spec.train_op, spec.loss]) == []


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', ['global_loss', 'all_reduce'])
@pytest.mark.parametrize('model_fn', [
    _ema_beside_update_model_fn, _batch_norm_keras_schedule_model_fn,
    _table_counter_model_fn, _running_max_model_fn])
def test_no_read_of_the_step_is_left_unordered_with_its_writes(
    model_fn, aggregation):
  # EMA shadows, moving statistics, an optimizer's own step counter, a
  # hash table, loss-free counters: the family of the hand-advanced step.
  _, spec, _ = _build(model_fn, 2, aggregation)
  assert unordered_accesses([spec.train_op, spec.loss]) == []


@pytest.mark.fast
def test_the_graph_check_sees_an_unordered_read():
  # The check itself: one device's BERT-style graph leaves the learning
  # rate's read of the step unordered with the increment.
  _, spec, _ = _build(_hand_stepped_model_fn, 0)
  unordered = unordered_accesses([spec.train_op, spec.loss])
  assert any('global_step' not in read and 'Assign' in write
             for read, write in unordered), unordered


@pytest.mark.training
def test_a_model_fn_ordered_read_after_the_write_keeps_its_order():
  # assign(...).read_value() reads after the write by the model_fn's own
  # dependency: no edge may reverse it (that would be a cycle).
  def model_fn(features, labels, mode):
    step = tf1.train.get_or_create_global_step()
    advanced = step.assign_add(1)  # Returns the value read after it.
    predictions = tf1.layers.dense(
        features['x'], 1, kernel_initializer=tf1.constant_initializer(0.1))
    loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
    rate = 0.01 * tf.cast(advanced, tf.float32)
    update = tf1.train.GradientDescentOptimizer(rate).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=update)

  finals = [_final_variables(model_fn, towers, runs=2) for towers in (0, 2)]
  for run in finals[1]:
    assert run['global_step'] == _STEPS
    np.testing.assert_allclose(run['dense/kernel'],
                               finals[0][0]['dense/kernel'], rtol=1e-5)


@pytest.mark.training
@pytest.mark.parametrize('model_fn', [_hand_stepped_model_fn,
                                      _bert_style_model_fn])
def test_a_hand_advanced_step_trains_as_one_device_in_every_run(model_fn):
  expected = _final_variables(functools.partial(model_fn, ordered=True), 0,
                              runs=1)[0]
  for towers in (2, 3):
    for aggregation in AGGREGATIONS:
      for run, actual in enumerate(_final_variables(model_fn, towers,
                                                    aggregation)):
        assert sorted(actual) == sorted(expected)
        for name, value in expected.items():
          np.testing.assert_allclose(
              actual[name], value, rtol=1e-4, atol=1e-6,
              err_msg=f'{name}, {towers} towers, {aggregation}, run {run}')


@pytest.mark.fast
@pytest.mark.parametrize('task_type', ['chief', 'worker'])
def test_a_synchronous_task_reads_the_step_before_it_is_written(
    monkeypatch, task_type):
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']},
       'task': {'type': task_type, 'index': 0}}))
  _, spec, _ = _build(_bert_style_model_fn, 2, 'all_reduce')
  assert unordered_accesses([spec.train_op, spec.loss]) == []


@pytest.mark.training
def test_a_tf1_while_loop_in_the_step_builds_and_trains_as_one_device():
  # Control flow v1 has back edges (a cycle in the graph) and contexts no
  # control edge may cross: its ops are left alone, and nothing fails.
  def model_fn(features, labels, mode, ordered=False):
    step = tf1.train.get_or_create_global_step()
    predictions = tf1.layers.dense(
        features['x'], 1, kernel_initializer=tf1.constant_initializer(0.1))
    loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
    doubled = tf1.while_loop(lambda i, s: i < 2,
                             lambda i, s: (i + 1, s + tf.cast(step, tf.float32)),
                             [0, 0.0])[1]
    update = tf1.train.GradientDescentOptimizer(
        0.01 * (doubled + 1.0)).minimize(loss)
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=_advanced_by_hand(update, step, ordered))

  with _v1_control_flow():
    expected = _final_variables(functools.partial(model_fn, ordered=True), 0,
                                runs=1)[0]
    graph, _, _ = _build(model_fn, 2)
    assert any(op.type == 'NextIteration' for op in graph.get_operations())
    actual = _final_variables(model_fn, 2, runs=3)
  for run in actual:
    np.testing.assert_allclose(run['dense/kernel'], expected['dense/kernel'],
                               rtol=1e-5)


@pytest.mark.training
@pytest.mark.parametrize('towers', [0, 2])
def test_a_tf1_cond_add_runs_when_its_branch_is_taken(towers):
  # The other branch passes the ref variable on (tf.identity): the add was
  # made to wait for that read, dead whenever the add's branch runs, and on
  # towers the counter never moved (adversary round 31: 0 for 5).
  def model_fn(features, labels, mode):
    predictions = tf1.layers.dense(features['x'], 1)
    loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
    step = tf1.train.get_or_create_global_step()
    update = tf1.train.GradientDescentOptimizer(0.01).minimize(loss, step)
    counter = tf1.get_variable('counter', [], use_resource=False,
                               initializer=tf1.zeros_initializer())
    with tf.control_dependencies([update]):
      counted = tf1.cond(tf.equal(step % 2, 0),
                         lambda: tf1.assign_add(counter, 1.0),
                         lambda: tf.identity(counter))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=counted.op)

  with _v1_control_flow():
    finals = _final_variables(model_fn, towers, runs=1)
  assert finals[0]['counter'] == (_STEPS + 1) // 2


@pytest.mark.fast
def test_a_running_max_of_the_shard_is_refused():
  # scatter_nd_max of a per-shard value would run once per tower, each from
  # its own shard; a max does not add up like assign_add.
  def model_fn(features, labels, mode):
    lowest = tf1.get_variable('lowest', initializer=_fixed(1))
    predictions = tf1.layers.dense(features['x'], 1)
    loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
    update = tf1.train.GradientDescentOptimizer(0.01).minimize(
        loss, tf1.train.get_or_create_global_step())
    raised = lowest.scatter_nd_max([[0]], [tf.reduce_max(-labels)])
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      train_op=tf.group(update, raised))

  with pytest.raises(ValueError, match='ScatterNdMax does not add up'):
    _build(model_fn, 2)


def _mean_teacher_model_fn(features, labels, mode, ordered=False):
  """A teacher reading the weights' EMA shadows in the forward pass; the
  shadows' update is grouped beside the student's.

  Unwrapped, that races on one device too: the EMA's read of `w` and the
  update's write of it are unordered (1 run in 12 differed under load, and a
  CI run failed on the reference). With `ordered`, every read of `w` and its
  shadow comes before their writes, as the towers' write order makes it: the
  race-free one-device reference.
  """
  weights = tf1.get_variable('w', initializer=_fixed(4, 1))
  ema = tf1.train.ExponentialMovingAverage(0.5)
  average = ema.apply([weights])
  shadow = ema.average(weights)
  teacher = tf.matmul(features['x'], shadow)[:, 0]
  student = tf.matmul(features['x'], weights)[:, 0]
  loss = tf1.losses.mean_squared_error(labels, student) + tf.reduce_mean(
      tf.square(student - tf.stop_gradient(teacher)))
  optimizer = tf1.train.GradientDescentOptimizer(0.05)
  step = tf1.train.get_or_create_global_step()
  if not ordered:
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(
        optimizer.minimize(loss, step), average))
  gradients = optimizer.compute_gradients(loss)
  with tf.control_dependencies([g for g, _ in gradients]):
    old_weights, old_shadow = weights.read_value(), shadow.read_value()
  with tf.control_dependencies([old_weights, old_shadow]):
    # ExponentialMovingAverage's rule, from the values read before.
    new_shadow = shadow.assign(old_shadow - 0.5 * (old_shadow - old_weights))
    update = optimizer.apply_gradients(gradients, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(update, new_shadow))


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_a_mean_teacher_reading_ema_shadows_trains_as_one_device(aggregation):
  # Issue 24's audit listed EMA shadows read in the forward pass as refused
  # under all_reduce; they train as one device does under every aggregation.
  # One run per graph: re-running the initializer in the same session would
  # start the shadows from the trained weights (initialized_value).
  expected = _final_variables(
      functools.partial(_mean_teacher_model_fn, ordered=True), 0, runs=1)[0]
  for run in range(2):
    actual = _final_variables(_mean_teacher_model_fn, 3, aggregation,
                              runs=1)[0]
    for name in ('w', 'w/ExponentialMovingAverage'):
      np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5,
                                 err_msg=f'{name}, run {run}')


def _loop_increment_model_fn(features, labels, mode, ordered=False):
  """BERT's hand-stepped global_step, incremented in a TF1 while_loop."""
  step = tf1.train.get_or_create_global_step()
  rate = 0.05 * tf.cast(step + 1, tf.float32)
  predictions = tf1.layers.dense(features['x'], 1)
  loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
  weights = tf1.trainable_variables()
  update = tf1.train.GradientDescentOptimizer(rate).apply_gradients(
      zip(tf.gradients(loss, weights), weights))

  def body(i):
    with tf.control_dependencies([step.assign_add(1)]):
      return i + 1

  with tf.control_dependencies([update] if ordered else []):
    loop = tf1.while_loop(lambda i: i < 1, body, [0])
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(update, loop))


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_a_step_written_inside_a_tf1_while_loop_is_refused(aggregation):
  # No edge can enter a TF1 loop's frame: the learning rate's read of the
  # step raced the loop's increment, silently, before this refusal.
  with _v1_control_flow():
    with pytest.raises(ValueError, match=r'(?s)writes variable global_step '
                       r'.*while_loop.*enable_control_flow_v2'):
      _build(_loop_increment_model_fn, 2, aggregation)
    # Ordered by the model_fn itself (the loop waits for the update, which
    # waits for the read): nothing to refuse.
    _build(functools.partial(_loop_increment_model_fn, ordered=True), 2,
           aggregation)

@pytest.mark.fast
def test_a_shard_statistic_written_under_a_tf1_cond_names_its_variable():
  # The handle reaches the write through the cond's Switch: the refusal
  # named 'cond/ReadVariableOp/Switch' instead of the variable.
  def model_fn(features, labels, mode):
    latest = tf1.get_variable('latest_mean', initializer=_fixed(1))
    predictions = tf1.layers.dense(features['x'], 1)
    loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
    update = tf1.train.GradientDescentOptimizer(0.01).minimize(
        loss, tf1.train.get_or_create_global_step())
    written = tf1.cond(tf.reduce_sum(labels) > -1e9,
                       lambda: latest.assign([tf.reduce_mean(labels)]),
                       lambda: tf.identity(latest))
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      train_op=tf.group(update, written))

  with _v1_control_flow():
    with pytest.raises(ValueError, match='writes variable latest_mean '):
      _build(model_fn, 2)


@pytest.mark.training
def test_a_snapshot_under_a_cond_trains_as_one_device_in_every_run():
  # The reference orders the snapshot first: one device's unordered graph
  # races too (it wrote first in 1/39 to 5/25 runs under load).
  expected = _final_variables(
      functools.partial(_cond_snapshot_model_fn, ordered=True), 0, runs=1)[0]
  cases = [(_cond_snapshot_model_fn, towers, 'global_loss', 20)
           for towers in (2, 3)]
  for model_fn, towers, aggregation, runs in cases:
    for run, actual in enumerate(_final_variables(model_fn, towers,
                                                  aggregation, runs)):
      for name, value in expected.items():
        np.testing.assert_allclose(
            actual[name], value, rtol=1e-4, atol=1e-6,
            err_msg=f'{name}, {model_fn.__name__}, {towers} towers, '
            f'{aggregation}, run {run}')


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_an_assigning_cond_the_update_already_waits_for_is_not_refused(
    aggregation):
  # It was given a redundant edge, then refused as unorderable.
  _, spec, _ = _build(_forward_snapshot_model_fn, 2, aggregation)
  assert unordered_accesses([spec.train_op, spec.loss]) == []


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', ['round_robin', 'all_reduce'])
def test_a_cond_assigning_from_variables_on_several_devices_is_refused(
    aggregation):
  # Its end cannot be made to wait for its assignment (see write_order).
  with pytest.raises(ValueError, match=r'tower_1/cond .*several devices.*'
                     r"aggregation='global_loss'"):
    _build(_cond_snapshot_model_fn, 2, aggregation)


@pytest.mark.fast
@pytest.mark.parametrize('towers', [2, 3])
def test_a_snapshot_under_a_cond_reads_the_weights_before_the_update(towers):
  aggregation = 'global_loss'
  # The If reads w and writes slow: only slow is its write. Counted as a
  # write of both, its read of w was left after the update (on every tower
  # run the snapshot held the updated weights).
  _, spec, _ = _build(_cond_snapshot_model_fn, towers, aggregation)
  graph = spec.train_op.graph
  snapshots = [op for op in graph.get_operations() if op.type == 'If' and
               'split_batch' not in op.name and op in _ancestors(
                   [spec.train_op.op if hasattr(spec.train_op, 'op')
                    else spec.train_op])]
  updates = [op for op in _ancestors([spec.train_op])
             if op.type == 'ResourceApplyGradientDescent']
  assert snapshots and updates
  for snapshot in snapshots:
    read = {_variable_of(t) for t in snapshot.inputs if t.dtype == tf.resource}
    for update in updates:  # all_reduce: the tower reads its own copy.
      if _variable_of(update.inputs[0]) in read:
        assert snapshot in _ancestors([update]), (snapshot.name, update.name)
    # Lowered to TF1 control flow, the If's control edge did not wait for
    # its branch's read (10-59 of 300 runs on 3 loaded towers read late).
    assert not snapshot.get_attr('_lower_using_switch_merge'), snapshot.name


@pytest.mark.training
@pytest.mark.parametrize('model_fn', [_nested_function_snapshot_model_fn,
                                      _nested_cond_snapshot_model_fn])
def test_a_nested_snapshot_trains_as_one_device(model_fn):
  # A tf.function calling a snapshot was counted as a write of every
  # variable it takes, so it waited for the update: 200 of 200 runs read
  # new weights. The nested tf.cond, which also takes the unplaced step,
  # stayed lowered: 1-39 of 100 runs.
  expected = _final_variables(functools.partial(model_fn, ordered=True), 0,
                              runs=1)[0]
  for run, actual in enumerate(_final_variables(model_fn, 2, runs=10)):
    for name, value in expected.items():
      np.testing.assert_allclose(actual[name], value, rtol=1e-4, atol=1e-6,
                                 err_msg=f'{name}, run {run}')


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
@pytest.mark.parametrize('view', sorted(_REF_VIEWS))
def test_the_readers_of_a_ref_variables_alias_come_before_its_update(
    aggregation, view):
  # A slice, check_numerics or Print passes the buffer on: ordered after
  # them alone, the update raced their consumer (3 towers: 14/20 runs).
  _, spec, _ = _build(functools.partial(_ref_sum_beside_update_model_fn,
                                        view=view), 2, aggregation)
  step = _ancestors([spec.train_op])
  readers = [op for op in step if op.name.endswith('kernel_total')]
  updates = [op for op in step if op.type == 'ApplyGradientDescent' and
             _variable_of(op.inputs[0]) == 'dense/kernel']
  assert readers and updates
  for update in updates:
    assert set(readers) <= _ancestors([update]), update.name


@pytest.mark.training
def test_a_ref_variable_read_through_its_alias_trains_as_one_device():
  # A ref variable's read Identity shares its memory: the sum that takes
  # the Identity reads the weights when it runs, and ordering the in-place
  # update after the Identity alone let 18 of 20 runs sum updated weights.
  expected = _final_variables(
      functools.partial(_ref_sum_beside_update_model_fn, ordered=True), 0,
      runs=1)[0]
  for run, actual in enumerate(_final_variables(
      _ref_sum_beside_update_model_fn, 2, runs=10)):
    np.testing.assert_allclose(actual['total'], expected['total'], rtol=1e-5,
                               err_msg=f'run {run}')


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_a_snapshot_under_a_tf1_cond_is_read_before_the_update(aggregation):
  # disable_v2_behavior() builds TF1 conds; nothing ordered the branch's read
  # of the weights before the update (7-9 of 20 tower runs read new ones).
  with _v1_control_flow():
    _, spec, _ = _build(_cond_snapshot_model_fn, 2, aggregation)
  step = _ancestors([spec.train_op])
  reads = [op for op in step if op.type == 'ReadVariableOp' and
           op._control_flow_context is not None and  # pylint: disable=protected-access
           _variable_of(op.inputs[0]).endswith('w')]
  updates = [op for op in step if op.type == 'ResourceApplyGradientDescent']
  assert reads and updates
  for update in updates:
    if _variable_of(update.inputs[0]) in {_variable_of(r.inputs[0])
                                          for r in reads}:
      assert set(reads) & _ancestors([update]), update.name


@pytest.mark.fast
def test_an_assigning_cond_taking_the_unplaced_step_is_kept_whole():
  # The step has no device of its own; the weights have one. Left lowered,
  # the outer cond's end did not wait for the inner cond's assignment.
  _, spec, _ = _build(_nested_cond_snapshot_model_fn, 2)
  outer = [op for op in _ancestors([spec.train_op]) if op.type == 'If' and
           'split_batch' not in op.name]
  assert outer
  assert not any(op.get_attr('_lower_using_switch_merge') for op in outer)


def _executed_unordered(model_fn, towers, aggregation='global_loss'):
  """unordered_in_run over one step of the graph the session really ran."""
  graph, spec, session_config = _build(model_fn, towers, aggregation)
  with graph.as_default():
    spec.scaffold.finalize()
    with tf1.Session(config=session_config) as session:
      session.run(spec.scaffold.init_op)
      session.run(spec.scaffold.local_init_op)
      return executed_order.unordered_in_run(session,
                                             [spec.train_op, spec.loss])


@pytest.mark.fast
@pytest.mark.parametrize('control_flow', ['v2', 'v1'])
def test_the_executed_graph_reads_a_cond_snapshot_before_the_update(
    control_flow):
  # The Python graph was ordered, but TensorFlow lowers an If to
  # Switch/Merge and the edge out of it then waited for the branch's
  # pivot only: 7 of 250 loaded 3-tower runs snapshot the updated weights.
  # The partition graphs show what the executor really orders.
  if control_flow == 'v1':
    tf1.disable_control_flow_v2()
  try:
    assert _executed_unordered(_cond_snapshot_model_fn, 3) == []
  finally:
    tf1.enable_control_flow_v2()


@pytest.mark.training
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_a_tf1_cond_in_the_forward_pass_trains_as_one_device(aggregation):
  # The gradient of a TF1 cond puts its branches' gradient ops outside any
  # context, behind a Switch: the update was made to wait for one of them
  # and was skipped with it, every step (global_step stayed 0, 10/10 runs).
  with _v1_control_flow():
    expected = _final_variables(_forward_snapshot_model_fn, 0, runs=1)[0]
    actual = _final_variables(_forward_snapshot_model_fn, 2, aggregation,
                              runs=3)
  assert expected['global_step'] == _STEPS
  for run, values in enumerate(actual):
    for name, value in expected.items():
      np.testing.assert_allclose(values[name], value, rtol=1e-4, atol=1e-6,
                                 err_msg=f'{name}, run {run}')


def _cond_advanced_step_model_fn(features, labels, mode, ordered=False):
  """The hand-advanced step of BERT, under a tf.cond beside the update."""
  step = tf1.train.get_or_create_global_step()
  predictions = tf1.layers.dense(
      features['x'], 1, kernel_initializer=tf1.constant_initializer(0.1))
  loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
  variables = tf1.trainable_variables()
  update = tf1.train.GradientDescentOptimizer(
      0.05 * tf.cast(step + 1, tf.float32)).apply_gradients(
          zip(tf.gradients(loss, variables), variables))
  with tf.control_dependencies([update] if ordered else []):
    advanced = tf1.cond(step >= 0, lambda: tf.group(step.assign(step + 1)),
                        tf.no_op)
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(update, advanced))


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_a_write_inside_a_tf1_cond_waits_for_the_reads(aggregation):
  # Left unordered, the increment under a TF1 cond raced the learning
  # rate's read: 45 of 60 runs at 2-3 towers differed by up to 0.054.
  with _v1_control_flow():
    _, spec, _ = _build(_cond_advanced_step_model_fn, 2, aggregation)
  assert unordered_accesses([spec.train_op, spec.loss]) == []
