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
      writes.append([write(counter, x).op])
    return writes, marks


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


def test_a_write_computed_differently_is_not_compared():
  # An earlier tower's update by hand reads a stand-in gradient (zeros),
  # the last tower's the real one: never run, not a shard's size.
  def write(v, x):
    if x.shape[0] == 4:
      return v.assign_sub(0.2 * tf.zeros([]))
    return v.assign_sub(0.2 * v.read_value())
  free_writes.check_agree(*_towers(write))
