"""One update of the batch-norm moving statistics per step, from the batch.

Each tower's batch-norm layer would move its moving mean and variance
towards its own shard's statistics, so N towers would apply N updates per
step. While the towers are built, the moving-average update of Keras'
batch normalization (`tf.keras.layers.BatchNormalization`, its legacy v1
class and `tf.compat.v1.layers.batch_normalization`, which the canned
Estimators use) is intercepted: every tower records its shard's statistics,
earlier towers get a read of the variable in place of an update, and the
last tower applies ONE update with the global batch's statistics, rebuilt
from the shards':

  mean = sum_i n_i mean_i / N
  biased variance = sum_i n_i (var_i + (mean_i - mean)^2) / N

where n_i counts the values a shard contributes to one channel (examples
times spatial positions, or the mask's weights) and idle towers weigh zero. The fused kernel's
batch variance carries Bessel's correction m / (m - 1), which is undone per
shard and reapplied for the whole batch, as one device's fused layer would.

With batch_norm='global' (global_batch_norm.GlobalMoments), every tower's
forward pass already has the global batch's moments, and those are what
the layer hands its update: the last tower applies them as they are, and
nothing is rebuilt here (one statistics computation per layer call).

Anything else in UPDATE_OPS that several towers write to one variable would
run once per tower; `check_single_writers` refuses it.
"""

import contextlib
import dataclasses
import re
from typing import Dict, List, Optional, Sequence

from keras.src.layers.normalization import batch_normalization as keras_bn
import tensorflow as tf

from estimator_towers.graph import patching
from estimator_towers.graph import stand_ins as stand_ins_lib

tf1 = tf.compat.v1
_Base = keras_bn.BatchNormalizationBase
_READS = frozenset(['ReadVariableOp', 'Identity'])
# The name of the read an earlier tower's layer gets in place of its update.
_DEFERRED = 'AssignMovingAvgInLastTower'


@dataclasses.dataclass
class _Shard:
  """What one tower's layer call contributes to one moving variable."""
  value: Optional[tf.Tensor]  # The shard's batch mean or variance.
  count: tf.Tensor  # Values per channel in the shard.
  corrected: bool  # The variance carries Bessel's correction (fused kernel).
  mean: Optional[tf.Tensor]  # For a variance: the same call's batch mean.


class MovingStatistics:
  """Intercepts batch-norm updates while the towers of a step are built.

  Args:
    num_towers: How many towers are built.
    sizes: Each tower's number of real examples (int32 [num_towers]); an
      idle tower (0) trains on a padding copy and must weigh nothing.
    task_group: The training tasks (a task_sync.TaskGroup in a synchronous
      cluster, whose towers' moments are combined too, so that every task
      applies the same global-batch update; one_machine.OneMachine else).
    global_moments: The step's global_batch_norm.GlobalMoments when the
      towers normalise with the global batch's moments (the values the
      layers update with are then global already); None for per-tower
      normalisation, whose shard statistics are combined here.
  """

  def __init__(self, num_towers: int, sizes: tf.Tensor, task_group,
               global_moments=None):
    self._num_towers = num_towers
    self._global_moments = global_moments
    self._task_group = task_group
    self._sizes = sizes
    self._graph = tf1.get_default_graph()
    self._tower = None
    # The layer call being built, by id(layer): its count and mean so far.
    self._calls: Dict[int, _Shard] = {}
    # Per tower: moving variable name -> its updates in call order.
    self._trains = False  # Whether some layer updated its statistics.
    self._shards: List[Dict[str, List[_Shard]]] = [
        {} for _ in range(num_towers)]
    # The last tower's update ops (by write_key): exact although they write
    # from its shard (tower_effects lets them through).
    self.exact_writes = set()
    # Earlier towers' reads in place of an update wait for the update, so
    # the update runs wherever the model_fn runs tower 0's UPDATE_OPS.
    self.stand_ins = stand_ins_lib.StandIns()
    # Per tower: how many updates of each moving variable it built so far.
    self._positions: List[Dict[str, int]] = [{} for _ in range(num_towers)]

  @property
  def trains(self) -> bool:
    """Whether a tower built a batch-norm layer that updates its moving
    statistics (one in training mode)."""
    return self._trains

  @contextlib.contextmanager
  def tower(self, index: int):
    """Intercepts the batch-norm updates built in tower `index`."""
    originals = {name: getattr(_Base, name) for name in
                 ('_moments', '_fused_batch_norm', '_assign_moving_average')}
    statistics = self

    def moments(layer, inputs, reduction_axes, keep_dims, mask=None):
      statistics._note_call(layer, inputs, corrected=False, mask=mask)
      return originals['_moments'](layer, inputs, reduction_axes, keep_dims,
                                   mask=mask)

    def fused_batch_norm(layer, inputs, mask, training):
      # Keras 2.15 leaves the kernel's Bessel's correction in the variance
      # its fused path averages (this flag is always True there).
      corrected = getattr(layer, '_bessels_correction_test_only', True)
      statistics._note_call(layer, inputs, corrected)
      return originals['_fused_batch_norm'](layer, inputs, mask, training)

    def assign_moving_average(layer, variable, value, momentum, inputs_size):
      return statistics._assign(originals['_assign_moving_average'], layer,
                                variable, value, momentum, inputs_size)

    patches = [('_assign_moving_average', assign_moving_average)]
    if self._global_moments is None:  # Else GlobalMoments intercepts them.
      patches += [('_moments', moments),
                  ('_fused_batch_norm', fused_batch_norm)]
    self._tower = index
    try:
      # Guarded: a batch-norm layer another thread or graph builds at the
      # same time keeps Keras' own methods.
      with patching.Patcher() as patcher:
        for name, method in patches:
          patcher.set(_Base, name, patcher.guard(method, originals[name]))
        yield
    finally:
      self._tower = None

  def _note_call(self, layer, inputs, corrected: bool, mask=None) -> None:
    """Starts a layer call: how many values per channel it normalises.

    A mask (non-fused path) weighs each example's values, as Keras'
    weighted moments do: the count is then the sum of those weights.
    """
    channels = layer.moving_mean.shape.num_elements()
    if mask is None:
      count = tf.size(inputs) // channels
    else:
      weights = tf.expand_dims(tf.cast(mask, inputs.dtype), -1)
      count = tf.reduce_sum(tf.broadcast_to(weights, tf.shape(inputs)))
      count = count / channels
    self._calls[id(layer)] = _Shard(None, count, corrected, None)

  def _assign(self, original, layer, variable, value, momentum, inputs_size):
    """Records the shard's statistic; the last tower applies the global one."""
    check_supported(layer)
    self._trains = True
    if self._global_moments is not None:
      return self._assign_global(original, layer, variable, value, momentum,
                                 inputs_size)
    call = self._calls.get(id(layer))
    if call is None or (variable is layer.moving_variance and
                        call.mean is None):
      raise ValueError(
          f'Batch-norm layer {layer.name!r} updates {variable.name} without '
          'computing batch statistics the usual Keras way, so '
          'replicate_model_fn cannot combine them over towers.')
    if variable is layer.moving_mean:
      mean = None
    elif variable is layer.moving_variance:
      mean = call.mean
    else:
      raise ValueError(
          f'Batch-norm layer {layer.name!r} updates {variable.name}, which '
          'replicate_model_fn cannot combine over towers.')
    shard = _Shard(self._outside(value, layer), call.count, call.corrected,
                   mean)
    if mean is None:
      call.mean = shard.value
    calls = self._shards[self._tower].setdefault(variable.name, [])
    calls.append(shard)
    if self._tower < self._num_towers - 1:
      return self._stand_in(variable)
    shards = self._matching(variable.name, len(calls) - 1)
    if mean is None:
      global_value = self._mean(shards)
    else:
      global_value = self._variance(shards)
    return self._update(
        variable, original(layer, variable, global_value, momentum,
                           inputs_size))

  def _assign_global(self, original, layer, variable, value, momentum,
                     inputs_size):
    """The last tower applies `value`, the global batch's statistic."""
    if not self._global_moments.computed(layer):
      raise ValueError(
          f'Batch-norm layer {layer.name!r} updates {variable.name} without '
          'computing batch statistics the usual Keras way, so '
          'replicate_model_fn cannot make them the global batch\'s. Use '
          'tf.keras.layers.BatchNormalization or tf.compat.v1.layers.'
          'batch_normalization unchanged, or pass batch_norm=\'per_tower\'.')
    if self._tower < self._num_towers - 1:
      return self._stand_in(variable)
    return self._update(variable, original(layer, variable, value, momentum,
                                           inputs_size))

  def _key(self, variable) -> tuple:
    """(variable name, how many updates of it this tower built before)."""
    positions = self._positions[self._tower]
    position = positions.get(variable.name, 0)
    positions[variable.name] = position + 1
    return variable.name, position

  def _stand_in(self, variable) -> tf.Tensor:
    """Not an update: the last tower applies the step's one update."""
    read = tf.identity(variable, name=_DEFERRED)
    self.stand_ins.add(self._key(variable), read.op)
    return read

  def _update(self, variable, update):
    """Records the last tower's one update of `variable`."""
    op = getattr(update, 'op', update)
    self.exact_writes.add(write_key(op))
    self.stand_ins.set_real(self._key(variable), [op])
    return update

  def _matching(self, name: str, position: int) -> List[_Shard]:
    """Every tower's `position`-th update of variable `name`."""
    shards = []
    for i, per_variable in enumerate(self._shards):
      calls = per_variable.get(name, [])
      if len(calls) <= position:
        raise ValueError(
            f'Tower {i} updates {name} {len(calls)} times, the last tower '
            f'{position + 1} times. Every tower must build the same model.')
      shards.append(calls[position])
    return shards

  def _weights(self, shards: Sequence[_Shard], dtype) -> List[tf.Tensor]:
    """Each shard's values per channel; zero for an idle tower's padding."""
    return [tf.where(self._sizes[i] > 0, tf.cast(shard.count, dtype),
                     tf.zeros([], dtype))
            for i, shard in enumerate(shards)]

  def _mean(self, shards: Sequence[_Shard]) -> tf.Tensor:
    with tf.name_scope('global_batch_mean'):
      dtype = shards[0].value.dtype
      weights = self._weights(shards, dtype)
      return _weighted_mean([s.value for s in shards], weights,
                            self._task_group)

  def _variance(self, shards: Sequence[_Shard]) -> tf.Tensor:
    with tf.name_scope('global_batch_variance'):
      dtype = shards[0].value.dtype
      weights = self._weights(shards, dtype)
      means = [s.mean for s in shards]
      mean = _weighted_mean(means, weights, self._task_group)
      terms = []
      for shard, shard_mean in zip(shards, means):
        variance = shard.value
        if shard.corrected:
          count = tf.cast(shard.count, dtype)
          variance = variance * (count - 1) / count
        terms.append(variance + tf.square(shard_mean - mean))
      variance = _weighted_mean(terms, weights, self._task_group)
      if shards[0].corrected:
        total = tf.add_n(weights)
        total = self._task_group.sum([total])[0]
        variance = variance * total / (total - 1)
      return variance

  def _outside(self, value: tf.Tensor, layer) -> tf.Tensor:
    """`value` as a tensor of the towers' graph.

    A layer called with a `training` tensor updates inside a conditional,
    whose branch captures the statistic from the towers' graph.
    """
    value = tf.convert_to_tensor(value)
    while value.graph is not self._graph:
      inner = value.graph
      outer = {id(internal): external for internal, external in zip(
          getattr(inner, 'internal_captures', ()),
          getattr(inner, 'external_captures', ()))}.get(id(value))
      if outer is None:
        raise ValueError(
            f'Batch-norm layer {layer.name!r} computes its update inside a '
            'function or loop, where replicate_model_fn cannot combine it '
            'over towers. Call the layer outside tf.function and loops.')
      value = outer
    return value


def per_tower_layers(graph: tf.Graph) -> List[str]:
  """The batch-norm layers of a towered TRAIN graph, by name scope.

  Their moving statistics get one update from the global batch, but their
  forward pass normalises each tower's shard with the shard's own batch
  statistics (one device normalises the whole batch): the reason such a
  model does not train bit-identically on towers. Found by the read an
  earlier tower's layer gets in place of its update, in the graph and in
  its functions (a layer called with a `training` tensor updates inside a
  conditional's branch).

  Args:
    graph: A graph in which replicate_model_fn built its TRAIN towers.

  Returns:
    The layers' name scopes, sorted and without repeats.
  """
  names = [op.name for op in graph.get_operations()]
  for function in graph.as_graph_def().library.function:
    names.extend(node.name for node in function.node_def)
  pattern = re.compile(rf'(?:(.*)/)?{_DEFERRED}(?:_\d+)?$')
  return sorted({match.group(1) or '' for match in map(pattern.match, names)
                 if match})


def write_key(op: tf.Operation) -> str:
  """Names an op, prefixed by its function's name when inside a function.

  A layer called with a `training` tensor updates inside a conditional's
  branch function; tower_effects names the writes it finds there the same
  way.
  """
  if isinstance(op.graph, tf.__internal__.FuncGraph):
    return f'{op.graph.name}/{op.name}'
  return op.name


def check_supported(layer) -> None:
  """Refuses batch-norm options whose statistics cannot match one device.

  Raises:
    ValueError: `layer` uses renorm or sets virtual_batch_size.
  """
  if layer.renorm:
    raise ValueError(
        f'Batch-norm layer {layer.name!r} uses renorm=True, whose moving '
        'statistics replicate_model_fn cannot combine over towers exactly. '
        'Use renorm=False, or train on one device.')
  if layer.virtual_batch_size is not None:
    raise ValueError(
        f'Batch-norm layer {layer.name!r} sets virtual_batch_size: its ghost '
        'batches would straddle towers, so the moving statistics cannot '
        'match one device. Leave virtual_batch_size=None, or train on one '
        'device.')


def _weighted_mean(values: Sequence[tf.Tensor],
                   weights: Sequence[tf.Tensor], task_group) -> tf.Tensor:
  """sum_i w_i v_i / sum_i w_i; a zero weight drops a NaN value.

  Both sums run over the towers of every task of `task_group`.
  """
  terms = [tf.where(w > 0, w * v, tf.zeros_like(v))
           for v, w in zip(values, weights)]
  numerator, denominator = tf.add_n(terms), tf.add_n(weights)
  numerator, denominator = task_group.sum([numerator, denominator])
  return numerator / denominator


def _target(op: tf.Operation):
  """The variable (handle or ref) an update op writes, or None."""
  if op.type in _READS or not op.inputs:
    return None
  first = op.inputs[0]
  if first.dtype == tf.resource or first.dtype._is_ref_dtype:  # pylint: disable=protected-access
    return first
  return None


def check_single_writers(updates_per_tower: Sequence[Sequence]) -> None:
  """Refuses UPDATE_OPS that several towers write to the same variable.

  Batch-norm statistics are written by the last tower only (see
  MovingStatistics). Any other write every tower makes, such as a moving
  average of the user's own, would run once per tower per step.

  Args:
    updates_per_tower: Each tower's UPDATE_OPS, in tower order.

  Raises:
    ValueError: two towers' UPDATE_OPS write one variable.
  """
  writers: Dict[str, int] = {}
  for index, updates in enumerate(updates_per_tower):
    for update in updates:
      op = update if isinstance(update, tf.Operation) else update.op
      target = _target(op)
      if target is None:
        continue
      name = target.op.name
      if writers.setdefault(name, index) != index:
        raise ValueError(
            f'UPDATE_OPS of towers {writers[name]} and {index} both write '
            f'{name} (op {op.name}): it would change once per tower, '
            'not once per step as on one device. replicate_model_fn combines '
            'only the moving statistics of tf.keras.layers.'
            'BatchNormalization and tf.compat.v1.layers.batch_normalization. '
            'Use one of those for batch norm. Add any other update in one '
            'tower only (if trainer.tower_context().index == 0), where it '
            "sees that tower's shard, or train on one device.")
