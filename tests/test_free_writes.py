"""Writes that read nothing of the shard compare equal across towers unless
the shard's static shape went into them as Python numbers."""

import pytest
import tensorflow as tf

from estimator_towers.graph import op_ledger
from estimator_towers.towers import free_writes

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1


def _towers(write, rows=(4, 3)):
  """Builds `write(counter, x)` once per tower, x a shard of `rows` rows;
  returns each tower's write and mark."""
  with tf.Graph().as_default():
    counter = tf1.get_variable('counter', [], tf.float32,
                               tf1.zeros_initializer(), use_resource=True)
    writes, marks = [], []
    for count in rows:
      marks.append(op_ledger.position())
      x = tf1.placeholder(tf.float32, [count, 5])
      written = write(counter, x)
      writes.append([getattr(written, 'op', written)])
    return writes, marks, list(rows)


@pytest.mark.parametrize('write', [
    lambda v, x: v.assign_add(x.shape[0]),
    lambda v, x: v.assign_add(tf.reduce_sum(tf.ones(x.shape[:1]))),
    lambda v, x: v.assign_add(tf.reduce_sum(tf.zeros([x.shape[0], 200, 60]))),
], ids=['python_rows', 'ones_of_python_rows', 'big_fill'])
def test_a_write_of_the_shards_python_size_is_refused(write):
  with pytest.raises(ValueError, match=r"static shape \(x.shape\[0\]"):
    free_writes.check_agree(*_towers(write))


@pytest.mark.parametrize('write', [
    lambda v, x: v.assign_add(1.0),
    lambda v, x: v.assign_add(tf.cast(tf.shape(x)[1], tf.float32)),
    lambda v, x: v.assign_add(x.shape[1] * v.read_value()),
], ids=['constant', 'width', 'python_width_times_a_read'])
def test_a_write_the_same_in_every_tower_passes(write):
  free_writes.check_agree(*_towers(write))


def test_towers_of_equal_shards_cannot_be_told_apart():
  # Documented (writing_model_fns.md, rule 6): the constant is the same.
  free_writes.check_agree(*_towers(lambda v, x: v.assign_add(x.shape[0]),
                                   rows=(3, 3)))


def test_a_write_from_stand_in_gradients_compares_as_the_real_one():
  # An earlier tower's update by hand reads zeros standing in for the
  # gradient (never run), the last tower's the real gradient.
  def write(v, x):
    gradient = (tf.zeros([], name='stand_in') if x.shape[0] == 4 else
                tf.identity(v.read_value(), name='gradient'))
    return v.assign_sub(0.2 * gradient)

  writes, marks, rows = _towers(write)
  routed = {'stand_in', 'gradient'}
  names = {op.name for w in writes for op in op_ledger.ancestors(w)}
  assert routed <= names
  free_writes.check_agree(writes, marks, rows, routed)
  with pytest.raises(ValueError, match=r'the constant 0\. and tower 1 from '
                     'a Mul'):
    free_writes.check_agree(writes, marks, rows)


def test_a_python_loop_over_the_shards_rows_is_refused():
  def write(v, x):
    return tf.group([v.assign_add(1.0) for _ in range(x.shape[0])])

  writes, marks, rows = _towers(write)
  with pytest.raises(ValueError, match=r'tower 0 computes it from 4 such '
                     r'writes and tower 1 from 3'):
    free_writes.check_agree(
        [[op for op in op_ledger.ancestors(w)
          if op.type == 'AssignAddVariableOp'] for w in writes], marks, rows)


def test_a_sum_of_as_many_reads_as_rows_is_refused():
  def write(v, x):
    return v.assign_add(sum(v.read_value() for _ in range(x.shape[0])))

  with pytest.raises(ValueError, match='tower 0 computes it from a AddV2'):
    free_writes.check_agree(*_towers(write))


def test_an_attribute_holding_the_shards_size_is_refused():
  def write(v, x):
    return v.assign_add(tf.nn.leaky_relu(v.read_value(), 1.0 / x.shape[0]))

  with pytest.raises(ValueError, match='a LeakyRelu op with some '
                     'attributes'):
    free_writes.check_agree(*_towers(write))
