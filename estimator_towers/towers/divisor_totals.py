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

The same reading serves a loss guarded by a condition on such a sum
(`tf.where(num_present > 0, loss, 0)`, as tf.compat.v1.losses'
mean_pairwise_squared_error writes it): `Divisor.rebuild` then gives the
condition of the whole batch, which every tower applies instead of its own.
An expression may use its sum several times (`tf.where(n == 0, 1, n)`).
"""

from typing import Callable, NamedTuple, Optional

import tensorflow as tf

_BINARY = {'Add': tf.add, 'AddV2': tf.add, 'Sub': tf.subtract,
           'Mul': tf.multiply, 'RealDiv': tf.divide, 'Div': tf.divide,
           'TrueDiv': tf.divide, 'Maximum': tf.maximum,
           'Minimum': tf.minimum}
_UNARY = {'Identity': tf.identity, 'StopGradient': tf.stop_gradient,
          'LogicalNot': tf.logical_not, 'OnesLike': tf.ones_like,
          'ZerosLike': tf.zeros_like}
# Comparisons and logic: a guard's condition on the sum (`n > 0`).
_CONDITIONS = {'Greater': tf.greater, 'GreaterEqual': tf.greater_equal,
               'Less': tf.less, 'LessEqual': tf.less_equal,
               'Equal': tf.equal, 'NotEqual': tf.not_equal,
               'LogicalAnd': tf.logical_and, 'LogicalOr': tf.logical_or}
_SELECTS = frozenset(['Select', 'SelectV2'])


class Divisor(NamedTuple):
  """A tower's divisor as an expression of one sum over its examples.

  Attributes:
    sum: The sum over the tower's examples the divisor is computed from.
    rebuild: The divisor's expression applied to another value of that
      sum (the towers' total), in the expression's own dtype (a bool for a
      condition).
  """
  sum: tf.Tensor
  rebuild: Callable[[tf.Tensor], tf.Tensor]


def parts(divisor: tf.Tensor, depends: Callable[[tf.Tensor], bool],
          is_sum: Callable[[tf.Tensor], bool]) -> Optional[Divisor]:
  """`divisor` as f(a sum over the examples), f of constants only.

  Args:
    divisor: A tower's divisor (or a guard's condition).
    depends: Whether a tensor depends on the tower's examples.
    is_sum: Whether a tensor is a plain sum over the tower's examples.

  Returns:
    The Divisor, or None when the divisor is no such expression (two
    different sums, a function other than arithmetic, comparisons and
    selections with constants).
  """
  if is_sum(divisor):
    return Divisor(divisor, lambda total: total)
  op = divisor.op
  varying = [i for i, t in enumerate(op.inputs) if depends(t)]
  known = (op.type in _BINARY or op.type in _UNARY or op.type == 'Cast' or
           op.type in _CONDITIONS or op.type in _SELECTS)
  if not known or not varying:
    return None
  inner = {}
  for i in varying:
    found = parts(op.inputs[i], depends, is_sum)
    if found is None:
      return None
    inner[i] = found
  sums = {found.sum.name for found in inner.values()}
  if len(sums) != 1:
    return None  # Two different sums: no one total to rebuild from.

  def rebuild(total: tf.Tensor) -> tf.Tensor:
    args = list(op.inputs)
    for i, found in inner.items():
      args[i] = tf.cast(found.rebuild(total), args[i].dtype)
    return _apply(op, args)

  return Divisor(next(iter(inner.values())).sum, rebuild)


def _apply(op: tf.Operation, args) -> tf.Tensor:
  if op.type == 'Cast':
    return tf.cast(args[0], op.get_attr('DstT'))
  if op.type in _UNARY:
    return _UNARY[op.type](args[0])
  if op.type in _SELECTS:
    return tf.where(*args)
  if op.type in _CONDITIONS:
    return _CONDITIONS[op.type](*args)
  return _BINARY[op.type](*args)
