"""Micro-batches: a global batch beyond device memory, in time on each device.

`replicate_model_fn(..., micro_batches=M)` splits each device's shard of a
TRAIN batch into M consecutive micro-batches and builds each as a tower of
its own on that device: N devices give N * M towers, tower `i * M + m`
being micro-batch m of device i. Everything that makes N towers compute
one device's step (the loss weights, the one update differentiating the
weighted global loss once, loss scaling's one overflow check, the merged
loss, hooks and summaries of one step) then holds for N * M towers as it
is; only two things are added here:

* **Time order.** Towers are parallel in the graph, so TensorFlow would
  run every micro-batch's forward pass at once and keep all their
  activations alive until the backward passes. Once the one update exists,
  `order_in_time` makes the first ops of micro-batch m + 1 on a device wait
  (control inputs) for micro-batch m's backward pass there: the gradient
  ops colocated with m's forward ops (the one update colocates every
  gradient op with its forward op). Micro-batch m's activations are freed
  before m + 1 makes its own, so the peak falls roughly M-fold for the
  activations. The gradient contributions of a variable (its size, one
  per micro-batch) are added in micro-batch order as they come, instead of
  by one AddN that would keep them all until the last backward pass.
* **Loss weights known in advance.** Micro-batch m's backward pass starts
  from its loss weight, so that weight must not depend on a later
  micro-batch's forward pass (a mean's divisor, `tf.size` of its
  activations): the weights of the gradients are the micro-batches' shares
  of the examples (a sum: one each), known from the split alone, and the
  exact weights (divisors read off the loss) are checked against them
  before the update writes anything (tower_weights.TowerWeights).

Under 'all_reduce' (and in a synchronous cluster) a device's micro-batch
towers share that device's copies (replicas.Replicas maps tower i * M + m
to device i) and their gradients are added there before the step's one
all-reduce.

What is refused: batch norm in training, whose forward pass would normalise
each micro-batch with that micro-batch's statistics only (the moving
statistics would still get one exact update from the global batch).

EVAL and PREDICT are not split into micro-batches: they keep no activations
for a backward pass, and their batch size is the input_fn's to choose.

The graph holds M copies of the model per device, and building it takes
more than M times as long (tf.gradients over N * M towers; see
docs/benchmarks.md).
"""

import logging
from typing import Dict, List, Optional, Sequence, Set

import tensorflow as tf

from estimator_towers.graph import op_ledger
from estimator_towers.towers import shard_statistics
from estimator_towers.towers import sharding
from estimator_towers import tower as tower_lib
from estimator_towers.update import write_order

# A named logger, as in replicate.py: absl's functions would configure the
# root logger.
_log = logging.getLogger(__name__)
tf1 = tf.compat.v1
# Ops never gated: they hold state or feed the step, and run once.
_UNGATED = frozenset(['VarHandleOp', 'VariableV2', 'Variable', 'Placeholder',
                      'PlaceholderWithDefault'])


def check(micro_batches, aggregation: str) -> int:
  """Validates the `micro_batches` argument of replicate_model_fn.

  Args:
    micro_batches: The number of micro-batches per tower.
    aggregation: The `aggregation` argument.

  Returns:
    `micro_batches`.

  Raises:
    ValueError: `micro_batches` is not a positive int.
  """
  if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or (
      micro_batches < 1):
    raise ValueError(
        f'micro_batches={micro_batches!r}; it must be a positive int, the '
        'number of micro-batches each tower runs one after another in a '
        'step (1: the whole shard at once).')
  del aggregation  # Every aggregation takes micro-batches.
  return micro_batches


class MicroBatches:
  """The towers of a TRAIN step run as micro-batches in time.

  Args:
    devices: The tower devices (one per device, as the user gave them).
    count: Micro-batches per device, above 1.
  """

  def __init__(self, devices: Sequence[str], count: int):
    self._devices = list(devices)
    self.count = count

  @property
  def tower_devices(self) -> List[str]:
    """The device of each of the N * M towers, device after device."""
    return [d for d in self._devices for _ in range(self.count)]

  def context(self, tower: int) -> tower_lib.TowerContext:
    """What `tower_context()` tells micro-batch tower `tower`."""
    device, micro = divmod(tower, self.count)
    return tower_lib.TowerContext(device, len(self._devices),
                                  self._devices[device], micro, self.count)

  def refuse_batch_norm(self, trains_batch_norm: bool,
                        towers: op_ledger.TowerLedger) -> None:
    """Fails when the model normalises its batch in training.

    Args:
      trains_batch_norm: Whether a Keras batch-norm layer updated its
        moving statistics (moving_statistics saw it).
      towers: The towers' regions; tower 0's ops are searched for a fused
        batch norm in training mode (`tf.compat.v1.nn.fused_batch_norm`).

    Raises:
      ValueError: The model trains batch norm.
    """
    graph = tf1.get_default_graph()
    region = towers.region(0)
    fused = [op.name for op in graph.get_operations()
             if op.type in shard_statistics.FUSED_BATCH_NORMS and
             region.contains(op) and
             op.get_attr('is_training') and not _normalises_each_row(op)]
    if not trains_batch_norm and not fused:
      return
    what = f' ({fused[0]})' if fused else ''
    raise ValueError(
        f'micro_batches={self.count}: the model trains batch norm{what}. '
        'Its forward pass would normalise each micro-batch with that '
        "micro-batch's own mean and variance, not the device's shard's, so "
        'the step would not be the one the shard computes (its moving mean '
        'and variance would still get one exact update from the global '
        'batch). Use micro_batches=1 (more devices, or a smaller batch), '
        'or a normalisation that does not mix examples (layer or group '
        'norm), or batch norm in inference mode (frozen statistics).')

  def order_in_time(self, towers: op_ledger.TowerLedger,
                    update_ops: Set[str], shards: Sequence,
                    results: Sequence[tf.Operation],
                    checks: Sequence[tf.Operation]
                    ) -> List[Optional[tf.Operation]]:
    """Runs each device's micro-batches one after another.

    Call once the one update exists (and after anything else adds control
    inputs): the first ops of micro-batch m + 1 of a device get a control
    input from an op that waits for micro-batch m's backward pass there,
    the update's gradient ops colocated with m's ops that depend on its
    examples (its activations; a shared op such as a weight's regularizer,
    made in tower 0, sums the gradients of every micro-batch). Also makes
    the update's writes wait for `checks`.

    Args:
      towers: The N * M towers' regions.
      update_ops: Names of the one update's ops (gradients included).
      shards: Each tower's features and labels.
      results: The ops that end the one update (the step's writes are
        among their inputs).
      checks: Ops the update's writes must wait for (the loss weights'
        check).

    Returns:
      Per tower, the op its first ops wait on (None for a device's first
      micro-batch).

    Raises:
      ValueError: A micro-batch's backward pass reads ops of a later
        micro-batch that depend on its examples, so they cannot run one
        after another.
    """
    graph = tf1.get_default_graph()
    num_towers = len(self._devices) * self.count
    forward: List[List[tf.Operation]] = [[] for _ in range(num_towers)]
    after = towers.first
    update = []
    for op in graph.get_operations():
      if not op_ledger.made_after(op, after):
        continue
      if op.name in update_ops:
        update.append(op)
        continue
      tower = towers.tower_of(op)
      if tower < num_towers and towers.region(tower).contains(op):
        forward[tower].append(op)
    owner: Dict[str, int] = {}
    examples = []
    for tower in range(num_towers):
      examples.append(_from_examples(shards[tower], set(forward[tower])))
      owner.update((op.name, tower) for op in examples[tower])
    reads = _towers_read(graph, after, examples)
    backward: List[List[tf.Operation]] = [[] for _ in range(num_towers)]
    for op in update:
      for group in op.colocation_groups():
        tower = owner.get(group[len(b'loc:@'):].decode())
        # Not a sum of several micro-batches' gradients (tf.gradients
        # colocates it with one of them): it waits for the later ones.
        if tower is not None and reads[op] == 1 << tower:
          backward[tower].append(op)
          break
    self._sum_in_time(graph, update, reads)
    # Variables made in a later micro-batch (none, when the towers share
    # them) are initialised before any step: their initialisers never wait.
    initialising = op_ledger.ancestors(
        [v.initializer for v in tf1.global_variables() + tf1.local_variables()
         if v.initializer is not None], after)
    waits: List[Optional[tf.Operation]] = [None] * num_towers
    for tower in range(num_towers):
      if tower % self.count == 0:
        continue
      if not backward[tower - 1]:
        if examples[tower - 1]:
          # Exact still, but every micro-batch's activations may be alive.
          _log.warning(
              'micro_batches=%d: no backward pass of micro-batch %d of '
              'device %d depends on that micro-batch alone, so the next '
              'one cannot wait for it; its memory is not bounded.',
              self.count, (tower - 1) % self.count, tower // self.count)
        continue
      device = self._devices[tower // self.count]
      with graph.control_dependencies(None), graph.device(device):
        with graph.control_dependencies(backward[tower - 1]):
          done = tf.no_op(name=f'micro_batch_{tower - 1}_backward_done')
      read = op_ledger.ancestors([done], after)
      self._check_no_cycle(read, examples[tower], tower)
      members = set(forward[tower])
      for op in forward[tower]:
        # An op the backward pass reads (a shared weight's transformation)
        # runs before it anyway.
        if op not in read and op not in initialising and _is_root(
            op, members):
          op._add_control_input(done)  # pylint: disable=protected-access
      waits[tower] = done
    if checks:
      # The step's writes, not the initializers of slots it created.
      for op in op_ledger.ancestors(results, after):
        if op.name in update_ops and write_order.writes(op):
          op._add_control_inputs(checks)  # pylint: disable=protected-access
    return waits

  def _sum_in_time(self, graph: tf.Graph, update: Sequence[tf.Operation],
                   reads: Dict[tf.Operation, int]) -> None:
    """Adds the micro-batches' gradients as they come.

    tf.gradients sums a variable's gradient contributions with one AddN,
    which waits for all of them: every micro-batch's contribution (the
    size of the variable) would stay alive until the last backward pass.
    A chain of additions in micro-batch order (all devices' micro-batch 0,
    then 1, ...) frees each contribution once it is added.
    """
    for op in update:
      if op.type != 'AddN' or bin(reads[op]).count('1') < 2:
        continue
      inputs = sorted(op.inputs,
                      key=lambda t: self._latest(reads.get(t.op, 0)))
      with graph.control_dependencies(None), graph.colocate_with(op):
        total = inputs[0]
        for t in inputs[1:]:
          total = tf.add(total, t, name=op.name.split('/')[-1] + '_in_time')
          reads[total.op] = reads[op]
      for consumer in list(op.outputs[0].consumers()):
        for index, t in enumerate(list(consumer.inputs)):
          if t is op.outputs[0]:
            consumer._update_input(index, total)  # pylint: disable=protected-access

  def _latest(self, towers: int) -> tuple:
    """(micro-batch, device) of the latest tower in the bit set."""
    if not towers:
      return (-1, -1)
    device, micro = divmod(towers.bit_length() - 1, self.count)
    return (micro, device)

  def _check_no_cycle(self, read: Set[tf.Operation],
                      later: Set[tf.Operation], tower: int) -> None:
    """Fails when a backward pass reads (`read`) ops of tower `tower` that
    depend on its examples (`later`)."""
    both = read & later
    if both:
      device, micro = divmod(tower, self.count)
      name = op_ledger.by_creation(both)[0].name
      raise ValueError(
          f'micro_batches={self.count}: the backward pass of micro-batch '
          f'{micro - 1} of device {device} reads {name}, which micro-batch '
          f'{micro} computes from its examples, so the two cannot run one '
          'after another. The loss of one micro-batch (or its gradient) '
          'must not depend on another micro-batch; use micro_batches=1.')


def _normalises_each_row(op: tf.Operation) -> bool:
  """Whether a fused batch norm is Keras' layer normalisation, which
  reshapes its input to [1, rows, features, 1] (NCHW) so that each row (an
  example, or one position of it) is a channel normalised on its own."""
  shape = op.inputs[0].shape
  return op.get_attr('data_format') == b'NCHW' and shape.rank == 4 and (
      tf.compat.dimension_value(shape[0]) == 1)


def _towers_read(graph: tf.Graph, after: op_ledger.Mark,
                 examples: Sequence[Set[tf.Operation]]
                 ) -> Dict[tf.Operation, int]:
  """For each op made after `after`, the towers whose example-dependent
  ops (`examples`) it reads, directly or not, as a bit set."""
  own = {op: 1 << tower for tower, ops in enumerate(examples) for op in ops}
  reads: Dict[tf.Operation, int] = {}
  # Creation order is a topological order of data inputs; a control input
  # added later (write ordering) comes after its op, and orders writes
  # after reads, which the backward passes do not depend on.
  for op in op_ledger.by_creation(
      op for op in graph.get_operations()
      if op_ledger.made_after(op, after)):
    mask = own.get(op, 0)
    for t in op.inputs:
      mask |= reads.get(t.op, 0)
    for control in op.control_inputs:
      mask |= reads.get(control, 0)
    reads[op] = mask
  return reads


def _from_examples(shard, ops: Set[tf.Operation]) -> Set[tf.Operation]:
  """The ops among `ops` that read the shard's examples, directly or not."""
  leaves = sharding.leaves(shard, expand_composites=True)
  pending = [consumer for t in leaves if isinstance(t, tf.Tensor) and
             t.shape.rank != 0 for consumer in t.consumers()]
  found = set()
  while pending:
    op = pending.pop()
    if op in found or op not in ops:
      continue
    found.add(op)
    pending.extend(c for t in op.outputs for c in t.consumers())
  return found


def _is_root(op: tf.Operation, members: Set[tf.Operation]) -> bool:
  """Whether `op` starts its tower's computation: no input (data or
  control) comes from another op of the tower, so gating it on an earlier
  micro-batch delays everything of this tower that follows from it."""
  if op.type in _UNGATED or write_order._in_v1_control_flow(op):  # pylint: disable=protected-access
    # A TF1 cond or loop takes its inputs through its own ops (Enter,
    # Switch), which are gated where they read the tower's ops.
    return False
  return not any(t.op in members for t in op.inputs) and not any(
      c in members for c in op.control_inputs)
