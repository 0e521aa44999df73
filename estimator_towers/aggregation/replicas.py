"""Replicated variables for the 'all_reduce' aggregation.

Tower 0 creates the primary variables under their one-device names, on its
own device. Every later tower gets its own copy of each trainable primary,
on its own device, named `tower_<i>_replica/<primary name>`. Copies and their
optimizer slots are local variables (not in GLOBAL_VARIABLES nor
TRAINABLE_VARIABLES), so the Saver never writes or expects them: checkpoints
hold exactly the one-device names and move freely between strategies, tower
counts and plain Estimators.

After every restore or initialisation, the Scaffold's local_init_op sets each
copy (and each of its slots) from its primary (slot), so all copies start
identical. Each step then gives every copy the same update:

* each tower differentiates its own weighted loss w.r.t. its own copies;
* per variable, the towers' gradients are summed by an all-reduce that
  leaves the same sum on every device (cross_device);
* the model_fn's `apply_gradients` is performed once, on a list holding every
  copy: slots and the step count advance once, global_step once. If the
  model_fn passed the gradients on unchanged, each copy takes its own
  device's sum; if it transformed them (clipping), every copy takes the
  transformed tensor, sent to its device, which is exact.

Non-trainable variables (batch-norm statistics, counters) are not copied:
every tower uses the primary, as with the other strategies.

replica_path.ReplicaPath takes the towers' gradients and updates through
these copies: it is the all_reduce strategy's gradient path in TRAIN.
"""

import contextlib
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import tensorflow as tf

from estimator_towers.collectives import cross_device
from estimator_towers.graph import op_ledger
from estimator_towers.update import gradient_routing
from estimator_towers.cluster import task_sync
from tensorflow.python.ops import variables as variables_lib  # pylint: disable=g-direct-tensorflow-import,g-bad-import-order

tf1 = tf.compat.v1
_COPY_NAME = re.compile(r'(^|/)tower_\d+_replica/')
_WRITES = frozenset([
    'Assign', 'AssignAdd', 'AssignSub', 'AssignVariableOp',
    'AssignAddVariableOp', 'AssignSubVariableOp', 'ScatterUpdate',
    'ScatterAdd', 'ScatterSub', 'ResourceScatterUpdate', 'ResourceScatterAdd',
    'ResourceScatterSub'])

# Ops that read a checkpoint: a write of their value is a Saver's restore.
_RESTORES = frozenset(['RestoreV2', 'Restore', 'RestoreSlice'])

# Ops that only read a variable they take.
_READS = frozenset(['ReadVariableOp', 'ResourceGather', 'ResourceGatherNd',
                    'VariableShape', 'VarIsInitializedOp', 'Identity',
                    'IsVariableInitialized'])


class Replicas:
  """The copies of one TRAIN graph, their gradients and their update.

  Args:
    devices: The tower devices; tower i's copies live on devices[i].
    unshared: A context factory inside which variables may be created
      freely (see `VariableSharing.unshared`).
    placement: The strategies.AllReduce strategy, which lets the
      all-reduce ops keep the devices given here.
    task_group: The training tasks: in a synchronous cluster a
      task_sync.TaskGroup, over which gradients are also summed and to
      which the chief's variables are broadcast at the start; on one
      machine a one_machine.OneMachine.
    ledger: The build's towers (which tower made an op).
    towers_per_device: With micro-batches, M: towers i * M .. i * M + M - 1
      run on devices[i] one after another and share its copies, and their
      gradients are added there before the all-reduce.
  """

  def __init__(self, devices: Sequence[str],
               unshared: Callable[[], contextlib.AbstractContextManager],
               placement, task_group,
               ledger: Optional[op_ledger.TowerLedger] = None,
               towers_per_device: int = 1):
    self._devices = list(devices)
    self._per_device = towers_per_device
    self._ledger = ledger  # Which tower made an op: its own primary reads.
    self.task_group = task_group
    self._unshared = unshared
    self._placement = placement
    self._copies: Dict[int, List[tf.Variable]] = {}  # id(primary) -> copies
    self._primary: Dict[int, tf.Variable] = {}  # id(any copy) -> primary
    self._partitioned_copies = {}  # (id(primary), tower) -> its copy
    self._trainable: Optional[set] = None
    # id(gradient returned to the model_fn) -> that variable's sums per tower.
    self._sums: Dict[int, list] = {}
    self._used = set()  # ids of the sums some copy's update consumes.
    self._optimizers = []
    self._updates: List[op_ledger.Region] = []  # The ops of each update.
    # Primaries' initializers as made: `init_from_checkpoint` (e.g. in a
    # TPUEstimatorSpec's scaffold_fn) replaces one, leaving the old unused.
    self._first_initializers = set()

  # ----------------------------------------------------------------------
  # Copies.

  def _device_of(self, tower: int) -> int:
    """The index of tower `tower`'s device: whose copies it uses."""
    return tower // self._per_device

  def tower_variable(self, primary, tower: int):
    """What tower `tower` uses for `primary`: its device's copy if
    trainable."""
    if isinstance(primary, variables_lib.PartitionedVariable):
      return self._partitioned(primary, tower)
    device = self._device_of(tower)
    if not device or not self._is_trainable(primary):
      return primary
    if id(primary) not in self._copies:
      self._first_initializers.add(primary.initializer.name)
    copies = self._copies.setdefault(id(primary), [primary])
    while len(copies) <= device:
      copies.append(self._make_copy(primary, len(copies)))
    return copies[device]

  def primary_name(self, name: str, tower: int) -> str:
    """`name` without tower `tower`'s copy prefix: a variable named after a
    copy (a slot or EMA shadow made from it) is the primary's."""
    prefix = _copy_scope(self._device_of(tower))
    return name[len(prefix):] if name.startswith(prefix) else name

  def _partitioned(self, primary, tower: int):
    """A PartitionedVariable of tower `tower`'s copies of the parts."""
    parts = list(primary)
    copies = [self.tower_variable(part, tower) for part in parts]
    device = self._device_of(tower)
    if not device or all(c is p for c, p in zip(copies, parts)):
      return primary
    key = (id(primary), device)
    if key not in self._partitioned_copies:
      for copy, part in zip(copies, parts):
        # The constructor wants the slices; the Saver never sees copies.
        copy._set_save_slice_info(part._get_save_slice_info())  # pylint: disable=protected-access
      self._partitioned_copies[key] = variables_lib.PartitionedVariable(
          f'{_copy_scope(device)}{primary.name}', primary.get_shape(),
          primary.dtype, copies, primary._get_partitions())  # pylint: disable=protected-access
    return self._partitioned_copies[key]

  def _is_trainable(self, variable) -> bool:
    if self._trainable is None or id(variable) not in self._trainable:
      self._trainable = {id(v) for v in tf1.trainable_variables()}
    return id(variable) in self._trainable

  def _make_copy(self, primary, device: int):
    if not primary.shape.is_fully_defined():
      raise ValueError(
          f"aggregation='all_reduce' needs a static shape to replicate "
          f'{primary.name}, which has shape {primary.shape}.')
    graph = tf1.get_default_graph()
    name = f'{_copy_scope(device)}{primary.op.name}'
    with self._unshared(), graph.name_scope(None), graph.colocate_with(
        None, ignore_existing=True):
      # Zeros until local_init_op sets it from the primary (see sync_op).
      # The constraint too: optimizers project each variable they update.
      # A callable: a variable made inside a tf.cond branch is lifted out
      # of it, which a tensor made in the branch cannot be.
      shape, dtype = primary.shape, primary.dtype.base_dtype
      copy = tf1.Variable(
          lambda: tf.zeros(shape, dtype), name=name,
          trainable=True, use_resource=True,
          collections=[tf1.GraphKeys.LOCAL_VARIABLES],
          constraint=getattr(primary, 'constraint', None))
    # Trainable for the layers that own it (Keras lists trainable_weights),
    # but not in the collection: var_list=None means the primaries.
    _remove_from(graph, tf1.GraphKeys.TRAINABLE_VARIABLES, copy)
    self._primary[id(copy)] = primary
    return copy

  def primary_of(self, variable):
    return self._primary.get(id(variable), variable)

  @contextlib.contextmanager
  def local_slots(self) -> Iterator[None]:
    """Variables made inside for a copy (its slots) become local ones."""
    graph = tf1.get_default_graph()

    def creator(next_creator, **kwargs):
      variable = next_creator(**kwargs)
      if _COPY_NAME.search(_full_name(kwargs)):
        _remove_from(graph, tf1.GraphKeys.GLOBAL_VARIABLES, variable)
        _remove_from(graph, tf1.GraphKeys.TRAINABLE_VARIABLES, variable)
        if variable not in graph.get_collection(
            tf1.GraphKeys.LOCAL_VARIABLES):
          graph.add_to_collection(tf1.GraphKeys.LOCAL_VARIABLES, variable)
      return variable

    with tf1.variable_creator_scope(creator):
      yield

  # ----------------------------------------------------------------------
  # Gradients.

  def on_tower_devices(self, fn: Callable[[int], Any]) -> List[Any]:
    """[fn(i) built on tower i's device for every tower i]."""
    results = []
    with self._placement.deferring():
      for tower in range(len(self._devices) * self._per_device):
        with tf.device(self._devices[self._device_of(tower)]):
          results.append(fn(tower))
    return results

  def gradients(self, weighted_losses: Sequence[tf.Tensor], variables: List,
                differentiate: Callable[[tf.Tensor, List], List],
                has_rows: tf.Tensor) -> List:
    """Each tower's gradients w.r.t. its copies, all-reduced.

    Args:
      weighted_losses: Each tower's loss times its weight.
      variables: The variables the model_fn asked gradients for (primaries
        or one tower's copies).
      differentiate: (loss, variables) -> one gradient (or None) each.
      has_rows: Whether this task's batch has any example (a bool scalar);
        in a synchronous cluster a task without one adds nothing.

    Returns:
      The summed gradients on device 0, one per variable; the other
      devices' sums are remembered for `expand`.
    """
    primaries = [self.primary_of(v) for v in variables]
    per_tower = [self._tower_gradients(loss, primaries, tower, differentiate)
                 for tower, loss in enumerate(weighted_losses)]
    if self.task_group.across_tasks:
      # A local collective would be resolved by the cluster's group leader,
      # where every task's local group has the same key: see task_sync.
      return self._gradients_over_tasks(primaries, per_tower, has_rows)
    result = []
    with self._placement.deferring(), tf.name_scope('all_reduce'):
      for k in range(len(primaries)):
        grads = [g[k] for g in per_tower]
        missing = [t for t, g in enumerate(grads) if g is None]
        if len(missing) == len(grads):
          result.append(None)
          continue
        if missing:
          raise ValueError(
              f'Variable {primaries[k].name} has a gradient in some towers '
              f'but none in towers {missing}; every tower must build the '
              'same model.')
        sums = cross_device.all_sum(self._per_device_sums(grads),
                                    self._devices)
        result.append(_running_all(sums, self._devices[0]))
        self._sums[id(result[-1])] = sums
    return result

  def _per_device_sums(self, grads: list) -> list:
    """The towers' gradients of one variable added per device.

    Without micro-batches, each tower's own. With them, a device's
    micro-batches are added in their order on that device as they come
    (not by one AddN, which would keep every micro-batch's gradient alive
    until the last): one all-reduce per step, not per micro-batch.
    """
    if self._per_device == 1:
      return list(grads)
    sums = []
    for device, name in enumerate(self._devices):
      own = grads[device * self._per_device:(device + 1) * self._per_device]
      with tf.device(name):
        if isinstance(own[0], tf.IndexedSlices):
          sums.append(tf.IndexedSlices(
              tf.concat([g.values for g in own], 0),
              tf.concat([g.indices for g in own], 0), own[0].dense_shape))
          continue
        total = own[0]
        for grad in own[1:]:
          total = tf.add(total, grad)
        sums.append(total)
    return sums

  def _tower_gradients(self, loss: tf.Tensor, primaries: List, tower: int,
                       differentiate: Callable[[tf.Tensor, List], List]
                       ) -> List:
    """Tower `tower`'s gradients, one per primary, w.r.t. its copies.

    A tower reads its copies through its layers, but its loss can also
    depend on reads of a primary: `tf.compat.v1.trainable_variables()`
    lists only the primaries, which is how many model_fns add weight decay;
    a layer object built in tower 0 and called again reads them; and a
    kernel regularizer tower 0 added alone is part of every tower's total
    loss. The gradient of this tower's loss through those reads, wherever
    they were made, is this tower's share, so it is added to its copy's
    (tower 0 differentiates its own loss only: the later towers' share was
    lost, 0.05 off in a kernel in every run).
    """
    copies = [self.tower_variable(p, tower) for p in primaries]
    grads = list(differentiate(loss, copies))
    if self._ledger is None or tower == 0:
      return grads
    shared = [k for k, (p, c) in enumerate(zip(primaries, copies))
              if c is not p]
    if shared:
      # By the variables themselves: through every read, also those inside
      # a tf.cond or tf.while_loop's functions. Plain tf.gradients, not the
      # model_fn's method: most primaries have no path here (None), which
      # Keras' get_gradients would refuse.
      direct = gradient_routing.TF1_GRADIENTS(
          loss, [primaries[k] for k in shared],
          colocate_gradients_with_ops=True)
      for k, grad in zip(shared, direct):
        grads[k] = _added(grads[k], grad)
    return grads

  def _gradients_over_tasks(self, primaries: List, per_tower: List[List],
                            has_rows: tf.Tensor) -> List:
    """`gradients` in a synchronous cluster: summed over towers and tasks.

    The towers' gradients are added on tower 0's device, the dense sums of
    all variables then travel packed in one collective per dtype, and the
    result is sent to every tower device.
    """
    local: List = []
    with self._placement.deferring(), tf.name_scope('all_reduce'):
      for k, primary in enumerate(primaries):
        grads = [g[k] for g in per_tower]
        grad = _local_sum(primary, grads, self._devices[0])
        if grad is not None:
          with tf.device(self._devices[0]):
            grad = self.task_group.own_part(grad, has_rows)
        local.append(grad)
      dense = [k for k, g in enumerate(local)
               if g is not None and not isinstance(g, tf.IndexedSlices)]
      totals = dict(zip(dense, self.task_group.sum([local[k]
                                                     for k in dense])))
      result = []
      for k, grad in enumerate(local):
        if grad is None:
          result.append(None)
          continue
        if k in totals:
          total = totals[k]
        else:
          total = self.task_group.gather_slices(grad)
        sums = [_on_device(d, total) for d in self._devices]
        result.append(sums[0])
        self._sums[id(result[-1])] = sums
    return result

  # ----------------------------------------------------------------------
  # The update.

  def expand(self, grads_and_vars) -> list:
    """The model_fn's (gradient, variable) pairs for every copy.

    A gradient returned by `gradients` and passed on unchanged is replaced,
    for tower i's copy, by the sum on tower i's device. Any other gradient
    (transformed by the model_fn) is used for every copy.
    """
    expanded = []
    for grad, variable in grads_and_vars:
      primary = self.primary_of(variable)
      copies = self._copies.get(id(primary), [primary])
      sums = self._sums.get(id(grad)) if grad is not None else None
      for tower, copy in enumerate(copies):
        expanded.append((sums[tower] if sums else grad, copy))
        if sums:
          self._used.add(id(sums[tower]))
    return expanded

  def unused_sums(self) -> List:
    """The all-reduce results no update consumes.

    A collective completes only when every device takes part: if the
    model_fn transformed tower 0's sums, the other devices' results must
    still be computed, or the step waits forever.
    """
    return [t for sums in self._sums.values() for t in sums
            if id(t) not in self._used]

  def applied(self, optimizer, update: op_ledger.Region) -> None:
    """Records an update: its ops, and its optimizer if it made slots for
    the copies (None if it updated only the primaries)."""
    if optimizer is not None:
      self._optimizers.append(optimizer)
    self._updates.append(update)

  def sync_written(self, update, since: op_ledger.Mark, what: str):
    """After `update`, sets every copy of each primary it wrote.

    For an update the copies cannot take themselves (an optimizer's own
    apply_gradients with slots of its own): it updates the primaries, then
    each copy is set from its primary.

    Args:
      update: The update's op (or a list of them).
      since: A mark taken before the update was built.
      what: The update's name, for errors.

    Returns:
      An op running the update, the copies' assignments and the all-reduce
      results nothing consumes (see unused_sums).

    Raises:
      ValueError: The update wrote a copy rather than a primary.
    """
    primaries, copies = {}, {}
    for variables in self._copies.values():
      primaries[_handle_name(variables[0])] = variables[0]
      for copy in variables[1:]:
        copies[_handle_name(copy)] = copy
    written = {}
    graph = tf1.get_default_graph()
    for op in graph.get_operations():
      if op_ledger.made_before(op, since) or op.type in _READS:
        continue
      # Any other use of a variable may write it (ResourceApplyAdam, ...).
      for target in (t.name for t in op.inputs):
        if target in copies:
          raise ValueError(
              f"aggregation='all_reduce': {what} writes "
              f'{copies[target].op.name}, a per-device copy, itself. '
              + instead_of_all_reduce(
                  self.task_group.across_tasks))
        if target in primaries:
          written[target] = primaries[target]
    updates = tf.nest.flatten(update)
    with tf.name_scope('sync_replicas'), tf.control_dependencies(updates):
      assigns = [copy.assign(_copied(primary)).op
                 for primary in written.values()
                 for copy in self._copies[id(primary)][1:]]
    return tf.group(*updates, *assigns, *self.unused_sums())

  def pairs(self) -> List[tuple]:
    """(primary, copy) for every copy and every slot of a copy."""
    found = []
    for copies in self._copies.values():
      primary = copies[0]
      for copy in copies[1:]:
        found.append((primary, copy))
        for opt in self._optimizers:
          for slot in opt.get_slot_names():
            primary_slot = _slot(opt, primary, slot)
            copy_slot = _slot(opt, copy, slot)
            if (primary_slot is None) != (copy_slot is None):
              raise ValueError(
                  f'The optimizer made slot {slot!r} for only one of '
                  f'{primary.name} and its copy {copy.name}.')
            if primary_slot is not None:
              found.append((primary_slot, copy_slot))
    return found

  def check_no_other_writes(self, since: op_ledger.Mark) -> None:
    """Fails when the model_fn itself writes a replicated variable.

    Such a write (an assign in the model_fn) would reach one copy only, and
    the copies would drift apart silently.

    Args:
      since: A mark taken before the towers were built: earlier ops are not
        the model_fn's.
    """
    handles = {}
    for copies in self._copies.values():
      for v in copies:
        handles[_handle_name(v)] = v
    graph = tf1.get_default_graph()
    initializers = {v.initializer.name for vs in self._copies.values()
                    for v in vs} | self._first_initializers
    for op in graph.get_operations():
      if (op_ledger.made_before(op, since) or op.type not in _WRITES or
          op.name in initializers or op_ledger.in_any(op, self._updates) or
          _restores(op)):
        continue
      target = op.inputs[0].name if op.inputs else None
      if target in handles:
        raise ValueError(
            f"aggregation='all_reduce': the model_fn writes the trainable "
            f'variable {self.primary_of(handles[target]).op.name} itself '
            f'({op.type} {op.name}), which would reach only one of its '
            'copies. ' +
            instead_of_all_reduce(self.task_group.across_tasks))

  def check_saver(self, saver: Optional[tf1.train.Saver]) -> None:
    """Fails when the model_fn's own Saver restores copies, not primaries.

    A Saver the model_fn builds over its model's objects (model_to_estimator's
    object-based one) sees the last tower's copies: its restore would set
    them and leave the primaries, from which local_init_op sets every copy,
    uninitialised.

    Args:
      saver: The merged spec's scaffold's Saver (None: Estimator builds one
        over the global variables, which are the primaries).

    Raises:
      ValueError: the Saver restores a copy and not its primary.
    """
    if saver is None or saver.saver_def is None:
      return
    graph = tf1.get_default_graph()
    restore = graph.get_operation_by_name(saver.saver_def.restore_op_name)
    restored = {op.inputs[0].name for op in op_ledger.ancestors([restore])
                if op.type in _WRITES and _restores(op)}
    for primary, copy in self.pairs():
      if (_handle_name(copy) in restored and
          _handle_name(primary) not in restored):
        raise ValueError(
            "aggregation='all_reduce': the model_fn's own Saver "
            f'(scaffold.saver) restores {copy.op.name}, a tower\'s copy, and '
            f'not {primary.op.name}: a run restored from a checkpoint would '
            'start from uninitialised variables. Let Estimator build the '
            "Saver (model_to_estimator(..., checkpoint_format='saver')), or "
            + instead_of_all_reduce(self.task_group.across_tasks))

  def sync_op(self, after: tf.Operation) -> tf.Operation:
    """Sets every copy and copy slot from its primary, after `after`."""
    with tf.name_scope('sync_replicas'):
      with tf.control_dependencies([after]):
        assigns = [copy.assign(_copied(primary)).op
                   for primary, copy in self.pairs()]
      return tf.group(after, *assigns)

  def local_state(self) -> List[tf.Variable]:
    """The local variables a synchronous cluster's chief broadcasts.

    Not checkpointed, they are initialised by every task itself: one with a
    random initializer (a fixed random projection) would differ between the
    tasks, each computing its gradients with its own. The copies and their
    slots are left out (set from their primaries afterwards), and so are
    variables of unknown shape or of a dtype no collective carries.
    """
    copies = {_handle_name(copy) for _, copy in self.pairs()}
    return [v for v in tf1.local_variables()
            if _handle_name(v) not in copies and
            task_sync.can_broadcast(v)]

  def scaffold(self, scaffold: tf1.train.Scaffold) -> tf1.train.Scaffold:
    """`scaffold` whose local_init_op also sets the copies."""
    return _SyncingScaffold(self, scaffold)


class _SyncingScaffold(tf1.train.Scaffold):
  """A Scaffold whose local_init_op ends by syncing the copies.

  SessionManager runs local_init_op after the restore or init_op, on every
  session (re)creation. The base op (the model_fn's own, else the default
  one) is found at finalize time, when every local variable exists.
  """

  def __init__(self, replicas: Replicas, scaffold: tf1.train.Scaffold):
    super().__init__(copy_from_scaffold=scaffold)
    self._replicas = replicas
    self._synced = False
    if not replicas.task_group.is_chief:
      # A worker neither restores nor waits for a chief's initialisation of
      # its variables (no ps holds them): local_init_op initialises them and
      # then takes the chief's values.
      self._ready_for_local_init_op = tf.constant([], tf.string)

  def finalize(self):
    if not self._synced:
      self._synced = True
      base = self._local_init_op
      if base is None:
        base = tf1.train.Scaffold.get_or_default(
            'local_init_op', tf1.GraphKeys.LOCAL_INIT_OP,
            tf1.train.Scaffold.default_local_init_op)
      base = self._replicas.task_group.started(
          base, self._worker_init_op,
          lambda: tf1.global_variables() + self._replicas.local_state())
      self._local_init_op = self._replicas.sync_op(base)
    return super().finalize()

  def _worker_init_op(self) -> tf.Operation:
    """What initialises a worker's variables: the model_fn's init_op, else
    every global variable's initializer."""
    if self._init_op is None:
      return tf1.global_variables_initializer()
    return self._init_op


def instead_of_all_reduce(in_cluster: bool) -> str:
  """What an error that refuses 'all_reduce' advises instead.

  Args:
    in_cluster: Whether the towers are those of a synchronous cluster,
      where no other aggregation trains (see `strategies.check_tasks`).

  Returns:
    A sentence.
  """
  if in_cluster:
    return ("A synchronous cluster trains only with 'all_reduce': train "
            "with ps tasks (asynchronous, aggregation='global_loss') or on "
            'one machine.')
  return "Use aggregation='global_loss' or 'round_robin'."


def _added(grad, other):
  """The sum of two gradients of one variable, either of them None."""
  if grad is None or other is None:
    return other if grad is None else grad
  return tf.convert_to_tensor(grad) + tf.convert_to_tensor(other)


def _copy_scope(tower: int) -> str:
  """The name prefix of tower `tower`'s copies."""
  return f'tower_{tower}_replica/'


def _local_sum(primary, grads: list, device: str):
  """The towers' gradients of `primary` added on `device`; None if none."""
  missing = [t for t, g in enumerate(grads) if g is None]
  if len(missing) == len(grads):
    return None
  if missing:
    raise ValueError(
        f'Variable {primary.name} has a gradient in some towers but none in '
        f'towers {missing}; every tower must build the same model.')
  with tf.device(device):
    if isinstance(grads[0], tf.IndexedSlices):
      if not all(isinstance(g, tf.IndexedSlices) for g in grads):
        raise ValueError(
            f'Variable {primary.name} has sparse gradients in some towers '
            'and dense ones in others; every tower must build the same '
            'model.')
      return tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                              tf.concat([g.indices for g in grads], 0),
                              grads[0].dense_shape)
    return tf.add_n(grads) if len(grads) > 1 else tf.identity(grads[0])


def _on_device(device: str, value):
  """`value` (a Tensor or IndexedSlices) sent to `device`."""
  with tf.device(device):
    if isinstance(value, tf.IndexedSlices):
      return tf.IndexedSlices(tf.identity(value.values),
                              tf.identity(value.indices), value.dense_shape)
    return tf.identity(value)


def _running_all(sums: list, device: str):
  """Tower 0's sum, computed only together with every device's sum.

  A collective completes only when every device takes part. The model_fn
  sees tower 0's sum alone and may consume it where the other devices' sums
  are not (e.g. accumulated every step, applied inside a `tf.cond`): each
  step that computes it must compute them all, or the step waits forever.
  Sparse sums are gathered without a collective and need no such tie.
  """
  if isinstance(sums[0], tf.IndexedSlices):
    return sums[0]
  with tf.device(device), tf.control_dependencies(sums[1:]):
    return tf.identity(sums[0])


def _copied(primary) -> tf.Tensor:
  """The primary's value in a buffer of its own.

  A ref variable's read shares the variable's memory, and a copy assigned
  from it can keep sharing it (virtual CPU devices share one allocator).
  The primary's in-place update then also moves the copy, which its own
  copy-on-write update takes as its start: the copy stepped twice in about
  half the runs (tf.compat.v1.disable_resource_variables(), all_reduce).
  """
  value = primary.read_value()
  if primary.dtype._is_ref_dtype:  # pylint: disable=protected-access
    value = tf.raw_ops.Snapshot(input=value)
  return value


def _restores(write: tf.Operation) -> bool:
  """Whether `write` sets its variable from a checkpoint.

  Such a write is a Saver's restore, not the model_fn training a variable:
  the session runs it before local_init_op, which then sets every copy from
  its primary. Whether the Saver restores the primaries at all is
  `Replicas.check_saver`'s question.
  """
  if len(write.inputs) < 2:
    return False
  op = write.inputs[1].op
  while op.type == 'Identity' and op.inputs:
    op = op.inputs[0].op
  return op.type in _RESTORES


def _handle_name(variable) -> str:
  """The name of the tensor a write to `variable` takes as its target."""
  return variable.handle.name if hasattr(variable, 'handle') else variable.name


def _remove_from(graph: tf.Graph, key: str, variable) -> None:
  ref = graph.get_collection_ref(key)
  ref[:] = [v for v in ref if v is not variable]


def _full_name(kwargs) -> str:
  name = kwargs.get('name') or ''
  scope = tf1.get_default_graph().get_name_scope()
  return f'{scope}/{name}' if scope else str(name)


def _slot(optimizer, variable, name: str):
  """The slot `name` of `variable`, or None when the optimizer has none.

  A Keras legacy optimizer raises KeyError for a variable it does not
  update (DNNLinearCombined's two optimizers each update half the model),
  where a tf.compat.v1 one returns None.
  """
  try:
    return optimizer.get_slot(variable, name)
  except KeyError:
    return None
