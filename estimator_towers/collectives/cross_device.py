"""Summing one tensor per device so that every device gets the same sum.

Used by the `all_reduce` aggregation (see replicas.py). Three ways:

* NCCL (`nccl_ops.all_sum`) when every device is a GPU;
* TensorFlow's collective ops (`CollectiveReduce`, ring all-reduce) otherwise.
  They run in a `tf.compat.v1.Session` across the local (also virtual CPU)
  devices; each session gets its own collective executor, so their keys
  (collective_keys) need only be unique within one graph;
* sparse gradients (`tf.IndexedSlices`, e.g. of embeddings) are not reduced
  but gathered: every device concatenates all towers' rows in tower order,
  which is what `tf.gradients` does for a variable used by several towers.
  A sparse optimizer update must see the rows, not a dense sum (Momentum's
  sparse update leaves untouched rows' accumulators alone).

Each device receives bit-identical results (ring all-reduce and the concat
broadcast one result), which keeps the replicated variables identical.
"""

from typing import List, Sequence, Union

import tensorflow as tf
from tensorflow.python.ops import collective_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import nccl_ops  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.collectives import collective_keys

Gradient = Union[tf.Tensor, tf.IndexedSlices]

def uses_nccl(devices: Sequence[str]) -> bool:
  """True when every device is a GPU, so NCCL sums the gradients."""
  return all(tf.DeviceSpec.from_string(d).device_type == 'GPU'
             for d in devices)


def all_sum(values: Sequence[Gradient], devices: Sequence[str]
            ) -> List[Gradient]:
  """The sum of `values` (one per device), placed on every device.

  Args:
    values: One gradient per device, all of one shape and dtype; dense
      Tensors or all IndexedSlices.
    devices: The device of each value, distinct.

  Returns:
    One result per device, placed there, all equal.

  Raises:
    ValueError: `values` mixes dense and sparse gradients.
  """
  sparse = [isinstance(v, tf.IndexedSlices) for v in values]
  if any(sparse):
    if not all(sparse):
      raise ValueError('A variable has sparse gradients in some towers and '
                       'dense ones in others; every tower must build the '
                       'same model.')
    return _all_gather_slices(values, devices)
  if uses_nccl(devices):
    return nccl_ops.all_sum(
        [_on(d, tf.identity, v) for v, d in zip(values, devices)])
  keys = collective_keys.of_graph()
  group, instance = keys.local_group(devices), keys.local_instance()
  return [_on(d, collective_ops.all_reduce, v, len(devices), group, instance,
              'Add', 'Id') for v, d in zip(values, devices)]


def _on(device: str, fn, *args):
  with tf.device(device):
    return fn(*args)


def _all_gather_slices(values: Sequence[tf.IndexedSlices],
                       devices: Sequence[str]) -> List[tf.IndexedSlices]:
  results = []
  for device in devices:
    with tf.device(device):
      results.append(tf.IndexedSlices(
          tf.concat([v.values for v in values], 0),
          tf.concat([v.indices for v in values], 0),
          values[0].dense_shape))
  return results
