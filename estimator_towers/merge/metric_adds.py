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
* an add of a sum plus terms that do not depend on the shard would count
  those terms once per tower: a `ValueError`;
* an add of any other value per batch (a max, a square of a mean, a mean
  over the batch axis of a vector): a `ValueError`, as is metric state
  written from the shard by other than an add (`check_overwrites`).

Adds the analysis cannot read (a vector of per-threshold counts, as
`tf.compat.v1.metrics.auc` makes) are left as they are: they are sums of
per-example counts.
"""

from typing import Callable, Dict, List, Sequence

import tensorflow as tf

from estimator_towers.towers import loss_reduction
from estimator_towers.towers import tower_effects

# Adds into a metric's state: position of the value they add.
_ADDS = {'AssignAdd': 1, 'AssignAddVariableOp': 1}


def count_once(metric_ops: Sequence[Dict[str, tuple]],
               in_tower: Sequence[Callable[[tf.Operation], bool]],
               depends_on_shard: Sequence[Callable[[tf.Tensor], bool]],
               active: Sequence[tf.Tensor]) -> None:
  """Makes the towers' metric adds add up to one device's (module doc).

  Args:
    metric_ops: Each tower's `eval_metric_ops`.
    in_tower: Per tower, whether an op was created by its model_fn call.
    depends_on_shard: Per tower, whether a tensor depends on its shard (a
      `loss_reduction.ExampleDependence`).
    active: Per tower, a scalar bool: whether its shard has examples.

  Raises:
    ValueError: A metric adds a sum plus terms that do not depend on the
      examples.
  """
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
      _count_once(name, list(adds), depends_on_shard, active)


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
    if _unreadable_per_batch_value(values[0]):
      raise ValueError(
          f'The metric {metric!r} adds one value per batch that is neither '
          f'a sum nor a mean over the examples ({reductions[0].detail}, '
          'e.g. a max or a square of a mean). Under replicate_model_fn every '
          'tower adds its own shard\'s value, which is not what one device '
          'adds for the whole batch. Compute the metric from per-example '
          'values (a mean of per-example values, a sum), or evaluate without '
          'replicate_model_fn.')
    return
  spread = loss_reduction.spread_exactly(values, reductions, active,
                                         depends_on_shard)
  if spread is not None:
    for add, value, on in zip(adds, spread, active):
      _replace(add, position, tf.where(on, value, tf.zeros_like(value)),
               'weighted_by_shard')
    return
  weights = loss_reduction.exact_weights(values, reductions, active)
  if weights is None:  # Several means (a difference of two): checked shares.
    weights = loss_reduction.proportional_weights(
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


def _unreadable_per_batch_value(value: tf.Tensor) -> bool:
  """Whether an add the analysis cannot read is one value per batch.

  A scalar is; so is a mean over the batch axis (`mean_tensor` of a batch
  mean). Other vectors (`auc`'s per-threshold counts) are sums of
  per-example counts, which add up over the towers.
  """
  if value.shape.rank == 0:
    return True
  op = value.op
  while op.type in ('Identity', 'Cast', 'Reshape', 'Squeeze') and op.inputs:
    op = op.inputs[0].op
  return op.type == 'Mean'


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
