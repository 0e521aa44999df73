"""How a tower's loss combines its examples, and so how towers' losses add up.

One device computes the loss of the global batch. The towers compute it on
their shards, and the wrapper weights and adds the towers' losses. Which
weights are exact depends on how the loss reduces its examples:

* a **sum** over examples (`tf.compat.v1.losses` with `Reduction.SUM`, the
  default of the `tf.compat.v1.estimator` canned Estimators, or a hand-written
  `reduce_sum`): the global loss is the towers' sum, weight 1 each;
* a **ratio** of a sum by a count that depends on the batch (`reduce_mean`,
  the other `Reduction`s, a sum divided by the number of examples or by the
  sum of the weights): the global loss is the sum of the numerators over the
  sum of the denominators, so tower t weighs `D_t / sum(D)`. For a plain mean
  that is the tower's share of the examples.

`analyze` reads this off the graph of the loss: it follows additions,
scalings, casts and divisions back to the reductions over the tower's
examples. Terms that do not depend on the examples (regularization) are
fine in a ratio, since the weights add up to one; in a sum they would be
counted once per tower, so that is an error. A loss the analysis cannot read
is reported as unknown: `tower_weights.TowerWeights` then needs to be told.
The weights themselves are tower_weights'.
"""

import dataclasses
from typing import (AbstractSet, Callable, Dict, FrozenSet, Iterator, List,
                    Optional, Tuple)

from absl import logging
import numpy as np
import tensorflow as tf

from estimator_towers.graph import folded_shapes
from estimator_towers.graph import functions
from estimator_towers.graph import op_ledger
from estimator_towers.graph import reductions
from estimator_towers.towers import divisor_totals
from estimator_towers.towers import keras_masks
from estimator_towers.towers import sharding
from estimator_towers.towers import written_sizes

tf1 = tf.compat.v1

SUM = 'sum'
RATIO = 'ratio'
UNKNOWN = 'unknown'

PASS_THROUGH = frozenset(['Identity', 'Cast', 'StopGradient', 'Squeeze',
                           'Reshape', 'CheckNumerics', 'CheckNumericsV2',
                           'EnsureShape', 'Neg'])  # Neg: a scaling by -1.
ADDS = frozenset(['Add', 'AddV2', 'AddN', 'Sub'])
SCALES = frozenset(['Mul'])
_DIVIDE = reductions.DIVIDE
_UNSPLITTABLE = 'unsplittable'  # A term kind: see _per_row.
_PER_COLUMN = 'per_column'  # A term kind: see _per_column.
_NONLINEAR = 'nonlinear'  # A term kind: a function of a reduction (sqrt).
_STATIC_COUNT = 'static_count'  # A term kind: see _from_static_count.
_UNREAD_GUARD = 'unread_guard'  # A term kind: see _chooses_per_shard.
_TRAINED_DIVISOR = 'trained_divisor'  # A term kind: see _written_ratio.
# Ops through which no gradient flows back to their inputs' variables.
_NO_GRADIENT = frozenset(['StopGradient', 'PreventGradient', 'Shape',
                          'ShapeN', 'Size', 'Rank', 'OnesLike', 'ZerosLike',
                          'Round', 'Rint', 'Floor', 'Ceil', 'Sign'])
# Ops whose output is no weighted sum of their scalar input's shards.
_NONLINEAR_OPS = frozenset([
    'Sqrt', 'Rsqrt', 'Square', 'Pow', 'Log', 'Log1p', 'Exp', 'Expm1', 'Abs',
    'Maximum', 'Minimum', 'ClipByValue', 'Softplus', 'Tanh', 'Sigmoid',
    'Reciprocal', 'Inv', 'Relu'])
# Reductions that may take the rows away (axis 0): what is left is per
# column. L2Loss sums all its input, as a Sum does.
_REDUCTIONS = frozenset(['Sum', 'Mean', 'Max', 'Min', 'Prod', 'All', 'Any',
                         'ArgMax', 'ArgMin', 'EuclideanNorm'])
# Ops whose output's rows are their inputs' rows (broadcast element-wise).
_ELEMENTWISE = frozenset([
    'Mul', 'RealDiv', 'Div', 'DivNoNan', 'TrueDiv', 'Add', 'AddV2', 'Sub',
    'AddN', 'SquaredDifference', 'Select', 'SelectV2', 'Pow', 'Maximum',
    'Minimum']) | _NONLINEAR_OPS
# Where tf.size / tf.shape fold a static shape into a constant.
_SHAPE_FOLDS = frozenset(folded_shapes.FOLDING_FUNCTIONS)
_SHAPE_ELEMENT = frozenset(['StridedSlice', 'GatherV2', 'Gather'])
# Comparisons: element-wise too (tf.compat.v1.losses' present weights).
_COMPARISONS = reductions.COMPARISONS | reductions.LOGICAL
_MAX_TERMS = 64  # Reductions a divided numerator may add up.
MAX_OPS = 2000  # Bound on the walk: losses are small subgraphs at the top.
# The name of the cast of a divisor the model_fn wrote (a sum of weights, a
# count, max(positives, 1)), which `tower_weights` must read to trust;
# the counts the analysis builds itself (a mean's tf.size) are counts.
WRITTEN_DIVISOR = 'written_divisor'



@dataclasses.dataclass
class Reduction:
  """What `analyze` found.

  Attributes:
    kind: SUM, RATIO or UNKNOWN.
    divisors: For RATIO, one scalar tensor per ratio term: the count the
      term's sum is divided by.
    constant_terms: Whether the loss adds terms that do not depend on the
      examples (e.g. regularization).
    detail: A phrase saying what was found, for error messages.
    splittable: False when a term is no weighted sum of the shards' values
      (a mean divided by the rows again): no loss_reduction makes towers
      compute it.
    remedy: For an unsplittable loss, what to write instead.
    ratios: For RATIO, the tensor of each ratio term (what `divisors`
      divide).
    example_free: No term depends on the examples (a loss of the weights
      alone, a constant): every tower computes the same value.
    guards: With `analyze(..., guards=True)`, each `tf.where(c, x, 0)` the
      loss's terms pass through whose condition is a function of a sum over
      the examples (`num_present > 0`): the towers must apply the whole
      batch's condition (see `Guard`).
    sums: For SUM, the op name of each sum term.
  """
  kind: str
  divisors: List[tf.Tensor] = dataclasses.field(default_factory=list)
  constant_terms: bool = False
  detail: str = ''
  splittable: bool = True
  remedy: str = ('Divide a sum over the examples by their count once (a '
                 'mean), or train on one device.')
  ratios: List[tf.Tensor] = dataclasses.field(default_factory=list)
  example_free: bool = False
  guards: List['Guard'] = dataclasses.field(default_factory=list)
  sums: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Guard:
  """A `tf.where(c, x, 0)` (or `tf.where(c, 0, x)`) around a loss's terms.

  One device applies c of the whole batch once: where(c, sum of x, 0). A
  tower's own c_t of its shard would drop or keep its x_t on its own, so
  every tower applies the whole batch's condition instead, rebuilt from
  the towers' total of the sum c is computed from (divisor_totals).

  Attributes:
    name: The tf.where's output tensor name.
    kept: Which input is x (1: the true branch, 2: the false branch).
    condition: c as an expression of one sum over the examples; None when
      c does not depend on the examples (the same in every tower).
  """
  name: str
  kept: int
  condition: Optional[divisor_totals.Divisor]


# What each unsplittable term kind is, and what to write instead.
_UNSPLITTABLE_KINDS = {
    _UNSPLITTABLE: (
        'it divides by a count of the examples (the rows, a sum of weights) '
        'something that is not a sum over them (a mean, or a sum plus a '
        'constant)',
        Reduction.remedy),
    _PER_COLUMN: (
        'it reduces the rows per column (tf.reduce_sum/reduce_mean/max over '
        'axis 0) and then combines the columns in a way that is no sum or '
        'mean over all the elements (e.g. a sum of per-column weighted '
        'means, as sequence_loss(average_across_timesteps=False) then a sum)',
        'Sum (or average) over all the elements at once, e.g. '
        'tf.reduce_sum(losses * weights) / tf.reduce_sum(weights), or train '
        'on one device.'),
    _STATIC_COUNT: (
        "it divides by a value computed from the shard's static size that "
        'is not the count of the elements it sums (tf.shape(x)[0] + 1, '
        'tf.size of another tensor of the batch, or of a [batch, batch] '
        "one, with a static batch size): each tower's shard has a size of "
        'its own',
        'Divide by the count itself (tf.reduce_mean), or batch with a size '
        'known only at run time (no drop_remainder), where such a divisor is '
        'read as the sum over the examples it is (tf.size(x) of a [batch, '
        'k] tensor, tf.reduce_sum(tf.ones_like(x)) + 1), or train on one '
        'device.'),
    _UNREAD_GUARD: (
        'it chooses with a scalar tf.where by a condition on the examples '
        'that is no function of one sum over them (two sums, a max, a '
        "static shape): each tower would choose by its own shard's value",
        'Make the condition a function of one sum over the examples (a '
        'count, a sum of weights: tf.where(tf.reduce_sum(w) > 0, loss, 0)), '
        'or train on one device.'),
    _TRAINED_DIVISOR: (
        'it divides by a sum computed from trainable variables (a learned '
        'weighting or mask): one device differentiates through that '
        "divisor, which a tower's share of the whole batch's divisor cannot "
        'carry',
        'Stop the divisor\'s gradient (tf.stop_gradient(tf.reduce_sum(w)))'
        ' if the weights are not meant to be trained through it, or train '
        'on one device.'),
    _NONLINEAR: (
        'it applies a nonlinear function to a reduction over the examples '
        '(e.g. the square root of a mean, an RMSE): the towers\' weighted '
        'sum of sqrt(mean) is not the square root of the global mean',
        'Minimize the reduction itself (e.g. the mean squared error, which '
        'has the same minimum as its square root) and report the nonlinear '
        'value as an eval metric, or train on one device.'),
}


def analyze(loss: tf.Tensor,
            depends_on_examples: Callable[[tf.Tensor], bool],
            guards: bool = False) -> Reduction:
  """Classifies how `loss` reduces the tower's examples.

  Args:
    loss: A tower's scalar loss.
    depends_on_examples: Tells whether a tensor depends on the tower's shard
      of the batch.
    guards: Read through `tf.where(c, x, 0)` guards (`Reduction.guards`),
      for a caller that applies the whole batch's conditions; otherwise a
      guard is unknown (a tower's guarded value does not add up).

  Returns:
    A `Reduction`.
  """
  terms: List[tuple] = []
  found_guards: Optional[List[Guard]] = [] if guards else None
  _collect_terms(loss, depends_on_examples, terms, [0], found_guards)
  refused = {UNKNOWN, *_UNSPLITTABLE_KINDS}
  if not any(kind in refused for kind, _, _ in terms):
    unread = _unread_folded_rows(loss, depends_on_examples, {
        name for kind, _, name in terms if kind == RATIO})
    if unread is not None:
      terms.append((_STATIC_COUNT, None, unread))
  kinds = {kind for kind, _, _ in terms}
  constant = 'constant' in kinds
  kinds.discard('constant')
  for bad, (what, remedy) in _UNSPLITTABLE_KINDS.items():
    if bad in kinds:
      names = ', '.join(sorted(n for k, _, n in terms if k == bad))
      return Reduction(UNKNOWN, constant_terms=constant, splittable=False,
                       detail=f'{what}: {names}', remedy=remedy)
  found = ', '.join(sorted(f'{k} ({name})' for k, _, name in terms
                           if k != 'constant'))
  if not kinds or UNKNOWN in kinds or kinds == {SUM, RATIO}:
    detail = found or 'no reduction over the examples'
    if kinds == {SUM, RATIO}:
      detail = f'it adds a sum and a mean: {found}'
    return Reduction(UNKNOWN, constant_terms=constant, detail=detail,
                     example_free=not kinds)
  kind = kinds.pop()
  divisors = [d for k, d, _ in terms if k == RATIO]
  ratios = [loss.graph.get_operation_by_name(n).outputs[0]
            for k, _, n in terms if k == RATIO]
  return Reduction(kind, divisors, constant, found, ratios=ratios,
                   guards=found_guards or [],
                   sums=[n for k, _, n in terms if k == SUM])


def _collect_terms(tensor: tf.Tensor, depends, terms: List[tuple],
                   budget: List[int],
                   guards: Optional[List[Guard]] = None) -> None:
  """Appends (kind, divisor, op name) for each additive term of `tensor`,
  and to `guards` (when given) the guards the terms pass through."""
  budget[0] += 1
  if budget[0] > MAX_OPS:
    terms.append((UNKNOWN, None, tensor.op.name))
    return
  if not depends(tensor):
    terms.append(('constant', None, tensor.op.name))
    return
  op = tensor.op
  guard = _guard(tensor, depends) if guards is not None else None
  if guard is not None:
    guards.append(guard)
    _collect_terms(op.inputs[guard.kept], depends, terms, budget, guards)
  elif guards is not None and _chooses_per_shard(tensor, depends):
    terms.append((_UNREAD_GUARD, None, op.name))
  elif op.type in PASS_THROUGH or reduces_a_scalar(tensor):
    _collect_terms(op.inputs[0], depends, terms, budget, guards)
  elif op.type in ADDS:
    for t in op.inputs:
      _collect_terms(t, depends, terms, budget, guards)
  elif op.type in SCALES:
    varying = [t for t in op.inputs if depends(t)]
    if len(varying) == 1:
      _collect_terms(varying[0], depends, terms, budget, guards)
    else:
      terms.append(_times_a_reciprocal(op, depends, budget) or
                   (UNKNOWN, None, op.name))
  elif op.type in _DIVIDE and (masked := keras_masks.masked_mean(op)):
    # Keras' masked mean divides by the elements but means the valid ones.
    terms.append(_written_ratio(masked.valid, tensor.dtype, op.name))
  elif op.type in _DIVIDE:
    numerator, denominator = op.inputs[0], op.inputs[1]
    if not depends(denominator):
      core = _without_a_floor(denominator)
      counted = _counts_the_summed(numerator, core, depends)
      if counted == 'count':
        # A mean whose count the static batch size fixed while building.
        terms.append((RATIO, tf.cast(denominator, tensor.dtype), op.name))
      elif counted == 'ambiguous':
        value = float(np.reshape(static_value(denominator), []))
        terms.append((UNKNOWN, None, _ambiguous_size(op.name, value)))
      elif _is_the_rows(core, depends) or _folded_row_sum(core, depends):
        terms.append(_per_row(numerator, denominator, depends, budget, op))
      elif _from_static_count(denominator, numerator, depends):
        terms.append((_STATIC_COUNT, None, op.name))
      else:  # A scaling, e.g. by a fixed batch size.
        _collect_terms(numerator, depends, terms, budget, guards)
    elif _other_dims(denominator, getattr(depends, 'batch_size', None)):
      # A width of the shard (tf.shape(logits)[1]): the same in every tower.
      _collect_terms(numerator, depends, terms, budget, guards)
    else:  # A count of this shard's examples (rows, weights, tokens).
      terms.append(_per_row(numerator, denominator, depends, budget, op))
  elif _reduces_all(tensor, SUM, depends) or _counts_examples(tensor, depends):
    terms.append((SUM, None, op.name))
  elif _reduces_all(tensor, 'mean', depends):
    count = tf.cast(tf.size(op.inputs[0]), tensor.dtype)
    terms.append((RATIO, count, op.name))
  elif (op.type in ('Sum', 'Mean') and tensor.shape.rank == 0 and
        _row_reduction_below(op.inputs[0], depends) is not None):
    terms.append(_per_column(tensor, depends))
  elif op.type in _NONLINEAR_OPS and all(
      t.shape.rank == 0 for t in op.inputs if depends(t)):
    terms.append((_NONLINEAR, None, op.name))
  elif _per_column_mean(tensor, depends):
    # Every column divides its sum over the rows by their number.
    rows = tf.cast(tf.shape(op.inputs[0])[0], tensor.dtype)
    terms.append((RATIO, rows, op.name))
  else:
    terms.append((UNKNOWN, None, op.name))


def _guard(tensor: tf.Tensor, depends) -> Optional[Guard]:
  """`tensor` as a `Guard` if it is a scalar `tf.where(c, x, 0)` (or
  `tf.where(c, 0, x)`) whose c is the same in every tower or a function of
  one sum over the examples; else None."""
  op = tensor.op
  if op.type not in ('Select', 'SelectV2') or tensor.shape.rank != 0:
    return None
  condition = op.inputs[0]
  for kept, zero in ((1, 2), (2, 1)):
    if not _is_zero(op.inputs[zero]):
      continue
    if not depends(condition):
      if not _static_shapes(condition, depends):
        return Guard(tensor.name, kept, None)
      # A count over the rows that a static batch folded (`num_present > 0`
      # of tf.compat.v1.losses.mean_pairwise_squared_error without weights)
      # adds up over the towers as the sum it is; `tf.shape(x)[0] == 12`
      # holds the tower's size, no such sum.
      found = divisor_totals.parts(
          condition, varies(depends), lambda t: _folded_row_sum(t, depends))
      return None if found is None else Guard(tensor.name, kept, found)
    found = divisor_totals.parts(condition, varies(depends),
                                 lambda t: is_plain_sum(t, depends))
    return None if found is None else Guard(tensor.name, kept, found)
  return None


def _chooses_per_shard(tensor: tf.Tensor, depends) -> bool:
  """Whether `tensor` is a scalar tf.where whose condition is the shard's
  (no `Guard`): no weighting of the towers makes their choices one
  device's, whatever loss_reduction says."""
  op = tensor.op
  return (op.type in ('Select', 'SelectV2') and tensor.shape.rank == 0 and
          (depends(op.inputs[0]) or _static_shapes(op.inputs[0], depends)))


def _static_shapes(tensor: tf.Tensor, depends) -> bool:
  """Whether `tensor` may hold the shard's static size: a shape or size
  folded while building, from a shard of static rows (with unknown rows
  no folded shape holds them), other than one of its other dimensions
  picked by a known index (`tf.shape(x)[1]`)."""
  return (getattr(depends, 'batch_size', None) is not None and
          _from_shapes(tensor, rows_only=True))


def varies(depends) -> Callable[[tf.Tensor], bool]:
  """What `divisor_totals.parts` must read as the tower's, not as a
  constant of its expression: what depends on the shard but for its other
  dimensions, and shapes folded from its static rows."""
  rows = getattr(depends, 'batch_size', None)
  return lambda t: ((depends(t) and not _other_dims(t, rows)) or
                    _static_shapes(t, depends))


def _is_zero(tensor: tf.Tensor) -> bool:
  """Whether `tensor` is zeros whatever the examples."""
  if skip_pass_through(tensor).op.type == 'ZerosLike':
    return True
  value = tf.get_static_value(tensor)
  return value is not None and not np.any(value)


def _per_column_mean(tensor: tf.Tensor, depends) -> bool:
  """Whether `tensor` is `tf.reduce_mean(x, 0)` of per-example rows `x`,
  columns kept (a metric's per-class mean of probabilities)."""
  op = tensor.op
  if op.type != 'Mean' or not tensor.shape.rank or _reduced_axes(op) != {0}:
    return False
  values = op.inputs[0]
  return (_row_reduction_below(values, depends) is None and
          _may_be_the_rows(values.shape, depends))


def _is_the_rows(denominator: tf.Tensor, depends) -> bool:
  """Whether a constant divisor is the shard's static number of rows.

  `tf.shape(x)[0]` of a statically shaped shard is an element of a shape
  that folded to a constant vector while the graph was built: the tower's
  row count, which one device's batch does not share, not a fixed scaling
  (Keras divides an activity regularizer by it). A scalar constant that
  happens to equal the rows (a sequence length) stays a scaling.
  """
  rows = getattr(depends, 'batch_size', None)
  element = skip_pass_through(denominator).op
  if rows is None or element.type not in _SHAPE_ELEMENT:
    return False
  shape = element.inputs[0]
  if not folded_shape(shape.op) or shape.shape.rank != 1:
    return False
  if _folded_element_index(element) != 0:
    # Another dimension that happens to equal the rows (a width of 3 on
    # shards of 3 rows): a fixed scaling, as one device's is.
    return False
  if not _rows_element(element.outputs[0], depends) and (
      folded_shapes.source(shape.op) is not None):
    # The first axis of a tensor free of the examples (a table), or of one
    # whose rows are elsewhere (per-class sums transposed).
    return False
  value = static_value(denominator)
  return value is not None and np.size(value) == 1 and (
      float(np.reshape(value, [])) == float(rows))


def _folded_element_index(element: tf.Operation) -> Optional[int]:
  """Which dimension a StridedSlice or Gather of a folded shape picks
  (non-negative), or None when not known while building."""
  index = static_value(element.inputs[1])
  dims = element.inputs[0].shape.num_elements()
  if index is None or np.size(index) != 1 or not dims:
    return None
  return int(np.reshape(index, [])) % dims


def _per_row(numerator: tf.Tensor, denominator: tf.Tensor, depends,
             budget: List[int], op: tf.Operation) -> tuple:
  """The term `numerator / count` for a count of the shard's examples (its
  rows, or a sum of weights): a mean if `numerator` is a (scaled) sum over
  the examples. A mean divided again, or a constant (each tower would
  divide it by its own count), is no weighted sum of the shards' values:
  unsplittable. Anything else is unknown."""
  inner: List[tuple] = []
  _collect_terms(numerator, depends, inner, budget)
  kinds = {kind for kind, _, _ in inner}
  if kinds == {SUM}:
    return _written_ratio(denominator, op.outputs[0].dtype, op.name)
  if kinds & ({RATIO, 'constant'} | set(_UNSPLITTABLE_KINDS)) and (
      UNKNOWN not in kinds):
    return (_UNSPLITTABLE, None, op.name)
  return (UNKNOWN, None, op.name)


def _times_a_reciprocal(op: tf.Operation, depends, budget: List[int]
                        ) -> Optional[tuple]:
  """The term `(c / D) * S` of a sum S over the examples: a ratio written
  as a product (the Object Detection API's `(1 / normalizer) * loss`), or
  None."""
  if len(op.inputs) != 2:
    return None
  for scale, summed in (op.inputs, reversed(list(op.inputs))):
    scale = skip_pass_through(scale)
    if scale.op.type not in _DIVIDE or depends(scale.op.inputs[0]) or (
        not depends(scale.op.inputs[1])):
      continue
    inner: List[tuple] = []
    _collect_terms(summed, depends, inner, budget)
    if {kind for kind, _, _ in inner} == {SUM}:
      return _written_ratio(scale.op.inputs[1], op.outputs[0].dtype, op.name)
  return None


def _written_ratio(divisor: tf.Tensor, dtype: tf.DType, name: str) -> tuple:
  """The RATIO term of a divisor the model_fn wrote, or a trained-divisor
  term when a gradient reaches a trainable variable through it."""
  if _trained_through(divisor) is not None:
    return (_TRAINED_DIVISOR, None, name)
  # An identity even when no cast is needed: its name marks the divisor.
  return (RATIO, tf.identity(tf.cast(divisor, dtype), name=WRITTEN_DIVISOR),
          name)


def _trained_through(tensor: tf.Tensor) -> Optional[str]:
  """The name of a trainable variable a gradient of `tensor` reaches, or
  None. Integer and bool tensors (a comparison, a count) and stopped
  gradients carry none."""
  graph = tensor.graph
  trainable = {}
  for variable in graph.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES):
    trainable[variable.op.name] = variable.name
  # Each entry: a tensor, and how a function body's inputs map to the
  # tensors its call took (a function's ops are walked through, so that a
  # count taken inside one carries no gradient, as outside).
  stack, seen = [(tensor, {})], set()
  while stack and len(seen) < MAX_OPS:
    current, bound = stack.pop()
    if not (current.dtype.is_floating or current.dtype == tf.resource):
      continue
    op = current.op
    if id(current) in bound:
      stack.append(bound[id(current)])
      continue
    body = functions.called_body(op)
    # A call's outputs are walked one by one, and a body once per call.
    key = (id(op.graph), op.name, id(bound),
           None if body is None else current.value_index)
    if key in seen or op.type in _NO_GRADIENT:
      continue
    seen.add(key)
    if op.name in trainable and op.graph is graph:
      return trainable[op.name]
    if body is not None:
      inner = {id(arg): (outer, bound) for arg, outer in zip(body.inputs,
                                                              op.inputs)}
      stack.append((body.outputs[current.value_index], inner))
    else:
      stack.extend((t, bound) for t in op.inputs)
  return None


def _counts_the_summed(numerator: tf.Tensor, denominator: tf.Tensor,
                       depends) -> Optional[str]:
  """Whether a constant divisor is the number of elements summed.

  With a static batch size, tf.compat.v1.losses and Keras compute the count
  of a mean from static shapes (tf.size, tf.shape): the divisor no longer
  depends on the examples, but it still is the tower's count, not a fixed
  scaling. A constant the user wrote that equals a size the shard fixes is
  ambiguous: `x.shape[0]` is the rows, a global batch size that happens to
  equal the shard's elements is a scaling; nothing in the graph tells them
  apart (see written_sizes).

  Returns:
    'count' (from a folded shape), 'ambiguous' (a size of the shard,
    written by the user), or None (not the number of elements summed).
  """
  shapes = _summed_shapes(numerator, depends)
  if not shapes:
    return None
  value = static_value(denominator)
  if value is None or np.size(value) != 1:
    return None
  value = float(np.reshape(value, []))
  if not (_from_shapes(denominator) or
          _folded_row_sum(denominator, depends)):
    rows = getattr(depends, 'batch_size', None)
    return 'ambiguous' if any(
        written_sizes.shard_size(abs(value), shape, rows) or
        (shape.is_fully_defined() and abs(value) == shape.num_elements())
        for shape in shapes) else None
  if not _reduces_all(numerator, SUM, depends):
    return None
  summed = shapes[0]
  if not summed.is_fully_defined() or value != float(summed.num_elements()):
    return None
  # Equal here, but a count only if it grows with the rows as they do
  # (sum(range(n) + 1) is 6 for 3 rows of 2, 21 for one device's 6).
  return 'count' if _row_degree(denominator, depends) == 1 else None


def _summed_shapes(tensor: tf.Tensor, depends) -> List[tf.TensorShape]:
  """The shapes of the tensors reduced by the sums over the shard that
  `tensor` is made of (reduce_sum, l2_loss), through scalings by
  constants, additions and pass-throughs (`0.5 * tf.reduce_sum(e)`, a sum
  of two sums); empty when anything else makes `tensor`."""
  pending, shapes = [tensor], []
  while pending:
    if len(shapes) + len(pending) > _MAX_TERMS:
      return []
    current = pending.pop()
    if not depends(current):
      continue  # A term free of the examples (a weight's l2).
    op = current.op
    scaled = [t for t in op.inputs if depends(t)]
    if op.type in PASS_THROUGH or reduces_a_scalar(current):
      pending.append(op.inputs[0])
    elif op.type in ADDS:
      pending.extend(op.inputs)
    elif op.type in SCALES and len(scaled) == 1:
      pending.append(scaled[0])
    elif op.type == 'L2Loss' and _may_be_the_rows(op.inputs[0].shape,
                                                   depends):
      shapes.append(op.inputs[0].shape)
    elif _reduces_all(current, SUM, depends):
      # (A mean divided by a written constant equal to the rows stays a
      # scaling: a sequence length, more often than x.shape[0] again.)
      shapes.append(op.inputs[0].shape)
    else:
      return []
  return shapes


# A floor or an epsilon added to a count keeps it the count of a shard
# that has rows: `tf.maximum(n, 1)`, `n + 1e-8` (tiny: one device's divisor
# is n + eps once, the towers' are n_t + eps each).
_FLOOR_AT_MOST = 1.0
_EPSILON_AT_MOST = 1e-5


def _without_a_floor(divisor: tf.Tensor) -> tf.Tensor:
  """`divisor` without the floors and epsilons that guard a count against
  zero (`tf.maximum(tf.size(e), 1)`, `tf.size(e) + 1e-8`): the count they
  leave as it is for a shard that has rows."""
  while True:
    op = divisor.op
    while op.type in ('Identity', 'Cast'):
      divisor, op = op.inputs[0], op.inputs[0].op
    if op.type not in ('Maximum', 'Add', 'AddV2') or len(op.inputs) != 2:
      return divisor
    found = []
    for kept, guard in ((0, 1), (1, 0)):
      value = tf.get_static_value(op.inputs[guard])
      if value is None or np.size(value) != 1:
        continue
      value = float(np.reshape(value, []))
      if (value <= _FLOOR_AT_MOST if op.type == 'Maximum' else
          abs(value) <= _EPSILON_AT_MOST):
        found.append(op.inputs[kept])
    if not found:
      return divisor
    # max(n, 1) of a 1-row shard: both qualify; the count is the one folded.
    divisor = next((t for t in found if _from_shapes(t)), found[0])


def warn_of_a_written_size_product(loss: tf.Tensor, depends) -> None:
  """Logs a warning when the loss multiplies a sum over the shard by the
  reciprocal of a size the shard fixes, or a mean by such a size.

  `tf.reduce_sum(e) * (1 / x.shape[0])` of a static batch is a mean per
  example on one device, read here as a sum scaled by a fixed coefficient
  (the towers then train off one device's numbers); refusing every
  coefficient that happens to equal a shard's size refused common losses
  (`2.0 * mean` on 2-row shards), so such a product is only named.
  Factors inside a divided numerator are not looked at: the division
  decides the reading there.
  """
  rows = getattr(depends, 'batch_size', None)
  if rows is None:
    return
  pending, seen = [loss], set()
  while pending and len(seen) < MAX_OPS:
    tensor = pending.pop()
    if tensor.op.name in seen or not depends(tensor):
      continue
    seen.add(tensor.op.name)
    op = tensor.op
    if op.type in PASS_THROUGH or op.type in ADDS:
      pending.extend(op.inputs)
    elif op.type in SCALES and len(op.inputs) == 2:
      varying = [t for t in op.inputs if depends(t)]
      fixed = [t for t in op.inputs if not depends(t)]
      if len(varying) != 1:
        continue
      pending.append(varying[0])
      found = _size_product(varying[0], fixed[0], rows)
      if found:
        logging.warning(
            'replicate_model_fn: the loss %r multiplies %s, a size of each '
            "tower's shard under this static batch size. If it is "
            "x.shape[0] (the shard's rows, not one device's batch), the "
            "towers train off one device's numbers: write tf.shape(x)[0]. "
            "If it is a fixed coefficient, pass loss_reduction='%s' to say "
            'so and silence this.', loss.op.name, *found)
        return


def _size_product(varying: tf.Tensor, fixed: tf.Tensor,
                  rows: int) -> Optional[Tuple[str, str]]:
  """How `varying * fixed` multiplies a reduction over the shard by a
  shard size (a mean) or its reciprocal (a sum), and the loss_reduction
  that reads it as a fixed coefficient; or None."""
  # static_value, not tf.get_static_value, which folds no Reciprocal
  # (`sum * tf.math.reciprocal(n)` went unnamed).
  value = static_value(fixed)
  if value is None or np.size(value) != 1 or _from_shapes(fixed):
    return None  # Folded sizes are _unread_folded_rows' to read.
  value = abs(float(np.reshape(value, [])))
  reduced = skip_pass_through(varying).op
  if not value or reduced.type not in ('Sum', 'Mean'):
    return None
  factor = value if reduced.type == 'Mean' else 1 / value
  size = written_sizes.shard_size(factor, reduced.inputs[0].shape, rows)
  if size is None:
    return None
  what, told = ('a mean', 'mean') if reduced.type == 'Mean' else ('a sum',
                                                                 'sum')
  return f'{what} over the shard by {value:g} ({size} or its reciprocal)', told


def _ambiguous_size(name: str, value: float) -> str:
  """The detail of an UNKNOWN term divided by a constant the model_fn wrote
  that equals a size of the shard."""
  return (f'{name}: a reduction over the shard divided by {value:g}, a '
          'size of the tower\'s shard: either that size written as a '
          'number (x.shape[0] of a static batch), which each tower has of '
          'its own, or a fixed scaling that equals it (a global batch size)')


def _row_degree(tensor: tf.Tensor, depends) -> Optional[int]:
  """The power of the shard's row count in a value folded from static
  shapes (1 for a count of its elements: tf.size, tf.shape(x)[0] times
  other dimensions, a sum of ones over the rows), or None when it is no
  product of such terms."""
  op = skip_pass_through(tensor).op
  if op.type == 'Const':
    if not folded_shape(op):
      return 0  # A constant the model_fn wrote.
    if np.size(tf.get_static_value(op.outputs[0])) != 1:
      return None
    return _folded_rows_power(op, depends)  # A size.
  if op.type in _SHAPE_ELEMENT and folded_shape(op.inputs[0].op):
    index = _folded_element_index(op)
    if index is None:
      return None
    power = _folded_rows_power(op.inputs[0].op, depends)
    if power == 0:
      return 0  # The shape of a tensor other than the shard's.
    if power is None and index:
      return None  # Another dimension as long as the rows.
    return int(index == 0)
  if op.type == 'Prod' and folded_shape(op.inputs[0].op):
    return 1 if _reduced_axes(op) == {0} else None
  if op.type == 'Sum':
    return 1 if _folded_row_sum(op.outputs[0], depends) else None
  if op.type in ('Mul', 'RealDiv', 'Div', 'TrueDiv'):
    left, right = (_row_degree(t, depends) for t in op.inputs)
    if left is None or right is None:
      return None
    return left + right if op.type == 'Mul' else left - right
  return None


def _folded_rows_power(constant: tf.Operation, depends) -> Optional[int]:
  """The power of the shard's rows in the size of the tensor a folded
  shape constant was read from: 1 for a tensor of the shard with the rows
  first (a width equal to the rows included, unless the tensor holds pairs
  of examples), 0 for one that does not depend on the shard (a weight),
  None otherwise ([rows, rows] pairs, rows not first). A constant folded
  outside the towers' build (no recorded source) counts as a count's, 1."""
  source = folded_shapes.source(constant)
  if source is None:
    return 1
  if not _of_the_batch(source, depends):
    return 0
  axes = _row_axes(source, depends)
  if axes is None:  # Shaped by the rows only, or not readable: its shape.
    dims = source.shape.as_list() if source.shape.rank else []
    rows = getattr(depends, 'batch_size', None)
    if not dims or dims[0] != rows or rows in dims[1:]:
      return None
    return 1
  return 1 if axes == {0} else 0 if not axes else None


def _of_the_batch(tensor: tf.Tensor, depends) -> bool:
  """Whether a tensor depends on the shard's values, or takes its shape
  from the shard's (`tf.ones_like(x)`, `tf.range(tf.shape(x)[0])` fold a
  static shape of the shard: their values depend on no op of it)."""
  if depends(tensor):
    return True
  since = getattr(depends, 'since', None)
  pending, seen = [tensor.op], set()
  while pending and len(seen) < MAX_OPS:
    op = pending.pop()
    if op.name in seen or (since is not None and
                           op_ledger.made_before(op, since)):
      continue
    seen.add(op.name)
    source = folded_shapes.source(op)
    if source is not None:
      if depends(source):
        return True
      pending.append(source.op)
    pending.extend(t.op for t in op.inputs)
  return False


def from_static_rows(tensor: tf.Tensor, depends) -> bool:
  """Whether a tensor is computed from the shard's static number of rows.

  With a static batch size `tf.size(labels)`, `tf.shape(x)[0]` and
  `tf.ones_like(labels)` fold into constants that read no op of the shard:
  `depends` says they do not depend on it, yet each tower's holds its own
  shard's count, and one device's the whole batch's. An element of another
  dimension (`tf.shape(x)[1]`) is the same in every tower and is not
  counted.
  """
  def another_dimension(op: tf.Operation) -> bool:
    return (op.type in _SHAPE_ELEMENT and folded_shape(op.inputs[0].op) and
            not _rows_element(op.outputs[0], depends))
  return folded_shapes.computed_from(
      tensor, lambda op: folded_shapes.kind(op) is not None and
      _from_the_shard(op, depends), another_dimension, MAX_OPS)


def static_count(tensor: tf.Tensor, depends) -> bool:
  """Whether a tensor `from_static_rows` is a count of the shard's examples
  or of their elements (`tf.size(labels)`, `tf.shape(x)[0]`,
  `tf.reduce_sum(tf.ones_like(labels))`), which adds up over shards."""
  tensor = skip_pass_through(tensor)
  op = tensor.op
  if op.type in SCALES:  # A count times a fixed number.
    fixed = [not depends(t) and not from_static_rows(t, depends)
             for t in op.inputs]
    return any(fixed[1 - i] and static_count(t, depends)
               for i, t in enumerate(op.inputs))
  if op.type == 'Sum' and tensor.shape.rank == 0:
    summed = op.inputs[0].op  # A sum of a small ones_like, folded.
    if (folded_shapes.kind(summed) == folded_shapes.FILL and
        _reduced_axes(op) == set(range(op.inputs[0].shape.rank or 0)) and
        _from_the_shard(summed, depends)):
      return _folded_rows_power(summed, depends) == 1
  if _folded_size(op) and _from_the_shard(op, depends):
    return _folded_rows_power(op, depends) == 1
  return _rows_element(tensor, depends) or _folded_row_sum(tensor, depends)


def _row_axes(tensor: tf.Tensor, depends) -> Optional[FrozenSet[int]]:
  """The axes of a tensor of the shard that run over its rows (see
  batch_mixing.row_axes): {0} per example, empty for a statistic of the
  shard (per-class sums: as long on one device), None when unknown."""
  # Imported here: batch_mixing reads shard statistics, which read losses.
  from estimator_towers.towers import batch_mixing  # pylint: disable=g-import-not-at-top
  shard, since = getattr(depends, 'shard', None), getattr(depends, 'since',
                                                          None)
  if shard is None or since is None:
    return None
  for _ in range(MAX_OPS):
    if depends(tensor):
      return batch_mixing.row_axes(tensor, shard, since)
    # Free of the shard's values: a fill shaped like one of its tensors
    # (tf.ones(tf.shape(l)), a small ones_like) has that tensor's rows.
    op = tensor.op
    if op.type == 'Fill' and folded_shapes.source(op.inputs[0].op) is not None:
      tensor = folded_shapes.source(op.inputs[0].op)
    elif folded_shapes.kind(op) == folded_shapes.FILL:
      tensor = folded_shapes.source(op)
    elif op.type in PASS_THROUGH and op.inputs:
      tensor = op.inputs[0]
    else:
      return None
  return None


def _from_the_shard(constant: tf.Operation, depends) -> bool:
  """Whether a folded shape constant was read from a tensor that depends
  on the tower's shard."""
  source = folded_shapes.source(constant)
  return source is not None and _of_the_batch(source, depends)


def _folded_row_sum(denominator: tf.Tensor, depends) -> bool:
  """Whether a constant divisor is a sum over the shard's rows that a static
  batch size folded: `tf.compat.v1.losses`' count of present weights with
  constant weights broadcast over the rows (`weights=[[1., 0.]]`: 3 of a
  shard's 6 elements). Each tower's is its own rows' count, so the towers'
  divisors add up to one device's; as a scaling (a fixed divisor) the towers'
  losses were added: N times one device's step, silently."""
  op = skip_pass_through(denominator).op
  if op.type != 'Sum' or denominator.shape.rank != 0:
    return False
  rows = getattr(depends, 'batch_size', None)
  summed = op.inputs[0]
  return (rows is not None and summed.shape.rank is not None and
          summed.shape.rank >= 1 and _rows(summed.shape) == rows and
          _reduced_axes(op) == set(range(summed.shape.rank)) and
          _from_shapes(summed) and same_for_every_row(summed, depends))


def same_for_every_row(tensor: tf.Tensor, depends) -> bool:
  """Whether every row of `tensor` holds the same values, whatever the
  number of rows: element-wise ops of constants the model_fn wrote and of
  fills (`ones_like`) shaped like a whole tensor of the shard with the rows
  first, by its folded shape. A fill shaped from the rows' count
  (`tf.ones([n, n])`), like a [rows, rows] tensor (pairs of examples) or
  like a weight, a range over the rows or a value divided by them holds
  other values when the rows change: its sum over towers is no one
  device's."""
  pending, seen = [tensor.op], set()
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if len(seen) > MAX_OPS:
      return False
    if op.type == 'Const':
      if folded_shape(op):
        return False  # A size or shape as a value.
      if folded_shapes.kind(op) == folded_shapes.FILL and (
          _folded_rows_power(op, depends) is None):
        return False  # ones_like of pairs of examples.
    elif op.type in ('Fill', 'BroadcastTo'):
      shape = _fill_shape(op)
      if not (folded_shape(shape) and
              _folded_rows_power(shape, depends) is not None):
        return False  # [n, n] from the rows' count, or pairs of examples.
      pending.append(op.inputs[0 if op.type == 'BroadcastTo' else 1].op)
    elif (op.type in _ELEMENTWISE or op.type in PASS_THROUGH or
          op.type in _COMPARISONS):
      pending.extend(t.op for t in op.inputs)
    elif op.type == 'Sum' and 0 not in (_reduced_axes(op) or {0}):
      pending.append(op.inputs[0].op)  # Within each row (per example).
    else:
      return False
  return True


def _from_static_count(denominator: tf.Tensor, numerator: tf.Tensor,
                       depends) -> bool:
  """Whether a constant divisor is computed from the shard's static row
  count (`tf.shape(x)[0]`) or static size (`tf.size(x)` of what the
  numerator sums), folded while building, without being that count."""
  summed = None
  if _reduces_all(numerator, SUM, depends):
    summed = skip_pass_through(numerator).op.inputs[0].shape.num_elements()
  pending, seen = [denominator], set()
  while pending and len(seen) < MAX_OPS:
    tensor = pending.pop()
    if tensor.op.name in seen:
      continue
    seen.add(tensor.op.name)
    if _is_the_rows(tensor, depends) or _folded_row_sum(tensor, depends):
      return True  # (A count plus or times a constant: its own per tower.)
    op = tensor.op
    if op.type == 'Const' and _folded_size(op) and (
        _folded_rows_power(op, depends) != 0):
      value = static_value(tensor)
      if summed is not None and value is not None and np.size(value) == 1 and (
          int(np.reshape(value, [])) == summed):
        return True
      if _from_the_shard(op, depends):
        return True  # tf.size of another tensor of the shard ([rows, k]).
    if op.type in ('Fill', 'BroadcastTo') and folded_shape(
        _fill_shape(op)) and _from_the_shard(_fill_shape(op), depends):
      return True  # ones_like of a tensor of the shard, summed.
    if folded_shapes.kind(op) == folded_shapes.FILL and _from_the_shard(
        op, depends):
      return True  # A small ones_like of a tensor of the shard.
    pending.extend(op.inputs)
  return False


# How the value walk of _unread_folded_rows goes through an op: the inputs
# that carry values (not shapes, axes or indices).
_VALUE_INPUTS = {'Reshape': (0,), 'Fill': (1,), 'BroadcastTo': (0,),
                 'Tile': (0,), 'ExpandDims': (0,), 'Transpose': (0,),
                 'StridedSlice': (0,), 'Slice': (0,), 'GatherV2': (0,),
                 'Unpack': (0,)}
_VALUE_OPS = (_ELEMENTWISE | PASS_THROUGH | ADDS | SCALES | _DIVIDE |
              _COMPARISONS | _REDUCTIONS |
              frozenset(['Reciprocal', 'Inv', 'DivNoNan', 'Pack']))


def _unread_folded_rows(loss: tf.Tensor, depends,
                        read: AbstractSet[str]) -> Optional[str]:
  """The name of an op by which `loss` takes a value of the shard's static
  row count that its reading left aside, or None.

  With a static batch size, `tf.size(e)`, `tf.shape(x)[0]` and the like of
  the shard's tensors fold to constants; a ratio the reading recognised
  (`read`: its terms' ops) accounts for its divisor, but one written
  otherwise (`sum(e) * (1 / tf.size(e))`, `sum(e / tf.size(e))`, a mean
  times the rows) would be taken for a fixed scaling, each tower's own.
  The walk follows the ops that carry values (not a Reshape's shape, a
  reduction's axes).
  """
  if getattr(depends, 'batch_size', None) is None:
    return None
  pending, seen = [loss], set()
  while pending and len(seen) < MAX_OPS:
    tensor = pending.pop()
    op = tensor.op
    if (op.name, tensor.value_index) in seen or op.name in read:
      continue
    seen.add((op.name, tensor.value_index))
    if (_folded_size(op) and _from_the_shard(op, depends) and
        _folded_rows_power(op, depends) != 0):
      return op.name
    if _rows_element(tensor, depends):
      return op.name
    if op.type in _VALUE_INPUTS:
      pending.extend(op.inputs[i] for i in _VALUE_INPUTS[op.type])
    elif op.type in _VALUE_OPS:
      pending.extend(op.inputs[:1] if op.type in _REDUCTIONS else op.inputs)
  return None


def _rows_element(tensor: tf.Tensor, depends) -> bool:
  """Whether `tensor` is the element of a folded shape of the shard that
  holds its rows (`tf.shape(x)[0]`, `tf.unstack(tf.shape(x))[0]`, the
  second dimension of a transposed tensor)."""
  op = tensor.op
  if op.type == 'Unpack':
    shape, index = op.inputs[0].op, tensor.value_index
  elif op.type in _SHAPE_ELEMENT:
    shape, index = op.inputs[0].op, _folded_element_index(op)
  else:
    return False
  if not folded_shape(shape) or not _from_the_shard(shape, depends):
    return False
  if index is None:
    return True
  source = folded_shapes.source(shape)
  axes = _row_axes(source, depends)
  if axes is not None:
    return index in axes
  # Shaped by the rows only: another axis as long as them is a width,
  # unless the rows are not first (a transposed tensor).
  dims, rows = source.shape.as_list(), depends.batch_size
  return index < len(dims) and dims[index] == rows and (
      index == 0 or dims[0] != rows)


def _folded_size(op: tf.Operation) -> bool:
  """Whether `op` is a constant tf.size folded from a static shape."""
  return op.type == 'Const' and (
      folded_shapes.kind(op) == folded_shapes.SIZE or
      any(frame.name == 'size_internal' for frame in op.traceback))


def _fill_shape(op: tf.Operation) -> tf.Operation:
  """The op giving the shape of a Fill or BroadcastTo."""
  return op.inputs[1 if op.type == 'BroadcastTo' else 0].op


def folded_shape(op: tf.Operation) -> bool:
  """Whether `op` is a constant tf.size / tf.shape folded from a static shape.

  A constant made that way is a count of the shard's elements; one the user
  wrote (`/ 6.0`, a global batch size) is a scaling, even when it happens to
  equal the shard's count. Only where the constant was created tells them
  apart.
  """
  return op.type == 'Const' and (
      folded_shapes.kind(op) in (folded_shapes.SIZE, folded_shapes.SHAPE) or
      any(frame.name in _SHAPE_FOLDS for frame in op.traceback))


def _from_shapes(tensor: tf.Tensor, rows_only: bool = False) -> bool:
  """Whether a constant-valued tensor is computed from a folded shape; with
  `rows_only`, not counting an element of one picked by a known index
  other than the first (`tf.shape(x)[1]`: another dimension)."""
  def another_dimension(op: tf.Operation) -> bool:
    return (rows_only and op.type in _SHAPE_ELEMENT and
            folded_shape(op.inputs[0].op) and
            _folded_element_index(op) not in (None, 0))
  return folded_shapes.computed_from(tensor, folded_shape,
                                     another_dimension, MAX_OPS)


def _reduced_axes(op: tf.Operation) -> Optional[FrozenSet[int]]:
  """The axes a reduction op reduces, read through folded shapes; None if
  unknown."""
  return reductions.reduced_axes(op, static_value)


def _row_reduction_below(tensor: tf.Tensor, depends) -> Optional[tf.Operation]:
  """A reduction over the rows (axis 0) under element-wise ops, else None.

  Its result has columns, not rows, first: a reduction of it is no
  reduction over the examples, whatever its (unknown) first dimension.
  """
  return next(_row_reductions_below(tensor, depends), None)


def _row_reductions_below(tensor: tf.Tensor,
                          depends) -> Iterator[tf.Operation]:
  """Each reduction over the rows (axis 0, or unknown axes) `tensor` is
  computed from through element-wise ops. The walk follows only ops that
  keep their inputs' rows (not `ones_like`, whose values are no values of
  its input)."""
  pending, seen = [tensor], set()
  while pending and len(seen) < MAX_OPS:
    current = pending.pop()
    op = current.op
    if op.name in seen or not depends(current):
      continue
    seen.add(op.name)
    if op.type in _REDUCTIONS and op.outputs[0].shape.rank != 0:
      axes = _reduced_axes(op)
      if axes is None or 0 in axes:
        yield op
        continue
      pending.append(op.inputs[0])
    elif op.type in PASS_THROUGH or op.type in _ELEMENTWISE:
      pending.extend(op.inputs)


def reduces_rows(tensor: tf.Tensor, depends) -> bool:
  """Whether `tensor` is computed, through element-wise ops, from a mean
  (or max, min, product) over the shard's rows that keeps other axes (a
  column mean): one value per batch, which the towers' values do not add
  up to. A sum over the rows adds up.

  Args:
    tensor: A tower's tensor (a metric's add).
    depends: The tower's `ExampleDependence`.
  """
  return any(op.type != 'Sum'
             for op in _row_reductions_below(tensor, depends))


def _skip_scalings(tensor: tf.Tensor, depends) -> tf.Tensor:
  """`tensor` without pass-through ops and factors that are not examples'."""
  while True:
    tensor = skip_pass_through(tensor)
    op = tensor.op
    varying = [t for t in op.inputs if depends(t)]
    if op.type not in SCALES or len(varying) != 1:
      return tensor
    tensor = varying[0]


def _per_column(tensor: tf.Tensor, depends) -> tuple:
  """The term of a scalar Sum/Mean of a reduction over the rows.

  Sum(Mean(t, rows)) sums every element of t over the product of the
  reduced dimensions (the rows times any others): a ratio. A mean of it
  divides by all of t's elements. Sum(Sum(t, rows)) is a sum; a mean of it
  is a sum scaled by the columns, a fixed scaling only if they are static.
  Anything else (per-column weighted means summed, a max over the rows) is
  no weighted sum of the shards' values.
  """
  op = tensor.op
  inner_out = _skip_scalings(op.inputs[0], depends)
  inner = inner_out.op
  axes = _reduced_axes(inner) if inner.type in ('Sum', 'Mean') else None
  if (axes is None or 0 not in axes or
      _row_reduction_below(inner.inputs[0], depends) is not None):
    return (_PER_COLUMN, None, op.name)
  summed = inner.inputs[0]
  if inner.type == 'Sum':
    if op.type == 'Sum' or inner_out.shape.is_fully_defined():
      return (SUM, None, op.name)
    return (UNKNOWN, None, op.name)  # Scaled by a count of the columns.
  if op.type == 'Mean':
    count = tf.size(summed)
  else:  # What the inner mean divides every column by.
    count = tf.reduce_prod(tf.gather(tf.shape(summed), sorted(axes)))
  return (RATIO, tf.cast(count, tensor.dtype), op.name)


_STATEFUL_OR_FED = frozenset(['Placeholder', 'PlaceholderWithDefault',
                              'IteratorGetNext', 'IteratorGetNextSync'])


def static_value(tensor: tf.Tensor):
  """The value of a tensor computed from constants only, else None.

  tf.get_static_value folds few ops (not Sum); a count built from static
  shapes is evaluated in a scratch session when its ops are all pure.
  """
  value = tf.get_static_value(tensor)
  if value is not None:
    return value
  pending, ops = [tensor.op], {}
  while pending:
    op = pending.pop()
    if op.name in ops:
      continue
    ops[op.name] = op
    if (len(ops) > MAX_OPS or op.type in _STATEFUL_OR_FED or
        op.op_def.is_stateful):
      return None
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  # Only the tensor's own ops, copied one by one (serializing the whole
  # model graph per call cost seconds on big graphs), without devices: the
  # model graph may pin ops to devices a scratch session lacks (other towers
  # or tasks of a cluster); soft placement covers the functions' ops.
  graph_def = tf.compat.v1.GraphDef()
  graph_def.versions.CopyFrom(tensor.graph.graph_def_versions)
  for op in ops.values():
    node = graph_def.node.add()
    node.CopyFrom(op.node_def)
    node.device = ''
    if '_class' in node.attr:  # Colocation with ops left out of the copy.
      del node.attr['_class']
  if any(map(functions.runs_functions, ops.values())):
    graph_def.library.CopyFrom(tensor.graph.as_graph_def().library)
  with tf.Graph().as_default() as scratch:
    (copy,) = tf.graph_util.import_graph_def(
        graph_def, return_elements=[tensor.name], name='')
  config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
  with tf.compat.v1.Session(graph=scratch, config=config) as session:
    return session.run(copy)


def _reduces_all(tensor: tf.Tensor, how: str, depends) -> bool:
  """Whether `tensor` is a reduce_sum / reduce_mean over the examples.

  The reduced tensor must be a scalar of a tensor whose first dimension is
  the tower's batch: a sum of per-feature means is not a sum over examples.
  The batch dimension is unknown while the graph is built, or, when the
  input's batch size is static, the tower's static share of it.
  """
  op = skip_pass_through(tensor).op
  wanted = ('Sum', 'L2Loss') if how == SUM else ('Mean',)
  if op.type not in wanted or tensor.shape.rank != 0:
    return False
  if _row_reduction_below(op.inputs[0], depends) is not None:
    return False  # Per column: unknown columns compare equal to the rows.
  reduced = op.inputs[0].shape
  if reduced.rank is None:
    return True
  return reduced.rank >= 1 and _may_be_the_rows(reduced, depends)


def sums_the_rows(tensor: tf.Tensor, depends) -> bool:
  """Whether `tensor` is a sum over the examples, per column or whole.

  `tf.reduce_sum(x, 0)` of per-example rows `x` (a vector of per-class
  sums) adds up over the towers as a scalar sum does: a reduction over
  axis 0 of a tensor whose first dimension is the tower's batch, with no
  reduction of the rows below it.

  Args:
    tensor: The tensor.
    depends: Tells whether a tensor depends on the tower's shard (an
      `ExampleDependence`).

  Returns:
    Whether it is such a sum.
  """
  reduction = analyze(tensor, depends)
  if reduction.kind == SUM and not reduction.constant_terms:
    return True
  op = skip_pass_through(tensor).op
  if op.type != 'Sum':
    return False
  axes = _reduced_axes(op)
  summed = op.inputs[0]
  return (axes is not None and 0 in axes and
          _row_reduction_below(summed, depends) is None and
          _may_be_the_rows(summed.shape, depends))


def _counts_examples(tensor: tf.Tensor, depends) -> bool:
  """Whether `tensor` is `tf.size` or `tf.shape(...)[0]` of per-example rows.

  A count of the examples is a sum over them (of ones), whose first
  dimension is the tower's batch as in `_reduces_all`.
  """
  op = tensor.op
  if op.type == 'StridedSlice' and op.inputs[0].op.type == 'Shape':
    rows_of = counted_rows(tensor)
    if rows_of is None:
      return False
    counted = rows_of.shape
  elif op.type == 'Size':
    counted = op.inputs[0].shape
  else:
    return False
  return counted.rank is None or (
      counted.rank >= 1 and _may_be_the_rows(counted, depends))


def counted_rows(tensor: tf.Tensor) -> Optional[tf.Tensor]:
  """x, where `tensor` is `tf.shape(x)[0]` (the first element of x's
  Shape, a scalar), else None."""
  op = tensor.op
  if (op.type != 'StridedSlice' or op.inputs[0].op.type != 'Shape' or
      tensor.shape.rank != 0):
    return None
  begin = static_value(op.inputs[1])
  if begin is None or any(np.ravel(begin)):
    return None
  return op.inputs[0].op.inputs[0]


def _may_be_the_rows(shape: tf.TensorShape, depends) -> bool:
  """Whether `shape`'s first dimension may be the tower's examples.

  The shard's static row count when the batch size is static, or unknown:
  a tensor whose rows are unknown (past a loop or a sparse densification,
  also with a static batch size) is taken as the rows, as it is when the
  batch size is unknown (a tower of 1 example on a static batch of 5 was
  refused as "towers reduce differently").
  """
  rows = _rows(shape)
  return rows is None or rows == getattr(depends, 'batch_size', None)


def _rows(shape: tf.TensorShape):
  """The first dimension as an int or None, as TF2 shapes give it."""
  # tf.compat.v1.disable_v2_tensorshape() makes it a Dimension, and two
  # unknown Dimensions do not compare equal.
  return tf.compat.dimension_value(shape[0])


def skip_pass_through(tensor: tf.Tensor) -> tf.Tensor:
  while tensor.op.type in PASS_THROUGH or reduces_a_scalar(tensor):
    tensor = tensor.op.inputs[0]
  return tensor


def reduces_a_scalar(tensor: tf.Tensor) -> bool:
  """A Sum or Mean of a scalar, an identity (tf.compat.v1.losses adds one)."""
  op = tensor.op
  return op.type in ('Sum', 'Mean') and op.inputs[0].shape.rank == 0


class ExampleDependence:
  """Answers whether a tensor depends on one tower's shard of the batch.

  The walk follows data inputs only among the ops the tower created (those
  made after `since`) and stops at the shard's tensors.

  Args:
    shard: The tower's features and labels (any nest of tensors).
    since: A mark taken before the tower's model_fn call (an
      `op_ledger.Mark`).
    whole_batch: Names of ops whose values are the whole batch's, not the
      tower's (the one update's, e.g. routed gradients): the walk stops
      there.
  """

  def __init__(self, shard, since: op_ledger.Mark, whole_batch=frozenset()):
    leaves = sharding.leaves(shard, expand_composites=True)
    # A scalar feature is every tower's whole, not part of a shard.
    self._shard_ops = {t.op.name for t in leaves if isinstance(t, tf.Tensor)
                       and t.shape.rank != 0}
    dense = [t for t in sharding.leaves(shard) if isinstance(t, tf.Tensor)
             and not sharding.is_per_batch(t)]
    # The shard's static number of examples; None when known only at run
    # time (the usual case; static when the input's batch size is).
    self.batch_size = (_rows(dense[0].shape) if dense and dense[0].shape.rank
                       else None)
    self.shard, self.since = shard, since
    self._memo: Dict[str, bool] = {name: False for name in whole_batch}

  def __call__(self, tensor: tf.Tensor) -> bool:
    root = tensor.op
    stack, visiting = [(root, False)], set()
    while stack:
      op, expanded = stack.pop()
      if op.name in self._memo:
        continue
      if op.name in self._shard_ops:
        self._memo[op.name] = True
      elif op_ledger.made_before(op, self.since):
        self._memo[op.name] = False
      elif expanded:
        # An input still unresolved here closes a loop: it adds nothing new.
        self._memo[op.name] = any(self._memo.get(t.op.name, False)
                                  for t in op.inputs)
      elif op.name not in visiting:
        visiting.add(op.name)
        stack.append((op, True))
        stack.extend((t.op, False) for t in op.inputs
                     if t.op.name not in self._memo)
    return self._memo[root.name]


def is_plain_sum(tensor: tf.Tensor, depends) -> bool:
  reduction = analyze(tensor, depends)
  return reduction.kind == SUM and not reduction.constant_terms


# Ops a dimension other than the rows may be computed with.
_DIMENSION_OPS = frozenset(['Shape', 'StridedSlice', 'Cast', 'Identity',
                            'Const', 'Mul', 'Add', 'AddV2', 'Sub', 'Maximum',
                            'Minimum', 'RealDiv', 'FloorDiv', 'Prod',
                            'GatherV2', 'Pack'])


def _other_dims(tensor: tf.Tensor, rows: Optional[int] = None) -> bool:
  """Whether `tensor` is computed from dimensions of the shard other than
  its rows only (`tf.shape(x)[1]`, a feature width): the same in every
  tower, since the batch is split along the rows.

  A dimension is taken for another one only when it is known while
  building and differs from the shard's static row count `rows` (if
  known): an unknown one may be the rows of a transposed tensor (a
  time-major `[time, batch]` reads its batch as `tf.shape(x)[1]`), and the
  whole shape vector (`tf.reduce_prod(tf.shape(x))`) holds the rows.
  """
  pending, seen = [tensor], set()
  while pending:
    current = pending.pop()
    op = current.op
    if op.name in seen:
      continue
    seen.add(op.name)
    if len(seen) > 50 or op.type not in _DIMENSION_OPS or op.type == 'Shape':
      return False
    if op.type == 'StridedSlice' and op.inputs[0].op.type == 'Shape':
      if not _names_another_dim(op, rows):
        return False
      continue
    pending.extend(op.inputs)
  return True  # Walked to its dimensions and constants without the rows.


def _names_another_dim(op: tf.Operation, rows: Optional[int]) -> bool:
  """Whether a StridedSlice of a Shape picks one known dimension that
  cannot be the shard's rows."""
  begin = static_value(op.inputs[1])
  shape = op.inputs[0].op.inputs[0].shape
  if begin is None or shape.rank is None or np.size(begin) != 1:
    return False
  axis = int(np.reshape(begin, [])) % shape.rank
  size = shape[axis]
  return axis != 0 and size is not None and size != rows
