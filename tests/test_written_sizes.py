"""Tests for estimator_towers.towers.written_sizes."""

import pytest
import tensorflow as tf

from estimator_towers.towers import written_sizes


@pytest.mark.fast
@pytest.mark.parametrize('value,expected', [
    (3.0, 3),     # the rows (x.shape[0])
    (6.0, 6),     # rows times the width
    (12.0, 12),   # the count of [3, 2, 2]
    (1 / (1 / 3.0), 3),
    (3.0000001, 3),  # float32's reciprocal of a reciprocal
])
def test_a_size_the_shard_fixes_is_found(value, expected):
  assert written_sizes.shard_size(value, tf.TensorShape([3, 2, 2]),
                                  3) == expected


@pytest.mark.fast
@pytest.mark.parametrize('value', [2.0, 4.0, 5.0, 24.0, 0.0, -3.0,
                                   float('inf'), float('nan')])
def test_other_constants_are_no_size(value):
  assert written_sizes.shard_size(value, tf.TensorShape([3, 2, 2]),
                                  3) is None


@pytest.mark.fast
@pytest.mark.parametrize('shape,rows', [
    ([3, None], 3),  # a width known only at run time
    ([2, 3], 3),     # the rows are not first
    ([], 3),         # a scalar
    ([3, 2], None),  # the batch size is known only at run time
])
def test_no_size_without_static_rows_first(shape, rows):
  assert written_sizes.shard_size(3.0, tf.TensorShape(shape), rows) is None


@pytest.mark.fast
def test_many_dimensions_try_the_rows_and_the_count_only():
  shape = tf.TensorShape([3] + [2] * 8)
  assert written_sizes.shard_size(3.0, shape, 3) == 3
  assert written_sizes.shard_size(3.0 * 256, shape, 3) == 768
  assert written_sizes.shard_size(6.0, shape, 3) is None
