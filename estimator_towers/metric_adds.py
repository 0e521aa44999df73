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
  (see loss_reduction), so the towers' adds make the batch's mean; an idle
  tower (empty shard) adds zero;
* an add of a sum plus terms that do not depend on the shard would count
  those terms once per tower: a `ValueError`.

Adds the analysis cannot read (a vector of per-threshold counts, as
`tf.compat.v1.metrics.auc` makes) are left as they are: they are sums of
per-example counts.
"""

from typing import Callable, Dict, List, Sequence

import tensorflow as tf

from estimator_towers import loss_reduction

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
    return
  weights = loss_reduction.exact_weights(values, reductions, active)
  if weights is None:
    raise ValueError(
        f'The metric {metric!r} adds a sum of several means over the '
        "tower's examples; replicate_model_fn cannot weigh them into the "
        "whole batch's. Give each mean a metric of its own.")
  for add, value, weight, on in zip(adds, values, weights, active):
    weighted = value * tf.cast(weight, value.dtype)
    # An empty shard's mean is NaN, which a zero weight would keep.
    _replace(add, position, tf.where(on, weighted, tf.zeros_like(value)),
             'weighted_by_shard')


def _adds(update, in_tower: Callable[[tf.Operation], bool]
          ) -> List[tf.Operation]:
  """The adds a tower's metric update runs, in a fixed order."""
  found, seen = [], set()
  pending = [getattr(update, 'op', update)]
  while pending:
    op = pending.pop()
    if op.name in seen or not in_tower(op):
      continue
    seen.add(op.name)
    if op.type in _ADDS:
      found.append(op)
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  # Towers after the first build under their scope: compare below it.
  return sorted(found, key=lambda op: op.name.split('/', 1)[-1]
                if op.name.startswith('tower_') else op.name)


def _replace(add: tf.Operation, position: int, value: tf.Tensor,
             why: str) -> None:
  """Makes `add` add `value` (built on its device) instead."""
  with add.graph.name_scope(None), add.graph.device(add.device):
    value = tf.identity(value, name=f'{add.name}/{why}')
  add._update_input(position, value)  # pylint: disable=protected-access
