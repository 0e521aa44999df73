"""Batch norm in training normalises each shard with the global moments.

On one device, a batch-norm layer in training normalises the batch with the
batch's own per-channel mean and (biased) variance, and the gradients flow
through those moments. Towers see only their shard, so with
batch_norm='per_tower' each normalises with its shard's moments (as any
in-graph replication does) and trains another model than one device. With
batch_norm='global' (the default), while the towers are built, Keras'
`BatchNormalizationBase._moments` (the non-fused path) and
`_fused_batch_norm` (the fused path) are intercepted: each tower computes,
per channel, its shard's

  count n_i, mean m_i and centred sum of squares M2_i = sum (x - m_i)^2

(weighted by the mask, if any; zero for an idle tower, whose padding copy
must weigh nothing), and ONE collective per layer call exchanges them
between the tower devices: each tower puts its row into a zero matrix of
one row per tower and the matrix is all-summed, so every tower receives
every tower's row (adding zeros is exact). Every tower then combines them
as Chan et al.'s parallel variance does, without the cancellation of
E[x^2] - E[x]^2:

  n = sum n_i,  mean = sum n_i m_i / n,
  biased variance = (sum M2_i + sum n_i (m_i - mean)^2) / n.

The towers are built one after another, so the exchange happens at run
time: tower 0 picks the collective's instance key for each of its layer
calls, and the k-th batch-norm call of every later tower reuses the k-th
key. The gradient of an all-sum is the all-sum of the upstream gradients
(a second collective, keyed at the same time), which makes both one
`tf.gradients` of the global loss (aggregation 'global_loss',
'round_robin') and per-tower gradients summed afterwards ('all_reduce')
the gradients of one device.

The fused path keeps one device's numbers by normalising with
`tf.nn.batch_normalization` from the global mean and biased variance (what
the fused kernel does with the batch's), and hands the moving-average
update the variance with Bessel's correction n / (n - 1) of the global
count, as one device's fused layer does. The moving statistics
(moving_statistics.MovingStatistics) then take these global moments as
they are: one statistics computation per layer call.

In a synchronous cluster (task_sync), each tower then exchanges its task's
combined row with the towers of its index on the other tasks (a second
collective per call, in a group per tower index), so every tower of every
task normalises with the moments of the whole step's batch. Every task
must therefore have as many towers; replicate_model_fn adds the count to
the tasks' start agreement. The keys are the same on every task (a session
run's collective graph key, which pairs the tasks' steps, hashes them),
while each task's towers form a group of their own (the cluster's group
leader resolves every group).

A collective completes only when every tower takes part, so a layer call
inside a `tf.cond`, `tf.while_loop` or `tf.function` (which some towers
might skip) is refused, and so is a tower that makes another number of
batch-norm calls than tower 0. EVAL and PREDICT (moving statistics) are
not intercepted.
"""

import contextlib
import dataclasses
from typing import Dict, List, Optional, Sequence

from keras.src.layers.normalization import batch_normalization as keras_bn
from keras.src.utils import control_flow_util
import tensorflow as tf

from estimator_towers.choices import BATCH_NORMS
from estimator_towers.collectives import collective_keys
from estimator_towers.collectives import exchange as exchange_lib
from estimator_towers.towers import moving_statistics
from estimator_towers.graph import patching

tf1 = tf.compat.v1
_Base = keras_bn.BatchNormalizationBase

DEFAULT = 'global'


def check(batch_norm) -> None:
  """Refuses a `batch_norm` value replicate_model_fn does not know.

  Args:
    batch_norm: The value given to replicate_model_fn.

  Raises:
    TypeError: `batch_norm` is not a string.
    ValueError: `batch_norm` is not one of BATCH_NORMS.
  """
  if not isinstance(batch_norm, str):
    raise TypeError(f'batch_norm must be one of {BATCH_NORMS}, got '
                    f'{batch_norm!r}.')
  if batch_norm not in BATCH_NORMS:
    raise ValueError(
        f'batch_norm={batch_norm!r}; use one of {BATCH_NORMS}: \'global\' '
        'normalises every tower\'s shard with the whole batch\'s moments, '
        'as one device does; \'per_tower\' with its own shard\'s.')


@dataclasses.dataclass
class _Call:
  """The k-th batch-norm call of every tower: tower 0 keys the exchange
  between this machine's towers; in a cluster, tower i keys its exchange
  with the towers i of the other tasks (`tasks[i]`)."""
  layer: str
  channels: int
  local: exchange_lib.Keys
  tasks: List[exchange_lib.Keys]  # Empty on one machine.


class GlobalMoments:
  """Intercepts batch-norm moments in TRAIN while the towers are built.

  Args:
    devices: The tower devices, in tower order (distinct).
    sizes: Each tower's number of real examples (int32 [num_towers]); an
      idle tower (0) trains on a padding copy and must weigh nothing.
    task_group: The training tasks (task_sync.TaskGroup in a synchronous
      cluster, whose towers exchange their moments too;
      one_machine.OneMachine else).
    placement: The tower builder's strategies.Strategy, whose device
      function must let the collectives keep their tower's device.
  """

  def __init__(self, devices: Sequence[str], sizes: tf.Tensor, task_group,
               placement):
    self._devices = list(devices)
    self._sizes = sizes
    self._task_group = task_group
    self._placement = placement
    self._graph = tf1.get_default_graph()
    self._keys = collective_keys.of_graph(self._graph)
    if task_group.across_tasks:
      # Collectives of a cluster are resolved by its group leader: the
      # towers of this task form a group of their own, and each tower joins
      # the towers of the same index of the other tasks.
      task = tf.DeviceSpec.from_string(task_group.device)
      self._devices = [
          tf.DeviceSpec.from_string(d).replace(
              job=task.job, replica=task.replica, task=task.task).to_string()
          for d in self._devices]
      self._group = collective_keys.task_towers_group(task_group.index)
    else:
      self._group = self._keys.local_group(self._devices)
    self._calls: List[_Call] = []  # Tower 0's calls, in order.
    self._tower: Optional[int] = None
    self._position = 0  # The current tower's calls so far.
    # id(layer) of every layer whose moments were global in this step.
    self._layers: Dict[int, str] = {}
    self._lives: Dict[tuple, tf.Tensor] = {}

  @property
  def exchanges(self) -> bool:
    """Whether the towers exchange moments (a batch norm trained)."""
    return bool(self._calls)

  def computed(self, layer) -> bool:
    """Whether `layer`'s training moments were the global batch's."""
    return id(layer) in self._layers

  @contextlib.contextmanager
  def tower(self, index: int):
    """Intercepts the batch-norm moments built in tower `index`.

    Raises:
      ValueError: on exit, the tower made another number of batch-norm
        calls than tower 0 (their collectives would never pair up).
    """
    originals = {name: getattr(_Base, name)
                 for name in ('_moments', '_fused_batch_norm')}
    moments_of = self

    def moments(layer, inputs, reduction_axes, keep_dims, mask=None):
      return moments_of._moments(layer, inputs, reduction_axes, keep_dims,
                                 mask)

    def fused_batch_norm(layer, inputs, mask, training):
      return moments_of._fused(originals['_fused_batch_norm'], layer, inputs,
                               mask, training)

    self._tower, self._position = index, 0
    try:
      with patching.Patcher() as patcher:
        patcher.set(_Base, '_moments',
                    patcher.guard(moments, originals['_moments']))
        patcher.set(_Base, '_fused_batch_norm',
                    patcher.guard(fused_batch_norm,
                                  originals['_fused_batch_norm']))
        yield
      if index > 0 and self._position != len(self._calls):
        raise ValueError(
            f'Tower {index} makes {self._position} batch-norm calls in '
            f'training, tower 0 made {len(self._calls)}. Every tower must '
            'build the same model: the global batch\'s moments are '
            'exchanged between the towers at each call.')
    finally:
      self._tower = None

  # --------------------------------------------------------------------
  # The two intercepted paths.

  def _moments(self, layer, inputs, reduction_axes, keep_dims, mask):
    """The non-fused path: the global batch's mean and biased variance."""
    weights = None
    if mask is not None:  # As Keras' weighted moments weigh the values.
      weights = tf.expand_dims(tf.cast(mask, inputs.dtype), -1)
    mean, variance, _ = self._global(layer, inputs, reduction_axes, weights)
    shape = [1 if a in reduction_axes else inputs.shape[a]
             for a in range(inputs.shape.rank)]
    if not keep_dims:
      shape = [d for a, d in enumerate(shape) if a not in reduction_axes]
    return tf.reshape(mean, shape), tf.reshape(variance, shape)

  def _fused(self, original, layer, inputs, mask, training):
    """The fused path in training: normalised with the global moments.

    Inference (training False) keeps Keras' fused kernel; a `training`
    tensor chooses between the two at run time, the moments being computed
    (and exchanged) in every step either way.
    """
    # Keras' fused path ignores a mask (with a warning), so the moments do.
    training_value = control_flow_util.constant_value(training)
    if training_value is False:
      return original(layer, inputs, mask, training)
    rank = inputs.shape.rank
    # pylint: disable=protected-access
    channel_axis = 1 if layer._data_format == 'NCHW' else rank - 1
    axes = [a for a in range(rank) if a != channel_axis]
    dtype = layer._param_dtype
    x = tf.cast(inputs, dtype)
    mean, variance, count = self._global(layer, x, axes, None)
    def shaped(value):  # Per channel, to broadcast against `x`.
      if value is None or channel_axis == rank - 1:
        return value
      return tf.reshape(value, [-1 if a == channel_axis else 1
                                for a in range(rank)])
    beta = tf.cast(layer.beta, dtype) if layer.center else None
    gamma = tf.cast(layer.gamma, dtype) if layer.scale else None
    output = tf.cast(tf.nn.batch_normalization(
        x, shaped(mean), shaped(variance), shaped(beta), shaped(gamma),
        layer.epsilon), inputs.dtype)
    if getattr(layer, '_bessels_correction_test_only', True):
      # One device's fused kernel averages the batch variance with Bessel's
      # correction (Keras 2.15 keeps it): that of the global count.
      variance = variance * count / tf.maximum(count - 1, 1)
    if training_value is None:
      output = control_flow_util.smart_cond(
          training, lambda: output,
          lambda: original(layer, inputs, mask, False))
      momentum = control_flow_util.smart_cond(
          training, lambda: layer.momentum, lambda: 1.0)
    else:
      momentum = tf.convert_to_tensor(layer.momentum)
    inputs_size = (tf.shape(inputs)[0] if layer._support_zero_size_input()
                   else None)
    for variable, value in ((layer.moving_mean, mean),
                            (layer.moving_variance, variance)):
      # Keras' own updates, through the moving statistics' interception.
      layer.add_update(
          lambda variable=variable, value=value: layer._assign_moving_average(
              variable, value, momentum, inputs_size))
    return output
    # pylint: enable=protected-access

  # --------------------------------------------------------------------

  def _global(self, layer, x: tf.Tensor, axes: Sequence[int],
              weights: Optional[tf.Tensor]):
    """The global batch's moments of `x` over `axes`, per channel.

    Args:
      layer: The batch-norm layer (for messages and checks).
      x: The shard's values, in the layer's parameter dtype.
      axes: The reduction axes.
      weights: Per-value weights broadcastable to `x` (a mask), or None.

    Returns:
      (mean, biased variance, count), per channel, flat.
    """
    self._check_call(layer)
    index = self._tower
    # As few ops as will do: each has its gradient, per call and tower.
    with tf.name_scope('global_moments'):
      live = self._live(x.dtype)
      if weights is None:
        total = tf.reduce_sum(x, axes, keepdims=True)
        channels = total.shape.num_elements()
        if channels is None:
          raise ValueError(
              f'Batch-norm layer {layer.name!r} normalises channels of '
              'unknown size; the global moments need the channel '
              'dimensions known when the graph is built.')
        # Values per channel (the same for every channel).
        per_channel = tf.cast(tf.size(x), x.dtype) * (live / channels)
        count = tf.fill([channels], per_channel)
        mean = tf.math.divide_no_nan(total, per_channel)
        squares = tf.reduce_sum(
            tf.math.squared_difference(x, tf.stop_gradient(mean)), axes,
            keepdims=True) * live
      else:
        weights = tf.broadcast_to(weights, tf.shape(x)) * live
        count = tf.reduce_sum(weights, axes, keepdims=True)
        mean = tf.math.divide_no_nan(
            tf.reduce_sum(weights * x, axes, keepdims=True), count)
        # The shard's centred squares: the global variance adds the spread
        # of the shards' means to them, never subtracts two large sums.
        # The gradient through `mean` here is zero (sum of x - mean is 0).
        squares = tf.reduce_sum(
            weights * tf.math.squared_difference(x, tf.stop_gradient(mean)),
            axes, keepdims=True)
      row = tf.stack([tf.reshape(count, [-1]), tf.reshape(mean, [-1]),
                      tf.reshape(squares, [-1])])
      local, tasks = self._keys_for(layer, row.shape[1])
      row = _combined(self._exchange(row, local, index))
      if tasks is not None:  # This task's row, then every task's.
        row = _combined(self._exchange(row, tasks, self._task_group.index))
      count, mean, squares = tf.unstack(row)
      self._layers[id(layer)] = layer.name
      return mean, tf.math.divide_no_nan(squares, count), count

  def _live(self, dtype) -> tf.Tensor:
    """1 if the current tower has examples, else 0 (its shard weighs
    nothing); made once per tower and dtype."""
    key = (self._tower, dtype)
    if key not in self._lives:
      self._lives[key] = tf.cast(self._sizes[self._tower] > 0, dtype,
                                 name='tower_has_examples')
    return self._lives[key]

  def _check_call(self, layer) -> None:
    """Refuses what the exchange cannot make exact or would hang."""
    moving_statistics.check_supported(layer)
    if not exchange_lib.in_step(self._graph):
      raise ValueError(
          f'Batch-norm layer {layer.name!r} is called in training inside a '
          'tf.cond, tf.while_loop or tf.function. Its global-batch moments '
          'are exchanged between the towers by a collective that every '
          'tower must run in every step, which a branch or loop taken by '
          'some towers only would hang. Call the layer outside control '
          'flow (a `training` tensor is fine: the layer then chooses at run '
          'time, after the exchange).')

  def _keys_for(self, layer, channels: Optional[int]):
    """The keys of the current tower's next batch-norm call.

    Returns:
      (keys of the exchange between this machine's towers, keys of the
      exchange with the other tasks or None).

    Raises:
      ValueError: the call's channels are unknown, or differ from those of
        tower 0's call at the same position.
    """
    index, position = self._tower, self._position
    self._position += 1
    if channels is None:
      raise ValueError(
          f'Batch-norm layer {layer.name!r} normalises channels of unknown '
          'size; the global moments need the channel dimensions known when '
          'the graph is built.')
    if index == 0:
      self._calls.append(_Call(layer.name, channels, self._keys_of_call(
          channels, len(self._devices), local=True), []))
    if position >= len(self._calls):
      raise ValueError(
          f'Tower {index} makes more batch-norm calls than tower 0 (call '
          f'{position + 1} is {layer.name!r}). Every tower must build the '
          'same model.')
    call = self._calls[position]
    if call.channels != channels:
      raise ValueError(
          f'Batch-norm call {position + 1} of tower {index} ({layer.name!r}) '
          f'normalises {channels} channels, that of tower 0 '
          f'({call.layer!r}) {call.channels}. Every tower must build the '
          'same model.')
    if self._task_group.across_tasks:
      # Each tower is in its own group across the tasks (the towers of
      # index `index`), so each has its own keys, the same on every task.
      call.tasks.append(self._keys_of_call(channels, self._task_group.size,
                                           local=False))
      return call.local, call.tasks[index]
    return call.local, None

  def _keys_of_call(self, channels: int, size: int,
                    local: bool) -> exchange_lib.Keys:
    """A forward and a backward instance key for one exchange."""
    if local and not self._task_group.across_tasks:
      return exchange_lib.Keys(self._group, len(self._devices),
                               self._keys.local_instance(),
                               self._keys.local_instance())
    if local:
      # This task's towers, in a group of their own. The keys are the same
      # on every task: a session run's collective graph key, which pairs
      # the tasks' steps, hashes every instance key of the graph.
      group, carries = self._group, f'batch norm in a task:{channels}'

    else:
      group = collective_keys.tower_index_group(self._tower)
      carries = f'batch norm of tower {self._tower}:{channels}'
    return exchange_lib.Keys(
        group, size, self._keys.task_instance(size, f'{carries}:forward'),
        self._keys.task_instance(size, f'{carries}:backward'))

  def _exchange(self, row: tf.Tensor, keys: exchange_lib.Keys,
                index: int) -> tf.Tensor:
    """Every member's `row` ([3, channels]), stacked in member order.

    One all-sum of a [members, 3, channels] matrix that holds only this
    member's row, at `index` (the towers of this machine, or this tower and
    those of the same index of the other tasks); its gradient is the
    all-sum of the members' upstream gradients, keyed with the forward one.
    """
    if keys.size == 1:  # One tower, or one task: nothing to exchange.
      return row[None]
    return exchange_lib.summed(
        row, keys, self._devices[self._tower], self._placement,
        place=lambda own: tf.scatter_nd([[index]], own[None],
                                        [keys.size, *own.shape.as_list()]),
        take=lambda total: total[index])


def _combined(rows: tf.Tensor) -> tf.Tensor:
  """One [count, mean, centred squares] row of the rows' values together.

  Chan et al.'s parallel combination: the centred squares add the spread
  of the rows' means, never subtract two large sums.
  """
  counts, means, squares = tf.unstack(rows, axis=1)
  count = tf.reduce_sum(counts, 0)
  mean = tf.math.divide_no_nan(tf.reduce_sum(counts * means, 0), count)
  spread = tf.reduce_sum(counts * tf.square(means - mean), 0)
  return tf.stack([count, mean, tf.reduce_sum(squares, 0) + spread])
