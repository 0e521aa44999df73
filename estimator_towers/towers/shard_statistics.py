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
* class weights counted in the shard (`unsorted_segment_sum` by label);
* a softmax over the examples (`tf.nn.softmax` of a [batch] vector);
* batch norm from the shard's moments that batch_norm='global' does not
  reach (`tf.nn.moments` / `tf.nn.fused_batch_norm` by hand, tf_slim).

`Trail` follows, op by op in creation order, which tensors are such
statistics and which rows have met one ("mixed"). It is fed by
batch_mixing's walk, which knows each tensor's row axes. An exchange
between the towers (a collective: batch norm's global moments,
`whole_batch`) gives the whole batch's values: nothing passes it. With
batch_norm='per_tower' the user chose each shard's moments for batch norm:
the rows may meet them inside `tf.nn.moments` and
`tf.nn.batch_normalization` (Keras' non-fused layers, tf_slim) and in a
fused batch norm; anywhere else (advantages
standardised with `tf.nn.moments`) they are still refused. A running sum
over the examples (`tf.cumsum` along the rows) and a contraction over them
(`h^T h`) are statistics too. A truth value over the shard (`tf.reduce_all`,
`reduce_any`: Keras' hinge losses ask whether the labels are all 0 or 1)
is taken as the batch's: it is for every valid label set, and refusing
those losses would refuse every model using them.
"""

import re
from typing import AbstractSet, Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from estimator_towers.graph import functions
from estimator_towers.graph import reductions
from estimator_towers.towers import loss_reduction

# What batch_mixing calls `Axes`: the row axes of a tensor.
Axes = frozenset

_REDUCTIONS = frozenset(['Sum', 'Mean', 'Max', 'Min', 'Prod', 'EuclideanNorm',
                         'ArgMax', 'ArgMin'])
# Reductions by segment into a fixed number of segments (class counts by
# label); into as many as the shard has rows they pool each example's own
# values (a ragged sequence's mean).
_SEGMENT_REDUCTIONS = frozenset([
    'UnsortedSegmentSum', 'UnsortedSegmentMax', 'UnsortedSegmentMin',
    'UnsortedSegmentProd'])
_COUNTS_VALUES = frozenset(['Bincount', 'DenseBincount'])
_CUMULATIVE = frozenset(['Cumsum', 'Cumprod', 'CumulativeLogsumexp'])
_CONTRACTIONS = frozenset(['MatMul', 'BatchMatMul', 'BatchMatMulV2',
                           'BatchMatMulV3', 'Einsum'])
FUSED_BATCH_NORMS = frozenset(['FusedBatchNorm', 'FusedBatchNormV2',
                               'FusedBatchNormV3'])
# A count of the shard's rows read from its shape stays a statistic only
# through arithmetic: `tf.range(n)` numbers positions (whole_batch's
# labels), and `[n, -1]` is a shape.
_ARITHMETIC = frozenset([
    'Identity', 'Snapshot', 'StopGradient', 'Cast', 'Reshape', 'Squeeze',
    'ExpandDims', 'Neg', 'Reciprocal', 'Sqrt', 'Rsqrt', 'Square', 'Add',
    'AddV2', 'Sub', 'Mul', 'RealDiv', 'Div', 'TrueDiv', 'DivNoNan',
    'Maximum', 'Minimum', 'Pow', 'FloorDiv', 'Fill', 'BroadcastTo'])
# Ops through which a shape vector stays one, element for element.
_KEEPS_SHAPE = frozenset(['Identity', 'Snapshot', 'StopGradient', 'Cast'])
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
# tf.nn.batch_normalization's scope, and tf.nn.moments' (whose variance
# centres the rows on their mean).
_BATCH_NORM_SCOPE = re.compile(r'^(batchnorm|(weighted_)?moments)(_\d+)?$')

Found = Tuple[tf.Operation, str]


class Trail:
  """Which tensors are statistics of the shard and which rows met one.

  Args:
    per_tower_batch_norm: Whether batch_norm='per_tower' accepts each
      shard's moments.
    rows: The shard's static number of rows, or None: with a static batch
      size `tf.shape(x)[0]` folds into a constant, a count of the rows
      when it equals them.
    cancelled: Names of ops that scale rows by a statistic which a later
      division cancels (Keras' masked mean: keras_masks.scalings).
  """

  def __init__(self, per_tower_batch_norm: bool,
               rows: Optional[int] = None,
               cancelled: AbstractSet[str] = frozenset()):
    self._per_tower_batch_norm = per_tower_batch_norm
    self._rows = rows
    self._cancelled = cancelled
    # Tensor name -> (the op that made the statistic, whether it is a count
    # read from a shape, which only arithmetic keeps).
    self._statistics: Dict[str, Tuple[tf.Operation, bool]] = {}
    # A shape vector of rows -> the positions in it that count rows.
    self._shapes: Dict[str, Axes] = {}
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
    self._follow_shape(op)
    self._statistic_outputs(op, inputs, outputs, held)

  def mixed(self, tensor: tf.Tensor) -> Optional[Found]:
    """(op, phrase) where `tensor`'s rows met a statistic, or None."""
    return self._mixed.get(tensor.name)

  def statistic(self, tensor: tf.Tensor) -> Optional[tf.Operation]:
    """The op that made the statistic of the shard `tensor` is (not a
    count of its rows), or None."""
    found = self._statistics.get(tensor.name)
    return found[0] if found is not None and not found[1] else None

  def counts_rows(self, tensor: tf.Tensor) -> bool:
    """Whether `tensor` is a count of the shard's rows (read from a
    shape, or folded from a static one)."""
    found = self._statistics.get(tensor.name)
    return found is not None and found[1]

  # --------------------------------------------------------------------

  def _copy(self, source: str, target: str) -> None:
    for table in (self._statistics, self._mixed, self._shapes):
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
    if op.type in FUSED_BATCH_NORMS and self._normalises_rows(op, inputs):
      return (op, "normalises with the shard's own moments: a batch norm "
              "that batch_norm='global' does not reach")
    if op.type in _CUMULATIVE and inputs[0]:
      axis = tf.get_static_value(op.inputs[1])
      rank = op.inputs[0].shape.rank
      if axis is None or rank is None or int(axis) % rank in inputs[0]:
        return (op, 'accumulates over the examples (each row adds the rows '
                'before it)')
    if not any(outputs) or (self._per_tower_batch_norm and
                            _in_batch_norm(op)) or op.name in self._cancelled:
      return None
    skipped = _NOT_VALUES.get(op.type, ())
    positions = {p % len(op.inputs) for p in skipped} if op.inputs else set()
    for position, tensor in enumerate(op.inputs):
      source = self._statistics.get(tensor.name)
      if source is not None and position not in positions and (
          not inputs[position]):
        return (op, f'combines the rows with {source[0].type} '
                f"{source[0].name!r}, a statistic of the shard's rows"
                f'{_hint(source[0])}')
    return None

  def _normalises_rows(self, op: tf.Operation, inputs: Sequence[Axes]
                       ) -> bool:
    """Whether a fused batch norm in training normalises over the rows."""
    return (not self._per_tower_batch_norm and op.get_attr('is_training')
            and bool(set(inputs[0]) - {channel_axis(op)}))

  def _follow_shape(self, op: tf.Operation) -> None:
    """Keeps track of a shape vector through casts and copies."""
    if op.type in _KEEPS_SHAPE and op.inputs[0].name in self._shapes:
      self._shapes[op.outputs[0].name] = self._shapes[op.inputs[0].name]

  def _statistic_outputs(self, op: tf.Operation, inputs: Sequence[Axes],
                         outputs: Sequence[Axes],
                         held: Sequence[bool]) -> None:
    """Marks the outputs without rows that are statistics of the shard."""
    if op.type == 'Unpack' and op.inputs[0].name in self._shapes:
      for i in self._shapes[op.inputs[0].name]:
        self._statistics[op.outputs[i].name] = (op, True)
      return
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
    if op.inputs and op.inputs[0].name in self._shapes:
      return (op, True) if self._picks_a_count(op) else None
    if op.type == 'StridedSlice':
      return (op, True) if self._folded_count(op) else None
    if op.type == 'L2Loss' and inputs[0]:
      return (op, not held[0])
    if op.type in _SEGMENT_REDUCTIONS:
      return (op, False) if any(inputs) and self._fixed_segments(op) else None
    if op.type in _COUNTS_VALUES:
      return (op, False) if inputs[0] else None
    if op.type in _CONTRACTIONS:
      # Rows in, none out: summed against each other (h^T h) or against
      # values that hold no example (a sum). A matrix of the examples'
      # values the walk lost (a diagonal of their weights) may keep them
      # apart: not taken as a statistic.
      if any(inputs) and all(axes or not h for axes, h in zip(inputs, held)):
        return (op, not any(held))
      return None
    if (op.type not in _REDUCTIONS or not inputs[0] or
        _bounds_a_masked_rnn(op)):
      return None
    reduced = reductions.reduced_axes(op)
    if reduced is None or not reduced & set(inputs[0]):
      return None
    return (op, not held[0])

  def _fixed_segments(self, op: tf.Operation) -> bool:
    """Whether a segment reduction's number of segments is a constant other
    than the shard's row count (classes, not examples)."""
    number = tf.get_static_value(op.inputs[2])
    return number is not None and int(number) != self._rows

  def _picks_a_count(self, op: tf.Operation) -> bool:
    """Whether `op` reads a row count from a shape vector of rows:
    `tf.shape(x)[0]`, `tf.gather(tf.shape(x), 0)`, its product."""
    counts = self._shapes[op.inputs[0].name]
    length = tf.compat.dimension_value(op.inputs[0].shape[0])
    if op.type in ('Prod', 'Sum', 'Max', 'Min'):
      return True
    if op.type == 'StridedSlice':
      if op.get_attr('shrink_axis_mask') != 1:
        return False
      index = tf.get_static_value(op.inputs[1])
    elif op.type in ('GatherV2', 'Gather'):
      index = tf.get_static_value(op.inputs[1])
    else:
      return False
    if index is None or np.size(index) != 1 or length is None:
      return False
    return int(np.reshape(index, [])) % length in counts

  def _folded_count(self, op: tf.Operation) -> bool:
    """Whether a StridedSlice is `tf.shape(x)[0]` folded into a constant
    by a static shape, equal to the shard's static row count (as
    loss_reduction reads it)."""
    begin = tf.get_static_value(op.inputs[1])
    if (self._rows is None or begin is None or begin.size != 1 or
        int(begin[0]) != 0 or op.get_attr('shrink_axis_mask') != 1 or
        not loss_reduction.folded_shape(op.inputs[0].op)):
      return False
    shape = tf.get_static_value(op.inputs[0])
    return shape is not None and np.size(shape) > 0 and (
        int(np.reshape(shape, [-1])[0]) == self._rows)


def _bounds_a_masked_rnn(op: tf.Operation) -> bool:
  """Whether `op` is `tf.compat.v1.nn.dynamic_rnn`'s longest (or shortest)
  sequence length, read only as its loop's bound.

  The loop runs to the batch's longest length (a tower's: its shard's) and,
  past a row's own length, copies the row's state through and writes zeros
  as its output: each row's result is the same for any bound at least as
  long as the row, so the shard's bound gives it one device's. Known by
  dynamic_rnn's structure: `<scope>/sequence_length` checked as
  `<scope>/CheckSeqLen`, which its loop `<scope>/while` reads itself (to
  mask the rows), and the bound read by that loop alone.
  """
  checked = op.inputs[0].op
  scope, _, name = checked.name.rpartition('/')
  if op.type not in ('Max', 'Min') or checked.type != 'Identity' or (
      name != 'CheckSeqLen'):
    return False
  lengths = checked.inputs[0].op
  loop = f'{scope}/while' if scope else 'while'
  if lengths.type != 'Identity' or lengths.name != (
      f'{scope}/sequence_length' if scope else 'sequence_length'):
    return False
  if not any(c.type in functions.LOOPS and _frame_of(c) == loop
             for c in checked.outputs[0].consumers()):
    return False
  return _only_bounds_a_loop(op.outputs[0], loop)


def _frame_of(op: tf.Operation) -> str:
  """The loop `op` is (v2) or enters (v1: `<loop>/Enter...`)."""
  return op.name if op.type in ('While', 'StatelessWhile') else (
      op.name.rsplit('/', 1)[0])


def _only_bounds_a_loop(tensor: tf.Tensor, loop: str, depth: int = 3) -> bool:
  """Whether `tensor` reaches nothing but the loop named `loop`, through
  max/min with others (dynamic_rnn's `min(steps, max(1, longest))`)."""
  for consumer in tensor.consumers():
    if consumer.type in functions.LOOPS and _frame_of(consumer) == loop:
      continue
    if not (consumer.type in ('Maximum', 'Minimum') and depth and
            _only_bounds_a_loop(consumer.outputs[0], loop, depth - 1)):
      return False
  return True


def _decides_a_cond(tensor: tf.Tensor) -> bool:
  """Whether `tensor`, or a comparison of it, goes into a tf.cond."""
  for consumer in tensor.consumers():
    if consumer.type in ('If', 'StatelessIf'):
      return True
    if consumer.type in ('LessEqual', 'Less', 'GreaterEqual', 'Greater') and (
        any(c.type in ('If', 'StatelessIf')
            for c in consumer.outputs[0].consumers())):
      return True
  return False


def channel_axis(op: tf.Operation) -> int:
  """The channel axis of a fused batch norm's input (NHWC or NCHW)."""
  rank = op.inputs[0].shape.rank or 4
  return 1 if op.get_attr('data_format') in (b'NCHW', b'NCDHW') else rank - 1


def _in_batch_norm(op: tf.Operation) -> bool:
  """Whether `op` is made inside `tf.nn.batch_normalization` or
  `tf.nn.moments`."""
  return any(_BATCH_NORM_SCOPE.match(part)
             for part in op.name.split('/')[:-1])


def _hint(source: tf.Operation) -> str:
  """What to do about a statistic the user may not have written."""
  if 'SequenceMask' in source.name:
    return (" (tf.sequence_mask without maxlen pads to the shard's longest "
            'sequence: pass maxlen)')
  if source.type in ('Max', 'Min') and _decides_a_cond(source.outputs[0]):
    return (' (tf.compat.v1.nn.static_rnn with sequence_length branches on '
            "the shortest and longest lengths: tf.compat.v1.nn.dynamic_rnn, "
            'which masks each row past its own length, trains on towers)')
  if source.type == 'Size':
    return (' (Keras weighs a masked loss by tf.size / sum(mask): give the '
            "Keras loss reduction='sum' and divide by tf.reduce_sum(mask) "
            'yourself)')
  return ''
