"""What an earlier tower's train_op must still run once its update is dropped.

Only the last tower's train_op performs the one update (see one_update). An
earlier tower's train_op would repeat everything the model_fn chains to its
update: advancing global_step by hand, an exponential moving average of the
weights, a second optimizer's no-op. Those must happen once per step, as on
one device, so the earlier train_ops are not run. What an earlier tower does
with its own shard must still run, though:

* assertions, prints and conditionals on the shard that its train_op, or the optimizer calls the
  model_fn wrapped in `control_dependencies`, wait for (an assert on the
  shard);
* state they write from the shard's data.

Writes that do not depend on the shard (a manual `global_step` increment,
an EMA of the weights, a counter) run once, in the last tower.
"""

from typing import Callable, Iterable, List

import tensorflow as tf

_CHECKS = frozenset(['Assert', 'Print', 'PrintV2'])
# A `tf.debugging.assert_*` whose outcome is not known while the graph is
# built is an Assert inside a stateful conditional (control flow v2).
_CONDITIONALS = frozenset(['If'])
_WRITES = frozenset([
    'Assign', 'AssignAdd', 'AssignSub', 'AssignVariableOp',
    'AssignAddVariableOp', 'AssignSubVariableOp', 'ScatterUpdate',
    'ScatterAdd', 'ScatterSub', 'ScatterNdUpdate', 'ScatterNdAdd',
    'ResourceScatterUpdate', 'ResourceScatterAdd', 'ResourceScatterSub',
    'ResourceScatterNdUpdate', 'ResourceScatterNdAdd', 'LookupTableInsert',
    'LookupTableInsertV2', 'QueueEnqueueV2', 'QueueEnqueueManyV2'])


def earlier_tower_effects(train_op: tf.Operation, first_id: int,
                          depends_on_shard: Callable[[tf.Tensor], bool],
                          call_dependencies: Iterable[tf.Operation]
                          ) -> List[tf.Operation]:
  """The ops of an earlier tower's train_op that must run every step.

  Args:
    train_op: The tower's train_op (an Operation or a Tensor).
    first_id: The id of the first op the tower's model_fn call created; the
      walk stays among the tower's own ops.
    depends_on_shard: Tells whether a tensor depends on the tower's shard.
    call_dependencies: Control inputs the model_fn put around the tower's
      optimizer calls.

  Returns:
    The ops to group into the merged train_op, without repeats.
  """
  found = {}
  pending = [getattr(train_op, 'op', train_op), *call_dependencies]
  seen = set()
  while pending:
    op = pending.pop()
    if op.name in seen or op._id < first_id:  # pylint: disable=protected-access
      continue
    seen.add(op.name)
    if (op.type in _CHECKS or
        (op.type in _CONDITIONALS and any(map(depends_on_shard, op.inputs))) or
        (op.type in _WRITES and any(map(depends_on_shard, op.inputs[1:])))):
      found.setdefault(op.name, op)
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  return [_runnable(op) for op in found.values()]


def _runnable(op: tf.Operation) -> tf.Operation:
  """An op that runs `op` when the train_op waits for it.

  A control edge straight to a conditional is lost when TensorFlow lowers
  it to Switch/Merge (its Assert never runs); an edge to an output is kept.
  """
  if op.type in _CONDITIONALS and op.outputs:
    with op.graph.name_scope(None):
      return tf.identity(op.outputs[0], name=f'{op.name}/effect').op
  return op
