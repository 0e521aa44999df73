"""Where the variables live and how the towers' gradients become one update.

`replicate_model_fn(..., aggregation=...)` picks one of:

* 'global_loss' (default): one set of variables on `variables_device`; the
  last tower differentiates the weighted sum of every tower's loss once
  (see one_update), so each gradient is summed where `tf.gradients` sums it.
* 'round_robin': the same backward pass, but the variables are spread over
  the tower devices: each new variable goes to the device holding the fewest
  variable bytes so far (greedy in creation order, like TF1 contrib's
  GreedyLoadBalancingStrategy). Slots follow their variable.
* 'all_reduce': one copy of every trainable variable per tower device
  (replicas.py); each tower differentiates its own weighted loss w.r.t. its
  own copy, the gradients are summed across devices by an all-reduce
  (cross_device.py), and every copy takes the same update.

Each strategy is an object chosen once per model_fn call and handed to the
tower builder: it decides the device of a variable op, and it gives the
build its gradient path, the code through which the towers' gradients
become the one update. 'global_loss' and 'round_robin' (and every strategy
outside TRAIN, where the towers read tower 0's variables) take
`SharedVariables`, one set of variables that the update writes directly;
'all_reduce' in TRAIN takes `replica_path.ReplicaPath`, over a copy per
tower device (`replicas.Replicas`).
The one update and the builder call the path the same way whichever it is.
"""

import contextlib
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence

import tensorflow as tf

from estimator_towers.aggregation import replica_path
from estimator_towers.aggregation import replicas as replicas_lib
from estimator_towers.choices import AGGREGATIONS

DEFAULT_VARIABLES_DEVICE = '/device:CPU:0'


def check(aggregation: str, variables_device: Optional[str]) -> None:
  """Fails on an unknown strategy or one that places variables itself.

  Args:
    aggregation: The `aggregation` argument of replicate_model_fn.
    variables_device: Its `variables_device` argument; None if not given.

  Raises:
    ValueError: `aggregation` is unknown, or `variables_device` is given with
      a strategy that places variables on the tower devices.
  """
  if aggregation not in AGGREGATIONS:
    raise ValueError(f'aggregation={aggregation!r}; use one of '
                     f'{AGGREGATIONS}.')
  if aggregation != 'global_loss' and variables_device is not None:
    raise ValueError(
        f'variables_device={variables_device!r} cannot be combined with '
        f"aggregation={aggregation!r}, which places the variables on the "
        "tower devices itself; use aggregation='global_loss' to pin them.")


def check_tasks(aggregation: str, config) -> None:
  """Fails when `aggregation` cannot train in the TF_CONFIG cluster.

  With ps tasks, the tasks train asynchronously on the ps's variables:
  'all_reduce' keeps copies per device of one task and cannot. Without ps
  tasks, each task holds its own variables and only 'all_reduce' keeps them
  equal (task_sync): the others would train each task's copy on its own
  batches, and the workers' steps would be lost.

  Args:
    aggregation: The `aggregation` argument of replicate_model_fn.
    config: The Estimator's RunConfig (its TF_CONFIG cluster).

  Raises:
    ValueError: 'all_reduce' with parameter servers, or another strategy in
      a cluster of training tasks without parameter servers.
  """
  workers = getattr(config, 'num_worker_replicas', 1) or 1
  ps = getattr(config, 'num_ps_replicas', 0) or 0
  if aggregation == 'all_reduce' and ps > 0:
    raise ValueError(
        "aggregation='all_reduce' trains a cluster synchronously, without "
        f'parameter servers, but TF_CONFIG names {ps} ps task(s). Remove '
        "the ps tasks, or use aggregation='global_loss' or 'round_robin' "
        'for asynchronous training on the ps.')
  if aggregation != 'all_reduce' and workers > 1 and ps == 0:
    raise ValueError(
        f'TF_CONFIG names {workers} training tasks and no ps task, so every '
        f"task keeps its own variables, which aggregation={aggregation!r} "
        "would train apart. Use aggregation='all_reduce' (synchronous "
        'training across the tasks), or add ps tasks for asynchronous '
        'training.')


class Strategy:
  """An aggregation strategy: its placement and its gradient path.

  Attributes:
    name: The strategy's name, one of AGGREGATIONS.
  """

  name = ''

  def __init__(self):
    self._local = threading.local()

  def variable_device(self, op: tf.Operation, tower: int,
                      applying: bool) -> str:
    """The device of a variable op made in `tower` (or by the one update)."""
    raise NotImplementedError

  def gradient_path(self, training: bool,
                    unshared: Callable[[], contextlib.AbstractContextManager],
                    task_group, ledger=None) -> Any:
    """The path of the towers' gradients to the one update of a build.

    Args:
      training: Whether the build is TRAIN's (only its update writes).
      unshared: A context factory inside which variables may be created
        freely (see `VariableSharing.unshared`).
      task_group: The tasks training together (task_sync.TaskGroup or
        one_machine.OneMachine).
      ledger: The build's op_ledger.TowerLedger (which tower made an op).

    Returns:
      A `SharedVariables` here; see AllReduce for the other path.
    """
    del training, unshared, task_group  # One shared set needs none of them.
    return SharedVariables()

  @contextlib.contextmanager
  def deferring(self) -> Iterator[None]:
    """Inside, ops keep the device an inner `tf.device` gives them."""
    previous = getattr(self._local, 'deferring', False)
    self._local.deferring = True
    try:
      yield
    finally:
      self._local.deferring = previous

  @property
  def is_deferring(self) -> bool:
    return getattr(self._local, 'deferring', False)


class SharedVariables:
  """The gradient path of one set of variables that every tower uses.

  Its counterpart for 'all_reduce' in TRAIN is `replica_path.ReplicaPath`,
  with the same methods: the builder and the one update call whichever they are
  given, and never ask which it is.
  """

  def tower_variable(self, primary, tower: int):
    """What tower `tower` uses for `primary`: `primary` itself."""
    del tower
    return primary

  def primary_name(self, name: str, tower: int) -> str:
    """`name`: no tower's variables have names of their own."""
    del tower
    return name

  def primary_of(self, variable):
    """`variable`: every tower uses the primaries."""
    return variable

  def weighted_terms(self, weights, losses: List[tf.Tensor]
                     ) -> List[tf.Tensor]:
    """The towers' weighted losses, under the current device.

    Args:
      weights: The towers' loss weights (tower_weights.TowerWeights).
      losses: The towers' losses of one optimizer call.

    Returns:
      One term per tower.
    """
    return weights.terms(losses)

  def differentiate(self, loss: tf.Tensor, parts,
                    tower_terms: Callable[[tf.Tensor], List[tf.Tensor]],
                    has_rows: tf.Tensor) -> Any:
    """A base gradient method's result for the global `loss`: one backward
    pass, each gradient summed where `tf.gradients` sums it.

    Args:
      loss: The loss to differentiate (the global loss, or one derived
        from it by a wrapper).
      parts: The call's one_update.GradientParts.
      tower_terms: Unused (per-tower terms are for copies).
      has_rows: Unused (no sum over copies).

    Returns:
      What the gradient method returns.
    """
    del tower_terms, has_rows
    return parts.direct(loss)

  def update(self, call, replace: dict) -> Any:
    """An update call (minimize, get_updates, apply_gradients), run once
    with `replace` for its arguments."""
    return call.run(replace)

  def finish(self, spec: tf.estimator.EstimatorSpec,
             since) -> tf.estimator.EstimatorSpec:
    """`spec` unchanged: nothing to keep in step.

    Args:
      spec: The merged TRAIN spec.
      since: An op_ledger.Mark taken before the towers were built.

    Returns:
      `spec`.
    """
    del since
    return spec


class GlobalLoss(Strategy):
  """Every variable on one device."""

  name = 'global_loss'

  def __init__(self, variables_device: str):
    super().__init__()
    self._device = variables_device

  def variable_device(self, op, tower, applying):
    del op, tower, applying  # Slots are colocated with their variable anyway.
    return self._device


class RoundRobin(Strategy):
  """Each new variable on the tower device with the fewest bytes so far."""

  name = 'round_robin'

  def __init__(self, devices: Sequence[str]):
    super().__init__()
    self._devices = list(devices)
    self.loads: List[int] = [0] * len(devices)
    self._placed = {}  # op name -> device, so a repeated call agrees.

  def variable_device(self, op, tower, applying):
    del tower
    if applying:
      # Slots and an optimizer's own variables: colocated with a variable
      # when the optimizer says so; the others are small.
      return ''
    if op.name not in self._placed:
      index = min(range(len(self._devices)), key=lambda i: (self.loads[i], i))
      self.loads[index] += _variable_bytes(op)
      self._placed[op.name] = self._devices[index]
    return self._placed[op.name]


class AllReduce(Strategy):
  """Each tower's variables on its own device; see replicas.py."""

  name = 'all_reduce'

  def __init__(self, devices: Sequence[str], towers_per_device: int = 1):
    super().__init__()
    self._devices = list(devices)
    # With micro-batches, towers i * M .. i * M + M - 1 run on devices[i]
    # one after another and share that device's copies.
    self._per_device = towers_per_device

  def variable_device(self, op, tower, applying):
    del op
    # A copy's slots are colocated with the copy; '' lets that decide.
    return '' if applying else self._devices[tower // self._per_device]

  def gradient_path(self, training, unshared, task_group, ledger=None):
    """Copies per tower device in TRAIN (`replica_path.ReplicaPath` over
    `replicas.Replicas`); other modes read the primaries, which are tower
    0's variables (`SharedVariables`)."""
    if not training:
      return SharedVariables()
    return replica_path.ReplicaPath(
        replicas_lib.Replicas(self._devices, unshared, self, task_group,
                              ledger, self._per_device))


def make(aggregation: str, devices: Sequence[str],
         variables_device: Optional[str],
         towers_per_device: int = 1) -> Strategy:
  """The aggregation strategy of one model_fn call.

  Args:
    aggregation: One of AGGREGATIONS (checked by `check`).
    devices: The tower devices.
    variables_device: The variables' device for 'global_loss'; None for the
      default.
    towers_per_device: Towers built on each device, one after another (the
      micro-batches of a TRAIN step); 1 otherwise.

  Returns:
    A new Strategy (round_robin counts bytes per graph build).
  """
  if aggregation == 'round_robin':
    return RoundRobin(devices)
  if aggregation == 'all_reduce':
    return AllReduce(devices, towers_per_device)
  return GlobalLoss(variables_device or DEFAULT_VARIABLES_DEVICE)


def _variable_bytes(op: tf.Operation) -> int:
  """Bytes of the variable a variable op holds; 0 if unknown (tables)."""
  try:
    shape = tf.TensorShape(op.get_attr('shape'))
    dtype = tf.as_dtype(op.get_attr('dtype'))
  except (ValueError, TypeError):
    return 0
  if not shape.is_fully_defined():
    return 0
  return shape.num_elements() * dtype.size
