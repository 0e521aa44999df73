"""EVAL metrics that add up over towers as they do over one device's batches.

The towers of an evaluation step share each metric's state (variable
sharing): every tower's update op adds into the same `total` and `count`.
That equals one device's step only when each add is a sum over the shard's
examples (`tf.compat.v1.metrics.accuracy`: correct predictions and weights,
summed). A metric whose value is one number per batch breaks it:

* `tf.compat.v1.metrics.mean(loss)` of a scalar loss adds the loss to
  `total` and a constant 1 to `count`. N towers count each batch N times;
  canned KMeans's `score` (a mean over batches of the batch's summed
  distance) came out divided by the number of towers.
* The mean of a batch mean: each tower adds its shard's mean, but one
  device adds the mean of the whole batch.

`count_once` rewrites the towers' adds so that one step adds what one
device's step adds:

* an add that does not depend on the shard (a count of calls) is made by
  tower 0 only (the others add zero);
* an add of a sum over the shard's examples is kept: the towers' sums add
  up to the batch's;
* an add of a mean over the shard (a sum divided by a count of its
  examples) is weighted by the tower's share of the count, as the loss is
  (see loss_reduction), built as the shard's numerator over the batch's
  total so that a shard whose count is 0 (no positives, weights all 0)
  still adds its numerator, as one device counts it; an idle tower (empty
  shard) adds zero;
* an add of several means (a difference of two means over the shard) is
  weighted by the tower's share of the first mean's count, with a run-time
  check that every other mean's counts split over the towers alike;
* an add of a ratio times its own divisor (`tf.compat.v1.metrics.mean` of
  a weighted mean with `weights=` its weight) is the tower's numerator, so
  that a shard weighing 0 adds 0 (its own ratio is 0 / 0), made NaN (or 0
  for `divide_no_nan`) when the whole batch weighs 0, as one device's is;
* an add of a sum plus terms that do not depend on the shard would count
  those terms once per tower: a `ValueError`;
* an add of any other value per batch (a max, a square of a mean, a mean
  over the batch axis of a vector): a `ValueError`, as is metric state
  written from the shard by other than an add (`check_overwrites`).

Adds the analysis cannot read (a vector of per-threshold counts, as
`tf.compat.v1.metrics.auc` makes) are left as they are: they are sums of
per-example counts.

`in_tower_order` then makes the towers' adds into one state run in tower
order, so that every evaluation rounds the same way.
"""

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf

from estimator_towers.towers import loss_reduction
from estimator_towers.towers import tower_effects
from estimator_towers.towers import tower_weights

# Adds into a metric's state: position of the value they add.
_ADDS = {'AssignAdd': 1, 'AssignAddVariableOp': 1,
         # Adds at indices (mean_per_class_accuracy's per-class counts).
         'ScatterAdd': 2, 'ResourceScatterAdd': 2}


def count_once(metric_ops: Sequence[Dict[str, tuple]],
               in_tower: Sequence[Callable[[tf.Operation], bool]],
               depends_on_shard: Sequence[Callable[[tf.Tensor], bool]],
               active: Sequence[tf.Tensor],
               mixing: Optional[Callable[[tf.Tensor], Optional[tuple]]] = None
               ) -> None:
  """Makes the towers' metric adds add up to one device's (module doc).

  Args:
    metric_ops: Each tower's `eval_metric_ops`.
    in_tower: Per tower, whether an op was created by its model_fn call.
    depends_on_shard: Per tower, whether a tensor depends on its shard (a
      `loss_reduction.ExampleDependence`).
    active: Per tower, a scalar bool: whether its shard has examples.
    mixing: For a tensor of tower 0, where it mixes the shard's examples
      ((op, phrase), as `batch_mixing.mixing_op` finds it), or None.

  Raises:
    ValueError: A metric adds a sum plus terms that do not depend on the
      examples, or values that mix the shard's examples.
  """
  for name, adds in _matched_adds(metric_ops, in_tower):
    _refuse_mixing(name, adds[0], mixing)
    _count_once(name, list(adds), depends_on_shard, active)


def _matched_adds(metric_ops: Sequence[Dict[str, tuple]],
                  in_tower: Sequence[Callable[[tf.Operation], bool]]
                  ) -> Iterator[Tuple[str, Tuple[tf.Operation, ...]]]:
  """(metric name, the towers' k-th add of its update), once per add."""
  done = set()
  for name in metric_ops[0]:
    per_tower = [_adds(ops[name][1], in_tower[t])
                 for t, ops in enumerate(metric_ops)]
    if len({len(adds) for adds in per_tower}) != 1:
      continue  # Not the same model in every tower: spec_merge says so.
    for adds in zip(*per_tower):
      if adds[0].name in done:
        continue  # Shared by two metrics.
      done.update(add.name for add in adds)
      yield name, adds


def _refuse_mixing(metric: str, add: tf.Operation, mixing) -> None:
  """Refuses an add whose examples meet one another (batch_mixing)."""
  found = mixing(add.inputs[_ADDS[add.type]]) if mixing else None
  if found is None:
    return
  op, what = found
  raise ValueError(
      f'The metric {metric!r} adds values that combine the examples of '
      f'their batch: {op.type} {op.name!r} {what}. Under replicate_model_fn '
      "each tower computes them over its own shard, which is not what one "
      'device adds for the whole batch (a value divided by the batch\'s sum '
      'or count, examples paired within the batch). Compute the metric '
      'from per-example values, weighted by per-example weights '
      '(tf.compat.v1.metrics.mean(values, weights=w)), or evaluate without '
      'replicate_model_fn.')


def _count_once(metric: str, adds: List[tf.Operation], depends_on_shard,
                active) -> None:
  """Rewrites one add of every tower (the k-th of the metric's)."""
  position = _ADDS[adds[0].type]
  values = [add.inputs[position] for add in adds]
  if not any(depends(v) for depends, v in zip(depends_on_shard, values)):
    for add, value in zip(adds[1:], values[1:]):
      _replace(add, position, tf.zeros_like(value), 'once_per_step')
    return
  reductions = [loss_reduction.analyze(v, depends)
                for v, depends in zip(values, depends_on_shard)]
  kinds = {r.kind for r in reductions}
  if kinds == {loss_reduction.SUM}:
    if any(r.constant_terms for r in reductions):
      raise ValueError(
          f'The metric {metric!r} adds {reductions[0].detail} plus terms '
          'that do not depend on the examples. Under replicate_model_fn '
          "every tower adds into the metric's state, so those terms would "
          'count once per tower instead of once per batch. Add them in a '
          'metric of their own, or compute the metric from per-example '
          'values.')
    return
  if kinds != {loss_reduction.RATIO}:
    numerators = _numerators_of_weighted_ratios(values, depends_on_shard,
                                                active)
    if numerators is not None:
      for add, value in zip(adds, numerators):
        _replace(add, position, value, 'ratio_times_its_divisor')
      return
    if _unreadable_per_batch_value(values[0], depends_on_shard[0]):
      raise ValueError(
          f'The metric {metric!r} adds one value per batch that is neither '
          f'a sum nor a mean over the examples ({reductions[0].detail}, '
          'e.g. a max or a square of a mean). Under replicate_model_fn every '
          'tower adds its own shard\'s value, which is not what one device '
          'adds for the whole batch. Compute the metric from per-example '
          'values (a mean of per-example values, a sum), or evaluate without '
          'replicate_model_fn.')
    return
  spread = tower_weights.spread_exactly(values, reductions, active,
                                         depends_on_shard)
  if spread is not None:
    for add, value, on in zip(adds, spread, active):
      _replace(add, position, tf.where(on, value, tf.zeros_like(value)),
               'weighted_by_shard')
    return
  weights = tower_weights.exact_weights(values, reductions, active,
                                         depends_on=depends_on_shard)
  if weights is None:  # Several means (a difference of two): checked shares.
    weights = tower_weights.proportional_weights(
        values, reductions, active,
        f'The metric {metric!r} adds several means whose divisors do not '
        "split over the towers alike (e.g. a plain mean plus a weighted "
        "mean), so no weighting of the towers' adds gives one device's. "
        'Give each mean a metric of its own.')
  for add, value, weight, on in zip(adds, values, weights, active):
    weighted = value * tf.cast(weight, value.dtype)
    # An empty shard's mean is NaN, which a zero weight would keep.
    _replace(add, position, tf.where(on, weighted, tf.zeros_like(value)),
             'weighted_by_shard')


# Ops that keep a value (not Neg: a sign the rewrite must not drop; a Cast
# only between floating types, see `_keeps_value`).
_KEEPS_VALUE = frozenset(['Identity', 'StopGradient', 'Squeeze', 'Reshape',
                          'CheckNumerics', 'CheckNumericsV2', 'EnsureShape'])
_DIVIDES = {'RealDiv': False, 'Div': False, 'TrueDiv': False,
            'DivNoNan': True}  # Whether 0 / 0 is 0.


def _numerators_of_weighted_ratios(values: List[tf.Tensor], depends_on_shard,
                                   active: Sequence[tf.Tensor]
                                   ) -> Optional[List[tf.Tensor]]:
  """The towers' adds of a ratio weighted by its own divisor, rewritten.

  `tf.compat.v1.metrics.mean(sum(w * e) / sum(w), weights=sum(w))` (a mean
  over batches of each batch's weighted mean, each weighing the batch's
  weight) adds N / D * D per call; `mean_tensor` of per-class weighted
  means (N and D sums over the rows per class) adds it per class. One device adds N / D * D of the whole
  batch: N, or NaN when the batch weighs 0 (0 for `divide_no_nan`). Tower t
  adds its numerator N_t, times total / total for the towers' total D (the
  same NaN or 0 when it is 0): its own N_t / D_t * D_t would be NaN for a
  shard that weighs 0 in a batch that does not.

  Args:
    values: The towers' adds of one metric state.
    depends_on_shard: Per tower, its `ExampleDependence`.
    active: Per tower, whether its shard has examples.

  Returns:
    The values to add, or None when the adds are not of that form (a ratio
    times its own divisor, both sums over the shard).
  """
  found = []
  for value, depends in zip(values, depends_on_shard):
    parts = _ratio_times_its_divisor(value)
    if parts is None:
      return None
    numerator, divisor, _ = parts
    if not all(loss_reduction.sums_the_rows(part, depends)
               for part in (numerator, divisor)):
      return None
    found.append(parts)
  # In the divisor's own dtype: a float64 weight outside float32's range
  # would make the total 0 or inf.
  total = tf.add_n([tf.where(on, divisor, tf.zeros_like(divisor))
                    for (_, divisor, _), on in zip(found, active)])
  no_nan = found[0][2]
  once = tf.math.divide_no_nan(total, total) if no_nan else total / total
  return [tf.reshape(tf.cast(numerator * tf.cast(once, numerator.dtype),
                             value.dtype), tf.shape(value))
          for (numerator, _, _), value in zip(found, values)]


def _ratio_times_its_divisor(value: tf.Tensor):
  """(N, D, whether 0 / 0 is 0) if `value` is N / D * D, else None."""
  product = _kept(value)
  if product.op.type != 'Mul':
    return None
  left, right = (_kept(t) for t in product.op.inputs)
  for ratio, other in ((left, right), (right, left)):
    if ratio.op.type in _DIVIDES and _same_value(
        _kept(ratio.op.inputs[1]), other):
      return ratio.op.inputs[0], ratio.op.inputs[1], _DIVIDES[ratio.op.type]
  return None


def _kept(tensor: tf.Tensor) -> tf.Tensor:
  """`tensor` below ops that keep its value (a sum of a scalar too)."""
  while _keeps_value(tensor.op):
    tensor = tensor.op.inputs[0]
  return tensor


def _keeps_value(op: tf.Operation) -> bool:
  """Whether `op`'s output is its first input's value: a cast to an
  integer or bool truncates it, one between floating types only rounds."""
  if op.type == 'Cast':
    return op.inputs[0].dtype.is_floating and op.outputs[0].dtype.is_floating
  return op.type in _KEEPS_VALUE or (
      op.type in ('Sum', 'Mean') and op.inputs[0].shape.rank == 0)


def _same_value(a: tf.Tensor, b: tf.Tensor, depth: int = 8) -> bool:
  """Whether `a` and `b` are one tensor, or one stateless op of the same
  inputs (`tf.reduce_sum(w)` written twice)."""
  if a is b:
    return True
  if depth == 0 or a.value_index != b.value_index:
    return False
  x, y = a.op, b.op
  if (x.type != y.type or x.op_def.is_stateful or
      len(x.inputs) != len(y.inputs) or x.node_def.attr != y.node_def.attr):
    return False
  if x.type == 'Const':
    return True  # Their values are attributes, compared above.
  return all(_same_value(s, t, depth - 1) for s, t in zip(x.inputs, y.inputs))


def _unreadable_per_batch_value(value: tf.Tensor, depends_on_shard) -> bool:
  """Whether an add the analysis cannot read is one value per batch.

  A scalar is; so is a vector computed element-wise from a reduction over
  the batch axis (a function of `mean_tensor`'s column means: a square, a
  max, a division by a mean). Other vectors (`auc`'s per-threshold counts) are sums of per-example
  counts, which add up over the towers.
  """
  if value.shape.rank == 0:
    return True
  op = value.op
  while op.type in ('Identity', 'Cast', 'Reshape', 'Squeeze') and op.inputs:
    op = op.inputs[0].op
  return op.type == 'Mean' or loss_reduction.reduces_rows(value,
                                                          depends_on_shard)


def check_overwrites(metric_ops: Sequence[Dict[str, tuple]],
                     in_tower: Sequence[Callable[[tf.Operation], bool]],
                     depends_on_shard: Sequence[Callable[[tf.Tensor], bool]]
                     ) -> None:
  """Refuses metric state written from the shard by other than an add.

  A running max (`v.assign(tf.maximum(v, batch_max))`) written by every
  tower keeps whichever tower wrote last, run after run.

  Raises:
    ValueError: such a write.
  """
  for tower, ops in enumerate(metric_ops):
    for name, (_, update) in ops.items():
      for op in _ops_of(update, in_tower[tower]):
        if op.type in tower_effects.WRITES and op.type not in _ADDS and (
            len(op.inputs) > 1 and depends_on_shard[tower](op.inputs[-1])):
          raise ValueError(
              f'The metric {name!r} writes its state with {op.type} '
              f'({op.name}) from the examples. Under replicate_model_fn '
              'every tower writes it from its own shard, and the last write '
              'wins; one device writes it once from the whole batch. Keep '
              'the state as sums (assign_add) and derive the value from them, '
              'or evaluate without replicate_model_fn.')


def _ops_of(update, in_tower: Callable[[tf.Operation], bool]
            ) -> List[tf.Operation]:
  """The ops of a tower's metric update, the update and what it runs."""
  found, seen = [], set()
  pending = [getattr(update, 'op', update)]
  while pending:
    op = pending.pop()
    if op.name in seen or not in_tower(op):
      continue
    seen.add(op.name)
    found.append(op)
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  return found


def _adds(update, in_tower: Callable[[tf.Operation], bool]
          ) -> List[tf.Operation]:
  """The adds a tower's metric update runs, in a fixed order."""
  found = [op for op in _ops_of(update, in_tower) if op.type in _ADDS]
  # Towers after the first build under their scope: compare below it.
  return sorted(found, key=lambda op: op.name.split('/', 1)[-1]
                if op.name.startswith('tower_') else op.name)


def _replace(add: tf.Operation, position: int, value: tf.Tensor,
             why: str) -> None:
  """Makes `add` add `value` (built on its device) instead."""
  with add.graph.name_scope(None), add.graph.device(add.device):
    value = tf.identity(value, name=f'{add.name}/{why}')
  add._update_input(position, value)  # pylint: disable=protected-access


def in_tower_order(metric_ops: Sequence[Dict[str, tuple]],
                   in_tower: Sequence[Callable[[tf.Operation], bool]]) -> None:
  """Makes each tower's adds into a metric's state wait for the previous
  tower's (see `tower_effects.in_tower_order`).

  In any order, float adds round differently: two evaluations of the same
  checkpoint differed in the last bits (tensorflow/estimator's
  InMemoryEvaluatorHook test compares them exactly).

  Args:
    metric_ops: Each tower's `eval_metric_ops`.
    in_tower: Per tower, whether an op was created by its model_fn call.
  """
  tower_effects.in_tower_order([
      [add for _, update in ops.values() for add in _adds(update, inside)]
      for ops, inside in zip(metric_ops, in_tower)])


def idle_adds_nothing(metric_ops: Sequence[Dict[str, tuple]],
                      in_tower: Sequence[Callable[[tf.Operation], bool]],
                      active: Sequence[tf.Tensor]) -> None:
  """Makes an idle tower's metric adds add zero.

  An idle tower (no example in its shard) evaluates a padding copy of an
  example, so that no kernel sees an empty batch; none of what it adds may
  count. Every metric add is covered, also those `count_once` leaves as
  they are (a vector of per-threshold counts): metric state written other
  than by an add is refused by `check_overwrites`.

  Args:
    metric_ops: Each tower's `eval_metric_ops`.
    in_tower: Per tower, whether an op was created by its model_fn call.
    active: Per tower, a scalar bool: whether its shard has examples.
  """
  done = set()
  for ops, inside, on in zip(metric_ops, in_tower, active):
    for _, update in ops.values():
      for add in _adds(update, inside):
        if add.name in done:
          continue  # Shared by two metrics.
        done.add(add.name)
        value = add.inputs[_ADDS[add.type]]
        _replace(add, _ADDS[add.type],
                 tf.where(on, value, tf.zeros_like(value)), 'idle_adds_zero')
