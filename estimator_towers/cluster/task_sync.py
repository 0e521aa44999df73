"""Synchronous training across the tasks of a TF_CONFIG cluster without ps.

With `aggregation='all_reduce'`, every task (the chief, then the workers by
index) holds its own copy of the variables and trains on its part of the
step's global batch. What makes the tasks one computation:

* sums over tasks: every quantity the towers of one task add up (the
  examples that weigh the losses, the gradients, batch-norm moments) is
  also summed over the tasks, by TensorFlow's collective all-reduce between
  the tasks' gRPC servers. Dense tensors of one dtype travel packed in one
  collective; sparse gradients (embedding rows) are gathered in task order.
  Every task receives the same bits, so the copies stay identical;
* one start: after the chief restores (or initialises) the variables, its
  values are broadcast to every worker before step 1, inside the
  Scaffold's local_init_op;
* one failure policy: the start's broadcast waits at most the timeout, a
  session the Estimator re-creates after a peer died ends the task with an
  error instead of an endless retry (see `restart_guard`), and a step that
  waits longer than the timeout ends it too (peer_watch.StepWatch). The
  steps' own collectives carry no timeout: TensorFlow holds a thread per
  collective with a timeout until the timeout expires, which at tens of
  collectives a second and a 300 s timeout is tens of thousands of threads.

Collectives are keyed: a group key for the tasks, and an instance key per
collective op that must be the same on every task for the same tensor and
must not name two different collectives in one process (the servers cache
them). Keys are hashes of what the op carries and of its rank among the
collectives of its graph, so every task, building the same model_fn,
derives the same keys without talking (see collective_keys).

Within a task, the towers' sums are plain `add_n`s: a collective of the
local devices would also be resolved by the cluster's group leader, where
every task's local group has the same key.
"""

import contextlib
from typing import (Any, Callable, Dict, Iterator, List, Mapping, Optional,
                    Sequence)

import tensorflow as tf
from tensorflow.python.ops import collective_ops  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.collectives import collective_keys
from estimator_towers.cluster import task_agreement

# A prime far from small seeds: task k's graph seed is seed + k * stride.
_SEED_STRIDE = 1_000_003
_BROADCAST_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64,
                     tf.int32, tf.int64)

tf1 = tf.compat.v1

TRAINING_JOBS = ('chief', 'master', 'worker')
DEFAULT_TIMEOUT_SECS = 300.0
# What the restart guard's error says (trainer.sync_errors finds it).
RESTARTED = ('a task of the synchronous cluster failed, restarted or ended '
             'its input early')


def is_sync_cluster(config) -> bool:
  """True when `config` names a cluster of training tasks and no ps.

  Args:
    config: A tf.estimator.RunConfig (or None).
  """
  workers = getattr(config, 'num_worker_replicas', 1) or 1
  ps = getattr(config, 'num_ps_replicas', 0) or 0
  return (workers > 1 and ps == 0 and
          getattr(config, 'task_type', None) in TRAINING_JOBS)


def leader(cluster_spec: Dict[str, List[str]]) -> str:
  """The group leader of a cluster: the chief (or master)."""
  job = 'chief' if 'chief' in cluster_spec else 'master'
  return f'/job:{job}/replica:0/task:0'


def server_config(session_config: Optional[tf1.ConfigProto],
                  cluster_spec: Dict[str, List[str]]) -> tf1.ConfigProto:
  """The ConfigProto a training task's gRPC server must start with.

  The server, not the session, decides which devices exist (virtual CPUs
  included) and who leads collective groups.

  Args:
    session_config: The RunConfig's session config (device counts, GPU
      options); None for TensorFlow's defaults.
    cluster_spec: The TF_CONFIG cluster, as a dict.

  Returns:
    A new ConfigProto.
  """
  config = tf1.ConfigProto()
  if session_config is not None:
    for key, count in session_config.device_count.items():
      config.device_count[key] = count
    config.gpu_options.CopyFrom(session_config.gpu_options)
    config.intra_op_parallelism_threads = (
        session_config.intra_op_parallelism_threads)
    config.inter_op_parallelism_threads = (
        session_config.inter_op_parallelism_threads)
  if any(job in cluster_spec for job in ('chief', 'master')):
    config.experimental.collective_group_leader = leader(cluster_spec)
  return config


class TaskGroup:
  """The training tasks of one cluster, as seen from one of them.

  Args:
    config: The Estimator's RunConfig (a cluster where `is_sync_cluster`).
    tower_device: This task's first tower device ('/device:GPU:0'); the
      collectives run on that device of every task.
    timeout_secs: How long the start's broadcast may wait for the other
      tasks (the steps are bounded by peer_watch.StepWatch).
    placement: The tower builder's strategies.Strategy: its device
      functions must let the collectives keep this task's collective device.
  """

  # Sums and the start span several tasks (one_machine.OneMachine: one).
  across_tasks = True

  def __init__(self, config, tower_device: str,
               timeout_secs: float = DEFAULT_TIMEOUT_SECS,
               placement=None,
               agreement: Optional[Mapping[str, Any]] = None):
    self.size = config.num_worker_replicas
    self.index = config.global_id_in_cluster
    self.is_chief = config.is_chief
    self.task = f'{config.task_type}:{config.task_id}'
    spec = tf.DeviceSpec.from_string(tower_device)
    self.device = spec.replace(job=config.task_type, replica=0,
                               task=config.task_id).to_string()
    self._timeout = float(timeout_secs)
    self.placement = placement
    # What every task must have been given alike (task_agreement).
    self._agreement = dict(agreement or {})

  def own_part(self, gradient, has_rows: tf.Tensor):
    """`gradient` as this task's part of the sum: nothing if it has no rows.

    The zero row a task without examples trains on is weighted by zero, but
    a model can still make its gradient NaN (a log of a zero feature), and
    its sparse gradient touches rows (embedding row 0) that a momentum-like
    optimizer would then update. So its dense gradients count as zeros and
    its sparse ones as no rows at all.

    Args:
      gradient: A Tensor or tf.IndexedSlices, this task's towers' sum.
      has_rows: Whether this task's part of the step's global batch has any
        example (a bool scalar). A task without one trains its towers on a
        row of zeros, whose gradients must not count.

    Returns:
      The same kind of value.
    """
    if isinstance(gradient, tf.IndexedSlices):
      rows = tf.shape(gradient.indices)[0] * tf.cast(has_rows, tf.int32)
      return tf.IndexedSlices(gradient.values[:rows],
                              gradient.indices[:rows], gradient.dense_shape)
    return tf.where(has_rows, gradient, tf.zeros_like(gradient))

  @contextlib.contextmanager
  def _on_device(self, scope: str) -> Iterator[None]:
    deferring = (self.placement.deferring() if self.placement is not None
                 else contextlib.nullcontext())
    with deferring, tf.device(self.device), tf.name_scope(scope):
      yield

  # --------------------------------------------------------------------
  # Sums.

  def sum(self, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """Each tensor summed over the tasks, packed: one collective per dtype.

    Args:
      tensors: Dense tensors of fully known shapes, on any local device.

    Returns:
      The sums, in order, on this task's collective device.
    """
    results: List[Optional[tf.Tensor]] = [None] * len(tensors)
    by_dtype: Dict[tf.DType, List[int]] = {}
    for i, tensor in enumerate(tensors):
      by_dtype.setdefault(tensor.dtype.base_dtype, []).append(i)
    with self._on_device('sum_over_tasks'):
      for dtype, positions in by_dtype.items():
        parts = [tensors[i] for i in positions]
        shapes = [_static_shape(t) for t in parts]
        flat = tf.concat([tf.reshape(t, [-1]) for t in parts], 0)
        total = collective_ops.all_reduce(
            flat, self.size, collective_keys.TASK_GROUP,
            self._instance_key(f'sum:{dtype.name}:{shapes}'), 'Add', 'Id')
        sizes = [_num_elements(s) for s in shapes]
        for i, piece, shape in zip(positions, tf.split(total, sizes),
                                   shapes):
          results[i] = tf.reshape(piece, shape)
    return results

  def gather_slices(self, slices: tf.IndexedSlices) -> tf.IndexedSlices:
    """Every task's rows of a sparse gradient, in task order.

    Tasks may hold different numbers of rows, so each pads its rows to the
    largest count before the all-gather and the padding is cut out after.
    """
    with self._on_device('gather_over_tasks'):
      values = slices.values
      indices = tf.cast(slices.indices, tf.int64)
      rows = tf.shape(indices, out_type=tf.int64)[:1]
      # The number of rows varies with the batch; a row's shape may not.
      name = f'{values.dtype.name}:{_static_shape(values, first_dim=1)}'
      counts = collective_ops.all_gather(
          rows, self.size, collective_keys.TASK_GROUP,
          self._instance_key(f'rows:{name}'))
      most = tf.reduce_max(counts)
      pad = most - rows[0]
      values = tf.pad(values, [[0, pad]] + [[0, 0]] * (values.shape.rank - 1))
      indices = tf.pad(indices, [[0, pad]])
      if values.dtype in _BITCAST_DTYPES:
        all_values, all_indices = self._gather_packed(values, indices, name)
      else:
        all_values = collective_ops.all_gather(
            values, self.size, collective_keys.TASK_GROUP,
            self._instance_key(f'values:{name}'))
        all_indices = collective_ops.all_gather(
            indices, self.size, collective_keys.TASK_GROUP,
            self._instance_key(f'indices:{name}'))
      keep = tf.reshape(
          tf.sequence_mask(counts, most), [-1])
      return tf.IndexedSlices(
          tf.boolean_mask(all_values, keep),
          tf.cast(tf.boolean_mask(all_indices, keep), slices.indices.dtype),
          slices.dense_shape)

  def _gather_packed(self, values: tf.Tensor, indices: tf.Tensor, name: str):
    """All-gathers a sparse gradient's rows and indices in one collective:
    each int64 index is bitcast to the values' float type and rides as the
    row's last columns (a gather moves bits, so they come back exact). One
    collective fewer per sparse gradient and step: the tasks meet less
    often."""
    row_shape = _static_shape(values, first_dim=1)
    width = _num_elements(row_shape)
    index_columns = tf.reshape(tf.bitcast(indices, values.dtype),
                               [tf.shape(indices)[0], -1])
    packed = tf.concat([tf.reshape(values, [-1, width]), index_columns], 1)
    gathered = collective_ops.all_gather(
        packed, self.size, collective_keys.TASK_GROUP,
        self._instance_key(f'rows_and_indices:{name}'))
    all_values = tf.reshape(gathered[:, :width], [-1] + row_shape)
    all_indices = tf.reshape(tf.bitcast(gathered[:, width:], tf.int64), [-1])
    return all_values, all_indices

  # --------------------------------------------------------------------
  # The start.

  def broadcast_op(self, variables: Sequence[tf.Variable]) -> tf.Operation:
    """The chief's values of `variables`, assigned on every other task.

    Runs in local_init_op, after the chief's restore or initialisation.

    Raises:
      ValueError: a variable's shape is not fully known, or its dtype
        cannot be broadcast.
    """
    by_dtype: Dict[tf.DType, List[tf.Variable]] = {}
    for variable in variables:
      dtype = variable.dtype.base_dtype
      if dtype not in _BROADCAST_DTYPES:
        raise ValueError(
            f'Variable {variable.name} has dtype {dtype.name}, which the '
            'tasks of a synchronous cluster cannot broadcast from the '
            'chief. Make it float or int, or train with ps tasks.')
      by_dtype.setdefault(dtype, []).append(variable)
    ops = []
    with self._on_device('broadcast_from_chief'):
      for dtype, group in by_dtype.items():
        shapes = [_static_shape(v) for v in group]
        sizes = [_num_elements(s) for s in shapes]
        # Keys of the start that do not depend on the variables: the
        # session run that starts the tasks must be the same collective
        # graph on every task (its key hashes these), or the agreement op
        # before it would not meet between tasks with other variables.
        key = collective_keys.of_graph().fixed_task_instance(
            self.size, f'start:{dtype.name}')
        if self.is_chief:
          flat = tf.concat([tf.reshape(v.read_value(), [-1]) for v in group],
                           0)
          ops.append(collective_ops.broadcast_send(
              flat, flat.shape, dtype, self.size, collective_keys.TASK_GROUP,
              key, timeout=self._timeout).op)
          continue
        flat = collective_ops.broadcast_recv(
            [sum(sizes)], dtype, self.size, collective_keys.TASK_GROUP, key,
            timeout=self._timeout)
        for variable, piece, shape in zip(group, tf.split(flat, sizes),
                                          shapes):
          ops.append(variable.assign(tf.reshape(piece, shape)).op)
    return tf.group(*ops)

  def agree_on(self, name: str, value: Any) -> None:
    """Adds `name`'s `value` to what every task must have alike (before
    the Scaffold is finalized)."""
    self._agreement[name] = value

  def agreement_op(self, variables: Sequence[tf.Variable]) -> tf.Operation:
    """An op that ends every task when the tasks disagree on what they train.

    Runs first in local_init_op, before the broadcast, whose collectives
    would not pair up between tasks with different variables.
    """
    def gather(codes):
      # A key of its own, not one counted from the graph: tasks whose
      # graphs differ must still meet here.
      return collective_ops.all_gather(
          codes, self.size, collective_keys.TASK_GROUP,
          collective_keys.of_graph().fixed_task_instance(self.size,
                                                         'agreement'),
          timeout=self._timeout)

    with self._on_device('task_agreement'):
      return task_agreement.agreement_op(self.task, self._agreement,
                                         variables, self.size, gather)

  def started(self, base: tf.Operation,
              init_op: Callable[[], tf.Operation],
              variables: Callable[[], Sequence[tf.Variable]]
              ) -> tf.Operation:
    """`base`, preceded by the restart guard, the tasks' agreement (and on
    workers by their initialisation), then followed by the chief's
    broadcast.

    A worker neither restores nor waits for a chief's initialisation of its
    variables (no ps holds them): local_init_op initialises them and then
    takes the chief's values.

    Args:
      base: The local_init_op the Scaffold would run.
      init_op: Makes the op that initialises the variables (a worker's).
      variables: Gives the variables the chief broadcasts, once every
        variable exists.

    Returns:
      The op to run as local_init_op.
    """
    guard = self.restart_guard()
    with tf.control_dependencies([guard]):
      agreed = self.agreement_op(variables())
    first = [agreed]
    if not self.is_chief:
      init = init_op()  # Made before the guard: only its run waits for it.
      with tf.control_dependencies([agreed]):
        first = [tf.group(init)]
    with tf.control_dependencies(first):
      base = tf.group(base)
    with tf.control_dependencies([base]):
      return tf.group(base, self.broadcast_op(variables()))

  @contextlib.contextmanager
  def own_random_seed(self) -> Iterator[None]:
    """Inside, random ops of this task draw other numbers than its peers'.

    Every task builds the same graph, so with a graph-level seed
    (`tf_random_seed`) a random op (dropout, a random crop) gets the same
    seed on every task: the workers' towers would repeat the chief's
    towers' draws, where one process's towers all draw differently. Inside,
    a worker's graph seed is moved by its index. The chief keeps the seed
    (its initial values are the ones broadcast); the input_fn, built
    before, keeps it on every task, so that all read one global order.
    """
    graph = tf1.get_default_graph()
    seed = graph.seed
    if seed is None or self.index == 0:
      yield
      return
    graph.seed = (seed + _SEED_STRIDE * self.index) % 2**31
    try:
      yield
    finally:
      graph.seed = seed

  def restart_guard(self) -> tf.Operation:
    """An op that fails when the session is created a second time.

    The Estimator's MonitoredSession re-creates its session after an
    UnavailableError (a peer died) and then waits, on the broadcast, for a
    peer that is gone or restarted with a new collective state: in a
    synchronous cluster no task can go on alone. This op, run first in
    local_init_op, turns the second creation into an error that ends the
    task, so the cluster can be restarted from the last checkpoint.
    """
    created = [0]
    task = self.task

    def check():
      created[0] += 1
      if created[0] > 1:
        # A peer whose input ended exits too: its server closes the
        # collective this task was exchanging with it.
        raise RuntimeError(f'{task}: {RESTARTED} (its collectives broke off; '
                           'every task\'s input must give the same number of '
                           'steps), and this task cannot train alone. Restart '
                           'every task; they resume from the chief\'s last '
                           'checkpoint.')
      return 0

    with tf.device(tf.DeviceSpec.from_string(self.device).replace(
        device_type='CPU', device_index=0).to_string()):
      return tf1.py_func(check, [], tf.int64, stateful=True,
                         name='restart_guard').op

  # --------------------------------------------------------------------

  def _instance_key(self, carries: str) -> int:
    """An instance key, the same on every task for the same collective."""
    return collective_keys.of_graph().task_instance(self.size, carries)


def can_broadcast(variable: tf.Variable) -> bool:
  """Whether `broadcast_op` takes `variable`: a known shape and dtype."""
  return (variable.dtype.base_dtype in _BROADCAST_DTYPES and
          variable.shape.is_fully_defined())


# Sparse values whose rows can carry their int64 index bitcast (a whole
# number of elements per index).
_BITCAST_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _static_shape(tensor, first_dim: int = 0) -> List[int]:
  """The tensor's shape from `first_dim` on, which must be fully known."""
  shape = tensor.shape[first_dim:]
  if not shape.is_fully_defined():
    raise ValueError(
        f'{getattr(tensor, "name", tensor)} has shape {shape}, not fully '
        'known; tasks of a synchronous cluster sum or broadcast only tensors '
        'of known shapes.')
  return shape.as_list()


def _num_elements(shape: Sequence[int]) -> int:
  count = 1
  for dim in shape:
    count *= dim
  return count
