"""The op ledger tells which region, and which tower, made an op."""

import pytest
import tensorflow as tf

from estimator_towers.graph import op_ledger

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1


def test_marks_split_earlier_ops_from_later_ones():
  with tf.Graph().as_default():
    before = tf.constant(1.0)
    mark = op_ledger.position()
    after = tf.constant(2.0)
    assert op_ledger.made_before(before.op, mark)
    assert not op_ledger.made_after(before.op, mark)
    assert op_ledger.made_after(after.op, mark)
    assert not op_ledger.made_before(after.op, mark)
    assert op_ledger.made_after(before.op, op_ledger.GRAPH_START)


def test_region_holds_only_the_ops_made_inside():
  with tf.Graph().as_default():
    before = tf.constant(1.0)
    with op_ledger.region() as inside:
      made = tf.constant(2.0)
      with pytest.raises(ValueError, match='still being built'):
        inside.contains(made.op)
    after = tf.constant(3.0)
    assert inside.contains(made.op)
    assert not inside.contains(before.op)
    assert not inside.contains(after.op)
    assert op_ledger.in_any(made.op, [inside])
    assert not op_ledger.in_any(after.op, [inside])


def test_by_creation_sorts_in_creation_order():
  with tf.Graph().as_default():
    ops = [tf.constant(float(i), name=f'c{i}').op for i in range(4)]
    assert op_ledger.by_creation([ops[2], ops[0], ops[3], ops[1]]) == ops


def test_tower_ledger_tells_each_ops_tower():
  with tf.Graph().as_default():
    towers = op_ledger.TowerLedger()
    tf.constant(0.0)
    made = []
    for index in range(3):
      with towers.tower(index):
        made.append(tf.constant(float(index)).op)
    update = tf.constant(9.0).op  # After the last tower: the last tower's.
    assert towers.count == 3
    assert [towers.tower_of(op) for op in made] == [0, 1, 2]
    assert towers.tower_of(update) == 2
    assert towers.region(1).contains(made[1])
    assert not towers.region(1).contains(made[2])
    assert towers.first == towers.start(0)
    assert op_ledger.made_before(made[0], towers.start(1))


def test_towers_are_recorded_in_order():
  with tf.Graph().as_default():
    towers = op_ledger.TowerLedger()
    with pytest.raises(ValueError, match='in order'):
      with towers.tower(1):
        pass
