"""Keras' masked mean read as the ratio it is: sum(l * m) / sum(m).

A Keras loss whose predictions carry a mask (`Embedding(mask_zero=True)`,
`Masking`) and whose reduction is SUM_OVER_BATCH_SIZE (the default) scales
the mask before the mean (`losses_utils.apply_valid_mask`):

  scaled = mask * (size(mask) / sum(mask))
  loss = sum(l * scaled [* sample_weight]) / size(l * scaled)

Both sizes count the same elements, so the loss is sum(l * m [* w]) /
sum(m): a ratio over the valid tokens. Read op by op, though, each row is
multiplied by a statistic of its shard (`size / sum(mask)`), which
batch_mixing refuses, and the divisor is the number of elements, by which
loss_reduction would weigh the towers (off one device whenever the valid
tokens split unevenly between the shards).

`masked_mean` recognises exactly that structure and names the real divisor,
sum(m); loss_reduction weighs the towers by it (tower t by sum(m_t) over the
batch's, exact as for any weighted mean) and batch_mixing lets the scaling
through (`scalings`). Anything else that multiplies rows by a statistic of
their shard is still refused.

A shard whose every token is masked makes Keras' scale 0 / 0 and the
tower's loss NaN, which the step reports (one device, whose batch has valid
tokens, trains); as on one device, a batch without a valid token is NaN.
"""

from typing import Iterable, Optional, Set

import numpy as np
import tensorflow as tf

# Ops Keras puts between the scaled mask and the product with the losses
# (casts, squeeze_or_expand_dimensions).
_ALIGN = frozenset(['Identity', 'Cast', 'Squeeze', 'ExpandDims', 'Reshape'])
_DIVIDE = frozenset(['DivNoNan', 'RealDiv', 'Div', 'TrueDiv'])


def masked_mean(op: tf.Operation) -> Optional[tf.Tensor]:
  """sum(mask) if `op` is the division of Keras' masked mean, else None.

  Args:
    op: A division op of a loss.

  Returns:
    The valid tokens' count (a scalar `tf.reduce_sum(mask)` in the graph):
    the divisor one device's loss really has.
  """
  found = _parts(op)
  return None if found is None else found[1]


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
      parts = _parts(op)
      if parts is not None and _only_through(parts[2], names):
        found.add(parts[0].name)
  return found


def _only_through(chain, names: Set[str]) -> bool:
  """Whether the ops of `chain` (from the scaling up to the product with
  the losses) feed nothing in `names` but the next op of the chain."""
  allowed = {op.name for op in chain}
  return all(consumer.name in allowed
             for op in chain[:-1] for output in op.outputs
             for consumer in output.consumers() if consumer.name in names)


def _parts(op: tf.Operation):
  """(the scaling Mul op, sum(mask), the ops from the scaling to the product
  with the losses) of a masked mean's division, or None."""
  if op.type not in _DIVIDE or len(op.inputs) != 2:
    return None
  weighted = _summed(op.inputs[0])
  if weighted is None or weighted.op.type != 'Mul':
    return None
  if not _counts(op.inputs[1], weighted):
    return None
  for factor in weighted.op.inputs:
    chain = [weighted.op]
    found = _scaled_mask(_skip(factor, _ALIGN, chain))
    if found is None:
      found = _weighted_scaled_mask(_skip(factor, _ALIGN, chain), chain)
    if found is not None and _same_size(found[0].outputs[0], weighted):
      return found[0], found[1], [found[0]] + chain[::-1]
  return None


def _summed(tensor: tf.Tensor) -> Optional[tf.Tensor]:
  """What a scalar `reduce_sum` (possibly of a sum) adds up, or None."""
  tensor = _skip(tensor, frozenset(['Identity']))
  if tensor.op.type != 'Sum' or tensor.shape.rank != 0:
    return None
  while tensor.op.type == 'Sum' and _sums_everything(tensor.op):
    tensor = tensor.op.inputs[0]
  return tensor if tensor.shape.rank else None


def _sums_everything(op: tf.Operation) -> bool:
  """Whether a Sum op reduces every axis of its input."""
  rank = op.inputs[0].shape.rank
  if rank == 0:
    return True
  axes = tf.get_static_value(op.inputs[1])
  if rank is None or axes is None:
    return False
  return {int(a) % rank for a in np.reshape(axes, [-1])} == set(range(rank))


def _counts(divisor: tf.Tensor, tensor: tf.Tensor) -> bool:
  """Whether `divisor` is the number of elements of `tensor` (tf.size of
  it, or that size folded into a constant by a static shape)."""
  divisor = _skip(divisor, frozenset(['Identity', 'Cast']))
  if divisor.op.type == 'Size':
    return divisor.op.inputs[0].name == tensor.name
  value = tf.get_static_value(divisor)
  return (value is not None and np.size(value) == 1 and
          tensor.shape.is_fully_defined() and
          float(np.reshape(value, [])) == float(tensor.shape.num_elements()))


def _scaled_mask(tensor: tf.Tensor):
  """(Mul op, sum(mask)) if `tensor` is `mask * (size(mask) / sum(mask))`."""
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
        _sums_everything(valid.op) and _counts(total, mask)):
      return op, valid
  return None


def _weighted_scaled_mask(tensor: tf.Tensor, chain: list):
  """`_scaled_mask` under Keras' product with the sample weights."""
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


def _same_size(scaled: tf.Tensor, weighted: tf.Tensor) -> bool:
  """Whether the mask has the weighted losses' shape (the two sizes Keras
  divides by cancel only then)."""
  mask = scaled.op.inputs[0] if scaled.op.inputs[0].shape.rank else (
      scaled.op.inputs[1])
  return (mask.shape.rank is not None and
          mask.shape.rank == weighted.shape.rank and
          mask.shape.is_compatible_with(weighted.shape))


def _skip(tensor: tf.Tensor, types: frozenset,
          passed: Optional[list] = None) -> tf.Tensor:
  """`tensor` below the ops of `types`, which are added to `passed`."""
  while tensor.op.type in types and tensor.op.inputs:
    if passed is not None:
      passed.append(tensor.op)
    tensor = tensor.op.inputs[0]
  return tensor
