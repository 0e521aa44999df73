"""What a tower's train_op does with its own shard, besides the one update.

Only the last tower's train_op performs the one update (see one_update). An
earlier tower's train_op would repeat everything the model_fn chains to its
update: advancing global_step by hand, an exponential moving average of the
weights, a second optimizer's no-op. Those must happen once per step, as on
one device, so the earlier train_ops are not run. What an earlier tower does
with its own shard must still run, though: assertions, prints and
conditionals on the shard that its train_op, or the optimizer calls the
model_fn wrapped in `control_dependencies`, wait for (an assert on the
shard); inserts into mutable tables and queue enqueues (table_sharing orders
the inserts).

A variable write whose value depends on the shard runs once per tower, each
time from that tower's shard; one device runs it once, from the whole batch.
That is exact only when the write adds up over shards: an add or a
subtraction (`assign_add`, `scatter_add`, `assign_sub`) of a per-example
sum or a count of the shard's examples (an example counter, a running
total, per-class sums, the `tf.compat.v1.metrics` accumulators).
Those run in every tower, one tower after the other (`in_tower_order`), and
an idle tower (its shard a padding copy) adds zero. A count folded from a
static batch size (`tf.size(labels)`) is the shard's own count, though it
reads no op of the shard: it counts as the shard's. Any other such write
(an assign, a moving average of a batch statistic, an add of a mean, of
rows picked, ordered or weighed by position, of a value truncated to an
integer or read from a variable the towers add into, a write inside a
conditional or `tf.function` run on the shard) is a `ValueError` while
the graph is built: it would
silently differ from one device. The last tower is checked too, since its
write alone would come from the last shard only. Batch-norm moving
statistics are combined exactly by moving_statistics (its one update in the
last tower is let through), which also refuses other UPDATE_OPS that
several towers write.

Writes that do not depend on the shard (a manual `global_step` increment,
an EMA of the weights, a constant counter) run once, in the last tower;
free_writes checks that every tower computes them alike.
"""

from typing import (Callable, Collection, Iterable, List, NamedTuple,
                    Optional, Sequence, Set)

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from estimator_towers.towers import batch_mixing
from estimator_towers.towers import loss_reduction
from estimator_towers.graph import folded_shapes
from estimator_towers.graph import functions
from estimator_towers.graph import op_ledger

_CHECKS = frozenset(['Assert', 'Print', 'PrintV2'])
# A `tf.debugging.assert_*` whose outcome is not known while the graph is
# built is an Assert inside a stateful conditional (control flow v2).
_CONDITIONALS = frozenset(['If'])
# Ops that run functions, whose writes the walk cannot see from outside.
CALLS = frozenset(['If', 'StatelessIf', 'While', 'StatelessWhile', 'Case',
                    'StatelessCase', 'PartitionedCall',
                    'StatefulPartitionedCall'])
# Writes that add up over shards, when what they add does: position of the
# value they add. A subtraction too: v - s0 - s1 is v - (s0 + s1).
_ADDS = {'AssignAdd': 1, 'AssignAddVariableOp': 1, 'ScatterAdd': 2,
         'ResourceScatterAdd': 2, 'ScatterNdAdd': 2,
         'ResourceScatterNdAdd': 2, 'AssignSub': 1, 'AssignSubVariableOp': 1,
         'ScatterSub': 2, 'ResourceScatterSub': 2, 'ScatterNdSub': 2,
         'ResourceScatterNdSub': 2}
# Sums per class of per-example rows: (op, inputs that must be per example).
_PER_CLASS_SUMS = {'UnsortedSegmentSum': (0, 1), 'DenseBincount': (0, 2),
                   'Bincount': (0, 2)}
# One shared structure per model: run in every tower, as on one device.
_SHARED = frozenset(['LookupTableInsert', 'LookupTableInsertV2',
                     'LookupTableRemoveV2', 'LookupTableImport',
                     'LookupTableImportV2', 'QueueEnqueue', 'QueueEnqueueV2',
                     'QueueEnqueueMany', 'QueueEnqueueManyV2'])
_OTHER_WRITES = frozenset([
    'Assign', 'AssignVariableOp',
    'ScatterUpdate', 'ScatterMul', 'ScatterDiv', 'ScatterMin',
    'ScatterMax', 'ScatterNdUpdate', 'ResourceScatterUpdate',
    'ResourceScatterMul', 'ResourceScatterDiv',
    'ResourceScatterMin', 'ResourceScatterMax', 'ResourceScatterNdUpdate',
    'ScatterNdMax', 'ScatterNdMin',
    'ResourceScatterNdMax', 'ResourceScatterNdMin',
    # v[i].assign(x), a counter's step.
    'StridedSliceAssign', 'ResourceStridedSliceAssign', 'CountUpTo',
    'ResourceCountUpTo'])
WRITES = _SHARED | _OTHER_WRITES | frozenset(_ADDS)
# Writes that set a value: the same value written twice is written once.
_ASSIGNS = frozenset(['Assign', 'AssignVariableOp', 'ScatterUpdate',
                      'ResourceScatterUpdate', 'ScatterNdUpdate',
                      'ResourceScatterNdUpdate', 'StridedSliceAssign',
                      'ResourceStridedSliceAssign'])
# Optimizer kernels a model_fn may run itself: each run steps again.
APPLIES = ('Apply', 'ResourceApply', 'SparseApply', 'ResourceSparseApply')
# Stateful random ops: each task of a synchronous cluster draws its own, and
# each tower draws its own for its shard (equivalence names them), unless
# random_draws makes them one device's.
RANDOM = frozenset([
    'RandomUniform', 'RandomUniformInt', 'RandomStandardNormal',
    'TruncatedNormal', 'ParameterizedTruncatedNormal', 'RandomShuffle',
    'Multinomial', 'RandomGamma', 'RandomPoisson', 'RandomPoissonV2'])
_ADVICE = (
    'For batch statistics use a tf.keras.layers.BatchNormalization or '
    'tf.compat.v1.layers.batch_normalization layer, whose moving statistics '
    'the wrapper combines exactly; accumulating a per-example sum or an '
    'example count with assign_add is fine (derive a mean later, e.g. '
    'total / count); otherwise train without replicate_model_fn.')


class Effects(NamedTuple):
  """What `shard_effects` found in a tower's train_op."""
  # The ops to group into the merged train_op, without repeats.
  ops: List[tf.Operation]
  # Writes (and function calls that write) reading nothing of the shard,
  # for free_writes.check_agree.
  free_writes: List[tf.Operation]


def shard_effects(train_op: tf.Operation, since: op_ledger.Mark,
                  depends_on_shard: Callable[[tf.Tensor], bool],
                  call_dependencies: Iterable[tf.Operation],
                  active: tf.Tensor,
                  exempt: Collection[str] = (),
                  across_tasks: bool = False,
                  drawn: Optional[Callable[[tf.Tensor], bool]] = None,
                  global_rows: Optional[int] = None
                  ) -> Effects:
  """The ops of a tower's train_op that act on the tower's shard.

  Call it for every tower: the merged train_op must run an earlier tower's
  effects, and every tower's shard writes are checked and made to add
  nothing when the tower is idle.

  Args:
    train_op: The tower's train_op (an Operation or a Tensor).
    since: A mark taken before the tower's model_fn call; the walk stays
      among the ops made after it, the tower's own.
    depends_on_shard: Tells whether a tensor depends on the tower's shard
      (a `loss_reduction.ExampleDependence`).
    call_dependencies: Control inputs the model_fn put around the tower's
      optimizer calls.
    active: A scalar bool tensor, whether the tower has real examples.
    exempt: Names of ops another module makes exact: the tower's
      UPDATE_OPS (see moving_statistics) and the one update's ops (see
      one_update), which write once from the whole batch.
    across_tasks: The towers are those of one task of a synchronous
      cluster, whose variables are summed over tasks only through the one
      update and batch norm: any other write from the shard is refused.
    drawn: In a synchronous cluster, tells whether a tensor depends on the
      tower's random ops (see `random_draws`): a write from them is refused,
      since each task draws other numbers.
    global_rows: The batch's static number of rows, or None: the first
      rows of a shard that are all its rows are still a subset of the
      batch's (see `batch_mixing.check_loss`).

  Returns:
    The tower's Effects.

  Raises:
    ValueError: a variable write depends on the shard and does not add up
      over shards.
  """
  found, free = {}, []
  pending = [getattr(train_op, 'op', train_op), *call_dependencies]
  seen = set()
  while pending:
    op = pending.pop()
    if op.name in seen or op_ledger.made_before(op, since):
      continue
    seen.add(op.name)
    if op.type in _CHECKS:
      found.setdefault(op.name, op)
    elif op.name in exempt:
      pass  # Made exact elsewhere; what it reads is still walked.
    elif (drawn is not None and op.type in WRITES and
          any(map(drawn, op.inputs[1:]))):
      raise ValueError(
          f'The train_op writes variable {op.inputs[0].op.name} (op '
          f'{op.name}) from random numbers. In a synchronous cluster each '
          "task draws its own, and the tasks' variables would drift apart. "
          'Draw them from the global step with a stateless random op '
          '(tf.random.stateless_uniform), or train with ps tasks '
          '(asynchronous) or on one machine.')
    elif op.type in WRITES and (
        condition := _shard_condition(op, depends_on_shard)):
      raise ValueError(
          f'The train_op writes variable {variable_source(op.inputs[0]).name}'
          f' (op {op.name}) inside a tf.compat.v1.cond whose predicate '
          f"({condition}) depends on the "
          "tower's shard. Under replicate_model_fn each tower would choose "
          "the branch from its own shard, and the last tower's choice would "
          'stand for the whole batch. Move a write that adds a per-example '
          f'sum or count out of the conditional. {_ADVICE}')
    elif op.type in CALLS and _runs_on_the_shard(op, depends_on_shard):
      _check_no_writes_inside(op, exempt)
      if op.type in _CONDITIONALS:
        found.setdefault(op.name, op)
    elif op.type in CALLS:
      if _function_writes(op, exempt):
        free.append(op)
    elif op.type in WRITES and any(
        _of_the_shard(t, depends_on_shard) for t in op.inputs[1:]):
      if across_tasks:
        raise ValueError(
            f'The train_op writes variable {op.inputs[0].op.name} (op '
            f"{op.name}) from the tower's shard of the batch. In a "
            'synchronous cluster each task would write only its own part '
            "of the batch, and the tasks' variables would drift apart. "
            'Compute it as a metric (EVAL), or train with ps tasks '
            '(asynchronous) or on one machine.')
      if op.type not in _SHARED:
        _check_adds_up(op, depends_on_shard, global_rows)
        _add_nothing_when_idle(op, active)
      found.setdefault(op.name, op)
    elif op.type in WRITES and op.type not in _SHARED:
      free.append(op)
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  return Effects([_runnable(op) for op in found.values()], free)


def random_draws(graph: tf.Graph, tower: op_ledger.Region
                 ) -> List[tf.Tensor]:
  """The outputs of the stateful random ops made in `tower`.

  Args:
    graph: The graph of the towers.
    tower: The region of the ops one tower made.

  Returns:
    The tensors, for a `loss_reduction.ExampleDependence` that then tells
    whether a tensor depends on them.
  """
  return [op.outputs[0] for op in graph.get_operations()
          if op.type in RANDOM and tower.contains(op)]


# Draws RANDOM does not name: candidate samplers (nce_loss, sampled
# softmax) and the ops of a tf.random.Generator.
OTHER_DRAWS = frozenset([
    'AllCandidateSampler', 'FixedUnigramCandidateSampler',
    'LearnedUnigramCandidateSampler', 'LogUniformCandidateSampler',
    'ThreadUnsafeUnigramCandidateSampler', 'UniformCandidateSampler',
    'RngReadAndSkip', 'RngSkip', 'StatefulRandomBinomial',
    'StatefulStandardNormal', 'StatefulStandardNormalV2',
    'StatefulTruncatedNormal', 'StatefulUniform', 'StatefulUniformFullInt',
    'StatefulUniformInt'])


def draws(op: tf.Operation) -> bool:
  """Whether running `op` draws random numbers: a stateful random op, a
  candidate sampler, a tf.random.Generator's op, or a function-calling op
  (a while loop, a tf.function) whose functions hold one."""
  if op.type in RANDOM or op.type in OTHER_DRAWS:
    return True
  return op.type in CALLS and bool(_in_functions(
      op.graph, functions.called(op.node_def), set(),
      lambda kind: kind in RANDOM or kind in OTHER_DRAWS))


def every_draw(graph: tf.Graph, tower: op_ledger.Region) -> List[tf.Tensor]:
  """The outputs of the ops made in `tower` that draw random numbers
  (`draws`), for an ExampleDependence: what one device's copy of the
  model_fn would draw differently."""
  return [t for op in graph.get_operations()
          if tower.contains(op) and draws(op) for t in op.outputs]


# Ops that hand a variable's handle (or ref) on unchanged: an Identity, a
# TF1 cond's Switch, a while loop's Enter.
_FORWARDING = frozenset(['Identity', 'RefIdentity', 'Enter', 'RefEnter',
                         'Switch', 'RefSwitch'])


def check_loss_reads_no_write(loss: tf.Tensor, since: op_ledger.Mark,
                              depends_on_shard: Callable[[tf.Tensor], bool],
                              exempt: Collection[str] = ()) -> None:
  """Refuses a tower's loss computed after a write that repeats wrongly.

  Every tower's loss is run each step, so a write the loss waits for runs
  once per tower. That is harmless when the write is the same every time
  (a snapshot of the weights under a `tf.cond`), but a counter read back
  (`2 * assign_add(v, 1)`) or an assign from the tower's shard would give
  the towers values one device never has: the reported loss and its
  gradients would differ from one device's, silently.

  Args:
    loss: The tower's loss.
    since: A mark taken before the tower's model_fn call; the walk stays
      among the tower's own ops.
    depends_on_shard: Tells whether a tensor depends on the tower's shard.
    exempt: Names of writes another module makes exact (the tower's
      UPDATE_OPS, the moving statistics); the walk stops there.

  Raises:
    ValueError: the loss waits for (reads or is ordered after) an add into
      a variable, or an assign of a value from the shard or from the
      variable itself.
  """
  pending, seen = [loss.op], set()
  while pending:
    op = pending.pop()
    if (op.name in seen or op.name in exempt or
        op_ledger.made_before(op, since)):
      continue
    seen.add(op.name)
    why = _repeats_wrongly(op, depends_on_shard)
    if why:
      written = (variable_source(op.inputs[0]).name if op.type not in CALLS
                 else 'a variable inside a function')
      raise ValueError(
          f'The loss {loss.op.name!r} is computed after the model_fn writes '
          f'{written} ({_article(op.type)} {op.type} op, {op.name}), '
          f'{why}. Every tower computes its loss each step, so the write '
          "would run once per tower and the towers' losses would read values "
          'one device never has. Compute the loss without the write (make it '
          'in the train_op, which runs it once per step, or in an eval '
          'metric), or train on one device.')
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)


def _article(word: str) -> str:
  return 'an' if word[:1].lower() in 'aeiou' else 'a'


def _repeats_wrongly(write: tf.Operation, depends_on_shard) -> str:
  """Why running `write` once per tower is not running it once, or ''."""
  if write.type in CALLS:
    # Inside a function only the kind of write is known: a snapshot
    # assigned there is let through, an add (a counter) is not.
    adds = _in_functions(write.graph, functions.called(write.node_def), set(),
                         lambda kind: kind in WRITES and kind not in _SHARED
                         and kind not in _ASSIGNS)
    return f'adding to it inside the function ({adds[0]})' if adds else ''
  if write.type.startswith(APPLIES):
    return 'an optimizer step, which steps again each time it runs'
  if write.type not in WRITES or write.type in _SHARED:
    return ''  # A shared structure runs in every tower, as on one device.
  if write.type not in _ASSIGNS:
    return 'which changes it again each time it runs'
  value = write.inputs[-1]
  if _of_the_shard(value, depends_on_shard):
    return "from the tower's shard of the batch"
  written = variable_source(write.inputs[0])
  reads = op_ledger.ancestors([value.op])
  if any(op is not write and op.inputs and
         variable_source(op.inputs[0]) is written for op in reads):
    return 'from its own value'
  return ''


def _of_the_shard(tensor: tf.Tensor, depends_on_shard) -> bool:
  """Whether a tensor depends on the shard's values or on its static number
  of rows (`tf.size(labels)` under a static batch size)."""
  return depends_on_shard(tensor) or loss_reduction.from_static_rows(
      tensor, depends_on_shard)


def variable_source(handle: tf.Tensor) -> tf.Operation:
  """The op that made a variable's handle or ref, through ops that pass it
  on unchanged."""
  op = handle.op
  while op.type in _FORWARDING and op.inputs:
    op = op.inputs[0].op
  return op


def _check_adds_up(op: tf.Operation, depends_on_shard,
                   global_rows: Optional[int] = None) -> None:
  """Refuses a shard-dependent write that does not add up over shards."""
  position = _ADDS.get(op.type)
  if position is not None:
    value = op.inputs[position]
    if position == 2 and depends_on_shard(op.inputs[1]):
      if _per_example_adds(op.inputs[1], value, depends_on_shard):
        return  # Each example adds its own row: a histogram, a sum.
      why = ('it adds at indices computed from the shard, and the indices '
             'or the values added are not one row per example (a value of '
             'the whole shard, or the rows\' positions)')
    elif not depends_on_shard(value):  # From the static rows only.
      if loss_reduction.static_count(value, depends_on_shard):
        return
      why = ("it adds a value computed from the shard's static size (with "
             'a static batch size tf.size and tf.shape fold into each '
             "tower's own count) that is not a count of the shard's "
             'examples or elements')
    elif _per_class_sum(value, depends_on_shard):
      return  # Per-example rows summed per class, or per pair of columns.
    elif (found := _mixing(value, depends_on_shard, global_rows)):
      why = (f'it adds a value that {found[1]} ({found[0].type} '
             f"{found[0].name!r}): each tower's is its own shard's, not a "
             "part of the whole batch's")
    elif (cast := _truncating_cast(value)):
      why = (f'it adds a sum cast to an integer ({cast}'
             "): each tower's sum is truncated alone, one device's once")
    elif (loss_reduction.sums_the_rows(value, depends_on_shard) and
          _sums_rows_of_examples(value, depends_on_shard)):
      return  # A sum over the examples, whole or per column.
    else:
      reduction = loss_reduction.analyze(value, depends_on_shard)
      why = (f'it adds {reduction.detail or "a value"}, not only '
             'per-example sums or counts of the shard')
  else:
    why = f'a {op.type} does not add up over shards'
  raise ValueError(
      f'The train_op writes variable {variable_source(op.inputs[0]).name} (op '
      f"{op.name}) from the tower's shard of the batch, and {why}. Under "
      'replicate_model_fn it would be written once per tower, each time '
      "from that tower's shard, instead of once from the whole batch as on "
      f'one device. {_ADVICE}')


def _mixing(value: tf.Tensor, depends_on_shard,
            global_rows: Optional[int] = None):
  """Where `value` mixes the shard's examples (batch_mixing's (op, phrase):
  a subset or an order of rows by position, pairs of rows, rows meeting a
  statistic of the shard, rows weighed by their position), or None."""
  shard, since = depends_on_shard.shard, depends_on_shard.since
  found = batch_mixing.mixing_op(value, shard, since, global_rows=global_rows)
  if found is not None:
    return found
  # Rows weighed by their position: reported with the final tensor's own
  # kind, whose 'statistic' (a sum over the rows) is what an add may add.
  found = batch_mixing.mixing_op(value, shard, since, report_positions=True,
                                 global_rows=global_rows)
  return found if found is not None and found.kind == 'positions' else None


def _sums_rows_of_examples(value: tf.Tensor, depends_on_shard) -> bool:
  """Whether every sum or count `value` adds runs over a tensor whose first
  axis holds the shard's examples, one per row (not the distinct labels of
  `tf.unique`, nor `tf.bincount`'s classes: a function of several rows)."""
  shard, since = depends_on_shard.shard, depends_on_shard.since
  reduction = loss_reduction.analyze(value, depends_on_shard)
  if reduction.kind == loss_reduction.SUM:
    reductions = [value.graph.get_operation_by_name(n) for n in reduction.sums]
  else:  # Per column: tf.reduce_sum(x, 0).
    reductions = [loss_reduction.skip_pass_through(value).op]

  def per_example(tensor: tf.Tensor) -> bool:
    op = tensor.op
    if op.type == 'Where' and tensor.shape.rank == 2:
      tensor = op.inputs[0]  # The positions of a per-example condition.
    elif op.type == 'Fill':  # ones_like, tf.fill([n], 1.): a row each.
      shape = op.inputs[0].op
      if depends_on_shard(op.inputs[1]):
        return False
      if shape.type == 'Pack' and shape.inputs:
        if any(tf.get_static_value(t) is None for t in shape.inputs[1:]):
          return False  # tf.ones([n, n]): n rows of n, not a row each.
        tensor = loss_reduction.counted_rows(
            loss_reduction.skip_pass_through(shape.inputs[0]))
      else:
        tensor = shape.inputs[0] if shape.type == 'Shape' else None
      if tensor is None:
        return False
    axes = batch_mixing.row_axes(tensor, shard, since)
    return axes is not None and 0 in axes

  for op in reductions:
    if not op.inputs or not op.outputs:
      return False
    # tf.shape(x)[0] counts x's rows; a Sum or Size reduces its input.
    summed = loss_reduction.counted_rows(op.outputs[0])
    if not per_example(op.inputs[0] if summed is None else summed):
      return False
  return True


def _per_class_sum(value: tf.Tensor, depends_on_shard) -> bool:
  """Whether `value` sums per-example rows per class or per pair of
  columns: `tf.math.unsorted_segment_sum(x, labels, k)`, `tf.math.bincount(
  labels)` (with per-example weights, not binary), `tf.matmul(x, y,
  transpose_a=True)` (a sum over the examples of their outer products)."""
  op = loss_reduction.skip_pass_through(value).op
  if op.type in _PER_CLASS_SUMS:
    if op.type != 'UnsortedSegmentSum' and op.get_attr('binary_output'):
      return False  # Whether a class occurs: not a sum.
    return all(op.inputs[i].shape.num_elements() == 0 or  # No weights.
               _per_example(op.inputs[i], depends_on_shard)
               for i in _PER_CLASS_SUMS[op.type])
  if op.type == 'MatMul':
    return (op.get_attr('transpose_a') and not op.get_attr('transpose_b')
            and _per_example(op.inputs[0], depends_on_shard)
            and _per_example(op.inputs[1], depends_on_shard))
  return False


def _per_example(tensor: tf.Tensor, depends_on_shard) -> bool:
  """Whether `tensor` holds one row per example of the shard, in the
  shard's order, none made from other rows or from the rows' positions."""
  shard, since = depends_on_shard.shard, depends_on_shard.since
  return (batch_mixing.row_axes(tensor, shard, since) == {0} and
          batch_mixing.mixing_op(tensor, shard, since,
                                 report_positions=True) is None)


def _truncating_cast(value: tf.Tensor) -> Optional[str]:
  """The name of a cast from a float to an integer that `value` passes
  through on its way down to what it adds, or None."""
  tensor = value
  while tensor.op.type in loss_reduction.PASS_THROUGH:
    op = tensor.op
    if (op.type == 'Cast' and op.inputs[0].dtype.is_floating and
        tensor.dtype.is_integer):
      return op.name
    tensor = op.inputs[0]
  return None


def _per_example_adds(indices: tf.Tensor, updates: tf.Tensor,
                      depends_on_shard) -> bool:
  """Whether a scatter add adds one row per example at that example's own
  index (`scatter_add(counts, labels, ones_like(labels))`): over the towers
  every example adds once, as on one device."""
  if not _per_example(indices, depends_on_shard):
    return False
  op = updates.op
  if op.type == 'Fill' and op.inputs[0].op.type == 'Shape' and not (
      depends_on_shard(op.inputs[1])):
    # ones_like of a batch of unknown size: one value per row.
    return _per_example(op.inputs[0].op.inputs[0], depends_on_shard)
  if depends_on_shard(updates):
    return _per_example(updates, depends_on_shard)
  # Free of the shard's values: ones (or any fill) shaped like the rows.
  return loss_reduction.same_for_every_row(updates, depends_on_shard)


def calls_write(op: tf.Operation) -> bool:
  """Whether a function-calling op (`If`, `While`, a `tf.function` call)
  writes a variable inside its functions."""
  return bool(_writes_in_functions(op.graph, functions.called(op.node_def), set()))


def written_inputs(op: tf.Operation) -> Set[int]:
  """Positions of the inputs a function-calling op writes inside.

  An `If` that reads a weight and writes a snapshot of it takes both; only
  the snapshot is written. A nested call (a `tf.cond` in a `tf.function`)
  writes what its own functions write, followed through its inputs.
  """
  return _written_positions(op.graph, op.type, functions.called(op.node_def),
                            frozenset())


def _written_positions(graph: tf.Graph, kind: str, names: Iterable[str],
                       seen: frozenset) -> Set[int]:
  """Input positions of a `kind` call of functions `names` that they write."""
  offset = 1 if kind in ('If', 'StatelessIf', 'Case', 'StatelessCase') else 0
  written = set()
  for name in names:
    function = functions.function(graph, name)
    if function is None or name in seen:
      continue
    definition = function.definition
    args = [arg.name for arg in definition.signature.input_arg]
    nodes = {node.name: node for node in definition.node_def}
    for node in definition.node_def:
      if node.op in WRITES and node.op not in _SHARED and node.input:
        targets = [node.input[0]]
      elif functions.called(node)[1:] or functions.function(graph, node.op) is not None:
        inputs = [i for i in node.input if not i.startswith('^')]
        targets = [inputs[position] for position in _written_positions(
            graph, node.op, functions.called(node), seen | {name})
                   if position < len(inputs)]
      else:
        continue
      for target in targets:
        arg = _argument_of(target, nodes)
        if arg in args:
          written.add(offset + args.index(arg))
  return written


def _argument_of(reference: str, nodes) -> str:
  """The function argument a node input refers to, through Identity."""
  name = reference.lstrip('^').split(':')[0]
  while name in nodes and nodes[name].op == 'Identity' and nodes[name].input:
    name = nodes[name].input[0].split(':')[0]
  return name


def _shard_condition(op: tf.Operation, depends_on_shard) -> Optional[str]:
  """The name of the predicate of a TF1 cond around `op` that depends on
  the shard, or None. (TF2's conds are `If` ops: see CALLS.)"""
  context = op._control_flow_context  # pylint: disable=protected-access
  while context is not None:
    if context.IsCondContext() and depends_on_shard(context.pred):
      return context.pred.op.name
    context = context.outer_context
  return None


def _runs_on_the_shard(op: tf.Operation, depends_on_shard) -> bool:
  """Whether a function call reads the shard: through its inputs, or
  through a static size folded inside its functions (`tf.size(labels)` in
  a `tf.cond` branch: the call then reads nothing of the shard)."""
  if any(map(depends_on_shard, op.inputs)):
    return True
  pending, seen = [(op.graph, op.node_def)], set()
  while pending:
    graph, node = pending.pop()
    for name in functions.called(node):
      body = getattr(functions.function(graph, name), 'graph', None)
      if body is None or name in seen:
        continue
      seen.add(name)
      if any(map(depends_on_shard, folded_shapes.folded_in(body))):
        return True
      pending.extend((body, inner.node_def)
                     for inner in body.get_operations())
  return False


def _check_no_writes_inside(op: tf.Operation,
                            exempt: Collection[str]) -> None:
  """Refuses a function run on the shard that writes variables."""
  writes = _function_writes(op, exempt)
  if writes:
    raise ValueError(
        f'The train_op runs {op.type} {op.name} on the tower\'s shard, and '
        f'its function writes a variable ({", ".join(sorted(writes))}). '
        'Under replicate_model_fn it would run once per tower, each time '
        "from that tower's shard, instead of once from the whole batch as "
        'on one device. Move a write that adds a per-example sum or count '
        f'out of the conditional or tf.function. {_ADVICE}')


def _function_writes(op: tf.Operation, exempt: Collection[str]) -> Set[str]:
  """The variable writes inside the functions `op` runs, but `exempt`."""
  return set(_writes_in_functions(op.graph, functions.called(op.node_def),
                                  set())) - set(exempt)


def _writes_in_functions(graph: tf.Graph, names: Iterable[str],
                         seen: set) -> List[str]:
  """Variable writes inside the named graph functions, nested included."""
  return _in_functions(graph, names, seen,
                       lambda kind: kind in WRITES and kind not in _SHARED)


def draws_in_functions(op: tf.Operation) -> List[str]:
  """The stateful random ops inside the functions a function-calling op
  (`If`, `While`, a `tf.function` call) runs, nested included, as
  'function/node' names."""
  return _in_functions(op.graph, functions.called(op.node_def), set(),
                       lambda kind: kind in RANDOM)


def _in_functions(graph: tf.Graph, names: Iterable[str], seen: set,
                  wanted: Callable[[str], bool]) -> List[str]:
  """Nodes of a `wanted` op type inside the named graph functions, nested
  included."""
  found = []
  for name in names:
    function = functions.function(graph, name)
    if name in seen or function is None:
      continue
    seen.add(name)
    for node in function.definition.node_def:
      if wanted(node.op):
        found.append(f'{name}/{node.name}')
      found.extend(_in_functions(graph, functions.called(node), seen, wanted))
  return found


def in_tower_order(adds_per_tower: Sequence[Iterable[tf.Operation]]
                   ) -> None:
  """Makes each tower's adds into a variable wait for the previous tower's.

  The towers' adds into one variable would otherwise run at the same time:
  an add into a ref variable (`use_resource=False`) does not lock it by
  default, and two towers adding at once lost one tower's shard (an
  example counter of a CI run counted 13 of 15 examples; 4 towers lost
  adds in 2 of 2 runs of 1500 steps on a loaded machine). Adds into a
  resource variable lock it, but
  float adds in whatever order the executor picks round differently from
  run to run. In tower order every run adds alike. Adds into a ref
  variable are made to lock as well: a tower's own two adds into one
  variable run at the same time (one device's too, but N towers lose N
  times as often: 38 for 42 in one run of 3 steps), and an add inside TF1
  control flow cannot take a control edge from outside it (the step can
  hang).

  Args:
    adds_per_tower: Per tower, its adds (`_ADDS` ops) into variables that
      several towers add into.
  """
  by_variable = {}
  for tower, adds in enumerate(adds_per_tower):
    for add in adds:
      source = variable_source(add.inputs[0]).name
      by_variable.setdefault(source, [[] for _ in adds_per_tower])
      by_variable[source][tower].append(add)
  for towers in by_variable.values():
    every = [add for adds in towers for add in adds]
    # pylint: disable=protected-access
    for add in every:
      if 'use_locking' in add.node_def.attr:
        add._set_attr('use_locking', attr_value_pb2.AttrValue(b=True))
    if any(add._control_flow_context for add in every):
      continue
    previous = []
    for adds in filter(None, towers):
      for add in adds:
        add._add_control_inputs(
            [p for p in previous if p not in add.control_inputs])
      previous = adds


def check_adds_read_no_added(adds: Sequence[tf.Operation]) -> None:
  """Refuses a tower's add whose value reads a variable the towers add into.

  Each tower's adds wait for the previous tower's (`in_tower_order`): a
  value read from such a variable would hold the earlier towers' adds, and
  one device's the whole batch's or none.

  Args:
    adds: One tower's adds into variables from its shard.

  Raises:
    ValueError: an add's value reads one of those variables.
  """
  added = {variable_source(add.inputs[0]) for add in adds}
  for add in adds:
    read = added & _data_ancestors(add.inputs[_ADDS[add.type]], adds)
    if read:
      raise ValueError(
          'The train_op adds into variable '
          f'{variable_source(add.inputs[0]).name} (op {add.name}) a value read from variable '
          f'{sorted(op.name for op in read)[0]}, which the towers add into '
          "from their shards. Each tower would read it after the earlier "
          "towers' adds, one device after the whole batch's (or before it). "
          'Compute the value from the batch, and combine the variables '
          'after the step (e.g. in an eval metric), or train on one device.')


def _data_ancestors(tensor: tf.Tensor, adds: Sequence[tf.Operation]) -> Set:
  """The ops whose values `tensor` is computed from (not those it only
  waits for), stopping at the adds themselves."""
  found, pending = set(), [tensor.op]
  while pending:
    op = pending.pop()
    if op in found or op in adds:
      continue
    found.add(op)
    pending.extend(t.op for t in op.inputs)
  return found


def adds_in(ops: Iterable[tf.Operation]) -> List[tf.Operation]:
  """The adds (`assign_add`, `scatter_add`, ...) among `ops`."""
  return [op for op in ops if op.type in _ADDS]


def _add_nothing_when_idle(op: tf.Operation, active: tf.Tensor) -> None:
  """Makes an add of an idle tower's padding copy add zero."""
  position = _ADDS[op.type]
  value = op.inputs[position]
  with op.graph.name_scope(None), op.graph.device(op.device):
    masked = tf.where(active, value, tf.zeros_like(value),
                      name=f'{op.name}/idle_tower_adds_zero')
  op._update_input(position, masked)  # pylint: disable=protected-access


def _runnable(op: tf.Operation) -> tf.Operation:
  """An op that runs `op` when the train_op waits for it.

  A control edge straight to a conditional is lost when TensorFlow lowers
  it to Switch/Merge (its Assert never runs); an edge to an output is kept.
  """
  if op.type in _CONDITIONALS and op.outputs:
    with op.graph.name_scope(None):
      return tf.identity(op.outputs[0], name=f'{op.name}/effect').op
  return op
