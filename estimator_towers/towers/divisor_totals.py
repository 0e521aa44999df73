"""The whole batch's divisor of a ratio, rebuilt from the towers' sums.

A loss N / D divides a sum over the examples by a count of them. When D is
itself a sum over the examples (their number, their weights' sum) the whole
batch's divisor is the towers' sum. Losses also write the divisor as such a
sum plus, or bounded by, a constant: RetinaNet-style focal losses divide by
max(number of positives, 1), BERT's masked LM by sum(weights) + 1e-5. One
device applies that constant once, to the whole batch's sum; each tower's
own max(S_t, 1) would apply it once per tower (0.41 of a step off when a
shard has no positive). `Divisor.rebuild` applies the divisor's expression
to the towers' total instead, so that tower t's N_t / rebuild(sum S_t) adds
up to one device's N / D exactly.
"""

from typing import Callable, NamedTuple, Optional

import tensorflow as tf

_BINARY = {'Add': tf.add, 'AddV2': tf.add, 'Sub': tf.subtract,
           'Mul': tf.multiply, 'RealDiv': tf.divide, 'Div': tf.divide,
           'TrueDiv': tf.divide, 'Maximum': tf.maximum,
           'Minimum': tf.minimum}
_UNARY = {'Identity': tf.identity, 'StopGradient': tf.stop_gradient}


class Divisor(NamedTuple):
  """A tower's divisor as an expression of one sum over its examples.

  Attributes:
    sum: The sum over the tower's examples the divisor is computed from.
    rebuild: The divisor's expression applied to another value of that
      sum (the towers' total): a float32 scalar.
  """
  sum: tf.Tensor
  rebuild: Callable[[tf.Tensor], tf.Tensor]


def parts(divisor: tf.Tensor, depends: Callable[[tf.Tensor], bool],
          is_sum: Callable[[tf.Tensor], bool]) -> Optional[Divisor]:
  """`divisor` as f(a sum over the examples), f of constants only.

  Args:
    divisor: A tower's divisor.
    depends: Whether a tensor depends on the tower's examples.
    is_sum: Whether a tensor is a plain sum over the tower's examples.

  Returns:
    The Divisor, or None when the divisor is no such expression (two sums,
    a function other than arithmetic with constants).
  """
  if is_sum(divisor):
    return Divisor(divisor, lambda total: total)
  op = divisor.op
  varying = [i for i, t in enumerate(op.inputs) if depends(t)]
  known = op.type in _BINARY or op.type in _UNARY or op.type == 'Cast'
  if not known or len(varying) != 1:
    return None
  inner = parts(op.inputs[varying[0]], depends, is_sum)
  if inner is None:
    return None

  def rebuild(total: tf.Tensor) -> tf.Tensor:
    args = list(op.inputs)
    position = varying[0]
    args[position] = tf.cast(inner.rebuild(total), args[position].dtype)
    return tf.cast(_apply(op, args), tf.float32)

  return Divisor(inner.sum, rebuild)


def _apply(op: tf.Operation, args) -> tf.Tensor:
  if op.type == 'Cast':
    return tf.cast(args[0], op.get_attr('DstT'))
  if op.type in _UNARY:
    return _UNARY[op.type](args[0])
  return _BINARY[op.type](*args)
