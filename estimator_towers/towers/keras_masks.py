"""Keras' masked mean read as the ratio it is: sum(l * m) / sum(m).

A Keras loss whose predictions carry a mask (`Embedding(mask_zero=True)`,
`Masking`) and whose reduction is SUM_OVER_BATCH_SIZE (the default) scales
the mask before the mean (`losses_utils.apply_valid_mask`):

  scaled = mask * (size(mask) / sum(mask))
  loss = sum(l * scaled [* sample_weight]) / size(l * scaled)

The loss is sum(l * m [* w]) / (sum(m) * c), c = size(l * scaled) /
size(mask): 1 for a mask shaped like the losses, the static width a
per-example mask `[batch, 1]` is broadcast over. Read op by op, though,
each row is multiplied by a statistic of its shard (`size / sum(mask)`),
which batch_mixing refuses, and the divisor is the number of elements, by
which loss_reduction would weigh the towers (off one device whenever the
valid tokens split unevenly between the shards).

`masked_mean` recognises exactly that structure, used nowhere else in the
loss, with a mask whose rows are the shard's, and names the real divisor;
loss_reduction weighs the towers by it and builds each tower's term as
`unscaled_sum` over the whole batch's divisor (a shard without a valid
token adds 0, as its tokens do on one device, where Keras' own scale would
be 0 / 0). batch_mixing lets the scaling through (`scalings`). Anything
else that multiplies rows by a statistic of their shard is still refused.
"""

import dataclasses
from typing import Iterable, List, Optional, Set

import numpy as np
import tensorflow as tf

from estimator_towers.graph import reductions

# Ops Keras puts between the scaled mask and the product with the losses
# (casts, squeeze_or_expand_dimensions).
_ALIGN = frozenset(['Identity', 'Cast', 'Squeeze', 'ExpandDims', 'Reshape'])
_DIVIDE = reductions.DIVIDE


@dataclasses.dataclass
class MaskedMean:
  """What `masked_mean` found.

  Attributes:
    scaling: The `mask * (size / sum(mask))` Mul op.
    mask: The mask (float, the Mul's other input).
    valid: sum(mask), a scalar: the divisor the towers are weighed by.
    ratio: c of the module doc (a constant): the mean divides by valid * c.
    chain: The ops from the scaling to the product with the losses, in
      that order (the product last).
    summed: The ops from the product to the division (the sums, the
      division and its count), which may read the product.
  """
  scaling: tf.Operation
  mask: tf.Tensor
  valid: tf.Tensor
  ratio: float
  chain: List[tf.Operation]
  summed: List[tf.Operation]


def masked_mean(op: tf.Operation) -> Optional[MaskedMean]:
  """`op` as the division of Keras' masked mean, or None.

  Args:
    op: A division op of a loss.

  Returns:
    A `MaskedMean`: one device's loss divides by its `valid * ratio`.
  """
  if op.type not in _DIVIDE or len(op.inputs) != 2:
    return None
  summed = [op]
  weighted = _summed(op.inputs[0], summed)
  if weighted is None or weighted.op.type != 'Mul':
    return None
  if _count_of(op.inputs[1], weighted, summed) is None:
    return None
  for factor in weighted.op.inputs:
    chain = [weighted.op]
    found = _scaled_mask(_skip(factor, _ALIGN, chain))
    if found is None:
      found = _weighted_scaled_mask(_skip(factor, _ALIGN, chain), chain)
    if found is None:
      continue
    scaling, mask, valid = found
    ratio = _size_ratio(mask, weighted)
    if ratio is None:
      return None
    return MaskedMean(scaling, mask, valid, ratio, [scaling] + chain[::-1],
                      summed)
  return None


def scalings(ops: Iterable[tf.Operation]) -> Set[str]:
  """The names of the mask-scaling Mul ops of Keras' masked means in `ops`.

  Args:
    ops: A loss's ancestors.

  Returns:
    The names of `mask * (size / sum(mask))` ops that reach the loss only
    through such a mean: rows scaled by a statistic of the shard that the
    mean cancels. (The backward pass, outside `ops`, may read them too.)
  """
  ops = list(ops)
  names = {op.name for op in ops}
  found = set()
  for op in ops:
    if op.type in _DIVIDE:
      mean = masked_mean(op)
      if mean is not None and only_in_the_mean(mean, names):
        found.add(mean.scaling.name)
  return found


def only_in_the_mean(mean: MaskedMean, names: Set[str]) -> bool:
  """Whether the scaled mask, and the losses it weighs, reach the ops in
  `names` only through the mean (nothing else reads them there)."""
  allowed = {op.name for op in mean.chain + mean.summed}
  reading = mean.chain + mean.summed[1:]  # Not the division: its output.
  return all(consumer.name in allowed
             for op in reading for output in op.outputs
             for consumer in output.consumers() if consumer.name in names)


def unscaled_sum(mean: MaskedMean) -> tf.Tensor:
  """sum(l * m [* w]) / c: the numerator over `valid`, rebuilt with the
  unscaled mask.

  Each op of the chain is applied again with the mask in place of the
  scaled mask, so a shard whose mask sums to 0 gives 0, not 0 * inf.
  """
  current = mean.mask
  for below, op in zip(mean.chain, mean.chain[1:]):
    current = _applied(op, current, below)
  total = tf.reduce_sum(current)
  return total if mean.ratio == 1 else total / tf.constant(mean.ratio,
                                                           total.dtype)


def _applied(op: tf.Operation, current: tf.Tensor,
             below: tf.Operation) -> tf.Tensor:
  """`op` applied to `current` in place of its input from `below`."""
  if op.type == 'Mul':
    other = [t for t in op.inputs if t.op.name != below.name]
    return current * (other[0] if other else current)
  if op.type == 'Cast':
    return tf.cast(current, op.outputs[0].dtype)
  if op.type == 'Reshape':
    return tf.reshape(current, op.inputs[1])
  if op.type == 'ExpandDims':
    return tf.expand_dims(current, op.inputs[1])
  if op.type == 'Squeeze':
    return tf.squeeze(current, axis=list(op.get_attr('squeeze_dims')) or None)
  return tf.identity(current)


def _summed(tensor: tf.Tensor, summed: list) -> Optional[tf.Tensor]:
  """What a scalar `reduce_sum` (possibly of a sum) adds up, or None; the
  Sum ops passed are added to `summed`."""
  tensor = _skip(tensor, frozenset(['Identity']), summed)
  if tensor.op.type != 'Sum' or tensor.shape.rank != 0:
    return None
  while tensor.op.type == 'Sum' and reductions.sums_everything(tensor.op):
    summed.append(tensor.op)
    tensor = tensor.op.inputs[0]
  return tensor if tensor.shape.rank else None


def _count_of(divisor: tf.Tensor, tensor: tf.Tensor,
              passed: Optional[list] = None) -> Optional[tf.Tensor]:
  """`divisor` if it is the number of elements of `tensor` (tf.size of it,
  or that size folded into a constant by a static shape), else None; the
  ops on the way are added to `passed`."""
  path: list = []
  base = _skip(divisor, frozenset(['Identity', 'Cast']), path)
  if base.op.type == 'Size':
    found = base.op.inputs[0].name == tensor.name
    path.append(base.op)
  else:
    value = tf.get_static_value(base)
    found = (value is not None and np.size(value) == 1 and
             tensor.shape.is_fully_defined() and
             float(np.reshape(value, [])) ==
             float(tensor.shape.num_elements()))
  if not found:
    return None
  if passed is not None:
    passed.extend(path)
  return divisor


def _scaled_mask(tensor: tf.Tensor):
  """(Mul op, mask, sum(mask)) if `tensor` is `mask * (size(mask) /
  sum(mask))`, else None."""
  op = tensor.op
  if op.type != 'Mul':
    return None
  for mask, scale in (op.inputs, reversed(list(op.inputs))):
    scale = _skip(scale, frozenset(['Identity']))
    if scale.op.type not in _DIVIDE or scale.shape.rank != 0:
      continue
    total, valid = scale.op.inputs
    valid = _skip(valid, frozenset(['Identity']))
    if (valid.op.type == 'Sum' and valid.op.inputs[0].name == mask.name and
        reductions.sums_everything(valid.op) and
        _count_of(total, mask) is not None):
      return op, mask, valid
  return None


def _weighted_scaled_mask(tensor: tf.Tensor, chain: list):
  """`_scaled_mask` under Keras' product with the sample weights; the ops
  passed are added to `chain`."""
  op = tensor.op
  if op.type != 'Mul':
    return None
  for factor in op.inputs:
    below = [op]
    found = _scaled_mask(_skip(factor, _ALIGN, below))
    if found is not None:
      chain.extend(below)
      return found
  return None


def _size_ratio(mask: tf.Tensor, weighted: tf.Tensor) -> Optional[float]:
  """size(weighted) / size(mask) when it is a constant of the shard (1, or
  the static widths a per-example mask is broadcast over); else None.

  The mask's rows must be the shard's: its first dimension is the
  weighted losses' (both unknown, or equal), never a broadcast 1 (a mask
  shared by every row, whose sum is no count of the shard's tokens).
  """
  if mask.shape.rank is None or mask.shape.rank != weighted.shape.rank or (
      not mask.shape.rank):
    return None
  if mask.shape[0] != weighted.shape[0]:  # A static 1 is not unknown rows.
    return None
  ratio = 1
  for outer, inner in zip(weighted.shape[1:], mask.shape[1:]):
    if inner == outer:  # Equal, or both unknown (Keras aligned them).
      continue
    if inner == 1 and outer is not None:
      ratio *= outer  # A per-example mask broadcast over a static width.
      continue
    return None
  return float(ratio)


def _skip(tensor: tf.Tensor, types: frozenset,
          passed: Optional[list] = None) -> tf.Tensor:
  """`tensor` below the ops of `types`, which are added to `passed`."""
  while tensor.op.type in types and tensor.op.inputs:
    if passed is not None:
      passed.append(tensor.op)
    tensor = tensor.op.inputs[0]
  return tensor
