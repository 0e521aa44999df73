"""The axes a reduction reduces, as every reader of the towers' graphs sees
them."""

import numpy as np
import pytest
import tensorflow as tf

from estimator_towers.graph import reductions

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1


@pytest.mark.parametrize('axis, expected', [
    (0, {0}), (-1, {2}), ([0, -1], {0, 2}), (None, {0, 1, 2})])
def test_axes_are_non_negative(axis, expected):
  with tf.Graph().as_default():
    total = tf.reduce_sum(tf.ones([2, 3, 4]), axis=axis)
    assert reductions.reduced_axes(total.op) == expected
    assert reductions.sums_everything(total.op) == (expected == {0, 1, 2})


def test_axes_fed_at_run_time_or_an_unknown_rank_are_unknown():
  with tf.Graph().as_default():
    axis = tf1.placeholder(tf.int32, [])
    fed = tf.reduce_mean(tf.ones([2, 3]), axis=axis)
    unranked = tf.reduce_sum(tf1.placeholder(tf.float32, None), axis=0)
    for op in (fed.op, unranked.op):
      assert reductions.reduced_axes(op) is None
      assert not reductions.sums_everything(op)


def test_a_scalar_reduces_no_axis_and_sums_everything():
  with tf.Graph().as_default():
    total = tf.reduce_sum(tf.constant(3.0))
    assert reductions.reduced_axes(total.op) == set()
    assert reductions.sums_everything(total.op)


def test_a_caller_may_read_the_axes_its_own_way():
  with tf.Graph().as_default():
    axis = tf1.placeholder(tf.int32, [])
    total = tf.reduce_max(tf.ones([2, 3]), axis=axis)
    read = reductions.reduced_axes(total.op, lambda _: np.array(-1))
    assert read == {1}


def test_every_division_op_type_is_listed():
  with tf.Graph().as_default():
    x = tf.ones([2])
    made = {tf.math.divide_no_nan(x, x).op.type, (x / x).op.type,
            tf.compat.v1.div(x, x).op.type}
  assert made <= reductions.DIVIDE
