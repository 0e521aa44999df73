"""Finds rows combined with a statistic of their own shard.

One device computes a statistic of the batch (a sum, mean, max or count
over its examples) once, over the whole batch. A tower computes it over its
shard. While the statistic stays apart from the rows (a loss that is a sum
divided by a count, which loss_reduction weighs exactly) the towers add up
to one device; once it meets the rows again, every row depends on its
whole shard and no weighting of the towers gives one device's step:

* weights normalised by the shard's sum: `sum(loss * w / sum(w))`;
* values centred or scaled by the shard's mean, max or count:
  `(x - mean(x)) ** 2`, `x / max(x)`, `x / tf.shape(x)[0]`;
* a softmax over the examples (`tf.nn.softmax` of a [batch] vector);
* batch norm from the shard's moments that batch_norm='global' does not
  reach (`tf.nn.moments` / `tf.nn.fused_batch_norm` by hand, tf_slim).

`Trail` follows, op by op in creation order, which tensors are such
statistics and which rows have met one ("mixed"). It is fed by
batch_mixing's walk, which knows each tensor's row axes. An exchange
between the towers (a collective: batch norm's global moments,
`whole_batch`) gives the whole batch's values: nothing passes it. With
batch_norm='per_tower' the user chose each shard's moments: reductions
inside `tf.nn.moments` / `weighted_moments` and fused batch norm are then
no statistic.
"""

import re
from typing import Dict, Optional, Sequence, Tuple

import tensorflow as tf

# What batch_mixing calls `Axes`: the row axes of a tensor.
Axes = frozenset

_REDUCTIONS = frozenset(['Sum', 'Mean', 'Max', 'Min', 'Prod', 'Any', 'All',
                         'EuclideanNorm', 'ArgMax', 'ArgMin'])
_FUSED_BATCH_NORMS = frozenset(['FusedBatchNorm', 'FusedBatchNormV2',
                                'FusedBatchNormV3'])
# A count of the shard's rows read from its shape stays a statistic only
# through arithmetic: `tf.range(n)` numbers positions (whole_batch's
# labels), and `[n, -1]` is a shape.
_ARITHMETIC = frozenset([
    'Identity', 'Cast', 'Neg', 'Reciprocal', 'Sqrt', 'Rsqrt', 'Square',
    'Add', 'AddV2', 'Sub', 'Mul', 'RealDiv', 'Div', 'TrueDiv', 'DivNoNan',
    'Maximum', 'Minimum', 'Pow', 'FloorDiv'])
# Inputs that are shapes, axes, sizes or positions, not values: a
# statistic there does not meet the rows' values.
_NOT_VALUES = {
    'Reshape': (1,), 'Tile': (1,), 'Slice': (1, 2), 'StridedSlice': (1, 2, 3),
    'Pad': (1,), 'PadV2': (1,), 'MirrorPad': (1,), 'BroadcastTo': (1,),
    'Fill': (0,), 'ExpandDims': (1,), 'Transpose': (1,), 'Split': (0,),
    'SplitV': (1, 2), 'GatherV2': (2,), 'OneHot': (1,), 'Roll': (1, 2),
    'ReverseV2': (1,), 'TopKV2': (1,), 'ConcatV2': (-1,),
    'Sum': (1,), 'Mean': (1,), 'Max': (1,), 'Min': (1,), 'Prod': (1,),
    'ArgMax': (1,), 'ArgMin': (1,), 'Any': (1,), 'All': (1,),
    'EuclideanNorm': (1,)}
_MOMENTS_SCOPE = re.compile(r'^(weighted_)?moments(_\d+)?$')

Found = Tuple[tf.Operation, str]


class Trail:
  """Which tensors are statistics of the shard and which rows met one.

  Args:
    per_tower_batch_norm: Whether batch_norm='per_tower' accepts each
      shard's moments.
  """

  def __init__(self, per_tower_batch_norm: bool):
    self._per_tower_batch_norm = per_tower_batch_norm
    # Tensor name -> (the op that made the statistic, whether it is a count
    # read from a shape, which only arithmetic keeps).
    self._statistics: Dict[str, Tuple[tf.Operation, bool]] = {}
    self._shapes: Dict[str, Axes] = {}  # Shape of rows -> their axes.
    self._mixed: Dict[str, Found] = {}  # Tensor name -> where it mixed.

  def follow(self, op: tf.Operation, inputs: Sequence[Axes],
             outputs: Sequence[Axes], held: Sequence[bool]) -> None:
    """Records what `op`'s outputs are.

    Args:
      op: The next op, in creation order.
      inputs: The row axes of each of its inputs.
      outputs: The row axes of each of its outputs.
      held: Whether each input's values depend on the shard's values.
    """
    if op.type.startswith('Collective'):
      return  # The whole batch's values.
    if op.type in ('Shape', 'Size', 'ShapeN', 'Rank'):
      self._read_shape(op, inputs)
      return
    if op.type == 'IdentityN':  # tf.custom_gradient: output i is input i.
      for tensor, output in zip(op.inputs, op.outputs):
        self._copy(tensor.name, output.name)
      return
    mixed = next((self._mixed[t.name] for t in op.inputs
                  if t.name in self._mixed), None)
    mixed = mixed or self._mixing(op, inputs, outputs)
    if mixed is not None:
      for output in op.outputs:
        self._mixed[output.name] = mixed
      return
    self._statistic_outputs(op, inputs, outputs, held)

  def mixed(self, tensor: tf.Tensor) -> Optional[Found]:
    """(op, phrase) where `tensor`'s rows met a statistic, or None."""
    return self._mixed.get(tensor.name)

  # --------------------------------------------------------------------

  def _copy(self, source: str, target: str) -> None:
    for table in (self._statistics, self._mixed):
      if source in table:
        table[target] = table[source]

  def _read_shape(self, op: tf.Operation, inputs: Sequence[Axes]) -> None:
    if op.type == 'Size' and inputs[0]:
      self._statistics[op.outputs[0].name] = (op, True)
    elif op.type == 'Shape' and inputs[0]:
      self._shapes[op.outputs[0].name] = inputs[0]

  def _mixing(self, op: tf.Operation, inputs: Sequence[Axes],
              outputs: Sequence[Axes]) -> Optional[Found]:
    """Where `op` itself combines rows with a statistic of theirs."""
    if op.type in ('Softmax', 'LogSoftmax') and inputs[0]:
      rank = op.inputs[0].shape.rank
      if rank is not None and rank - 1 in inputs[0]:
        return (op, 'normalises over the examples (its last axis holds '
                "the shard's rows)")
    if op.type in _FUSED_BATCH_NORMS and not self._per_tower_batch_norm and (
        op.get_attr('is_training') and 0 in inputs[0]):
      return (op, "normalises with the shard's own moments: a batch norm "
              "that batch_norm='global' does not reach")
    if not any(outputs):
      return None
    skipped = _NOT_VALUES.get(op.type, ())
    positions = {p % len(op.inputs) for p in skipped} if op.inputs else set()
    for position, tensor in enumerate(op.inputs):
      source = self._statistics.get(tensor.name)
      if source is not None and position not in positions and (
          not inputs[position]):
        return (op, f'combines the rows with {source[0].type} '
                f"{source[0].name!r}, a statistic of the shard's rows")
    return None

  def _statistic_outputs(self, op: tf.Operation, inputs: Sequence[Axes],
                         outputs: Sequence[Axes],
                         held: Sequence[bool]) -> None:
    """Marks the outputs without rows that are statistics of the shard."""
    new = self._new_statistic(op, inputs, held)
    if new is None:
      given = [self._statistics[t.name] for t in op.inputs
               if t.name in self._statistics]
      kept = [s for s in given if not s[1] or op.type in _ARITHMETIC]
      new = kept[0] if kept else None
    if new is None:
      return
    for output, axes in zip(op.outputs, outputs):
      if not axes:
        self._statistics[output.name] = new

  def _new_statistic(self, op: tf.Operation, inputs: Sequence[Axes],
                     held: Sequence[bool]):
    """(op, is a count) if `op` reduces the rows away, else None."""
    if op.type == 'StridedSlice' and op.inputs[0].name in self._shapes:
      begin = tf.get_static_value(op.inputs[1])
      rows = self._shapes[op.inputs[0].name]
      if (begin is not None and begin.size == 1 and
          op.get_attr('shrink_axis_mask') == 1 and int(begin[0]) in rows):
        return (op, True)
      return None
    if op.type == 'L2Loss' and inputs[0]:
      return (op, not held[0])
    if op.type not in _REDUCTIONS or not inputs[0]:
      return None
    if self._per_tower_batch_norm and _in_moments(op):
      return None
    rank = op.inputs[0].shape.rank
    axes = tf.get_static_value(op.inputs[1]) if rank else None
    if axes is None:
      return None
    reduced = {int(a) % rank for a in axes.reshape([-1])}
    if not reduced & set(inputs[0]):
      return None
    return (op, not held[0])


def _in_moments(op: tf.Operation) -> bool:
  """Whether `op` is made inside `tf.nn.moments` or `weighted_moments`."""
  return any(_MOMENTS_SCOPE.match(part) for part in op.name.split('/')[:-1])

