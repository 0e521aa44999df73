"""`replicate_model_fn`: run a one-device model_fn on every device.

Training on N towers is the same computation as one device on the same global
batch: the batch is split along its first dimension, the model_fn is called
once per tower under that tower's device, the towers' losses are weighted by
their share of the examples, and one update is applied to one set of
variables whose names are those of the unwrapped model_fn.
"""

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, List, Mapping, Optional, Sequence

from absl import logging
import tensorflow as tf
from tensorflow.python.util import function_utils  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.aggregation import strategies as aggregation_lib
from estimator_towers.collectives import exchange as exchange_lib
from estimator_towers.towers import batch_mixing
from estimator_towers.update import first_step_check
from estimator_towers.towers import free_writes
from estimator_towers.towers import global_batch_norm
from estimator_towers.towers import loss_reduction as reduction_lib
from estimator_towers.update import loss_scaling
from estimator_towers.merge import metric_adds
from estimator_towers.update import micro_batches as micro_batches_lib
from estimator_towers.towers import moving_statistics
from estimator_towers.towers import regularization_losses
from estimator_towers.cluster import one_machine
from estimator_towers.update import one_update
from estimator_towers.graph import folded_shapes
from estimator_towers.graph import op_ledger
from estimator_towers.towers import optimizer_iterations
from estimator_towers.towers import own_collections
from estimator_towers.towers import predicted_rows
from estimator_towers.merge import prediction_audit
from estimator_towers.cluster import peer_watch
from estimator_towers.towers import random_draws
from estimator_towers.merge import saved_model_estimator
from estimator_towers.towers import scoped_collections
from estimator_towers.towers import sequence_masks
from estimator_towers.towers import shared_placeholders
from estimator_towers.towers import sharding
from estimator_towers.merge import spec_merge
from estimator_towers.towers import table_sharing
from estimator_towers.cluster import task_agreement as task_agreement_lib
from estimator_towers.cluster import task_sync
from estimator_towers.cluster import stop_request
from estimator_towers import tower as tower_lib
from estimator_towers.towers import tower_effects
from estimator_towers.towers import tower_weights
from estimator_towers.merge import tpu_spec
from estimator_towers.towers import variable_sharing
from estimator_towers.towers import variable_views
from estimator_towers.towers import whole_batch
from estimator_towers.update import write_order
from estimator_towers.run_config import session_device_counts

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys

# Ops that hold state; they live on the variables device, like the ps ops of
# tf.compat.v1.train.replica_device_setter.
_VARIABLE_OPS = frozenset([
    'Variable', 'VariableV2', 'AutoReloadVariable', 'VarHandleOp',
    'MutableHashTable', 'MutableHashTableV2', 'MutableHashTableOfTensors',
    'MutableHashTableOfTensorsV2', 'MutableDenseHashTable',
    'MutableDenseHashTableV2'])
_LOSS_REDUCTIONS = ('auto', 'mean', 'sum')
# The name scope of the model_fn's copy on the whole batch (prediction_audit,
# first_step_check).
_ONE_DEVICE_SCOPE = 'one_device_check'
_INPUT_PIPELINE_OPS = frozenset(['IteratorGetNext', 'IteratorGetNextSync',
                                 'QueueDequeueV2', 'QueueDequeueManyV2',
                                 'QueueDequeueUpToV2'])

ModelFn = Callable[..., tf.estimator.EstimatorSpec]


def replicate_model_fn(model_fn: ModelFn,
                       devices: Optional[Sequence[str]] = None,
                       *,
                       variables_device: Optional[str] = None,
                       loss_reduction: str = 'auto',
                       replicate_serving: bool = False,
                       aggregation: str = 'global_loss',
                       batch_norm: str = global_batch_norm.DEFAULT,
                       sync_timeout_secs: float = (
                           task_sync.DEFAULT_TIMEOUT_SECS),
                       task_agreement: Optional[Mapping[str, Any]] = None,
                       random_ops: str = 'per_tower',
                       micro_batches: int = 1,
                       check_first_batch: bool = True) -> ModelFn:
  """Wraps a one-device `model_fn` so that it uses several devices.

  The returned function is a `model_fn` for `tf.estimator.Estimator`. In
  TRAIN mode the towers' losses are weighted so that they add up to the
  global-batch loss one device computes (see `loss_reduction`), each tower's
  gradients are computed on its own device, and ONE update is applied to ONE
  set of variables: `optimizer.minimize(loss, global_step=...)` works with any
  `tf.compat.v1.train` or `tf.keras.optimizers.legacy` optimizer, unwrapped,
  and so does `compute_gradients`, a transformation of the gradients, then
  `apply_gradients` (the transformation sees the global-batch gradients).
  Only the last tower's train_op runs, so what the model_fn chains after
  its update (a manual global_step increment, an EMA) happens once; earlier
  towers' asserts and shard-dependent writes run too. Variables made by
  `get_variable`, `tf.compat.v1.layers`, feature columns and `tf.keras.layers`
  (named or not) are shared by all towers and keep one-device names, so
  checkpoints move freely between tower counts and plain Estimators. EVAL
  metrics share their state across towers and equal the one-device values;
  PREDICT outputs are concatenated back in input order. With
  aggregation='all_reduce' each tower device also holds a copy of the
  trainable variables, kept identical and never checkpointed. A batch that
  does not divide by the number of towers is split as evenly as possible;
  towers beyond a small batch are idle and contribute nothing. A
  SavedModelEstimator's model_fn evaluates and predicts on towers built on
  one import of its SavedModel (run it with
  saved_model_estimator.TowersSavedModelEstimator); training it on towers
  is refused.

  Inside the model_fn, `trainer.tower_context()` tells the tower index and
  count. In training, batch norm normalises each tower's shard with the
  whole batch's moments, as one device does (see `batch_norm`), and its
  moving mean and variance get one update per step from the global batch
  (see moving_statistics); hooks and summaries come from tower 0, the
  scaffold from the last tower (in training, its Saver sees the slots).

  Args:
    model_fn: A model_fn written for one device, taking some of `features`,
      `labels`, `mode`, `params`, `config`.
    devices: Tower devices, e.g. `['/gpu:0', '/gpu:1']`. None takes them from
      the RunConfig the Estimator passes: its GPUs, else its (virtual) CPUs.
    variables_device: Where the shared variables live with
      aggregation='global_loss'; None means '/cpu:0'. The other strategies
      place variables on the tower devices and refuse it.
    loss_reduction: How the model_fn's loss reduces its batch, which decides
      how the towers' losses add up. 'auto' reads it off the loss: a sum
      (`reduce_sum`, `Reduction.SUM` of the `tf.compat.v1` canned
      Estimators) adds the towers' losses; a mean or any sum divided by a
      count (`reduce_mean`, `SUM_OVER_BATCH_SIZE`, `SUM_BY_NONZERO_WEIGHTS`)
      weighs each tower by its share of the divisor. 'mean' or 'sum' state
      it; a contradiction with the loss is an error.
    replicate_serving: Keep towers in serving graphs (features fed by
      placeholders, as `export_saved_model` builds). By default a serving
      graph runs the model_fn once without device pins, so the SavedModel
      serves any batch size on any machine.
    aggregation: How the variables are placed and the towers' gradients
      combined (see docs/aggregation.md); every choice trains the same
      numbers and writes the same one-device checkpoint names.
      'global_loss': one set of variables on `variables_device`; the last
      tower differentiates the weighted global loss once. 'round_robin':
      the same, with the variables spread over the tower devices by bytes.
      'all_reduce': one copy of each trainable variable per tower device;
      each tower differentiates its own loss, the gradients are summed by
      an all-reduce (NCCL on GPUs, collective ops otherwise) and every copy
      takes the same update. In a TF_CONFIG cluster of a chief and workers
      without ps tasks, 'all_reduce' trains synchronously: every task's
      batch is part of the step's global batch (chief first, then the
      workers by index; `task_slice` cuts these parts from one pipeline),
      the sums also run over the tasks, and every task applies the same
      update (see docs/cluster.md). The other strategies
      need ps tasks in a cluster.
    batch_norm: How batch norm (`tf.keras.layers.BatchNormalization`, fused
      or not, `tf.compat.v1.layers.batch_normalization` and what builds on
      them) normalises in training. 'global': with the mean and variance
      of the whole global batch, exchanged between the tower devices by
      one collective per layer call, gradients included: the towers train
      one device's model (see global_batch_norm). 'per_tower': with each
      tower's shard's own, as in-graph replication usually does (cheaper,
      another model). The moving statistics get one global-batch update
      per step either way. In a synchronous cluster the tasks exchange the
      moments too, and every task must have as many towers (checked at
      the start).
    sync_timeout_secs: In a synchronous cluster, how long a task waits for
      the others before it fails instead of hanging: at the start, when
      the chief broadcasts its variables (an error), and in each training
      step (peer_watch.StepWatch ends the process with one line); a worker
      whose chief's server has not answered for that long ends too. Keep
      it above the slowest step. See docs/cluster.md, "Faults in a
      synchronous cluster".
    task_agreement: In a synchronous cluster, names and values every task
      must have been given alike (e.g. the options that change the
      computation, the input files). At the start every task compares
      them, and its model's variables, with every other task's; any
      difference ends every task with an error naming it. Compared
      without it too: the variables, this wrapper's settings, how each
      loss reduces its examples, and (with batch_norm='global' and a batch
      norm in the model) the number of towers per task.
    random_ops: How the towers draw random numbers (dropout, noise).
      'per_tower' (faster): each tower's random ops draw their own numbers,
      of the shard's shape and with seeds of their own, so with dropout
      the towers train like one device only in distribution. 'one_device':
      each tower draws what one device draws on the same global batch with
      the same `tf_random_seed`: a random op whose first dimension is the
      shard's rows (a dropout mask, per-example noise) draws the global
      batch's shape and the tower keeps its own rows; any other gets one
      device's seed (see random_draws). Each tower then draws the whole
      batch's random numbers (in a synchronous cluster, the whole
      cluster's batch). Random ops that cannot be matched to one device's
      are refused.
    micro_batches: In TRAIN, each tower runs its shard as this many
      consecutive micro-batches, one after another, within one step: the
      step is still one device's on the global batch (one update, one
      global_step, the global-batch loss), while a device holds the
      activations of one micro-batch at a time. Each micro-batch is built
      as a tower of its own (the graph grows that many times); EVAL and
      PREDICT are not split. Batch norm in training is refused with more
      than 1; see micro_batches.py and docs/writing_model_fns.md.
    check_first_batch: In PREDICT, compare the predictions whose rows the
      graph check cannot prove to be each computed from its own example (a
      step inside a tf.function, py_function or while loop, a scatter, ...)
      with one device's on the first batch: the model_fn is built once more
      and runs once on the whole first batch on tower 0's device, and
      `predict` fails before returning a row when they differ (see
      prediction_audit); a serving graph with `replicate_serving=True`
      refuses them. In EVAL, the same for a loss computed past such a
      step: `evaluate` fails after the first batch. In TRAIN, such a loss
      (and each optimizer call's loss) is compared before the first step,
      with the copy's optimizer calls discarded: `train` fails before any
      update (see first_step_check); not with micro_batches > 1,
      batch_norm='per_tower' or in a synchronous cluster. False merges and
      trains them unchecked: for a first batch too large for one device's
      memory.

  Returns:
    A model_fn that takes `(features, labels, mode, params, config)` and
    shows Estimator the arguments of `model_fn` (plus `mode` and `config`),
    so that Estimator checks them as it checks `model_fn`'s.

  Raises:
    TypeError: `model_fn` is not callable, `devices` is not a list of
      device strings, or `aggregation` or `batch_norm` is not a string.
    ValueError: `devices` is empty or repeats a device, `loss_reduction`,
      `aggregation`, `batch_norm` or `random_ops` is unknown,
      `variables_device` is given with an `aggregation` other than
      'global_loss', or `micro_batches` is not a positive int. Devices the
      session lacks,
      a `loss_reduction` the loss contradicts, and 'all_reduce' in a
      TF_CONFIG cluster of several tasks, are reported when the Estimator
      calls the model_fn.
  """
  if not callable(model_fn):
    raise TypeError(f'model_fn must be callable, got {model_fn!r}.')
  if task_agreement is not None and not isinstance(task_agreement, Mapping):
    raise TypeError('task_agreement must be a mapping of names to values, '
                    f'got {type(task_agreement).__name__}.')
  if not sync_timeout_secs > 0:
    raise ValueError(f'sync_timeout_secs={sync_timeout_secs!r}; it must be '
                     'a positive number of seconds.')
  if loss_reduction not in _LOSS_REDUCTIONS:
    raise ValueError(f'loss_reduction={loss_reduction!r}; use one of '
                     f'{_LOSS_REDUCTIONS}.')
  if not isinstance(aggregation, str):
    raise TypeError(f'aggregation must be one of '
                    f'{aggregation_lib.AGGREGATIONS}, got {aggregation!r}.')
  global_batch_norm.check(batch_norm)
  if devices is not None:
    devices = _canonical_devices(devices)
  aggregation_lib.check(aggregation, variables_device)
  random_draws.check(random_ops)
  micro_batches_lib.check(micro_batches, aggregation)
  if not isinstance(check_first_batch, bool):
    raise TypeError(f'check_first_batch must be True or False, got '
                    f'{check_first_batch!r}.')
  if variables_device is not None:
    variables_device = _canonical_variables_device(variables_device)
  if aggregation == 'global_loss' and variables_device is None:
    variables_device = _canonical_variables_device(
        aggregation_lib.DEFAULT_VARIABLES_DEVICE)
  # A SavedModelEstimator's model_fn imports its model on every call: its
  # towers are built on tower 0's import (see saved_model_estimator).
  model_fn = saved_model_estimator.for_towers(model_fn)
  accepted = _accepted_args(model_fn)
  if 'features' not in accepted:
    raise ValueError(f'{_name(model_fn)} has no `features` argument; a '
                     'model_fn takes features (and some of labels, mode, '
                     'params, config), as tf.estimator.Estimator requires.')

  presented = _presented_signature(model_fn)

  def replicated_model_fn(*args, **kwargs):
    # Estimator passes keywords; a caller reading the presented signature
    # (features, mode, config) passes them in its order.
    return towered_model_fn(**_bound(presented, args, kwargs))

  def towered_model_fn(features, labels=None, mode=None, params=None,
                       config=None):
    tower_devices = _tower_devices(devices, config)
    if mode == ModeKeys.TRAIN:
      aggregation_lib.check_tasks(aggregation, config)
    if variables_device is not None:
      _check_variables_device(variables_device, config)
    micro_count = micro_batches if mode == ModeKeys.TRAIN else 1
    strategy = aggregation_lib.make(aggregation, tower_devices,
                                    variables_device, micro_count)
    # The wrapper's own settings change the step: tasks that differ in
    # them would build collectives that never pair up (or train apart).
    agreement = {**{f"replicate_model_fn's {name}": value
                    for name, value in (
                        ('aggregation', aggregation),
                        ('batch_norm', batch_norm),
                        ('loss_reduction', loss_reduction),
                        ('random_ops', random_ops),
                        ('micro_batches', micro_batches),
                        ('check_first_batch', check_first_batch))},
                 **(task_agreement or {})}
    task_group = _task_group(mode, config, tower_devices[0],
                             sync_timeout_secs, strategy, agreement)
    kwargs = {'mode': mode, 'params': params, 'config': config}
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    if labels is not None and 'labels' not in accepted:
      raise ValueError(
          f'{_name(model_fn)} does not take labels, but the input_fn returns '
          'labels. Add a `labels` argument or return only features.')
    if 'labels' in accepted:
      kwargs['labels'] = labels
    if tf.executing_eagerly():
      # Called outside any graph (a test calling estimator.model_fn): there
      # are no towers to build, and one device's model_fn runs as written.
      return tpu_spec.as_estimator_spec(model_fn(features=features, **kwargs))
    if mode == ModeKeys.PREDICT and not replicate_serving and (
        _is_serving_graph(features)):
      return tpu_spec.as_estimator_spec(model_fn(features=features, **kwargs))
    micro = None
    if micro_count > 1:
      micro = micro_batches_lib.MicroBatches(tower_devices, micro_count)
    # One tower with the float16 rewrite still needs the one update's loss
    # scale, so it is built as towers are.
    if len(tower_devices) == 1 and not loss_scaling.automatic(config) and (
        not task_group.across_tasks) and micro is None:
      if devices is None:  # One device of the session: as if unwrapped.
        return tpu_spec.as_estimator_spec(
            model_fn(features=features, **kwargs))
      with tf1.get_default_graph().device(
          _placer(0, tower_devices[0], strategy, lambda: False)):
        return tpu_spec.as_estimator_spec(
            model_fn(features=features, **kwargs))
    if not sharding.has_batch(features, labels):
      _check_batch_free_call(task_group, micro, config)
      # Nothing to split: every tower would compute one device's values
      # again, and run its state updates once more; one call is exact.
      logging.info(
          'replicate_model_fn: the features and labels are one value for '
          'the whole batch; the model_fn runs once, on %s.', tower_devices[0])
      with tf1.get_default_graph().device(
          _placer(0, tower_devices[0], strategy, lambda: False)):
        return tpu_spec.as_estimator_spec(
            model_fn(features=features, **kwargs))
    # Beside a batch, arrays and lists of Python values are rows too.
    features = sharding.with_array_rows_as_tensors(features)
    labels = sharding.with_array_rows_as_tensors(labels)
    builder = _TowerBuilder(model_fn, tower_devices, strategy, task_group,
                            loss_reduction, mode,
                            loss_scaling.automatic(config),
                            random_draws.make(random_ops, task_group),
                            micro=micro, batch_norm=batch_norm,
                            check_first_batch=check_first_batch and not (
                                mode == ModeKeys.TRAIN and
                                _trains_with_other_tasks(config)))
    spec = builder.build(features, labels, kwargs)
    if task_group.across_tasks:
      # A stuck or dead peer must end this task, not hang it.
      spec = spec._replace(training_hooks=(
          *peer_watch.for_task(config, sync_timeout_secs),
          *spec.training_hooks))
    return spec

  replicated_model_fn.__signature__ = presented
  return replicated_model_fn


_ARGUMENTS = inspect.Signature([
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                      default=None if name != 'features' else
                      inspect.Parameter.empty)
    for name in ('features', 'labels', 'mode', 'params', 'config')])


def _bound(presented: inspect.Signature, args, kwargs) -> dict:
  """A call's arguments by name: by the presented signature when they fit
  it, else in Estimator's full order (features, labels, mode, params,
  config), as callers passing all five positionally do.

  Raises:
    TypeError: They fit neither.
  """
  try:
    arguments = presented.bind(*args, **kwargs).arguments
  except TypeError:
    arguments = _ARGUMENTS.bind(*args, **kwargs).arguments
  return {name: value for name, value in arguments.items()
          if name in _ARGUMENTS.parameters}


def _check_batch_free_call(task_group, micro, config) -> None:
  """Refuses a batch-free input where one call is not one device's step.

  Raises:
    ValueError: in a synchronous cluster (each task would train alone),
      with micro-batches, or with the float16 loss scale, which need towers.
  """
  why = ('tasks of a synchronous cluster would each train alone'
         if task_group.across_tasks else
         'micro_batches splits a batch' if micro is not None else
         'the automatic float16 loss scale is applied across towers'
         if loss_scaling.automatic(config) else None)
  if why:
    raise ValueError(
        'replicate_model_fn found no feature or label with a batch '
        f'dimension to split over the towers (scalars are one value per '
        f'batch), and {why}. Give the batched inputs shape [batch, ...] in '
        'the input_fn, or, for an input with no batch, train without '
        'micro_batches, the float16 loss scale or the synchronous cluster.')


@dataclasses.dataclass
class _Split:
  """The global batch split into the towers' shards.

  Attributes:
    features: Each tower's features.
    labels: Each tower's labels.
    sizes: Each tower's number of real examples (an int32 vector).
    padded: Whether an idle tower got a copy of an example (TRAIN, PREDICT)
      or an empty shard (EVAL).
    global_rows: The batch's static number of rows, or None.
  """
  features: List[Any]
  labels: List[Any]
  sizes: tf.Tensor
  padded: bool
  global_rows: Optional[int] = None

  def shard(self, tower: int) -> tuple:
    """The tower's features and labels."""
    return self.features[tower], self.labels[tower]

  @functools.cached_property
  def rows(self) -> spec_merge.RowOrder:
    """Puts the towers' outputs in input order (one for the whole merge)."""
    return spec_merge.RowOrder(self.sizes, self.padded)


@dataclasses.dataclass
class _Step:
  """What one model_fn call builds around its towers, once the batch is
  split: the loss weights, the one update, the shared tables and (TRAIN)
  the batch-norm statistics and (batch_norm='global') moments; the
  exchanges of `whole_batch`; each tower's view of the collections."""
  split: _Split
  weights: tower_weights.TowerWeights
  update: one_update.OneUpdate
  tables: table_sharing.TableSharing
  statistics: Optional[moving_statistics.MovingStatistics]
  moments: Optional[global_batch_norm.GlobalMoments]
  rows: whole_batch.TowerRows
  collections: own_collections.OwnCollections


class _TowerBuilder:
  """Builds the towers of one model_fn call and merges their specs.

  `build` runs the phases in order: split the batch, build each tower,
  refuse a loss that mixes the shard's examples (batch_mixing), check the
  towers' effects, finish the one update, merge the specs.

  Args:
    model_fn: The one-device model_fn.
    devices: The tower devices.
    strategy: The aggregation strategy (strategies.Strategy): where
      variables live, and the towers' gradient path to the one update.
    task_group: The tasks training together (task_sync.TaskGroup or
      one_machine.OneMachine).
    loss_reduction: 'auto', 'mean' or 'sum' (see loss_reduction).
    mode: The Estimator's mode.
    automatic_loss_scale: Whether the float16 rewrite asks for a loss scale.
    draws: How the towers draw random numbers (random_draws.make).
    micro: With micro-batches (TRAIN), their micro_batches.MicroBatches:
      then each device's micro-batches are towers of their own, run one
      after another.
    batch_norm: 'global' or 'per_tower' (see replicate_model_fn).
    check_first_batch: See replicate_model_fn.
  """

  def __init__(self, model_fn, devices: Sequence[str],
               strategy: aggregation_lib.Strategy, task_group,
               loss_reduction: str, mode, automatic_loss_scale: bool,
               draws,
               micro: Optional[micro_batches_lib.MicroBatches] = None,
               batch_norm: str = global_batch_norm.DEFAULT,
               check_first_batch: bool = True):
    self._model_fn = model_fn
    self._check_first_batch = check_first_batch
    self._draws = draws
    self._micro = micro
    self._devices = micro.tower_devices if micro else devices
    self._strategy = strategy
    self._task_group = task_group
    self._reduction = loss_reduction
    self._mode = mode
    self._automatic_loss_scale = automatic_loss_scale
    self._batch_norm = batch_norm
    self._towers = op_ledger.TowerLedger()
    self._sharing = variable_sharing.VariableSharing()
    self._tpu_parts = []  # Of towers that return a TPUEstimatorSpec.
    # One shared set of variables, or (all_reduce in TRAIN) a copy per
    # tower device, which the sharing hands to each tower.
    self._path = strategy.gradient_path(mode == ModeKeys.TRAIN,
                                        self._sharing.unshared, task_group,
                                        self._towers)
    self._sharing.copies = self._path

  def build(self, features, labels, kwargs) -> tf.estimator.EstimatorSpec:
    """The merged spec of the towers of one model_fn call."""
    spec = self._build(features, labels, kwargs)
    # Last: the one update has built the backward exchanges, and the checks
    # above read each tower's dependencies without the joins' edges
    # between towers.
    exchange_lib.join_members(tf1.get_default_graph())
    return spec

  def _build(self, features, labels, kwargs) -> tf.estimator.EstimatorSpec:
    """`build` before the exchanges' members are joined."""
    split, has_rows = self._split_batch(features, labels)
    step = self._step(split, has_rows)
    specs, update_ops = self._build_towers(step, kwargs)
    if self._task_group.across_tasks:
      self._agree_on_the_step(step)
    self._check_tables(step.tables)
    for i in range(len(self._devices)):
      sequence_masks.widen(split.shard(i), self._towers.region(i))
    if self._mode in (ModeKeys.TRAIN, ModeKeys.EVAL) and (
        specs[0].loss is not None):
      # Every tower builds the same model: tower 0's loss tells.
      batch_mixing.check_loss(specs[0].loss, split.shard(0),
                              self._towers.start(0),
                              self._batch_norm == 'per_tower',
                              training=self._mode == ModeKeys.TRAIN,
                              global_rows=split.global_rows)
      # UPDATE_OPS are made exact (moving_statistics) in TRAIN only.
      tower_effects.check_loss_reads_no_write(
          specs[0].loss, self._towers.start(0),
          reduction_lib.ExampleDependence(split.shard(0),
                                          self._towers.start(0)),
          ({_op_of(u).name for u in update_ops[0]} |
           step.statistics.exact_writes)
          if self._mode == ModeKeys.TRAIN else ())
    if self._mode == ModeKeys.TRAIN:
      moving_statistics.check_single_writers(update_ops)
      if self._micro:
        self._micro.refuse_batch_norm(step.statistics.trains, self._towers)
      one_update_ops = step.update.update_op_names()
      effects = self._check_effects(step, specs, update_ops, one_update_ops)
      spec = self._merge_train(step, specs, effects, one_update_ops)
      spec = self._finish_update(step, spec, one_update_ops)
      if self._micro:
        # Last: the backward passes and every other control input exist.
        self._micro.order_in_time(
            self._towers, one_update_ops,
            [step.split.shard(i) for i in range(len(self._devices))],
            step.update.result_ops(), step.weights.checks)
      return self._loss_checked_on_first_step(spec, specs, step, features,
                                              labels, kwargs)
    if self._mode == ModeKeys.EVAL:
      return self._loss_checked_on_first_batch(
          self._merge_eval(step, specs), specs[0], step, features, labels,
          kwargs)
    first_rows = predicted_rows.check(
        predicted_rows.outputs(specs[0]), split.shard(0),
        self._towers.start(0), self._batch_norm == 'per_tower',
        global_rows=split.global_rows)
    depends = [reduction_lib.ExampleDependence(
        split.shard(i), self._towers.start(i)) for i in range(len(specs))]
    spec = spec_merge.merge_predict(specs, split.rows, depends)
    if first_rows:
      spec = predicted_rows.guard(spec, first_rows,
                                  tf.reduce_sum(split.sizes))
    spec = self._finish_tpu_spec(spec, split)
    unproven = self._unproven(specs[0], split)
    if not unproven or not self._check_first_batch:
      return spec
    if _is_serving_graph(features):
      prediction_audit.refuse_in_serving(unproven)
    return self._checked_on_first_batch(spec, unproven, step, features,
                                        labels, kwargs)

  # --------------------------------------------------------------------------
  # Phases.

  def _split_batch(self, features, labels):
    """Phase 1: the towers' shards, and whether the batch has any example."""
    num_towers = len(self._devices)
    # Not compiled by XLA's auto-clustering: its shards have sizes known only
    # at run time, which XLA cannot prove equal where the ops after the split
    # need them to be (bfloat16 + --xla failed to compile on AVX2 CPUs).
    with tf.name_scope('split_batch'), tf.xla.experimental.jit_scope(
        compile_ops=False):
      batch = sharding.global_batch_size(
          sharding.named_leaves(features, labels))
      sizes = sharding.shard_sizes(batch, num_towers)
      has_rows = batch > 0
      # Idle towers get a copy of an example, weighted by zero in the loss,
      # adding nothing to the metrics, sliced off the predictions: an empty
      # batch can make a mean NaN, and TF 2.15's oneDNN CPU convolution
      # returns a wrongly shaped result for it (an evaluation batch smaller
      # than the tower count crashed).
      pad = True
      feature_shards = [self._draws.shard(s) for s in sharding.split_batch(
          features, sizes, num_towers, pad)]
      label_shards = [self._draws.shard(s) for s in sharding.split_batch(
          labels, sizes, num_towers, pad)]
      if self._mode == ModeKeys.EVAL:
        feature_shards = [sharding.unknown_rows(s) for s in feature_shards]
        label_shards = [sharding.unknown_rows(s) for s in label_shards]
    return _Split(feature_shards, label_shards, sizes, pad,
                  sharding.static_rows((features, labels))), has_rows

  def _step(self, split: _Split, has_rows: tf.Tensor) -> _Step:
    """The collaborators that need the split batch."""
    num_towers = len(self._devices)
    weights = tower_weights.TowerWeights(
        self._reduction, split.sizes,
        [split.shard(i) for i in range(num_towers)], self._towers,
        self._task_group, in_advance=self._micro is not None)
    update = one_update.OneUpdate(
        num_towers, weights, self._sharing.unshared, self._path,
        has_rows, training=self._mode == ModeKeys.TRAIN,
        automatic_loss_scale=self._automatic_loss_scale)
    self._draws.split(split.sizes, split.padded)
    statistics = moments = None
    if self._mode == ModeKeys.TRAIN:
      if self._batch_norm == 'global':
        moments = global_batch_norm.GlobalMoments(
            self._devices, split.sizes, self._task_group, self._strategy)
      statistics = moving_statistics.MovingStatistics(
          num_towers, split.sizes, self._task_group, moments)
    collections = own_collections.OwnCollections(self._path.primary_of)
    self._sharing.on_reached(collections.reached)
    return _Step(split, weights, update,
                 table_sharing.TableSharing(split.sizes), statistics, moments,
                 whole_batch.TowerRows(self._devices, split.sizes,
                                       self._strategy, self._rows_refusal()),
                 collections)

  def _rows_refusal(self) -> Optional[str]:
    """Why `whole_batch` cannot exchange rows between these towers."""
    if self._micro:
      return ('with micro_batches > 1 the towers run one after another, so '
              'a collective between them would never complete. Use '
              'micro_batches=1.')
    if self._task_group.across_tasks:
      return ('in a synchronous cluster the tasks would have to exchange '
              'their rows too, which is not supported. Train on one machine.')
    return None

  def _build_towers(self, step: _Step, kwargs):
    """Phase 2: each tower's spec and UPDATE_OPS, tower after tower."""
    specs, update_ops = [], []
    with step.update.routing(), (
        optimizer_iterations.same_iterations_accepted()), (
            self._draws.seeds()), folded_shapes.recording():
      for i in range(len(self._devices)):
        with self._towers.tower(i) as region, self._draws.tower(
            i, step.split.shard(i), region.start):
          spec, added = self._build_tower(step, i, kwargs)
        specs.append(spec)
        update_ops.append(added[tf1.GraphKeys.UPDATE_OPS])
    return specs, update_ops

  def _agree_on_the_step(self, step: _Step) -> None:
    """What the built step needs every task of the cluster to have alike,
    beyond the wrapper's settings: known only once the towers are built."""
    if step.moments is not None and step.moments.exchanges:
      # Each tower exchanges its moments with the towers of its index on
      # the other tasks: every task needs as many. Without a batch norm
      # the tasks' tower counts may differ.
      self._task_group.agree_on(
          task_agreement_lib.TOWERS_FOR_GLOBAL_BATCH_NORM,
          len(self._devices))
    # A mean on one task and a sum on another weigh their towers apart.
    self._task_group.agree_on("the losses' reductions over the examples",
                              step.weights.reductions_resolved())

  def _check_tables(self, tables: table_sharing.TableSharing) -> None:
    """Orders the towers' accesses of shared tables; refuses table writes
    in a synchronous cluster."""
    tables.order_accesses(self._towers)
    written = tables.written(self._towers.first)
    if self._task_group.across_tasks and written:
      # A table is not a variable: it is neither summed nor broadcast.
      raise ValueError(
          f'The model_fn writes the mutable lookup table(s) {written} while '
          'training. In a synchronous cluster each task would insert only '
          'its own part of the batch, and the tables would drift apart. '
          'Train with ps tasks (asynchronous), or on one machine.')

  def _check_effects(self, step: _Step, specs, update_ops,
                     one_update_ops) -> List[tf.Operation]:
    """Phase 3 (TRAIN): checks the one update and each tower's effects.

    Returns:
      What earlier towers' train_ops must still run (see tower_effects).
    """
    split, graph = step.split, tf1.get_default_graph()
    last = len(specs) - 1
    step.update.check_batch_free_update(reduction_lib.ExampleDependence(
        split.shard(last), self._towers.start(last), one_update_ops))
    effects, adds, free, rows = [], [], [], []
    for i, spec in enumerate(specs):
      # The last tower's effects run in its own train_op; its shard
      # writes are still checked and idle-masked.
      depends = reduction_lib.ExampleDependence(
          split.shard(i), self._towers.start(i), one_update_ops)
      rows.append(depends.batch_size)
      found = tower_effects.shard_effects(
          spec.train_op, self._towers.start(i), depends,
          step.update.call_dependencies[i], split.sizes[i] > 0,
          {_op_of(u).name for u in update_ops[i]} |
          step.statistics.exact_writes | one_update_ops,
          across_tasks=self._task_group.across_tasks,
          drawn=self._drawn(graph, self._towers.region(i), one_update_ops),
          global_rows=split.global_rows)
      if i < last:
        effects.extend(found.ops)
      adds.append(tower_effects.adds_in(found.ops))
      tower_effects.check_adds_read_no_added(adds[-1])
      free.append(found.free_writes)
    free_writes.check_agree(
        free, [self._towers.start(i) for i in range(len(specs))], rows,
        step.update.routed_gradients())
    tower_effects.in_tower_order(adds)
    return effects

  def _merge_train(self, step: _Step, specs, effects,
                   one_update_ops) -> tf.estimator.EstimatorSpec:
    """Phase 4 (TRAIN): one spec with the global loss and one train_op."""
    split = step.split
    spec_merge.check_train(specs)
    spec = spec_merge.merge_train(
        specs, step.weights.merged_loss([s.loss for s in specs]), effects)
    spec = spec._replace(predictions=spec_merge.whole_batch_predictions(
        specs, split.rows, [reduction_lib.ExampleDependence(
            split.shard(i), self._towers.start(i), one_update_ops)
                                   for i in range(len(specs))]))
    # Batch-norm layers get the whole batch's moments in TRAIN.
    spec = self._predictions_as_read(spec, specs[0], split, statistics=False)
    return self._finish_tpu_spec(spec, split)

  def _finish_update(self, step: _Step, spec,
                     one_update_ops) -> tf.estimator.EstimatorSpec:
    """Phase 5 (TRAIN): the one update's copies, sums and write order."""
    spec = self._path.finish(spec, self._towers.first)
    # Earlier towers' stand-ins for the one update and the moving
    # statistics' updates run them (for what the model_fn chained after
    # them, and hooks): after the effects checks.
    step.update.stand_ins.connect()
    step.statistics.stand_ins.connect()
    # The loss logged (and checked for NaN) is the global batch's.
    if self._task_group.across_tasks:
      # The tasks' stop requests ride in the loss's collective.
      loss = stop_request.sum_loss_with_flags(self._task_group, spec.loss)
    else:
      loss = spec.loss
    spec = spec._replace(loss=loss)
    # Towers change the schedule: reads the model_fn left unordered with
    # the step's writes must still see the values from before the step.
    write_order.order_writes([spec.train_op, spec.loss],
                             step.update.result_ops(), one_update_ops)
    return spec

  def _merge_eval(self, step: _Step, specs) -> tf.estimator.EstimatorSpec:
    """EVAL: one spec whose metrics add what one device's step adds."""
    split, num_towers = step.split, len(specs)
    depends = [reduction_lib.ExampleDependence(
        split.shard(i), self._towers.start(i)) for i in range(num_towers)]
    spec_merge.check_eval(specs)
    spec = spec_merge.merge_eval(
        specs, step.weights.merged_loss([s.loss for s in specs]))
    # Every tower adds into one metric state: an add per batch (a count
    # of calls, a batch's mean) must add what one device's step adds.
    metric_ops = [s.eval_metric_ops or {} for s in specs]
    in_tower = [self._towers.region(i).contains for i in range(num_towers)]
    metric_adds.check_overwrites(metric_ops, in_tower, depends)
    active = [split.sizes[i] > 0 for i in range(num_towers)]
    metric_adds.count_once(
        metric_ops, in_tower, depends, active,
        lambda tensor: batch_mixing.mixing_op(
            tensor, split.shard(0), self._towers.start(0),
            self._batch_norm == 'per_tower'))
    metric_adds.idle_adds_nothing(metric_ops, in_tower, active)
    metric_adds.in_tower_order(metric_ops, in_tower)
    spec = spec._replace(predictions=spec_merge.whole_batch_predictions(
        specs, split.rows, depends))
    spec = self._predictions_as_read(spec, specs[0], split, statistics=True)
    return self._finish_tpu_spec(spec, split)

  def _predictions_as_read(self, spec, first, split: _Split,
                           statistics: bool) -> tf.estimator.EstimatorSpec:
    """EVAL's and TRAIN's merged predictions, failing when read where their
    rows are not one device's (predicted_rows: not refused, as nothing
    but a wrapper or a hook reads them)."""
    first_rows, wrong = predicted_rows.findings(
        predicted_rows.outputs(first._replace(export_outputs=None)),
        split.shard(0), self._towers.start(0),
        self._batch_norm == 'per_tower', split.global_rows, statistics)
    if first_rows:
      spec = predicted_rows.guard(spec, first_rows,
                                  tf.reduce_sum(split.sizes))
    return predicted_rows.fail_when_read(spec, wrong) if wrong else spec

  def _unproven(self, first, split: _Split):
    """{name: op} of tower 0's predictions the walk cannot follow to the
    end (see prediction_audit), but those drawn at random: one device's
    copy would draw other numbers."""
    named = predicted_rows.outputs(first)
    found = predicted_rows.unproven(named, split.shard(0),
                                    self._towers.start(0))
    if not found:
      return found
    drawn = self._drawn_in_tower_0()
    return {name: op for name, op in found.items() if not drawn(named[name])}

  def _drawn_in_tower_0(self) -> reduction_lib.ExampleDependence:
    """Whether a tensor depends on tower 0's random draws (in its while
    loops and functions too)."""
    return reduction_lib.ExampleDependence(
        tower_effects.every_draw(tf1.get_default_graph(),
                                 self._towers.region(0)),
        self._towers.start(0))

  def _loss_checked_on_first_batch(self, spec, first, step: _Step, features,
                                   labels, kwargs):
    """EVAL's `spec` with a hook comparing its loss with the model_fn's on
    the whole batch, on the first batch, when the loss is computed past a
    step the walk cannot follow (prediction_audit)."""
    if not self._check_first_batch or first.loss is None:
      return spec
    unproven = self._untraced_losses({'loss': first.loss}, step)
    if not unproven:
      return spec
    one_device, _ = self._build_one_device(step, features, labels, kwargs)
    check = prediction_audit.FirstBatchCheck(
        {'loss': spec.loss}, {'loss': one_device.loss}, unproven, loss=True)
    return spec._replace(evaluation_hooks=(*spec.evaluation_hooks, check))

  def _checked_on_first_batch(self, spec, unproven, step: _Step, features,
                              labels, kwargs) -> tf.estimator.EstimatorSpec:
    """`spec` with a hook comparing its `unproven` predictions with the
    model_fn's on the whole batch, on the first batch (prediction_audit)."""
    merged = predicted_rows.predictions(spec)
    names = sorted(name for name in unproven if name in merged)
    if not names:  # Only export outputs: predict never fetches them.
      return spec
    one_device = predicted_rows.predictions(
        self._build_one_device(step, features, labels, kwargs)[0])
    missing = [name for name in names if name not in one_device]
    if missing:
      raise ValueError(
          f'The model_fn called on the whole batch returns no prediction '
          f'{missing[0]!r}, which every tower returned: its predictions must '
          'not depend on the tower (tower_context()).')
    check = prediction_audit.FirstBatchCheck(
        {name: merged[name] for name in names},
        {name: one_device[name] for name in names}, unproven)
    return spec._replace(
        prediction_hooks=(*spec.prediction_hooks, check))

  def _build_one_device(self, step: _Step, features, labels, kwargs):
    """The model_fn called on the whole batch, as one device calls it: on
    tower 0's device, with tower 0's variables and tables (reused as tower
    1 reuses them), outside the towers' exchanges, with its optimizer calls
    discarded; recorded as one more tower, whose collection entries are
    dropped afterwards.

    Returns:
      (its EstimatorSpec, the losses of its optimizer calls in order).
    """
    graph = tf1.get_default_graph()
    device = self._devices[0]
    index = self._towers.count
    one_kwargs = dict(kwargs)
    if 'labels' in one_kwargs:
      one_kwargs['labels'] = labels
    with contextlib.ExitStack() as stack:
      stack.enter_context(tower_lib._entered(  # pylint: disable=protected-access
          tower_lib.TowerContext(0, 1, device)))
      stack.enter_context(graph.name_scope(_ONE_DEVICE_SCOPE))
      stack.enter_context(scoped_collections.tower(_ONE_DEVICE_SCOPE))
      stack.enter_context(shared_placeholders.tower(
          _ONE_DEVICE_SCOPE, self._towers.region(0)))
      stack.enter_context(self._towers.tower(index))
      stack.enter_context(regularization_losses.tower(
          index, self._towers, scope=_ONE_DEVICE_SCOPE))
      stack.enter_context(graph.device(_placer(
          0, device, self._strategy, lambda: False)))
      # Before the sharing's views, which keep what they find hidden.
      stack.enter_context(variable_views.hidden(self._update_variables(step)))
      stack.enter_context(self._sharing.tower(1))
      stack.enter_context(step.tables.tower(1))
      losses = stack.enter_context(first_step_check.discarding_updates())
      stack.enter_context(own_collections.per_tower(graph, index, keep=False))
      stack.enter_context(step.collections.tower(index, keep=False))
      stack.enter_context(own_collections.additions_dropped(
          graph, tf1.GraphKeys.REGULARIZATION_LOSSES))
      spec = self._model_fn(features=features, **one_kwargs)
    if tpu_spec.is_tpu_spec(spec):
      spec, _ = tpu_spec.split(spec)
    return spec, losses

  def _update_variables(self, step: _Step) -> List[tf.Variable]:
    """The variables the one update made (optimizer slots, Adam's powers):
    none in EVAL and PREDICT."""
    if self._mode != ModeKeys.TRAIN:
      return []
    made = step.update.update_op_names()
    return [v for v in tf1.global_variables() + tf1.local_variables()
            if v.op.name in made]

  def _loss_checked_on_first_step(self, spec, specs, step: _Step, features,
                                  labels, kwargs):
    """TRAIN's `spec` with a hook comparing its losses with the model_fn's
    on the whole batch before the first step, for losses computed past a
    step the walk cannot follow (first_step_check).

    Not on one tower, nor in a cluster (see _trains_with_other_tasks); with
    micro-batches (the whole batch may not fit one device) or per-tower
    batch norm (the towers differ from one device by choice) the log says
    the loss goes unchecked.
    """
    if not self._check_first_batch or len(specs) < 2:
      return spec
    # name: (each tower's loss, the copy's optimizer call or None).
    candidates, calls = {}, step.update.tower_losses()
    for k, losses in enumerate(calls):
      name = ('loss' if losses[0] is specs[0].loss
              else f'loss of optimizer call {k + 1}')
      candidates[name] = (losses, k)
    if specs[0].loss is not None and 'loss' not in candidates:
      candidates['loss'] = ([s.loss for s in specs], None)
    unproven = self._untraced_losses(
        {name: losses[0] for name, (losses, _) in candidates.items()}, step)
    if not unproven:
      return spec
    if self._micro:
      first_step_check.skipped('with micro_batches > 1 the whole batch may '
                               'not fit one device', unproven)
      return spec
    if self._batch_norm == 'per_tower':
      first_step_check.skipped("with batch_norm='per_tower' the towers "
                               'differ from one device by choice', unproven)
      return spec
    one_device, one_calls = self._build_one_device(step, features, labels,
                                                   kwargs)
    if len(one_calls) != len(calls):
      raise ValueError(
          f'The model_fn called on the whole batch made {len(one_calls)} '
          f'optimizer call(s), and each tower {len(calls)}: its training '
          'must not depend on the tower (tower_context()).')
    merged, one = {}, {}
    for name in unproven:
      losses, k = candidates[name]
      merged[name] = step.weights.merged_loss(losses)
      one[name] = one_device.loss if k is None else one_calls[k]
    inputs = [t for t in tf.nest.flatten((features, labels),
                                         expand_composites=True)
              if isinstance(t, tf.Tensor)]
    why = first_step_check.refusal(
        [*merged.values(), *one.values(), *inputs],
        [spec.train_op, spec.loss,
         *tf1.get_collection(tf1.GraphKeys.SUMMARIES)], inputs)
    if why:
      first_step_check.skipped(why, unproven)
      return spec
    check = first_step_check.FirstStepCheck(inputs, merged, one, unproven)
    return spec._replace(training_hooks=(*spec.training_hooks, check))

  def _untraced_losses(self, losses, step: _Step):
    """{name: the op the walk could not follow} of tower 0's `losses`
    computed past one, but those drawn at random."""
    drawn, found = self._drawn_in_tower_0(), {}
    for name, loss in losses.items():
      untraced = []
      batch_mixing.mixing_op(loss, step.split.shard(0),
                             self._towers.start(0), untraced=untraced)
      if untraced and not drawn(loss):
        found[name] = untraced[0]
    return found

  # --------------------------------------------------------------------------
  # One tower.

  def _finish_tpu_spec(self, spec, split: _Split):
    """`spec` with the towers' TPUEstimatorSpec parts, if they gave any."""
    if not self._tpu_parts:
      return spec
    if len(self._tpu_parts) != len(self._devices):
      raise ValueError(
          f'Only {len(self._tpu_parts)} of {len(self._devices)} towers '
          f'returned a TPUEstimatorSpec; every tower must build the same '
          'model.')
    return tpu_spec.finish(
        spec, self._tpu_parts,
        lambda name, tensors: split.rows.concat(
            name, tensors, kind='TPUEstimatorSpec'),
        [sharding.static_rows(shard) for shard in split.features])

  def _drawn(self, graph, tower: op_ledger.Region, one_update_ops):
    """In a synchronous cluster, whether a tensor of the tower made in
    `tower` depends on its random ops (each task draws its own); None on
    one machine."""
    if not self._task_group.across_tasks:
      return None
    return reduction_lib.ExampleDependence(
        tower_effects.random_draws(graph, tower), tower.start,
        one_update_ops)

  def _build_tower(self, step: _Step, index: int, kwargs):
    device = self._devices[index]
    features, labels = step.split.shard(index)
    context = (self._micro.context(index) if self._micro else
               tower_lib.TowerContext(index, len(self._devices), device))
    name_scope = f'tower_{index}' if index else ''
    graph = tf1.get_default_graph()
    tower_kwargs = dict(kwargs)
    if 'labels' in tower_kwargs:
      tower_kwargs['labels'] = labels
    update = step.update
    with contextlib.ExitStack() as stack:
      stack.enter_context(tower_lib._entered(context))  # pylint: disable=protected-access
      if name_scope:
        stack.enter_context(graph.name_scope(name_scope))
      stack.enter_context(scoped_collections.tower(name_scope))
      stack.enter_context(shared_placeholders.tower(
          name_scope, self._towers.region(0)))
      stack.enter_context(regularization_losses.tower(index, self._towers))
      stack.enter_context(graph.device(_placer(
          index, device, self._strategy, lambda: update.applying)))
      stack.enter_context(self._sharing.tower(index))
      stack.enter_context(step.tables.tower(index))
      stack.enter_context(update.tower(index, name_scope))
      if step.moments is not None:
        stack.enter_context(step.moments.tower(index))
      if step.statistics is not None:
        stack.enter_context(step.statistics.tower(index))
      stack.enter_context(step.rows.tower(index))
      added = stack.enter_context(own_collections.per_tower(graph, index))
      stack.enter_context(step.collections.tower(index))
      # As the Estimator calls it: features by keyword, so that any order
      # of the arguments works.
      spec = self._model_fn(features=features, **tower_kwargs)
    if tpu_spec.is_tpu_spec(spec):
      spec, parts = tpu_spec.split(spec)
      self._tpu_parts.append(parts)
    elif not isinstance(spec, tf.estimator.EstimatorSpec):
      # ValueError, as tf.estimator.Estimator raises for it.
      raise ValueError(f'{_name(self._model_fn)} returned {type(spec).__name__}'
                      '; a model_fn must return a tf.estimator.EstimatorSpec '
                      'or a TPUEstimatorSpec.')
    if self._mode == ModeKeys.TRAIN:
      update.check_tower(index, spec)
    return spec, added


def _trains_with_other_tasks(config) -> bool:
  """Whether other tasks train the model too: then the first-step check
  (first_step_check) is not built, as a task of a synchronous cluster has
  its share of the batch only and, with ps tasks, other workers update the
  variables between the check's reads."""
  return (getattr(config, 'num_worker_replicas', 1) or 1) > 1


def _task_group(mode, config, tower_device: str, timeout_secs: float,
                strategy: aggregation_lib.Strategy,
                agreement: Optional[Mapping[str, Any]]):
  """The tasks training together: a synchronous cluster's, else this one.

  Only TRAIN spans the tasks of a cluster; EVAL and PREDICT, and clusters
  with ps tasks, run as on one machine.
  """
  if mode == ModeKeys.TRAIN and task_sync.is_sync_cluster(config):
    return task_sync.TaskGroup(config, tower_device, timeout_secs, strategy,
                               agreement)
  return one_machine.OneMachine()


def _placer(tower: int, tower_device: str,
            strategy: aggregation_lib.Strategy,
            applying: Callable[[], bool]):
  """A device function: variables where the aggregation strategy puts them,
  the rest on the tower's device, except the one update, which goes where
  apply_gradients puts it (by the variables), and ops the strategy places
  itself (all-reduce)."""

  def place(op):
    if strategy.is_deferring:
      return op.device
    if op.type in _VARIABLE_OPS:
      return strategy.variable_device(op, tower, applying())
    if isinstance(op.graph, tf.__internal__.FuncGraph):
      # A branch of tf.cond (or a loop body) is inlined onto the device of
      # its caller: a read of a variable left unplaced in it lands on the
      # tower's device, which, a branch deeper, cannot be colocated with the
      # variable unless the session allows soft placement.
      device = _read_device(op)
      if device:
        return device
    return '' if applying() else tower_device

  return place


def _read_device(op: tf.Operation) -> str:
  """The device of the variable whose handle `op` takes, if known.

  Inside a function graph the handle is a placeholder standing for the
  outer graph's tensor it captured (one per level of nesting).
  """
  for tensor in op.inputs:
    if tensor.dtype != tf.resource:
      continue
    while (isinstance(tensor.graph, tf.__internal__.FuncGraph) and
           tensor.op.type == 'Placeholder'):
      outer = {id(inner): captured
               for captured, inner in tensor.graph.captures}
      if id(tensor) not in outer:
        break
      tensor = outer[id(tensor)]
    if tensor.op.type in _VARIABLE_OPS:
      return tensor.op.device
  return ''


def _canonical_devices(devices) -> List[str]:
  if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
    raise TypeError(f'devices must be a list of device strings such as '
                    f"['/gpu:0', '/gpu:1'], got {devices!r}.")
  if not devices:
    raise ValueError('devices is empty; pass None to use every device of the '
                     'RunConfig, or name at least one device.')
  canonical = []
  for device in devices:
    if not isinstance(device, str):
      raise TypeError(f'devices must hold strings, got {device!r}.')
    try:
      spec = tf.DeviceSpec.from_string(device)
    except ValueError as e:
      raise ValueError(f'{device!r} in devices is not a device name like '
                       "'/gpu:0' or '/cpu:1'.") from e
    if spec.device_type not in ('CPU', 'GPU') or spec.device_index is None:
      raise ValueError(f'{device!r} in devices must name a CPU or GPU with its '
                       "index, like '/gpu:0' or '/cpu:1'.")
    canonical.append(spec.to_string())
  repeated = sorted({d for d in canonical if canonical.count(d) > 1})
  if repeated:
    raise ValueError(f'devices repeats {repeated}; name each device once.')
  return canonical


def _canonical_variables_device(device) -> str:
  if not isinstance(device, str):
    raise TypeError(f"variables_device must be a device string such as "
                    f"'/cpu:0' or '/gpu:0', got {device!r}.")
  try:
    spec = tf.DeviceSpec.from_string(device)
  except ValueError as e:
    raise ValueError(f'variables_device={device!r} is not a device name like '
                     "'/cpu:0' or '/gpu:0'.") from e
  if spec.device_type is not None and spec.device_type not in ('CPU', 'GPU'):
    raise ValueError(f'variables_device={device!r} must name a CPU or a GPU.')
  return spec.to_string()


def _check_variables_device(device: str, config) -> None:
  """Fails when the session lacks the local device `device` names."""
  spec = tf.DeviceSpec.from_string(device)
  if spec.job is not None or spec.device_type is None:
    return  # A cluster task or a whole machine: the cluster decides.
  num_gpus, num_cpus = session_device_counts(
      getattr(config, 'session_config', None))
  available = {'GPU': num_gpus, 'CPU': num_cpus}[spec.device_type]
  if (spec.device_index or 0) >= available:
    raise ValueError(
        f'variables_device={device!r}, but the session has {available} '
        f'{spec.device_type} device(s). Name one it has (the default is '
        "'/cpu:0').")


def _tower_devices(devices, config) -> List[str]:
  """The towers: explicit `devices` checked against the session, or all."""
  session_config = getattr(config, 'session_config', None)
  num_gpus, num_cpus = session_device_counts(session_config)
  if devices is None:
    if num_gpus:
      return [f'/device:GPU:{i}' for i in range(num_gpus)]
    return [f'/device:CPU:{i}' for i in range(num_cpus)]
  available = {'GPU': num_gpus, 'CPU': num_cpus}
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    if spec.device_index >= available[spec.device_type]:
      raise ValueError(
          f'devices names {device}, but the session has '
          f'{available[spec.device_type]} {spec.device_type} device(s). Ask '
          'make_run_config for more (num_gpus=, cpu_devices=) or name fewer.')
  return list(devices)


def _is_serving_graph(features) -> bool:
  """True when the features are fed by placeholders, not an input pipeline."""
  leaves = [t for t in sharding.leaves(features, expand_composites=True)
            if isinstance(t, tf.Tensor)]
  pending, seen, placeholders = [t.op for t in leaves], set(), 0
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.type in _INPUT_PIPELINE_OPS:
      return False
    if op.type in ('Placeholder', 'PlaceholderWithDefault'):
      placeholders += 1
    pending.extend(t.op for t in op.inputs)
  return placeholders > 0


def _presented_signature(model_fn: ModelFn) -> inspect.Signature:
  """The signature Estimator reads: the model_fn's own arguments, so that
  its checks (params given to a model_fn without `params`, an argument it
  does not know, labels it does not take) run as for the unwrapped
  model_fn, at construction; plus `mode` and `config`, which the towers
  need."""
  accepted = _accepted_args(model_fn)
  order = ['features', 'labels', 'mode', 'params', 'config']
  names = [n for n in order if n in accepted or n in ('mode', 'config')]
  # An extra argument with a default keeps it (the wrapper never passes
  # it), as before the signature was presented; one without is refused.
  names += sorted(accepted - set(order) - _defaulted_args(model_fn))
  return inspect.Signature([
      inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
      for n in names])


def _defaulted_args(model_fn) -> frozenset:
  """The model_fn's arguments that have a default value."""
  try:
    parameters = inspect.signature(model_fn).parameters.values()
  except (TypeError, ValueError):  # Some builtins and C callables.
    return frozenset()
  return frozenset(p.name for p in parameters
                   if p.default is not inspect.Parameter.empty)


def _accepted_args(model_fn) -> frozenset:
  """The model_fn's arguments as Estimator reads them (a functools.partial's
  bound ones left out, **kwargs not an argument)."""
  # Private, but Estimator's own reading: the wrapper must pass what
  # Estimator would pass the unwrapped model_fn, and nothing else.
  return frozenset(function_utils.fn_args(model_fn))


def _name(model_fn) -> str:
  return getattr(model_fn, '__name__', repr(model_fn))


def _op_of(update) -> tf.Operation:
  """The op of an UPDATE_OPS entry (an Operation or a Tensor)."""
  return update if isinstance(update, tf.Operation) else update.op
