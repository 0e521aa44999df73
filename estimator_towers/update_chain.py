"""Running every tower's UPDATE_OPS one tower after the other.

A batch-norm update reads its moving average and subtracts a fraction of
the difference. Run concurrently, all towers read the same old value and
the average overshoots, by a different amount each run. Chaining the towers
(each tower's reads of a moving variable wait for the previous tower's writes
to it) makes the result an ordinary moving average over the towers' batch
statistics, the same every run. Only these small assign ops are ordered; the
towers' forward and backward passes still run in parallel.
"""

from typing import Dict, List, Sequence

import tensorflow as tf

_READS = frozenset(['ReadVariableOp', 'Identity'])
# How far back from an update op to look for its reads of the variable; the
# read sits in the update's own small subgraph (e.g. AssignMovingAvg/sub).
_MAX_SEARCH = 64


def _target(op: tf.Operation):
  """The variable (handle or ref) an update op writes, or None."""
  if not op.inputs:
    return None
  first = op.inputs[0]
  if first.dtype == tf.resource or first.dtype._is_ref_dtype:  # pylint: disable=protected-access
    return first
  return None


def _reads_of(update: tf.Operation, target) -> List[tf.Operation]:
  """Ops inside `update`'s name scope that read `target`."""
  scope = update.name.rsplit('/', 1)[0] + '/'
  found, pending, seen = [], list(update.inputs[1:]), set()
  while pending and len(seen) < _MAX_SEARCH:
    op = pending.pop().op
    if op.name in seen or not op.name.startswith(scope):
      continue
    seen.add(op.name)
    if op.type in _READS and op.inputs and op.inputs[0] is target:
      found.append(op)
    pending.extend(op.inputs)
  return found


def chain_towers(updates_per_tower: Sequence[Sequence[tf.Operation]]) -> None:
  """Makes tower i's updates of a variable wait for tower i-1's.

  Args:
    updates_per_tower: Each tower's UPDATE_OPS, in tower order.
  """
  previous: Dict[object, List[tf.Operation]] = {}
  for updates in updates_per_tower:
    current: Dict[object, List[tf.Operation]] = {}
    for update in updates:
      if not isinstance(update, tf.Operation):
        update = update.op
      target = _target(update)
      if target is None:
        continue
      key = target.ref()
      current.setdefault(key, []).append(update)
      before = previous.get(key)
      if before:
        # Private API, but the only way to order ops already built by the
        # user's model_fn; the alternative is racing updates.
        waiting = _reads_of(update, target) or [update]
        for op in waiting:
          op._add_control_inputs(before)  # pylint: disable=protected-access
    previous = {**previous, **current}
