"""Constants a model_fn wrote that equal a size its shard fixes.

With a static batch size, `x.shape[0]` is a Python int while the towers are
built: the shard's rows, not one device's. A loss `tf.reduce_sum(e) /
x.shape[0]` is a mean per example on one device, yet the graph holds only a
constant, which reads like a fixed scaling (`/ GLOBAL_BATCH_SIZE`, a sum).
Nothing in the graph tells the two apart, so loss_reduction asks here
whether a constant equals one of the sizes a shard fixes and then refuses
rather than guess; `loss_reduction='mean'` or `'sum'` settles it.
"""

import itertools
import math
from typing import Optional

import numpy as np
import tensorflow as tf

# A loss's reduced tensors have few dimensions; beyond this many, only the
# rows and the count are tried (the subsets' number doubles per dimension).
_MAX_SUBSET_DIMS = 6


def shard_size(value: float, summed: tf.TensorShape,
               rows: Optional[int]) -> Optional[int]:
  """The size of the shard `value` equals, or None.

  Args:
    value: a constant the model_fn wrote (a divisor, or a factor's
      reciprocal).
    summed: the static shape of the tensor a reduction over the shard sums;
      its first dimension must be the shard's rows.
    rows: the shard's static number of rows, or None when the batch size
      is known only at run time (no constant can then hold it).

  Returns:
    The shard's rows times a product of some of the summed tensor's other
    dimensions (the rows themselves, a row's elements, their count) that
    equals `value` (to float32's precision), or None.
  """
  if rows is None or not summed.is_fully_defined() or not summed.rank:
    return None
  dims = summed.as_list()
  if dims[0] != rows or not np.isfinite(value) or value <= 0:
    return None
  others = dims[1:]
  if len(others) > _MAX_SUBSET_DIMS:
    candidates = {rows, rows * math.prod(others)}
  else:
    candidates = {rows * math.prod(chosen)
                  for count in range(len(others) + 1)
                  for chosen in itertools.combinations(others, count)}
  for size in sorted(candidates):
    if size and math.isclose(value, size, rel_tol=1e-6):
      return size
  return None
