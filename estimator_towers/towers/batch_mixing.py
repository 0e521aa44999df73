"""Refuses a loss that mixes the examples of its batch.

A loss that takes each example's negatives from the whole batch (SimCLR's
NT-Xent over `z1 @ z2^T`, two-tower retrieval with in-batch negatives,
pairwise distances for triplet mining) is not a sum of per-example terms:
computed per tower over the tower's shard, each tower sees only its shard's
examples as negatives, and the towers train another model than one device,
silently. `check_loss` finds that while the graph is built and raises a
ValueError naming the op; `whole_batch` gives a tower every tower's rows,
which makes such a loss exact.

The check follows where the shard's examples lie in each tensor the loss
is computed from: the *row axes*, the axes indexed by the tower's examples
(axis 0 of every feature and label). Ops known to keep examples apart map
them from inputs to outputs (elementwise ops, dense layers, reshapes,
transposes, convolutions, embedding lookups, reductions, which drop a
reduced row axis). The loss mixes examples where one tensor gets two row
axes: a MatMul or batched matmul, an einsum, or a broadcasting elementwise
op whose output is [rows, rows] from two shard-dependent operands. A batched
matmul whose batch dimension holds the examples on both sides (attention
within an example, [batch, heads, seq, seq]) keeps them apart.

It also refuses a loss that keeps a subset of the shard's rows chosen by
position: a slice of a row axis other than its full range (`sq[:-1]`,
`p[1:] - p[:-1]`, `x[0]`), a `tf.gather` along a row axis, a `top_k` over
one, a mask or weight comparing the rows' positions with a number
(`tf.range(n) < 6`). Each shard drops or pairs its own rows, not the
batch's. A
`tf.boolean_mask` (a gather at the rows a per-example mask picks) and a
full sort stay per example. A reversal, roll,
shuffle or sort of a row axis reorders the rows: a tensor in that order
may go through per-example ops and be reduced, meet rows reordered alike
(reversals and constant rolls compose) or values equal along the rows, or
be concatenated along the rows; an op that combines it with rows in
another order (mixup's `x * lam + tf.reverse(x, [0]) * (1 -
lam)`, negatives shifted by `tf.roll`) pairs each shard's rows, not the
batch's, and is refused. So is a product `P @ x` (or an einsum) that sums
the rows against a matrix holding no example (a one-hot permutation, a
reversed identity): its rows are combinations of the shard's, in an order
of their own. Rows that meet a statistic of their shard (a sum, mean,
max or count over them: normalised weights, centred values, a softmax over
the examples, batch norm by hand) are refused too; shard_statistics
follows those. An op the walk does not know ends the trail: the check
only refuses what it proves, so a mixing it cannot follow (a
`tf.gather_nd` of rows, a custom op, control flow) is not caught here.
`mixing_op(untraced=...)` names such ops (and slices whose bounds it
cannot read, windows along a row axis, reshapes that lose the rows): a
prediction past one is compared with one device (prediction_audit).
"""

import dataclasses
import string
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

from estimator_towers.graph import folded_shapes
from estimator_towers.graph import op_ledger
from estimator_towers.graph import reductions
from estimator_towers.towers import keras_masks
from estimator_towers.towers import loss_reduction
from estimator_towers.towers import shard_statistics
from estimator_towers.towers import sharding

Axes = FrozenSet[int]
_NONE: Axes = frozenset()

# Same shape in and out, one element from the same element.
_ELEMENTWISE = frozenset([
    'Identity', 'Snapshot', 'Cast', 'Neg', 'Abs', 'Exp', 'Log', 'Log1p',
    'Expm1', 'Sqrt', 'Rsqrt', 'Square', 'Reciprocal', 'Inv', 'Tanh',
    'Sigmoid', 'Relu', 'Relu6', 'Elu', 'Selu', 'Softplus', 'Softsign',
    'LeakyRelu', 'Sign', 'Floor', 'Ceil', 'Round', 'Rint', 'Sin', 'Cos',
    'Erf', 'Erfc', 'StopGradient', 'PreventGradient', 'CheckNumerics',
    'CheckNumericsV2', 'EnsureShape', 'OnesLike', 'ZerosLike', 'LogicalNot',
    'IsNan', 'IsFinite', 'IsInf', 'Softmax', 'LogSoftmax', 'Slice', 'Pad',
    'PadV2', 'MirrorPad', 'Tile', 'Roll', 'ReverseV2', 'RandomShuffle',
    'Cumsum', 'Cumprod', 'CumulativeLogsumexp'])
# Elementwise with numpy broadcasting: inputs align on their last axes.
_BROADCASTING = frozenset([
    'Add', 'AddV2', 'AddN', 'Sub', 'Mul', 'MulNoNan', 'RealDiv', 'Div',
    'DivNoNan', 'TrueDiv', 'FloorDiv', 'FloorMod', 'Mod', 'TruncateDiv',
    'Maximum', 'Minimum', 'SquaredDifference', 'Pow', 'Atan2', 'Xdivy',
    'Xlogy', 'Equal', 'NotEqual', 'Less', 'LessEqual', 'Greater',
    'GreaterEqual', 'LogicalAnd', 'LogicalOr', 'SelectV2', 'BiasAdd',
    'ClipByValue', 'BroadcastTo'])
# Ops whose first output keeps the examples on axis 0 (NHWC or NCHW).
_BATCH_FIRST = frozenset([
    'Conv2D', 'Conv3D', 'DepthwiseConv2dNative', 'MaxPool', 'MaxPoolV2',
    'AvgPool', 'MaxPool3D', 'AvgPool3D', 'LRN', 'ResizeBilinear',
    'ResizeNearestNeighbor', 'ResizeBicubic'])
_REDUCTIONS = frozenset(['Sum', 'Mean', 'Max', 'Min', 'Prod', 'Any', 'All',
                         'EuclideanNorm', 'ArgMax', 'ArgMin'])
_MATMULS = frozenset(['MatMul', 'BatchMatMul', 'BatchMatMulV2',
                      'BatchMatMulV3'])
_SHAPE_READS = frozenset(['Shape', 'ShapeN', 'Size', 'Rank'])
_MAX_OPS = 50_000  # Bound on the walk: a loss's graph is rarely this big.


class _Mixing(Exception):
  """An op whose output has two row axes."""

  def __init__(self, op: tf.Operation, what: str):
    super().__init__(what)
    self.op = op
    self.what = what


class _Subset(_Mixing):
  """An op that keeps some of the rows, chosen by their position; `kept`:
  the number of first rows it keeps, when a written constant says (`[:6]`,
  `tf.slice(x, [0, 0], [6, -1])`), else None."""

  def __init__(self, op: tf.Operation, what: str,
               kept: Optional[int] = None):
    super().__init__(op, what)
    self.kept = kept


class _Reordered(_Mixing):
  """An op that pairs rows reordered by position with rows in order."""


def check_loss(loss: tf.Tensor, shard, since: op_ledger.Mark,
               per_tower_batch_norm: bool = False,
               training: bool = True,
               global_rows: Optional[int] = None) -> None:
  """Refuses a tower's loss that mixes the examples of the tower's shard.

  Args:
    loss: The tower's loss.
    shard: The tower's features and labels (any nest of tensors).
    since: The mark taken before the tower's model_fn call.
    per_tower_batch_norm: Whether batch_norm='per_tower' accepts each
      shard's batch-norm moments (see shard_statistics).
    training: Whether the loss is TRAIN's, where batch-norm layers get the
      whole batch's moments (else EVAL's: they do not).
    global_rows: The static number of rows of the batch the towers share,
      if known: a slice of the rows ending at a written number below it
      keeps only some of one device's rows, even where it keeps every row
      of a shard (`e[:3]` of 3-row shards of a batch of 6).

  Raises:
    ValueError: an op the loss is computed from puts two of the shard's
      examples' axes in one tensor, or combines them with a statistic of
      the shard.
  """
  found = mixing_op(loss, shard, since, per_tower_batch_norm,
                    global_rows=global_rows)
  if found is None:
    return
  op, what = found
  if found.kind == 'statistic':
    raise ValueError(
        f'The loss {loss.op.name!r} combines examples with a statistic of '
        f'their batch: {op.type} {op.name!r} {what}. One device computes '
        'that statistic over the whole batch; each tower would compute it '
        "over its own shard (weights divided by the shard's sum, values "
        "centred or scaled by the shard's mean, max or count, a softmax "
        'over the examples) and compute another loss. Reduce first and '
        'divide once (tf.reduce_sum(loss * w) / tf.reduce_sum(w), '
        f'tf.reduce_mean(loss)); {batch_norm_remedy(training)}; or run on '
        'one device.')
  if found.kind == 'reordered':
    raise ValueError(
        f'The loss {loss.op.name!r} pairs examples of its batch by their '
        f'position: {op.type} {op.name!r} {what}. One device pairs rows of '
        'the whole batch (mixup with a reversed or shuffled batch, shifted '
        "negatives); each tower would pair its own shard's rows and train "
        'another model. Exchange the rows with estimator_towers.whole_batch '
        '(see docs/writing_model_fns.md, "Losses over the whole batch"), '
        'pair examples in the input pipeline, or train on one device.')
  if found.kind == 'positions':
    raise ValueError(
        f'The loss {loss.op.name!r} weighs examples by their position in '
        f'the batch: {op.type} {op.name!r} {what}. Each tower numbers its '
        "own shard's rows from 0, one device the whole batch's, and the "
        'towers would train another model. Pass the position in as a '
        'feature, or train on one device.')
  if found.kind == 'subset':
    raise ValueError(
        f'The loss {loss.op.name!r} keeps only some examples of its batch '
        f'by their position: {op.type} {op.name!r} {what}. Each tower '
        'would take that subset of its own shard (x[:-1] drops each '
        "shard's last row, not the batch's) and train another model than "
        'one device. Weigh '
        
        'examples out instead (tf.boolean_mask by a per-example mask, or a '
        '0/1 weight per example), slice another axis, exchange the rows '
        'with estimator_towers.whole_batch (see docs/writing_model_fns.md, '
        '"Losses over the whole batch"), or train on one device.')
  raise ValueError(
      f'The loss {loss.op.name!r} mixes the examples of its batch: '
      f'{op.type} {op.name!r} {what} (in-batch negatives, as in SimCLR or '
      'two-tower retrieval). Each tower would take its negatives from its '
      'own shard only and train another model than one device. Exchange '
      'the rows with estimator_towers.whole_batch (see '
      'docs/writing_model_fns.md, "Losses over the whole batch"), or train '
      'on one device.')


def batch_norm_remedy(training: bool) -> str:
  """What to do about batch norm's moments of a shard, in or outside TRAIN."""
  if training:
    return ('for batch norm use a tf.keras or tf.compat.v1.layers batch-norm '
            "layer (replicate_model_fn normalises it with the whole batch's "
            "moments) or batch_norm='per_tower'")
  return ('outside TRAIN replicate_model_fn does not exchange batch-norm '
          'moments: call batch-norm layers with training=False in EVAL and '
          'PREDICT (their moving statistics)')


class _Found(tuple):
  """(op, phrase): what `mixing_op` found; its `kind` is 'pairs' (two row
  axes in one tensor), 'subset' (some rows kept by position), 'reordered'
  (rows in another order met rows in order), 'statistic' or 'positions'
  (numbers the rows by position)."""

  def __new__(cls, op, what, kind='pairs'):
    found = super().__new__(cls, (op, what))
    found.kind = kind
    return found


def row_axes(tensor: tf.Tensor, shard,
             since: op_ledger.Mark) -> Optional[Axes]:
  """The axes of `tensor` that run over the shard's rows (empty for a
  statistic of the shard, {0} for a per-example tensor), or None when the
  walk cannot tell (it met pairs of rows, or a mix, on the way)."""
  found: Dict[str, Axes] = {}
  mixed = mixing_op(tensor, shard, since, rows_of=found)
  # A statistic met on the way leaves the rows' axes read to the end.
  if mixed is not None and mixed.kind != 'statistic':
    return None
  return found.get(tensor.name, _NONE)


def mixing_op(tensor: tf.Tensor, shard, since: op_ledger.Mark,
              per_tower_batch_norm: bool = False,
              report_positions: bool = False,
              rows_of: Optional[Dict[str, Axes]] = None,
              global_rows: Optional[int] = None,
              untraced: Optional[List[tf.Operation]] = None):
  """The first op `tensor` is computed from that mixes the shard's examples.

  Args:
    tensor: What to check (a tower's loss).
    shard: The tower's features and labels.
    since: The mark taken before the tower's model_fn call.
    per_tower_batch_norm: See `check_loss`.
    report_positions: Also report a `tensor` that numbers the shard's rows by
      their position (kind 'positions': each tower numbers its own from 0)
      or holds them in another order (kind 'reordered': each tower reorders
      its own shard), as a prediction must not.
    rows_of: Filled with the row axes of each tensor the walk met (see
      `row_axes`).
    global_rows: See `check_loss`.
    untraced: Filled with the ops `tensor`'s value is computed from that
      read the shard's rows but that the walk does not know: past them a
      mixing goes unseen (see `unproven`).

  Returns:
    (op, phrase saying how it mixes), or None; its `kind` says how
    ('statistic': rows met a statistic of their shard, see
    shard_statistics).
  """
  rows: Dict[str, Axes] = {} if rows_of is None else rows_of
  # The order of a tensor's rows (see `_ANY`); absent: the shard's order.
  orders: Dict[str, object] = {}
  for leaf in sharding.leaves(shard):
    # Dense features and labels only: a SparseTensor's indices are not rows.
    if isinstance(leaf, tf.Tensor) and leaf.shape.rank != 0:
      rows[leaf.name] = frozenset([0])
  ops = op_ledger.ancestors([tensor.op], since)
  if len(ops) > _MAX_OPS:
    return None
  values = _value_ancestors(tensor.op, ops)
  # Tensors whose values depend on the shard's (not only on its shape).
  held = set(rows)
  shard_rows = dense_rows(shard)
  trail = shard_statistics.Trail(per_tower_batch_norm, shard_rows,
                                 keras_masks.scalings(ops))
  # Positions in the shard's order (`tf.range` of its row count), which
  # rows in another order must not meet (a sorted batch weighted by rank).
  positions = set()
  numbered: Dict[str, tf.Operation] = {}  # Position tensor -> its Range.
  for op in op_ledger.by_creation(ops):
    if op.type not in _SHAPE_READS and any(t.name in held
                                           for t in op.inputs):
      held.update(t.name for t in op.outputs)
    inputs = [rows.get(t.name, _NONE) for t in op.inputs]
    inputs_held = [t.name in held for t in op.inputs]
    if _numbers_positions(op, trail, positions):
      positions.update(t.name for t in op.outputs)
      first = next((numbered[t.name] for t in op.inputs
                    if t.name in numbered), op)
      numbered.update((t.name, first) for t in op.outputs)
    if op in values and _compares_positions(op, inputs, positions):
      return _Found(op, 'compares the positions of the examples in their '
                    'batch with a number: a mask of rows by position',
                    kind='subset')
    if op in values and _weighs_by_position(op, inputs, positions):
      return _Found(op, 'scales the rows by their positions (tf.range of '
                    'the rows)', kind='positions')
    if not any(inputs):
      trail.follow(op, inputs, [_NONE] * len(op.outputs), inputs_held)
      continue
    try:
      product = _product(op, inputs, inputs_held)
      undone = _undoes_a_concat(op, inputs, orders)
      outputs = _rule(op, inputs, product, global_rows, shard_rows, undone)
      # Each part is one of the joined tensors, its rows in shard order.
      order = None if undone else _order(op, inputs, orders, product,
                                         positions)
    except _Subset as subset:
      if op in values:
        found = _Found(subset.op, subset.what, kind='subset')
        found.kept = subset.kept
        return found
      outputs = [_NONE] * len(op.outputs)  # Only its shape is read.
      order = None
    except _Reordered as reordered:
      return _Found(reordered.op, reordered.what, kind='reordered')
    except _Mixing as mixing:
      return _Found(mixing.op, mixing.what)
    if (untraced is not None and isinstance(outputs, _Untraced) and
        op in values and op.type not in _SHAPE_READS and any(inputs)):
      untraced.append(op)
    trail.follow(op, inputs, outputs, inputs_held)
    for output, axes in zip(op.outputs, outputs):
      if axes:
        rows[output.name] = axes
        if order is not None:
          orders[output.name] = order
  mixed = trail.mixed(tensor)
  if mixed is not None:
    return _Found(*mixed, kind='statistic')
  if report_positions and tensor.name in numbered:
    return _Found(numbered[tensor.name], 'numbers the examples of its '
                  'batch by their position', kind='positions')
  statistic = trail.statistic(tensor)
  if report_positions and statistic is not None and _rank(tensor) != 0:
    return _Found(statistic, 'makes a statistic of the shard, which the '
                  "prediction repeats in each row", kind='statistic')
  order = orders.get(tensor.name)
  if report_positions and order is not None and order != _ANY:
    return _Found(tensor.op, f'puts the rows of its batch in another order '
                  f'({_describe(order)})', kind='reordered')
  return None


def dense_rows(shard) -> Optional[int]:
  """The shard's static number of rows as its first dense tensor of rank
  1 or more holds it, or None."""
  dense = [t for t in sharding.leaves(shard)
           if isinstance(t, tf.Tensor) and t.shape.rank]
  return tf.compat.dimension_value(dense[0].shape[0]) if dense else None


# The order of a tensor's rows relative to the shard's: absent (None) for
# the shard's own order; `_ANY` for values equal along the rows (ones_like),
# which meet rows in any order; (reversed, shift) for reversals and rolls by
# constants, which compose (a double reversal is the shard's order again);
# ('op', name) for an order only that op made (a shuffle, a sort, a concat);
# a `_ByMatrix` for rows combined by a matrix (see `_product`), one order per
# value of the matrix.
_ANY = 'any'
_ROW_CONSTANT = frozenset(['OnesLike', 'ZerosLike'])


def _order(op: tf.Operation, inputs: List[Axes], orders: Dict[str, object],
           product: Optional['_Product'] = None, positions=frozenset()):
  """The order of the rows of `op`'s outputs (see `_ANY`; `product`: see
  `_product`; `positions`: tensors numbering the shard's rows in order).

  Raises:
    _Reordered: `op` combines rows in two orders: each tower would pair
      its shard's rows by position where one device pairs the batch's.
  """
  given = [orders.get(t.name) for t, axes in zip(op.inputs, inputs) if axes]
  given += [None for t, axes in zip(op.inputs, inputs)
            if not axes and t.name in positions]
  found = {order for order in given if order != _ANY}
  if op.type in _ROW_CONSTANT:
    return _ANY
  if op.type in ('ConcatV2', 'Pack') and _joins_rows(op, inputs):
    # Stacked rows, not paired; the op, for a split that takes them apart.
    return ('op', f'{op.type} {op.name!r}', op)
  if len(found) > 1:
    reorder = next(o for o in found if o is not None)
    raise _Reordered(
        op, f'combines rows reordered by {_describe(reorder)} (a reversed, '
        'rolled, shuffled or sorted batch) with rows in another order')
  base = found.pop() if found else (_ANY if given else None)
  if product is not None and base != _ANY:
    # Rows combined by one matrix are in one order, whatever the product.
    if base is not None:
      return ('op', f'{op.type} {op.name!r}')
    return _ByMatrix(_recipe(product.matrix, {}),
                     f'{op.type} {op.name!r} (a product with '
                     f'{product.matrix.op.name!r})')
  return _reordered(op, inputs, base)


# Ops that keep a vector of positions one (shifted, scaled, cast, made a
# column: `tf.range(n)[:, None] < 6`).
_POSITION_ARITHMETIC = frozenset(['Identity', 'Cast', 'Add', 'AddV2', 'Sub',
                                  'Mul', 'RealDiv', 'TrueDiv', 'Div',
                                  'FloorDiv', 'Neg', 'StopGradient',
                                  'ExpandDims', 'Reshape', 'Squeeze'])


def _numbers_positions(op: tf.Operation, trail, positions) -> bool:
  """Whether `op`'s output numbers the shard's rows in their order:
  `tf.range(n)` or `tf.linspace(a, b, n)` of the shard's row count n, or
  arithmetic of such positions."""
  if op.type == 'Range':
    return _counts_from_zero(op) and trail.counts_rows(op.inputs[1])
  if op.type in ('LinSpace', 'LinSpaceV2'):
    return trail.counts_rows(op.inputs[2])
  if op.type == 'StridedSlice' and op.inputs[0].name in positions:
    try:  # Every position, as a column (`[:, None]`) or not.
      return bool(_strided(op, frozenset([0]), _rank(op.inputs[0]) or 1))
    except _Subset:
      return False
  return op.type in _POSITION_ARITHMETIC and any(
      t.name in positions for t in op.inputs)




def _compares_positions(op: tf.Operation, inputs: List[Axes],
                        positions) -> bool:
  """Whether `op` compares the shard's row positions with what holds no
  row (`tf.range(n) < 6`, the first rows of each shard where one device
  masks the batch's; positions against each example's own lengths, a
  sequence mask, hold rows)."""
  return (op.type in reductions.COMPARISONS and not any(inputs) and
          any(t.name in positions for t in op.inputs))


def _weighs_by_position(op: tf.Operation, inputs: List[Axes],
                        positions) -> bool:
  """Whether `op` scales the shard's rows by their positions
  (`x * tf.range(n)`: each shard numbers its own rows from 0); indices
  built from positions (`tf.range(n) * classes + labels`) scale no row."""
  return (op.type in ('Mul', 'RealDiv', 'TrueDiv', 'Div') and
          any(t.name in positions for t in op.inputs) and
          any(axes for t, axes in zip(op.inputs, inputs)
              if t.name not in positions))


def _joins_rows(op: tf.Operation, inputs: List[Axes]) -> bool:
  """Whether a ConcatV2 or Pack puts its inputs' rows after one another."""
  if op.type == 'Pack':
    return False  # A new axis: rows side by side, paired.
  axis = _constant(op.inputs[-1])
  rank = _rank(op.outputs[0])
  return axis is not None and rank is not None and any(
      int(axis) % rank in axes for axes in inputs[:-1])


def _reordered(op: tf.Operation, inputs: List[Axes], base):
  """`base` after `op` moved rows, if it does (see `_ANY`)."""
  if base == _ANY or not _reorders(op, inputs):
    return base
  if op.type not in ('ReverseV2', 'Roll') or (
      base is not None and _opaque(base)):
    return ('op', f'{op.type} {op.name!r}')
  flipped, shift = base or (False, 0)
  if op.type == 'ReverseV2':
    flipped, shift = not flipped, -shift
  else:
    by = _constant(op.inputs[1])
    if by is None or np.ndim(by) != 0:
      return ('op', f'{op.type} {op.name!r}')
    shift += int(by)
  return None if (flipped, shift) == (False, 0) else (flipped, shift)


def _opaque(order) -> bool:
  """Whether `order` is no reversal or roll (it does not compose)."""
  return isinstance(order, _ByMatrix) or order[0] == 'op'


def _describe(order) -> str:
  if isinstance(order, _ByMatrix):
    return order.phrase
  if order[0] == 'op':
    return order[1]
  flipped, shift = order
  parts = (['ReverseV2'] if flipped else []) + (
      [f'Roll by {shift}'] if shift else [])
  return ' and '.join(parts)


def _reorders(op: tf.Operation, inputs: List[Axes]) -> bool:
  """Whether `op` moves rows of a row axis to other positions."""
  if op.type == 'RandomShuffle':
    return 0 in inputs[0]
  if op.type in ('ReverseV2', 'Roll'):
    rank = _rank(op.inputs[0])
    axes = _axes_of(op.inputs[1 if op.type == 'ReverseV2' else 2],
                    rank) if rank else None
    return axes is not None and any(a in inputs[0] for a in axes)
  if op.type == 'TopKV2':  # A full sort; fewer rows is refused as a subset.
    rank = _rank(op.inputs[0])
    return rank is not None and rank - 1 in inputs[0]
  return False


def _value_ancestors(op: tf.Operation, ops) -> set:
  """The ops among `ops` whose values `op` reads: not those read only for
  their shape (a subset of rows that sizes a draw takes no example) or
  waited for (an assert on some rows)."""
  ops, seen, pending = set(ops), set(), [op]
  while pending:
    current = pending.pop()
    if current in seen or current not in ops:
      continue
    seen.add(current)
    if current.type not in _SHAPE_READS:
      pending.extend(t.op for t in current.inputs)
  return seen


_UNIQUE = frozenset(['Unique', 'UniqueV2', 'UniqueWithCounts',
                     'UniqueWithCountsV2'])


def _rule(op: tf.Operation, inputs: List[Axes],
          product: Optional['_Product'] = None,
          global_rows: Optional[int] = None,
          shard_rows: Optional[int] = None,
          undone: bool = False) -> Sequence[Axes]:
  """The row axes of each of `op`'s outputs (empty where unknown);
  `global_rows`: see `check_loss`; `shard_rows`: the shard's static rows;
  `undone`: a split that takes apart what a concat joined (see
  `_undoes_a_concat`)."""
  kind = op.type
  if kind == 'Slice':
    _check_slice(op, inputs[0], global_rows)
    if _unread_bounds(op.inputs[1:]):
      return _Untraced([inputs[0]])
  if kind in _ELEMENTWISE:
    return [inputs[0]]
  if kind in _BROADCASTING:
    return [_broadcast(op, inputs)]
  if kind == 'Select':
    return [_select(op, inputs)]
  combined = product.axes if product is not None else _NONE
  if kind in _MATMULS:
    return [_matmul(op, inputs, combined)]
  if kind == 'Einsum':
    return [_einsum(op, inputs, combined)]
  if kind in _REDUCTIONS:
    return [_reduce(op, inputs[0])]
  if kind == 'L2Loss':  # A sum of every element: a scalar.
    return [_NONE]
  if kind in shard_statistics.FUSED_BATCH_NORMS:
    return _fused_batch_norm(op, inputs[0])
  if kind in _BATCH_FIRST:
    axes = [frozenset([0]) if 0 in inputs[0] else _NONE]
    # Rows along a spatial axis: a window spans neighbouring rows.
    return _Untraced(axes) if inputs[0] - {0} else axes
  if kind in ('Reshape', 'Squeeze', 'ExpandDims', 'Transpose',
              'StridedSlice'):
    axes = [_reshaped(op, inputs[0], global_rows, shard_rows)]
    if (inputs[0] and not axes[0]) or (
        kind == 'StridedSlice' and _unread_bounds(op.inputs[1:])):
      return _Untraced(axes)  # Rows lost on the way, or a slice unread.
    return axes
  if kind in ('Split', 'SplitV', 'Unpack', 'ConcatV2', 'Pack'):
    return _joined(op, inputs, undone)
  if kind in ('Gather', 'GatherV2', 'ResourceGather'):
    return [_gather(op, inputs)]
  if kind == 'DynamicPartition':  # Rows by a per-row partition: a subset.
    return [inputs[0]] * len(op.outputs)
  if kind == 'Switch':  # TF1 cond: the data goes on as it is.
    return [inputs[0], inputs[0]]
  if kind in _UNIQUE and 0 in inputs[0]:
    raise _subset(op, "keeps one row per distinct value of the shard's "
                  'examples (tf.unique): which rows are distinct depends on '
                  'the other rows of the shard')
  if kind == 'OneHot':
    return [_one_hot(op, inputs[0])]
  if kind == 'TopKV2':
    return _top_k(op, inputs[0], global_rows)
  if kind in ('SoftmaxCrossEntropyWithLogits',
              'SparseSoftmaxCrossEntropyWithLogits'):
    per_row = frozenset([0]) if any(0 in axes for axes in inputs) else _NONE
    return [per_row, _NONE]
  return _Untraced([_NONE] * len(op.outputs))


class _Untraced(list):
  """`_rule`'s answer for an op it does not know: no row axes, because the
  walk cannot tell where (or whether) the op keeps the rows it reads."""


def _fused_batch_norm(op: tf.Operation, axes: Axes) -> List[Axes]:
  """y has x's axes; the batch moments have the channel's, which hold the
  rows only when each row is a channel (Keras' layer normalisation
  reshapes to [1, rows, features, 1], NCHW)."""
  channel = shard_statistics.channel_axis(op)
  per_channel = frozenset([0]) if channel in axes else _NONE
  return [axes] + [per_channel] * (len(op.outputs) - 1)


def _rank(tensor: tf.Tensor) -> Optional[int]:
  return tensor.shape.rank


def _constant(tensor: tf.Tensor):
  value = tf.get_static_value(tensor)
  return value if value is not None else _folded(tensor, 8)


# Integer ops `_folded` evaluates (a perm, axes or sizes computed from ranks).
_FOLDS = {'Sub': np.subtract, 'AddV2': np.add, 'Add': np.add,
          'Mul': np.multiply}


def _folded(tensor: tf.Tensor, depth: int):
  """The value of a small integer computation from static ranks, shapes
  and constants (`tf.nn.softmax(x, axis=0)` swaps axes by a perm computed
  from `tf.rank(x)`, which tf.get_static_value does not fold), or None."""
  value = tf.get_static_value(tensor)
  if value is not None or depth == 0:
    return value
  op = tensor.op
  if op.type == 'Rank':
    rank = _rank(op.inputs[0])
    return None if rank is None else np.int32(rank)
  inputs = [_folded(t, depth - 1) for t in op.inputs]
  if any(v is None for v in inputs):
    return None
  if op.type in _FOLDS:
    return _FOLDS[op.type](*inputs)
  if op.type == 'Range':
    return np.arange(*inputs)
  if op.type == 'ConcatV2':
    return np.concatenate([np.reshape(v, [-1]) for v in inputs[:-1]])
  if op.type == 'Pack':
    return np.stack(inputs)
  return None


def _two_or_more(op: tf.Operation, axes: Axes, what: str) -> Axes:
  if len(axes) > 1:
    raise _Mixing(op, what)
  return axes


def _broadcast(op: tf.Operation, inputs: List[Axes]) -> Axes:
  """Inputs align on their last axes; two row axes are pairs of examples."""
  out_rank = _rank(op.outputs[0])
  if out_rank is None:
    return _NONE
  found = set()
  for tensor, axes in zip(op.inputs, inputs):
    rank = _rank(tensor)
    if axes and rank is not None:
      found.update(a + out_rank - rank for a in axes)
  return _two_or_more(
      op, frozenset(found), 'broadcasts two operands that both depend on '
      "the tower's examples into a tensor of pairs of examples (shape "
      f'{op.outputs[0].shape}; labels of shape [batch] against predictions '
      'of shape [batch, 1] broadcast so too: reshape one of them)')


def _select(op: tf.Operation, inputs: List[Axes]) -> Axes:
  """tf.compat.v1.where: a vector condition picks rows (axis 0)."""
  values = inputs[1] | inputs[2]
  condition = inputs[0]
  if condition and _rank(op.inputs[0]) == 1:
    condition = frozenset([0]) if 0 in condition else _NONE
  return _two_or_more(op, values | condition,
                      'selects between tensors of different examples')


def _matmul_layout(op: tf.Operation):
  """(rank of a, rank of b, rank of the output, a transposed, b
  transposed) of a matmul; None for an unknown rank."""
  ranks = [_rank(op.inputs[0]), _rank(op.inputs[1]), _rank(op.outputs[0])]
  if None in ranks:
    return None
  if op.type == 'MatMul':
    flips = op.get_attr('transpose_a'), op.get_attr('transpose_b')
  else:
    flips = op.get_attr('adj_x'), op.get_attr('adj_y')
  return (*ranks, *flips)


def _matmul(op: tf.Operation, inputs: List[Axes], combined: Axes) -> Axes:
  """Batch axes stay; the kept axis of each operand's matrix is an output
  axis; the contracted one is gone."""
  layout = _matmul_layout(op)
  if layout is None:
    return _NONE
  rank_a, rank_b, out, flip_a, flip_b = layout
  found = set()
  for axis in inputs[0]:
    if axis < rank_a - 2:
      found.add(axis + out - rank_a)
    elif axis == rank_a - (1 if flip_a else 2):
      found.add(out - 2)
  for axis in inputs[1]:
    if axis < rank_b - 2:
      found.add(axis + out - rank_b)
    elif axis == rank_b - (2 if flip_b else 1):
      found.add(out - 1)
  found.update(combined)
  return _two_or_more(
      op, frozenset(found), 'makes a [shard, shard] tensor of pairs of '
      f'examples (shape {op.outputs[0].shape}) from two operands that both '
      "depend on the tower's examples")


@dataclasses.dataclass(frozen=True)
class _ByMatrix:
  """The order of rows combined by a matrix: equal for equal matrices."""
  recipe: object  # `_recipe` of the matrix.
  phrase: str = dataclasses.field(compare=False)


def _recipe(tensor: tf.Tensor, memo: dict, depth: int = 40):
  """What `tensor`'s value is computed from, as a hashable nest: equal for
  two stateless computations of one value (a permutation matrix built
  twice from the same shape); a stateful op, or a walk too deep, is named."""
  if tensor.name in memo:
    return memo[tensor.name]
  op = tensor.op
  if depth == 0 or op.op_def.is_stateful:
    found = tensor.name
  else:
    attrs = tuple(sorted((k, v.SerializeToString(deterministic=True))
                         for k, v in op.node_def.attr.items()
                         if not k.startswith('_')))
    found = (op.type, tensor.value_index, attrs,
             tuple(_recipe(t, memo, depth - 1) for t in op.inputs))
  memo[tensor.name] = found
  return found


class _Product(NamedTuple):
  """Output axes that combine the shard's rows, and the matrix doing it."""
  axes: Axes
  matrix: tf.Tensor


def _product(op: tf.Operation, inputs: List[Axes], held: List[bool]
             ) -> Optional[_Product]:
  """Rows of a matmul or einsum that combine the shard's rows by a matrix.

  `P @ x` with x's rows summed against a matrix P whose values hold no
  example (built from shapes and constants: a one-hot permutation, a
  reversed identity; mixup written as a product) gives each output row a
  combination of the shard's rows: rows in an order of their own, which
  may not meet the shard's (the same matrix gives the same order). A
  matrix computed from the examples (a diagonal of per-example weights)
  weighs rows, and a uniform one whose kept axes all have size 1
  (`ones([1, n]) @ x`) sums them: neither reorders. Any other such row
  vector (`one_hot([0], n) @ x`: the first row) picks or weighs rows by
  their position, which each tower would do within its own shard.

  Args:
    op: The op.
    inputs: The row axes of each input.
    held: Whether each input's values depend on the shard's.

  Returns:
    The combination, or None.

  Raises:
    _Subset: a row vector that holds no example and is not uniform.
  """
  if op.type in _MATMULS:
    found = _matmul_combined(op, inputs, held)
  elif op.type == 'Einsum':
    found = _einsum_combined(op, inputs, held)
  else:
    return None
  if found is None:
    return None
  axes, matrix = found[0], op.inputs[found[1]]
  if not axes:
    if _uniform(matrix):
      return None  # A sum of the rows (times a constant).
    raise _Subset(op, f'picks or weighs the rows by their position (a '
                  f'product with {matrix.op.name!r}, which holds no example)')
  return _Product(frozenset(axes), matrix)


# Ops whose output is uniform when their first input is: a part, a copy or
# a rearrangement of it, or one function of each element (not a pad, which
# adds other values).
_KEEP_UNIFORM = (frozenset(['Reshape', 'ExpandDims', 'Transpose', 'Squeeze',
                            'BroadcastTo', 'StridedSlice']) |
                 _ELEMENTWISE) - frozenset(['Pad', 'PadV2', 'MirrorPad',
                                            'Cumsum', 'Cumprod',
                                            'CumulativeLogsumexp'])


def _uniform(tensor: tf.Tensor, depth: int = 40) -> bool:
  """Whether every element of `tensor` is one value (`tf.ones`, a fill, a
  constant times it): a product with it sums rows, not by position."""
  op = tensor.op
  if tensor.shape.is_fully_defined() and tensor.shape.num_elements() <= 1:
    return True  # A scalar (a count to divide by) is one value.
  if depth == 0:
    return False
  if op.type in ('Fill', 'OnesLike', 'ZerosLike'):
    return True
  if op.type == 'Const':
    value = tf.make_ndarray(op.get_attr('value'))
    return value.size == 0 or bool(np.all(value == value.flat[0]))
  if op.type in _KEEP_UNIFORM:
    return _uniform(op.inputs[0], depth - 1)
  if op.type == 'IdentityN':
    return _uniform(op.inputs[tensor.value_index], depth - 1)
  if op.type in _BROADCASTING:
    return all(_uniform(t, depth - 1) for t in op.inputs)
  if op.type in ('Pack', 'ConcatV2'):  # One part only: several may differ.
    parts = op.inputs[:-1] if op.type == 'ConcatV2' else op.inputs
    return len(parts) == 1 and _uniform(parts[0], depth - 1)
  return False


def _matmul_combined(op: tf.Operation, inputs: List[Axes], held: List[bool]):
  """(output axes, the matrix's input position) for `_product`, or None."""
  layout = _matmul_layout(op)
  if layout is None:
    return None
  rank_a, rank_b, out, flip_a, flip_b = layout
  ranks = (rank_a, rank_b)
  contracted = (rank_a - (2 if flip_a else 1), rank_b - (1 if flip_b else 2))
  kept = (rank_a - (1 if flip_a else 2), rank_b - (2 if flip_b else 1))
  for rows, matrix, axis in ((0, 1, out - 1), (1, 0, out - 2)):
    if (contracted[rows] not in inputs[rows] or held[matrix] or
        contracted[matrix] in inputs[matrix]):
      continue
    shape, rank = op.inputs[matrix].shape, ranks[matrix]
    # Its kept axis, and its batch axes (broadcast into the output's).
    mapped = {kept[matrix]: axis, **{i: i + out - rank
                                     for i in range(rank - 2)}}
    return {at for i, at in mapped.items() if shape[i] != 1}, matrix
  return None


def _einsum_combined(op: tf.Operation, inputs: List[Axes], held: List[bool]):
  """`_matmul_combined` for an einsum: a row letter summed against an
  operand that holds no example gives that operand's other letters."""
  parsed = _einsum_subscripts(op)
  if parsed is None:
    return None
  operands, output = parsed
  for i, (subscripts, axes) in enumerate(zip(operands, inputs)):
    rows = {subscripts[a] for a in axes if a < len(subscripts)}
    for letter in rows - set(output):
      for j, other in enumerate(operands):
        if j == i or held[j] or letter not in other:
          continue
        return {output.index(x) for k, x in enumerate(other)
                if x in output and op.inputs[j].shape[k] != 1}, j
  return None


def _einsum_subscripts(op: tf.Operation):
  """(each operand's subscripts, the output's) of an einsum, an ellipsis
  spelled out as letters of its own (aligned on the right, as einsum
  broadcasts them); None for an implicit output or an unknown rank."""
  equation = op.get_attr('equation').decode().replace(' ', '')
  if '->' not in equation:
    return None
  operands, output = equation.split('->')
  operands = operands.split(',')
  if '...' not in equation:
    return operands, output
  widths = []
  for subscripts, tensor in zip(operands, op.inputs):
    rank = _rank(tensor)
    if rank is None:
      return None
    named = len(subscripts.replace('...', ''))
    widths.append(rank - named if '...' in subscripts else 0)
  spare = [c for c in string.ascii_letters if c not in equation]
  letters = ''.join(spare[:max(widths)])
  return ([s.replace('...', letters[len(letters) - w:])
           for s, w in zip(operands, widths)],
          output.replace('...', letters))


def _einsum(op: tf.Operation, inputs: List[Axes], combined: Axes) -> Axes:
  parsed = _einsum_subscripts(op)
  if parsed is None:
    return _NONE
  operands, output = parsed
  equation = op.get_attr('equation').decode()
  letters = set()
  for subscripts, axes in zip(operands, inputs):
    letters.update(subscripts[a] for a in axes if a < len(subscripts))
  found = frozenset(output.index(x) for x in letters if x in output)
  found |= combined
  return _two_or_more(op, found, f'({equation}) makes a tensor of pairs of '
                      'examples from operands that depend on the tower\'s '
                      'examples')


def _axes_of(tensor: tf.Tensor, rank: int) -> Optional[List[int]]:
  """A constant axis list, normalised; None if not constant."""
  value = _constant(tensor)
  if value is None:
    return None
  return [int(a) % rank for a in ([value] if value.ndim == 0 else value)]


def _reduce(op: tf.Operation, axes: Axes) -> Axes:
  rank = _rank(op.inputs[0])
  if rank is None:
    return _NONE
  reduced = _axes_of(op.inputs[1], rank) if rank else []
  if reduced is None:
    return _NONE
  keep = op.type not in ('ArgMax', 'ArgMin') and op.get_attr('keep_dims')
  return frozenset(a if keep else a - sum(r < a for r in reduced)
                   for a in axes if a not in reduced)


def _reshaped(op: tf.Operation, axes: Axes,
              global_rows: Optional[int] = None,
              shard_rows: Optional[int] = None) -> Axes:
  """Reshape keeps the examples first; the others move their axes. A
  leading axis of 1 is the rows' when the shard has one row: BERT's
  [rows * seq, width] back to [rows, seq, width] (read past it, the rows
  became the sequence's axis and `[:, 0]` one row of them)."""
  source, result = op.inputs[0], op.outputs[0]
  rank, out = _rank(source), _rank(result)
  if rank is None or out is None:
    return _NONE
  if op.type == 'Reshape':
    first = tf.compat.dimension_value(result.shape[0]) if out else None
    if 0 not in axes or out == 0 or (
        first == 1 and shard_rows != 1 and
        tf.compat.dimension_value(source.shape[0]) != 1):
      return _past_ones(source, result, axes)
    return frozenset([0])
  if op.type == 'Transpose':
    perm = _constant(op.inputs[1])
    if perm is None:
      return _NONE
    return frozenset(j for j, p in enumerate(perm) if int(p) in axes)
  if op.type == 'ExpandDims':
    where = _axes_of(op.inputs[1], out)
    if where is None:
      return _NONE
    return frozenset(a + 1 if a >= where[0] else a for a in axes)
  if op.type == 'Squeeze':
    dims = [d % rank for d in op.get_attr('squeeze_dims')]
    if not dims:
      dims = [d for d in range(rank)
              if tf.compat.dimension_value(source.shape[d]) == 1]
    return frozenset(a - sum(d < a for d in dims) for a in axes
                     if a not in dims)
  return _strided(op, axes, rank, global_rows)


def _past_ones(source: tf.Tensor, result: tf.Tensor, axes: Axes) -> Axes:
  """A reshape that adds or drops axes of size 1 before the rows or at
  the end ([n, d] to [1, n, d, 1], as Keras' layer normalisation and a
  batched matmul over a batch of one reshape, and back), possibly merging
  the rows with the static axes after them: the rows move past the ones.
  An unknown dimension is taken as the one it must be."""
  if len(axes) != 1:
    return _NONE
  (row,) = axes
  before = [tf.compat.dimension_value(d) for d in source.shape]
  after = [tf.compat.dimension_value(d) for d in result.shape]
  rest = _without_trailing_ones(before[row + 1:])
  if any(d != 1 for d in before[:row]):
    return _NONE
  for at in range(len(after)):
    if any(d != 1 for d in after[:at]):
      break
    tail = _without_trailing_ones(after[at + 1:])
    merged = len(rest) - len(tail)
    block = rest[:max(merged, 0)]
    if merged < 0 or None in block or not all(
        a is None or b is None or a == b for a, b in zip(rest[merged:], tail)):
      continue
    size = before[row]
    expected = None if size is None else size * int(
        np.prod(block, dtype=np.int64))
    if after[at] == 1 and size != 1:
      continue  # Not the rows' axis: all of them in one row.
    if after[at] is None or expected is None or after[at] == expected:
      return frozenset([at])
  return _NONE


def _without_trailing_ones(dims: List[Optional[int]]) -> List[Optional[int]]:
  while dims and dims[-1] == 1:
    dims = dims[:-1]
  return dims


def _subset(op: tf.Operation, what: str,
            kept: Optional[int] = None) -> _Subset:
  return _Subset(op, what, kept)


def _strided(op: tf.Operation, axes: Axes, rank: int,
             global_rows: Optional[int] = None) -> Axes:
  """StridedSlice: walk its spec, input axis by input axis."""
  if op.get_attr('ellipsis_mask'):
    return _NONE
  spec = tf.compat.dimension_value(op.inputs[1].shape[0])
  if spec is None:
    return _NONE
  new, shrink = op.get_attr('new_axis_mask'), op.get_attr('shrink_axis_mask')
  mapping, source, target = {}, 0, 0
  for i in range(spec):
    if new & (1 << i):
      target += 1
    elif shrink & (1 << i):
      if source in axes:
        raise _subset(op, f'takes one row of axis {source}, which indexes '
                      "the tower's examples")
      source += 1
    else:
      if source in axes and not _full_range(op, i, source, global_rows):
        raise _subset(op, f'slices axis {source}, which indexes the '
                      "tower's examples, to less than its full range",
                      _first_rows(op, i))
      mapping[source] = target
      source, target = source + 1, target + 1
  for rest in range(source, rank):
    mapping[rest] = target + rest - source
  return frozenset(mapping[a] for a in axes if a in mapping)


def _full_range(op: tf.Operation, i: int, axis: int,
                global_rows: Optional[int] = None) -> bool:
  """Whether entry `i` of StridedSlice `op`'s spec keeps all of `axis` in
  order (`[:]`); an entry it cannot read counts as full (the check only
  refuses what it proves). `global_rows`: see `check_loss`."""
  begin, strides = _constant(op.inputs[1]), _constant(op.inputs[3])
  bound = _written_bound(op, i)
  end = bound if bound is not None else _constant_end(op, i)
  if strides is None or begin is None or end is None:
    return True
  if int(strides[i]) != 1:
    return False
  size = tf.compat.dimension_value(op.inputs[0].shape[axis])
  starts = op.get_attr('begin_mask') & (1 << i) or int(begin[i]) == 0
  # An end bounded by a written number (min(6, n)) is short of one
  # device's batch of more rows, whatever the shard's size folds into.
  short = (global_rows is not None and end < global_rows if
           bound is not None else
           _short_of_the_batch(end, op.inputs[2], global_rows))
  ends = op.get_attr('end_mask') & (1 << i) or (
      size is not None and end >= size and not short)
  return bool(starts and ends)


def _first_rows(op: tf.Operation, i: int) -> Optional[int]:
  """How many first rows entry `i` of StridedSlice `op` keeps by a written
  constant end (`[:6]`, `[0:6:1]`), or None (another start or stride, an
  open or negative end, an end computed from shapes)."""
  begin, strides = _constant(op.inputs[1]), _constant(op.inputs[3])
  end = _end(op, i)
  if (begin is None or end is None or strides is None or
      int(strides[i]) != 1 or op.get_attr('end_mask') & (1 << i) or
      (_constant(op.inputs[2]) is not None and
       folded_shapes.computed_from(op.inputs[2]))):
    return None
  if not (op.get_attr('begin_mask') & (1 << i) or int(begin[i]) == 0):
    return None
  return end if end > 0 else None


def _end(op: tf.Operation, i: int) -> Optional[int]:
  """Entry `i` of StridedSlice `op`'s end: a constant, or the written
  bound of `tf.minimum(k, n)` (at most k rows: each shard keeps up to k
  of its own), else None."""
  # The bound first: under a static batch size min(6, n) folds into the
  # shard's n, every row of it.
  bound = _written_bound(op, i)
  return bound if bound is not None else _constant_end(op, i)


def _constant_end(op: tf.Operation, i: int) -> Optional[int]:
  end = _constant(op.inputs[2])
  return None if end is None else int(end[i])


def _written_bound(op: tf.Operation, i: int) -> Optional[int]:
  """k, where entry `i` of StridedSlice `op`'s end is `tf.minimum(k, n)`
  with k written."""
  packed = op.inputs[2].op
  if packed.type != 'Pack' or len(packed.inputs) <= i:
    return None
  bound = _below_copies(packed.inputs[i]).op
  if bound.type != 'Minimum':
    return None
  written = [_constant(t) for t in bound.inputs
             if not folded_shapes.computed_from(t)]
  written = [w for w in written if w is not None and np.size(w) == 1]
  return int(np.ravel(written[0])[0]) if written else None


def _short_of_the_batch(kept: int, written: tf.Tensor,
                        global_rows: Optional[int]) -> bool:
  """Whether a slice keeping the first `kept` rows (a shard's, or more)
  keeps fewer than one device's `global_rows`: a number the model_fn wrote
  (`e[:3]`), not one folded from the shard's own shape (`e[:tf.shape(e)
  [0]]`, every row wherever it runs)."""
  return (global_rows is not None and kept < global_rows and
          not folded_shapes.computed_from(written))


def _unread_bounds(bounds: Sequence[tf.Tensor]) -> bool:
  """Whether a slice's begin, end, size or strides are neither constant
  nor computed from shapes (`h[:tf.shape(x)[0]]`: the rows wherever it
  runs): the walk takes such a slice as keeping every row, unproven."""
  return any(_constant(t) is None and not folded_shapes.computed_from(
      t, folded=lambda op: op.type in _SHAPE_READS, max_ops=50)
             for t in bounds)


def _check_slice(op: tf.Operation, axes: Axes,
                 global_rows: Optional[int] = None) -> None:
  """tf.slice: a row axis must start at 0 and keep every row (of one
  device's batch too: `global_rows`, see `check_loss`)."""
  begin, size = _constant(op.inputs[1]), _constant(op.inputs[2])
  if begin is None or size is None:
    return
  for axis in axes:
    rows = tf.compat.dimension_value(op.inputs[0].shape[axis])
    if int(begin[axis]) != 0 or not (
        int(size[axis]) == -1 or (
            rows is not None and size[axis] == rows and
            not _short_of_the_batch(rows, op.inputs[2], global_rows))):
      written = (int(size[axis]) if int(begin[axis]) == 0 and
                 int(size[axis]) > 0 and
                 not folded_shapes.computed_from(op.inputs[2]) else None)
      raise _subset(op, f'slices axis {axis}, which indexes the tower\'s '
                    'examples, to less than its full range', written)


def _top_k(op: tf.Operation, axes: Axes,
           global_rows: Optional[int] = None) -> List[Axes]:
  """TopKV2 over the last axis: a full sort of rows keeps every row (in
  another order, which a later slice would exploit); fewer is a subset,
  also a written k below the batch's rows (`global_rows`, see `check_loss`)
  that a shard of k rows keeps whole."""
  rank = _rank(op.inputs[0])
  if rank is None:
    return [_NONE, _NONE]
  written = _constant(op.inputs[1])
  short = (global_rows is not None and written is not None and
           not folded_shapes.computed_from(op.inputs[1]) and
           int(np.ravel(written)[0]) < global_rows)
  if rank - 1 in axes and (
      short or not _whole_axis(op.inputs[1], op.inputs[0])):
    raise _subset(op, 'keeps the k largest rows of an axis that indexes the '
                  "tower's examples")
  return [axes, axes]


def _whole_axis(k: tf.Tensor, values: tf.Tensor) -> bool:
  """Whether `k` is the size of `values`' last axis: a constant equal to
  it, or the last entry of a shape of `values`' rank (tf.sort's k)."""
  size = tf.compat.dimension_value(values.shape[-1])
  constant = _constant(k)
  if constant is not None:
    return size is not None and int(constant) == size
  op = k.op
  while op.type in ('StridedSlice', 'Identity', 'Cast'):
    op = op.inputs[0].op
  if op.type == 'Shape':  # tf.sort reads the shape of what it negates.
    return _rank(op.inputs[0]) == _rank(values)
  shape = _constant(op.outputs[0]) if op.type == 'Const' else None
  return (shape is not None and shape.ndim == 1 and size is not None and
          len(shape) == _rank(values) and int(shape[-1]) == size)


def _joined(op: tf.Operation, inputs: List[Axes],
            undone: bool = False) -> List[Axes]:
  """Split, Unpack, ConcatV2, Pack: one tensor's axes, or several's."""
  if op.type in ('Split', 'SplitV'):
    value, dim = _split_operands(op)
    axes = inputs[1] if op.type == 'Split' else inputs[0]  # The value's.
    if not undone:
      _check_split(op, value, dim, axes)
    return [axes] * len(op.outputs)
  if op.type == 'ConcatV2':
    together = frozenset().union(*inputs[:-1])
    if _joins_rows(op, inputs) and not all(inputs[:-1]):
      # Rows followed by other values (tf.nn.sampled_softmax_loss puts the
      # labels before the sampled classes): no longer one row axis.
      return [_NONE]
    return [together if len(together) == 1 else _NONE]
  axis = op.get_attr('axis')
  together = frozenset().union(*inputs)
  if op.type == 'Unpack':
    axis %= max(_rank(op.inputs[0]) or 1, 1)
    if axis in together and len(op.outputs) > 1:
      raise _subset(op, f'unstacks axis {axis}, which indexes the tower\'s '
                    'examples, into one tensor per row position')
    kept = frozenset(a - (a > axis) for a in together if a != axis)
    return [kept] * len(op.outputs)
  out = _rank(op.outputs[0])  # Pack
  if out is None or len(together) != 1:
    return [_NONE]
  axis %= out
  return [frozenset(a + 1 if a >= axis else a for a in together)]


def _split_operands(op: tf.Operation):
  """(value, axis) of a Split, (split_dim, value), or a SplitV, (value,
  size_splits, split_dim)."""
  if op.type == 'Split':
    return op.inputs[1], op.inputs[0]
  return op.inputs[0], op.inputs[2]


def _undoes_a_concat(op: tf.Operation, inputs: List[Axes],
                     orders: Dict[str, object]) -> bool:
  """Whether `op` splits rows, in equal parts, that a ConcatV2 stacked
  from as many tensors of equal static rows, with only row-wise ops
  between (`tf.split(f(tf.concat([view1, view2], 0)), 2)`, SimCLR's two
  views): each part is then one of the stacked tensors, in shard order."""
  if op.type != 'Split' or not inputs[1]:
    return False
  value, dim = _split_operands(op)
  order = orders.get(value.name)
  if not (isinstance(order, tuple) and len(order) == 3 and
          order[2].type == 'ConcatV2'):
    return False
  concat = order[2]
  axis, rank = _constant(dim), _rank(value)
  joined, joined_rank = _constant(concat.inputs[-1]), _rank(concat.outputs[0])
  if None in (axis, rank, joined, joined_rank):
    return False
  pieces = concat.inputs[:-1]
  sizes = {tf.compat.dimension_value(t.shape[0]) if t.shape.rank else None
           for t in pieces}
  equal_rows = (len(sizes) == 1 and None not in sizes) or _parts_of_rows(
      pieces)
  return (int(axis) % rank == 0 and int(joined) % joined_rank == 0 and
          len(pieces) == len(op.outputs) and equal_rows)


def _parts_of_rows(pieces: Sequence[tf.Tensor]) -> bool:
  """Whether `pieces` are the parts of one tensor split along another
  axis than its rows (SimCLR's views, split along the channels): each has
  that tensor's rows, also where their number is not static."""
  op = pieces[0].op
  if op.type not in ('Split', 'SplitV') or any(t.op is not op
                                               for t in pieces):
    return False
  _, dim = _split_operands(op)
  axis, rank = _constant(dim), _rank(pieces[0])
  return axis is not None and rank is not None and int(axis) % rank != 0


def _check_split(op: tf.Operation, value: tf.Tensor, dim: tf.Tensor,
                 axes: Axes) -> None:
  """tf.split along a row axis: each part holds some of the shard's rows,
  by position (the first half of each tower's shard is not the first half
  of one device's batch)."""
  if len(op.outputs) < 2:
    return
  axis, rank = _constant(dim), _rank(value)
  if axis is None or rank is None:
    return
  axis = int(axis) % rank
  if axis in axes:
    raise _subset(op, f'splits axis {axis}, which indexes the tower\'s '
                  'examples, into parts by position (tf.split)')


def _gather(op: tf.Operation, inputs: List[Axes]) -> Axes:
  """Output = params[:axis] + indices[batch_dims:] + params[axis + 1:]."""
  params, indices = op.inputs[0], op.inputs[1]
  rank_i = _rank(indices)
  batch_dims = op.get_attr('batch_dims') if op.type != 'Gather' else 0
  if rank_i is None:
    return _NONE
  if op.type == 'GatherV2':
    axis = _constant(op.inputs[2])
    rank_p = _rank(params)
    if axis is None or rank_p is None:
      return _NONE
    axis = int(axis) % rank_p
  else:
    axis = 0
  if axis in inputs[0] and op.type != 'ResourceGather' and (
      not _picked_by_mask(indices)) and not (
          axis == 0 and (_within_each_example(params, indices) or
                         _every_row_in_order(params, indices))):
    raise _subset(op, f'gathers along axis {axis}, which indexes the '
                  "tower's examples, by position")
  found = set()
  if axis in inputs[0]:
    found.add(axis)  # The rows a per-example mask picked.
  for a in inputs[1]:
    found.add(a if a < batch_dims else axis + a - batch_dims)
  if op.type != 'ResourceGather':
    for a in inputs[0]:
      if a < axis:
        found.add(a)
      elif a > axis:
        found.add(a + rank_i - batch_dims - 1)
  return frozenset(found) if len(found) == 1 else _NONE


_SAME_VALUES = frozenset(['Identity', 'Cast', 'Reshape', 'ExpandDims',
                          'Squeeze'])


def _below_copies(tensor: tf.Tensor) -> tf.Tensor:
  while tensor.op.type in _SAME_VALUES:
    tensor = tensor.op.inputs[0]
  return tensor


def _every_row_in_order(params: tf.Tensor, indices: tf.Tensor) -> bool:
  """Whether `indices` are `tf.range(n)` for n the rows of `params`: every
  row, in order. tf.vectorized_map gathers so, as
  `tf.where(n > 1, tf.range(reduce_max([n])), 0)` (0: the one row)."""
  op = _below_copies(indices).op
  if op.type == 'SelectV2' and _constant(op.inputs[2]) is not None:
    pred = op.inputs[0].op
    if (int(np.max(_constant(op.inputs[2]))) != 0 or
        pred.type != 'Greater' or _constant(pred.inputs[1]) != 1 or
        not _counts_rows_of(pred.inputs[0], params)):
      return False
    op = _below_copies(op.inputs[1]).op
  if op.type != 'Range':
    return False
  limit = op.inputs[1]
  if limit.op.type == 'Max' and limit.op.inputs[0].op.type == 'Pack' and (
      len(limit.op.inputs[0].op.inputs) == 1):
    limit = limit.op.inputs[0].op.inputs[0]  # The max of [n]: n.
  return _counts_from_zero(op) and _counts_rows_of(limit, params)


def _counts_rows_of(count: tf.Tensor, params: tf.Tensor) -> bool:
  """Whether `count` is `tf.shape(params)[0]`."""
  counted = loss_reduction.counted_rows(_below_copies(count))
  return counted is not None and (
      _below_copies(counted) is _below_copies(params))


def _within_each_example(params: tf.Tensor, indices: tf.Tensor) -> bool:
  """Whether `indices` pick each example's rows among its own rows of
  `params`, as BERT's gather_indexes does: it flattens [batch, seq, width]
  to [batch * seq, width] and adds `tf.range(batch) * seq` to each
  example's positions (which must lie in [0, seq))."""
  total = _below_copies(indices)
  source = params.op
  if total.op.type not in ('Add', 'AddV2') or source.type != 'Reshape':
    return False
  dims = [tf.compat.dimension_value(d) for d in source.inputs[0].shape]
  rank = _rank(params)
  if rank is None or len(dims) <= rank:
    return False
  block = dims[1:1 + len(dims) - rank]  # Merged into the rows' axis.
  if None in block:
    return False
  size = int(np.prod(block, dtype=np.int64))
  return any(_row_numbers_times(t) == size for t in total.op.inputs)


def _row_numbers_times(tensor: tf.Tensor) -> Optional[int]:
  """C if `tensor` is `tf.range(n) * C` (reshaped), else None."""
  product = _below_copies(tensor).op
  if product.type != 'Mul':
    return None
  a, b = product.inputs
  for numbers, factor in ((a, b), (b, a)):
    numbers = _below_copies(numbers).op
    scale = _constant(factor)
    if numbers.type != 'Range' or scale is None or np.size(scale) != 1:
      continue
    if _counts_from_zero(numbers):
      return int(np.reshape(scale, []))
  return None


def _counts_from_zero(op: tf.Operation) -> bool:
  """Whether Range `op` starts at the constant 0 and steps by 1: tf.range(n),
  the positions 0 .. n - 1."""
  start, delta = _constant(op.inputs[0]), _constant(op.inputs[2])
  return (start is not None and delta is not None and int(start) == 0 and
          int(delta) == 1)


def _picked_by_mask(indices: tf.Tensor) -> bool:
  """Whether `indices` are the positions tf.where gives of a mask (as
  tf.boolean_mask gathers, or `tf.where(mask)[:, 0]`, their row column):
  each row is kept or not on its own."""
  op = indices.op
  while op.type in ('Squeeze', 'Reshape', 'Identity', 'Cast') or (
      op.type == 'StridedSlice' and _first_column(op)):
    op = op.inputs[0].op
  return op.type == 'Where'


def _first_column(op: tf.Operation) -> bool:
  """Whether a StridedSlice is `t[:, 0]` of a matrix (every row, column 0)."""
  begin = _constant(op.inputs[1])
  return (op.inputs[0].shape.rank == 2 and begin is not None and
          np.size(begin) == 2 and int(np.ravel(begin)[1]) == 0 and
          op.get_attr('shrink_axis_mask') == 2 and
          op.get_attr('begin_mask') & 1 and op.get_attr('end_mask') & 1)


def _one_hot(op: tf.Operation, axes: Axes) -> Axes:
  axis = op.get_attr('axis')
  if axis == -1:
    return axes
  return frozenset(a + 1 if a >= axis else a for a in axes)
