"""Reading reductions and divisions in a graph.

The towers' readers of losses (loss_reduction), of Keras masked means
(keras_masks) and of shard statistics (shard_statistics) all ask which axes a
`Sum`, `Mean`, `Max`, ... reduces and whether an op divides; they ask here so
that the three agree.
"""

from typing import Callable, FrozenSet, Optional

import numpy as np
import tensorflow as tf

DIVIDE = frozenset(['RealDiv', 'Div', 'DivNoNan', 'TrueDiv'])
# Element-wise comparisons, and the logical ops that combine their masks.
COMPARISONS = frozenset(['Equal', 'NotEqual', 'Greater', 'GreaterEqual',
                         'Less', 'LessEqual'])
LOGICAL = frozenset(['LogicalAnd', 'LogicalOr', 'LogicalNot'])


def reduced_axes(
    op: tf.Operation,
    static_value: Callable[[tf.Tensor], Optional[np.ndarray]] = (
        tf.get_static_value)
) -> Optional[FrozenSet[int]]:
  """The non-negative axes a reduction op reduces; None if unknown.

  Args:
    op: a reduction op (`Sum`, `Mean`, `Max`, `Min`, `Prod`, ...), whose
      second input holds the axes.
    static_value: reads the axes' value when the graph fixes it; a caller
      that folds shapes further passes its own.

  Returns:
    The axes as a frozenset (empty for a scalar input), or None when the
    input's rank or the axes are not known while the graph is built.
  """
  rank = op.inputs[0].shape.rank
  if rank == 0:
    return frozenset()
  if rank is None or len(op.inputs) < 2:
    return None
  axes = static_value(op.inputs[1])
  if axes is None:
    return None
  return frozenset(int(a) % rank for a in np.ravel(axes))


def sums_everything(op: tf.Operation) -> bool:
  """Whether a reduction op reduces every axis of its input."""
  axes = reduced_axes(op)
  return axes is not None and axes == set(range(op.inputs[0].shape.rank))
