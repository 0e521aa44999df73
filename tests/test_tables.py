"""Mutable lookup tables the model_fn writes are shared by the towers.

One device has one table; the towers must write (and checkpoint) that one
table, not one per tower, with one device's keys and values.
"""

import numpy as np
import pytest
import tensorflow as tf

from helpers import (assert_same_variables, dataset_input_fn,
                     make_estimator, seeded, variables_of)

pytestmark = pytest.mark.training

tf1 = tf.compat.v1
STEPS = 3
BATCH = 7  # Divides by neither 2 nor 3 towers.


def _table(kind, name):
  if kind == 'mutable':
    return tf.lookup.experimental.MutableHashTable(
        tf.int64, tf.float32, default_value=-1.0, name=name)
  return tf.lookup.experimental.DenseHashTable(
      tf.int64, tf.float32, default_value=-1.0, empty_key=-1,
      deleted_key=-2, initial_num_buckets=16, name=name)


def table_model_fn(features, labels, mode, params):
  """Records the last row seen per id, and counts ids, in two tables."""
  ids = features['id']
  logits = tf1.layers.dense(features['x'], 1, kernel_initializer=seeded(3))
  # A read-only table beside them: per-tower copies are harmless.
  static = tf.lookup.StaticHashTable(
      tf.lookup.KeyValueTensorInitializer(
          tf.constant([0, 1], tf.int64), tf.constant([2.0, 3.0])), 1.0)
  logits *= tf.expand_dims(static.lookup(ids % 2), 1)
  last_row = _table(params['table'], 'last_row')
  counts = _table(params['table'], 'counts')
  loss = tf1.losses.sigmoid_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        'last_row': tf1.metrics.mean(last_row.lookup(ids)),
        'counts': tf1.metrics.mean(counts.lookup(ids))})
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  # Ids repeat within a batch: the last row of an id wins, as one insert
  # of the whole batch does.
  record = last_row.insert(ids, features['row'])
  # Lookup then insert: every tower must see the table before the step.
  seen = counts.lookup(ids)
  with tf.control_dependencies([seen]):
    count = counts.insert(ids, tf.maximum(seen, 0.0) + 1.0)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=tf.group(train_op, record, count))


def _input_fn(data, repeat=True, batch=BATCH):
  x, y = data
  n = len(x)
  # Repeated ids in each batch; with batches of 2, the two rows share one.
  ids = np.arange(n) * 7 % 5 if batch == BATCH else np.arange(n) // 2
  features = {'x': x, 'id': ids.astype(np.int64),
              'row': np.arange(n, dtype=np.float32)}
  return dataset_input_fn(features, y[:, None].astype(np.float32), batch,
                          repeat)


def _tables_of(estimator, names=('last_row', 'counts')):
  """Each checkpointed table of `names` as a sorted {key: value}."""
  found = {}
  for name in names:
    keys = estimator.get_variable_value(f'{name}-keys')
    values = estimator.get_variable_value(f'{name}-values')
    found[name] = dict(sorted(
        (int(k), float(v)) for k, v in zip(keys, values) if k >= 0))
  return found


@pytest.mark.parametrize('table,towers,aggregation,batch', [
    ('mutable', 2, 'global_loss', BATCH),
    ('dense', 3, 'round_robin', BATCH),
    ('mutable', 3, 'all_reduce', BATCH),
    # An idle tower's copy of row 0 must not overwrite row 1's value.
    ('dense', 3, 'global_loss', 2),
])
def test_tables_equal_one_device(tmp_path, data, table, towers, aggregation,
                                 batch):
  params = {'table': table}
  one = make_estimator(table_model_fn, tmp_path / 'one', params=params)
  many = make_estimator(table_model_fn, tmp_path / 'many', towers,
                        params=params, aggregation=aggregation)
  for estimator in (one, many):
    estimator.train(_input_fn(data, batch=batch), steps=STEPS)
  expected = _tables_of(one)
  assert len(expected['last_row']) in (3, 5)  # Every id, each once.
  assert _tables_of(many) == expected
  assert_same_variables(
      {k: v for k, v in variables_of(one).items() if 'keys' not in k and
       'values' not in k},
      {k: v for k, v in variables_of(many).items() if 'keys' not in k and
       'values' not in k})
  # EVAL: every tower looks its ids up in the one restored table.
  eval_fn = _input_fn(data, repeat=False)
  assert many.evaluate(eval_fn) == pytest.approx(one.evaluate(eval_fn))


def test_read_after_write_of_a_shared_table_is_refused(tmp_path, data):
  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features['x'], 1)
    loss = tf1.losses.sigmoid_cross_entropy(labels, logits)
    table = _table('mutable', 'ids')
    insert = table.insert(features['id'], features['row'])
    with tf.control_dependencies([insert]):
      size = table.size()  # Would count only earlier towers' ids.
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss + 0.0 * tf.cast(size, tf.float32),
        tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  many = make_estimator(model_fn, tmp_path, 2)
  with pytest.raises(ValueError, match="table 'ids' is read by .* after a "
                     'write of the same step'):
    many.train(_input_fn(data), steps=1)


def test_table_inside_a_cond_is_refused(tmp_path, data):
  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features['x'], 1)
    loss = tf1.losses.sigmoid_cross_entropy(labels, logits)
    table = _table('mutable', 'ids')
    record = tf.cond(tf.reduce_sum(features['row']) > 0,
                     lambda: table.insert(features['id'], features['row']),
                     tf.no_op)
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      train_op=tf.group(train_op, record))

  many = make_estimator(model_fn, tmp_path, 2)
  with pytest.raises(ValueError, match="table 'ids' is used inside If"):
    many.train(_input_fn(data), steps=1)


def two_writes_model_fn(features, labels, mode):
  """Writes each table twice in a step, a remove and an insert each way."""
  logits = tf1.layers.dense(features['x'], 1, kernel_initializer=seeded(3))
  loss = tf1.losses.sigmoid_cross_entropy(labels, logits)
  evict_then_add = _table('mutable', 'evict_then_add')
  removed = evict_then_add.remove(features['evict'])
  with tf.control_dependencies([removed]):
    added = evict_then_add.insert(features['id'], features['row'])
  add_then_evict = _table('mutable', 'add_then_evict')
  inserted = add_then_evict.insert(features['id'], features['row'])
  with tf.control_dependencies([inserted]):
    evicted = add_then_evict.remove(features['evict'])
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=tf.group(train_op, added, evicted))


def test_a_table_written_twice_in_a_step_equals_one_device(tmp_path, data):
  x, y = data
  # Id 5 comes first in the batch (tower 0) and is evicted by the last
  # example (tower 1): one device removes before it inserts, so 5 stays in
  # evict_then_add and leaves add_then_evict; tower by tower would not.
  ids = np.array([5, 1, 2, 3, 4, 6, 7] * 2, np.int64)
  evict = np.array([0, 0, 0, 0, 0, 0, 5] * 2, np.int64)
  features = {'x': x[:14], 'id': ids, 'evict': evict,
              'row': np.arange(14, dtype=np.float32)}
  found = []
  for towers in (1, 2):
    estimator = make_estimator(two_writes_model_fn, tmp_path / str(towers),
                               towers)
    estimator.train(dataset_input_fn(features, y[:14, None].astype(
        np.float32), BATCH), steps=2)
    found.append(_tables_of(estimator,
                            ('evict_then_add', 'add_then_evict')))
  assert 5 in found[0]['evict_then_add']
  assert 5 not in found[0]['add_then_evict']
  assert found[1] == found[0]
