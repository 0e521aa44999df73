"""Within a training step, reads see the variables as they were before it.

A train_op is a graph, not a program: TensorFlow runs two ops in either
order unless one depends on the other. BERT's optimizer shows why that
matters. It reads `global_step` for the learning rate, applies the
gradients without `global_step`, and groups `global_step.assign(step + 1)`
beside the update: nothing orders the learning rate's read before the
increment. One device's executor happens to run the read first; towers
change the schedule (reads on other devices, transfers between them), and
in some runs the update used the next step's learning rate - a silent,
intermittent difference from one device.

So the merged train_op settles what the model_fn left open the way one
device settles it in practice, reads first, and every run is the same:

* every variable write the step runs waits for every read of the same
  variable that the step runs, unless the read comes after the write by
  the model_fn's own dependencies (`assign(...).read_value()`, an EMA made
  under `control_dependencies([update])`): that order is kept;
* every write outside the one update (a manual step increment, a counter,
  an EMA chained beside the update) also waits for the one update, unless
  the update waits for it.

"Reads" are the ops that take a variable (a resource handle or a ref) and
do not write it; "the step" is what the train_op and the loss need, so
nothing runs that did not run before. A control edge into or out of a TF1
control-flow context (`tf.compat.v1.cond`/`while_loop` with control flow v1,
what `disable_v2_behavior()` builds) can make the step hang or skip work, so
no edge touches their ops: a read inside TF1 conds is counted as a read by
the cond's exits (its Merge ops), which run whichever branch is taken;
a write inside them waits for the reads (an edge into a branch from an op
that always runs is safe). No edge can enter a TF1 while_loop's frame: its
reads are left as they are, and a write inside it that the step's other
accesses of the variable are not ordered with is refused.
The same holds for ops behind a Switch outside any context (a TF1 cond's
gradient): the executor skips them in some steps, and an edge from one
would skip the write too.
Under TF 2.x, conditionals are `If` ops (those count as a write when their
functions write, else as a read).

An `If`, `Case` or `While` op is lowered to TF1 control flow when the graph
runs, and the lowered op signals its end from its functions' data outputs
only: a control edge out of it does not wait for what its branches do
beside them (an assign under a `tf.cond`). Under load, 10-59 of 300 runs of
a Lookahead-style snapshot on 3 towers read the weights after the update
although the graph ordered the `If` first. An op the step must wait for is
therefore kept a function call (`_lower_using_switch_merge=False`), whose
end is the end of everything its functions run (0 of 760 runs wrong).
"""

import heapq
from typing import Collection, Dict, Iterable, List, Sequence, Set, Tuple

import tensorflow as tf

from estimator_towers.graph import op_ledger
from estimator_towers.towers import tower_effects

# Optimizer kernels update the variables they take (all of them).
_UPDATE_PREFIXES = ('ApplyGradient', 'ResourceApply', 'ResourceSparseApply',
                    'Apply', 'SparseApply')
_STRIDED_ASSIGNS = frozenset(['StridedSliceAssign',
                              'ResourceStridedSliceAssign'])
# Ops whose output may share its input's buffer: a ref variable's value read
# through them is still the variable's memory, which a write changes in
# place. Slices and splits along the first dimension, an identity transpose,
# a same-type cast, a one-input concat or add pass the buffer on too.
_ALIASING = frozenset([
    'Identity', 'IdentityN', 'Reshape', 'ExpandDims', 'Squeeze',
    'Bitcast', 'StopGradient', 'PreventGradient', 'EnsureShape',
    'CheckNumerics', 'CheckNumericsV2', 'Print', 'PlaceholderWithDefault',
    'StridedSlice', 'Slice', 'Split', 'SplitV', 'Unpack', 'Transpose',
    'ConjugateTranspose', 'BroadcastTo', 'Cast', 'ConcatV2', 'Concat', 'AddN',
    'Switch', 'RefSwitch', 'Merge', 'RefMerge', 'Enter', 'RefEnter', 'Exit',
    'RefExit'])


def order_writes(fetches: Sequence, update_results: Iterable[tf.Operation],
                 update_ops: Collection[str]) -> int:
  """Orders the step's variable writes after its reads (see module doc).

  Args:
    fetches: What runs every step: the merged train_op and the loss.
    update_results: The ops that end the one update (what its optimizer
      calls returned).
    update_ops: Names of every op of the one update.

  Returns:
    How many control edges were added.
  """
  step = _Step(fetches)
  step.check_loop_writes()
  added = 0
  for variable, writes in step.writes.items():
    for write in writes:
      added += step.order_before(
          [read for read in step.reads.get(variable, ()) if read is not write],
          write)
  # Last, as the edges above may make a write one the update waits for.
  update_results = [op for op in update_results if op in step.ops]
  waited_for = op_ledger.ancestors(update_results)
  for write in dict.fromkeys(w for ws in step.writes.values() for w in ws):
    if write.name not in update_ops and write not in waited_for:
      # The update does not wait for it, so this edge closes no cycle.
      new = [op for op in update_results if op not in write.control_inputs]
      write._add_control_inputs(new)  # pylint: disable=protected-access
      step.waited_for.extend(new)
      added += len(new)
  keep_whole(step.waited_for)
  return added


_LOWERED = frozenset(['If', 'StatelessIf', 'Case', 'StatelessCase', 'While',
                      'StatelessWhile'])


def keep_whole(ops: Iterable[tf.Operation]) -> None:
  """Makes the control-flow ops among `ops` that write variables end only
  when everything their functions run has ended, so that a control edge out
  of them orders their reads too (see the module doc).

  One that writes nothing passes its reads on only through its outputs,
  which a lowered op does wait for. As one call, such an op runs where its
  variables are: the variables the calls take together (a global_step
  placed by the placer, taken beside weights placed on a device) must be
  able to share one device.

  Raises:
    ValueError: Such ops take variables on several devices together: as
      function calls they would have to run on each of them.
  """
  ops = [op for op in dict.fromkeys(ops) if _lowered_write(op)]
  groups = _Groups()
  for op in ops:
    groups.join([tower_effects.variable_source(t) for t in op.inputs
                 if _takes_variable(t)])
  for op in ops:
    devices = groups.devices(tower_effects.variable_source(next(
        t for t in op.inputs if _takes_variable(t))))
    if len(devices) > 1:
      raise ValueError(
          f'{op.name} (a tf.cond, tf.case or tf.while_loop) assigns to '
          f'variables and takes variables on several devices ({devices}), '
          'and the training step must order it before a write of a variable '
          'it reads. TensorFlow runs it as TF1 control flow, whose end does '
          'not wait for its assignments, so that order cannot be kept. Use '
          "aggregation='global_loss', which keeps the variables on one "
          'device.')
    op._set_attr('_lower_using_switch_merge',  # pylint: disable=protected-access
                 tf.compat.v1.AttrValue(b=False))


class _Groups:
  """Variables that must share a device, joined (union-find)."""

  def __init__(self):
    self._parent: Dict[tf.Operation, tf.Operation] = {}

  def _root(self, op: tf.Operation) -> tf.Operation:
    while self._parent.get(op, op) is not op:
      op = self._parent[op]
    return op

  def join(self, ops: Sequence[tf.Operation]) -> None:
    for op in ops[1:]:
      self._parent[self._root(op)] = self._root(ops[0])

  def devices(self, op: tf.Operation) -> List[str]:
    """The devices placed on the variables joined with `op`."""
    root = self._root(op)
    members = [root] + [o for o in self._parent if self._root(o) is root]
    return sorted({o.device for o in members} - {''})


def _lowered_write(op: tf.Operation) -> bool:
  return op.type in _LOWERED and tower_effects.calls_write(op)


class _Step:
  """The ops one training step runs, with their variable accesses."""

  def __init__(self, fetches: Sequence):
    self.ops = op_ledger.ancestors(_op(f) for f in fetches if f is not None)
    self.reads: Dict[str, List[tf.Operation]] = {}
    self.writes: Dict[str, List[tf.Operation]] = {}
    # Ops that some write was made to wait for (for keep_whole).
    self.waited_for: List[tf.Operation] = []
    # (variable, op) for each write inside a TF1 while_loop.
    self._loop_writes: List[Tuple[str, tf.Operation]] = []
    self._may_be_dead = _may_be_dead(self.ops)
    for op in self.ops:
      if _in_v1_control_flow(op) or op in self._may_be_dead:
        self._add_cond_reads(op)
        continue
      for variable, written in _accesses(op):
        accesses = self.writes if written else self.reads
        accesses.setdefault(variable, []).append(op)
        if not written:
          accesses[variable].extend(self._live_reads(
              _aliased_reads(op, self.ops)))
    self._position = self._reads_first_order()

  def _live_reads(self, reads: List[tf.Operation]) -> List[tf.Operation]:
    """`reads`, those that may be skipped replaced by the cond exits that
    run in every step: a ref variable's value passed into a TF1 cond
    branch is read there (a write in the other branch made to wait for
    that read never ran: a counter stayed 0 on towers)."""
    live = [op for op in reads if not (_in_v1_control_flow(op) or
                                       op in self._may_be_dead)]
    dead = [op for op in reads if op not in live]
    if dead:
      live.extend(_cond_exits(dead, self.ops, self._may_be_dead))
    return live

  def _add_cond_reads(self, op: tf.Operation) -> None:
    """Counts the reads of an op inside a TF1 cond as reads by the cond's
    exits (its Merge ops outside any TF1 context), which run whichever
    branch was taken: a write can wait for them without a control edge
    into or out of a branch (a Lookahead-style snapshot under a TF1 cond
    read the updated weights in 7-9 of 20 runs on towers)."""
    if not _in_v1_cond_only(op):
      self._loop_writes.extend((variable, op) for variable, written
                               in _accesses(op) if written)
      return
    exits = None
    for variable, written in _accesses(op):
      if written:
        # An edge into a branch from an op that always runs is safe: the
        # write still runs only when its branch does.
        self.writes.setdefault(variable, []).append(op)
        continue
      if exits is None:
        exits = _cond_exits([op, *_aliased_reads(op, self.ops)], self.ops,
                            self._may_be_dead)
      self.reads.setdefault(variable, []).extend(exits)

  def check_loop_writes(self) -> None:
    """Refuses a write inside a TF1 while_loop that the step's other
    accesses of its variable are not ordered with.

    No control edge may enter or leave a TF1 loop's frame, so such a write
    cannot be ordered after the step's reads as one device's executor
    happens to order them: on towers some runs would see it, some not.

    Raises:
      ValueError: Naming the variable and the loop's write.
    """
    for variable, write in self._loop_writes:
      others = [op for op in self.reads.get(variable, []) +
                self.writes.get(variable, []) if op is not write]
      if not others:
        continue
      ordered = op_ledger.ancestors([write]) | self._descendants(
          write, len(self.ops))
      loose = [op for op in others if op not in ordered]
      if loose:
        raise ValueError(
            f'The train_op writes variable {variable} (op {write.name}) '
            'inside a tf.compat.v1.while_loop built with control flow v1 '
            f'(disable_v2_behavior or disable_control_flow_v2), and '
            f'{loose[0].name} reads or writes it in the same step with no '
            'order between them. replicate_model_fn cannot order a write '
            "inside a TF1 loop, so towers would see it before or after at "
            'random. Build the loop with control flow v2 (call '
            'tf.compat.v1.enable_control_flow_v2() before the model_fn), '
            'move the write out of the loop, or order it yourself with '
            'tf.control_dependencies.')

  def order_before(self, before: Iterable[tf.Operation],
                   op: tf.Operation) -> int:
    """Makes `op` wait for each of `before` that does not wait for it."""
    inputs = set(op.control_inputs) | {t.op for t in op.inputs}
    candidates = [o for o in dict.fromkeys(before) if o not in inputs]
    later = [o for o in candidates if self._place(o) > self._place(op)]
    # Only an op placed after `op` can wait for it; a path to it passes
    # through ops placed before it, which bounds the search.
    after = self._descendants(op, max(map(self._place, later))
                              ) if later else set()
    # What the model_fn ordered after the write stays after it.
    added = [o for o in candidates if o not in after]
    if any(map(_lowered_write, added)):
      # One the write already waits for needs no edge (nor keep_whole's
      # placement constraint).
      before_op = op_ledger.ancestors([op])
      added = [o for o in added if o not in before_op]
    if added:
      op._add_control_inputs(added)  # pylint: disable=protected-access
      self.waited_for.extend(added)
      if any(self._place(o) > self._place(op) for o in added):
        self._position = self._reads_first_order()
    return len(added)

  def _place(self, op: tf.Operation) -> int:
    # A TF1 while_loop's back edge keeps its ops out of the order: place
    # them last, so that the search for what waits for an op sees them.
    return self._position.get(op, len(self.ops))

  def _descendants(self, op: tf.Operation, limit: int) -> Set:
    """The ops that wait for `op`, among those placed up to `limit`."""
    found, pending = set(), [op]
    while pending:
      for successor in _successors(pending.pop(), self.ops):
        if successor not in found and self._place(successor) <= limit:
          found.add(successor)
          pending.append(successor)
    return found

  def _reads_first_order(self) -> Dict[tf.Operation, int]:
    """A topological order of the step's ops in which, among ops free to
    run, non-writes come before writes: an edge from an earlier op to a
    later one can never close a cycle."""
    creation = {op: i for i, op in enumerate(
        next(iter(self.ops)).graph.get_operations())} if self.ops else {}
    waiting = {op: len(_predecessors(op, self.ops)) for op in self.ops}
    ready = [(writes(op), creation[op], op.name) for op, n in waiting.items()
             if n == 0]
    heapq.heapify(ready)
    by_name = {op.name: op for op in self.ops}
    position = {}
    while ready:
      _, _, name = heapq.heappop(ready)
      op = by_name[name]
      position[op] = len(position)
      for successor in _successors(op, self.ops):
        waiting[successor] -= 1
        if waiting[successor] == 0:
          heapq.heappush(ready, (writes(successor), creation[successor],
                                 successor.name))
    return position


def _aliased_reads(op: tf.Operation, within: Set[tf.Operation]) -> List:
  """The ops that read a ref variable's memory after `op` took it.

  A ref variable's `read` Identity does not copy: its consumers read the
  variable's buffer when they run, and an in-place write between the
  Identity and them changes what they see (a learning rate read from a
  ref global_step took the next step's value in 6-10 of 10 runs on
  all_reduce towers). So they are reads too, through ops that pass the
  buffer on. Resource variables read a copy (`ReadVariableOp`): none.
  """
  if not any(t.dtype._is_ref_dtype for t in op.inputs) or any(  # pylint: disable=protected-access
      t.dtype._is_ref_dtype for t in op.outputs):  # pylint: disable=protected-access
    return []
  found, pending = [], [op]
  while pending:
    for tensor in pending.pop().outputs:
      for consumer in tensor.consumers():
        if consumer in within and consumer not in found:
          found.append(consumer)
          if consumer.type in _ALIASING:
            pending.append(consumer)
  return found


def _op(fetch) -> tf.Operation:
  return fetch if isinstance(fetch, tf.Operation) else fetch.op


def _predecessors(op: tf.Operation, within: Set[tf.Operation]) -> Set:
  return {p for p in [*(t.op for t in op.inputs), *op.control_inputs]
          if p in within}


def _successors(op: tf.Operation, within: Set[tf.Operation]) -> Set:
  consumers = {c for t in op.outputs for c in t.consumers()}
  consumers.update(op._control_outputs)  # pylint: disable=protected-access
  return {c for c in consumers if c in within}


def _takes_variable(tensor: tf.Tensor) -> bool:
  return tensor.dtype == tf.resource or tensor.dtype._is_ref_dtype  # pylint: disable=protected-access


def _accesses(op: tf.Operation) -> List[Tuple[str, bool]]:
  """(variable, whether `op` writes it) for each variable `op` takes.

  A function call (`If`, a tf.function) writes only the variables its
  functions write; the others it reads, and those reads must come before
  the step's writes too (a Lookahead-style snapshot under a tf.cond read
  the updated weights on towers).
  """
  if op.type in tower_effects.CALLS:
    written = tower_effects.written_inputs(op)
    return [(tower_effects.variable_source(t).name, i in written)
            for i, t in enumerate(op.inputs) if _takes_variable(t)]
  is_write = writes(op)
  return [(name, is_write) for name in variables_taken(op)]


def variables_taken(op: tf.Operation) -> List[str]:
  """Names of the ops that make the variables (or tables) `op` takes."""
  return [tower_effects.variable_source(t).name for t in op.inputs
          if _takes_variable(t)]


def writes(op: tf.Operation) -> bool:
  """Whether `op` changes a variable or table it takes."""
  if op.type in tower_effects.WRITES or op.type in _STRIDED_ASSIGNS:
    return True
  if op.type.startswith(_UPDATE_PREFIXES):
    return True
  if op.type in tower_effects.CALLS:
    return tower_effects.calls_write(op)
  return False


def _in_v1_cond_only(op: tf.Operation) -> bool:
  """Whether `op` is inside TF1 conds only (no while_loop around it)."""
  context = op._control_flow_context  # pylint: disable=protected-access
  while context is not None:
    if not context.IsCondContext():
      return False
    context = context.outer_context
  return True


def _cond_exits(ops: Sequence[tf.Operation], within: Set[tf.Operation],
                may_be_dead: Set[tf.Operation]) -> List[tf.Operation]:
  """The first ops outside every TF1 context that wait for `ops` and run
  in every step (see `_may_be_dead`)."""
  found, seen, pending = [], set(ops), list(ops)
  while pending:
    for successor in _successors(pending.pop(), within):
      if successor in seen:
        continue
      seen.add(successor)
      if _in_v1_control_flow(successor) or successor in may_be_dead:
        pending.append(successor)
      else:
        found.append(successor)
  return found


# A Merge runs when any input is live; a loop's Exit when the loop ends.
_REVIVING = frozenset(['Merge', 'RefMerge', 'Exit', 'RefExit'])


def _may_be_dead(within: Set[tf.Operation]) -> Set[tf.Operation]:
  """The ops the executor skips in some steps: those after a Switch up to
  the Merge that joins its branches, inside a TF1 cond's context or not.

  The gradient of a TF1 cond puts its branches' gradient ops outside any
  context, behind a Switch. A control edge from such an op makes its
  consumer skipped too: an update made to wait for one (it takes the
  weights' handle for a zeros_like) never ran, and on towers global_step
  stayed 0 in 10 of 10 runs.
  """
  found = set()
  pending = [c for op in within if op.type in ('Switch', 'RefSwitch')
             for t in op.outputs for c in t.consumers()]
  while pending:
    op = pending.pop()
    if op in found or op not in within or op.type in _REVIVING:
      continue
    found.add(op)
    pending.extend(_successors(op, within))
  return found


def _in_v1_control_flow(op: tf.Operation) -> bool:
  # Private, but the only record of a TF1 cond or while_loop around an op.
  return op._control_flow_context is not None  # pylint: disable=protected-access
