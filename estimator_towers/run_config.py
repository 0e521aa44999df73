"""Builds `tf.estimator.RunConfig`s that say which devices a session gets.

A replicated model_fn can only place towers on devices its session actually
has, so this module turns plain arguments (how many GPUs, which ones, how many
virtual CPUs, memory and threading options) into the `session_config`
(a `tf.compat.v1.ConfigProto`) of a `RunConfig`, checking every value and
failing with a message that says how to fix it.

`build_session_config` is the pure part: it takes the number of GPUs on the
machine as an argument, so it can be tested anywhere. `make_run_config` looks
that number up and wraps the result in a `RunConfig` without losing the
defaults `RunConfig` derives from the `TF_CONFIG` environment variable.
`session_device_counts` reads a `ConfigProto` back into the number of GPU and
CPU devices a session built from it will have.

Two switches trade exactness for speed: `mixed_precision` turns on grappler's
automatic mixed precision rewrite ('float16' on GPUs, 'bfloat16' through
oneDNN on CPUs) and `xla` the XLA JIT for the whole graph. Neither needs a
change to the model_fn or its optimizer; float16's loss scaling is done by
`replicate_model_fn` (see loss_scaling.py).
"""

import collections.abc
import numbers
import logging
from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.client import pywrap_tf_session
from tensorflow.python.util import _pywrap_util_port

from estimator_towers.choices import MIXED_PRECISIONS
from estimator_towers.cluster import cluster_server
from estimator_towers.cluster import task_sync

# A named logger, not absl's functions: their first call in a script
# configures the root logger, after which every TensorFlow record prints
# twice (through TensorFlow's own handler and the root's).
_log = logging.getLogger(__name__)

__all__ = [
    'MIXED_PRECISIONS',
    'available_gpu_count',
    'build_session_config',
    'make_run_config',
    'session_device_counts',
]

_GPU = 'GPU'
_CPU = 'CPU'
_ON = rewriter_config_pb2.RewriterConfig.ON

# Without this, a session's global_jit_level compiles GPU clusters only. It is
# read when the process creates its first session (so it is set on import),
# and is inert in sessions whose config does not ask for XLA.
pywrap_tf_session.TF_SetTfXlaCpuGlobalJit(True)


def available_gpu_count() -> int:
  """Returns how many GPUs TensorFlow can see in this process.

  This is after `CUDA_VISIBLE_DEVICES` is applied, so GPU ids passed to this
  module index into this list, not into the machine's hardware list.
  """
  return len(tf.config.list_physical_devices(_GPU))


def make_run_config(model_dir: Optional[str] = None,
                    *,
                    num_gpus: Optional[int] = None,
                    gpu_ids: Optional[Sequence[int]] = None,
                    cpu_devices: Optional[int] = None,
                    allow_soft_placement: bool = True,
                    allow_growth: bool = True,
                    gpu_memory_fraction: Optional[float] = None,
                    log_device_placement: bool = False,
                    inter_op_threads: int = 0,
                    intra_op_threads: int = 0,
                    fallback_to_available_gpus: bool = False,
                    mixed_precision: Optional[str] = None,
                    xla: bool = False,
                    **run_config_kwargs: Any) -> tf.estimator.RunConfig:
  """Returns a `RunConfig` whose session has the requested devices.

  Args:
    model_dir: Checkpoint and summary directory, as for `RunConfig`.
    num_gpus: How many GPUs the session gets. None means all of `gpu_ids`
      when given, else every GPU TensorFlow sees.
    gpu_ids: Which GPUs (indices into the GPUs TensorFlow sees) the session
      gets; they become /gpu:0, /gpu:1, ... in that order.
    cpu_devices: If set, the session gets this many virtual CPU devices
      (/cpu:0 .. /cpu:N-1), so towers can run on a machine without GPUs.
    allow_soft_placement: Let ops without a kernel for their assigned device
      fall back to one that has it.
    allow_growth: Allocate GPU memory as needed instead of all up front.
    gpu_memory_fraction: Share of each GPU's memory to use, in (0, 1].
    log_device_placement: Log the device every op is placed on.
    inter_op_threads: Threads for running independent ops; 0 lets TF pick.
    intra_op_threads: Threads used inside one op; 0 lets TF pick.
    fallback_to_available_gpus: Instead of failing when more GPUs are asked
      for than exist, log a warning and use the ones that exist.
    mixed_precision: None (float32), 'float16' (GPU towers: grappler's
      auto_mixed_precision rewrite, with a dynamic loss scale applied by
      replicate_model_fn) or 'bfloat16' (CPU towers: the oneDNN bfloat16
      rewrite; no loss scale needed). The model_fn and its optimizer stay
      as they are; results then match one device only within the
      precision's rounding.
    xla: Compile the graph with the XLA JIT (global_jit_level ON_1). CPU
      devices are compiled too when this module was imported before the
      process's first session (TensorFlow reads its CPU auto-clustering
      switch then).
    **run_config_kwargs: Passed on to `tf.estimator.RunConfig` (for example
      tf_random_seed, save_checkpoints_steps, keep_checkpoint_max).

  Returns:
    A `tf.estimator.RunConfig` carrying the built `session_config`, plus the
    device filters and graph options `RunConfig` derives from `TF_CONFIG`.
    In a cluster without ps tasks (synchronous training), workers start
    without train_and_evaluate's staggered delay. In any cluster,
    train_and_evaluate is made to start this task's server from the
    session config (`cluster_server.install`).

  Raises:
    TypeError: If an argument has the wrong type.
    ValueError: If an argument is out of range, more GPUs are requested than
      exist (without fallback), `session_config` is passed, or
      `mixed_precision` cannot work on the session's devices.
  """
  if 'session_config' in run_config_kwargs:
    raise ValueError(
        'make_run_config builds session_config itself, so it cannot be passed '
        'in; use its arguments instead (num_gpus, gpu_ids, cpu_devices, '
        'allow_soft_placement, allow_growth, gpu_memory_fraction, '
        'log_device_placement, inter_op_threads, intra_op_threads, '
        'mixed_precision, xla), or call RunConfig.replace(session_config=...) '
        'on the result.')
  session_config = build_session_config(
      num_gpus=num_gpus,
      gpu_ids=gpu_ids,
      cpu_devices=cpu_devices,
      allow_soft_placement=allow_soft_placement,
      allow_growth=allow_growth,
      gpu_memory_fraction=gpu_memory_fraction,
      log_device_placement=log_device_placement,
      inter_op_threads=inter_op_threads,
      intra_op_threads=intra_op_threads,
      fallback_to_available_gpus=fallback_to_available_gpus,
      mixed_precision=mixed_precision,
      xla=xla,
      available_gpus=available_gpu_count())
  # Built without session_config first: RunConfig only derives its
  # distributed defaults from TF_CONFIG when it is given no session_config.
  run_config = tf.estimator.RunConfig(model_dir=model_dir, **run_config_kwargs)
  _merge_distributed_defaults(session_config, run_config.session_config)
  if (task_sync.is_sync_cluster(run_config) and
      'experimental_max_worker_delay_secs' not in run_config_kwargs):
    # train_and_evaluate delays worker k by 5(k+1) s (up to 60), which helps
    # asynchronous training; a synchronous step waits for every worker.
    run_config = run_config.replace(experimental_max_worker_delay_secs=0)
  if run_config.cluster_spec:
    # train_and_evaluate starts this task's server before any model_fn is
    # built; it must keep the towers' devices and lead collectives.
    cluster_server.install()
  return run_config.replace(session_config=session_config)


def build_session_config(*,
                         available_gpus: int,
                         num_gpus: Optional[int] = None,
                         gpu_ids: Optional[Sequence[int]] = None,
                         cpu_devices: Optional[int] = None,
                         allow_soft_placement: bool = True,
                         allow_growth: bool = True,
                         gpu_memory_fraction: Optional[float] = None,
                         log_device_placement: bool = False,
                         inter_op_threads: int = 0,
                         intra_op_threads: int = 0,
                         fallback_to_available_gpus: bool = False,
                         mixed_precision: Optional[str] = None,
                         xla: bool = False
                        ) -> tf.compat.v1.ConfigProto:
  """Validates device options and returns the matching `ConfigProto`.

  Args:
    available_gpus: How many GPUs the machine has (what TensorFlow sees).
    num_gpus: See `make_run_config`.
    gpu_ids: See `make_run_config`.
    cpu_devices: See `make_run_config`.
    allow_soft_placement: See `make_run_config`.
    allow_growth: See `make_run_config`.
    gpu_memory_fraction: See `make_run_config`.
    log_device_placement: See `make_run_config`.
    inter_op_threads: See `make_run_config`.
    intra_op_threads: See `make_run_config`.
    fallback_to_available_gpus: See `make_run_config`.
    mixed_precision: See `make_run_config`.
    xla: See `make_run_config`.

  Returns:
    A `tf.compat.v1.ConfigProto` with device_count['GPU'] always set,
    device_count['CPU'] set when `cpu_devices` is,
    gpu_options.visible_device_list set when `gpu_ids` is, and the
    rewrite and JIT options of `mixed_precision` and `xla`.

  Raises:
    TypeError: If an argument has the wrong type.
    ValueError: If an argument is out of range, more GPUs are requested
      than exist and `fallback_to_available_gpus` is False, or
      `mixed_precision` cannot work on the session's devices.
  """
  available_gpus = _check_int('available_gpus', available_gpus, minimum=0)
  if num_gpus is not None:
    num_gpus = _check_int('num_gpus', num_gpus, minimum=0)
  if gpu_ids is not None:
    gpu_ids = _check_gpu_ids(gpu_ids)
  if cpu_devices is not None:
    cpu_devices = _check_int('cpu_devices', cpu_devices, minimum=1)
  if gpu_memory_fraction is not None:
    gpu_memory_fraction = _check_memory_fraction(gpu_memory_fraction)
  inter_op_threads = _check_int('inter_op_threads', inter_op_threads, 0)
  intra_op_threads = _check_int('intra_op_threads', intra_op_threads, 0)
  for name, value in (('allow_soft_placement', allow_soft_placement),
                      ('allow_growth', allow_growth),
                      ('log_device_placement', log_device_placement),
                      ('fallback_to_available_gpus',
                       fallback_to_available_gpus), ('xla', xla)):
    _check_bool(name, value)
  _check_mixed_precision(mixed_precision)

  gpu_count, gpu_ids = _resolve_gpus(num_gpus, gpu_ids, available_gpus,
                                     fallback_to_available_gpus)

  config = tf.compat.v1.ConfigProto(
      allow_soft_placement=allow_soft_placement,
      log_device_placement=log_device_placement,
      inter_op_parallelism_threads=inter_op_threads,
      intra_op_parallelism_threads=intra_op_threads,
      graph_options=_estimator_default_graph_options())
  config.device_count[_GPU] = gpu_count
  if cpu_devices is not None:
    config.device_count[_CPU] = cpu_devices
  config.gpu_options.allow_growth = allow_growth
  if gpu_ids:
    config.gpu_options.visible_device_list = ','.join(map(str, gpu_ids))
  if gpu_memory_fraction is not None:
    config.gpu_options.per_process_gpu_memory_fraction = gpu_memory_fraction
  if mixed_precision is not None:
    _set_mixed_precision(config.graph_options.rewrite_options,
                         mixed_precision, gpu_count)
  if xla:
    config.graph_options.optimizer_options.global_jit_level = (
        tf.compat.v1.OptimizerOptions.ON_1)
  return config


def session_device_counts(
    session_config: Optional[tf.compat.v1.ConfigProto],
    available_gpus: Optional[int] = None) -> Tuple[int, int]:
  """Returns how many (GPU, CPU) devices a session with this config gets.

  GPUs are device_count['GPU'] if set, else the number of entries in
  gpu_options.visible_device_list if set, else every GPU on the machine. Like
  TensorFlow itself, the result never exceeds the visible list or the GPUs
  that exist. CPUs are device_count['CPU'] if set, else 1.

  Args:
    session_config: The session's `ConfigProto`; None means TF defaults.
    available_gpus: GPUs on the machine; looked up when None and needed.

  Returns:
    A `(num_gpus, num_cpus)` tuple.
  """
  if session_config is None:
    session_config = tf.compat.v1.ConfigProto()
  device_count = session_config.device_count
  visible = [entry for entry in
             session_config.gpu_options.visible_device_list.split(',')
             if entry.strip()]
  limits = []
  if _GPU in device_count:
    limits.append(device_count[_GPU])
  if visible:
    limits.append(len(visible))
  # Skip the lookup when the config already rules GPUs out.
  if not limits or min(limits) > 0:
    if available_gpus is None:
      available_gpus = available_gpu_count()
    limits.append(available_gpus)
  num_cpus = device_count[_CPU] if _CPU in device_count else 1
  return min(limits), num_cpus


def _resolve_gpus(num_gpus: Optional[int], gpu_ids: Optional[List[int]],
                  available: int,
                  fallback: bool) -> Tuple[int, Optional[List[int]]]:
  """Returns (GPU count, GPU ids or None) after checking they exist."""
  if gpu_ids is None:
    return _resolve_gpu_count(num_gpus, available, fallback), None
  if num_gpus is not None and num_gpus != len(gpu_ids):
    raise ValueError(
        f'num_gpus={num_gpus} but gpu_ids={gpu_ids} lists {len(gpu_ids)} '
        'GPUs; pass only gpu_ids, or make their lengths match.')
  missing = [gpu_id for gpu_id in gpu_ids if gpu_id >= available]
  if not missing:
    return len(gpu_ids), gpu_ids
  if not fallback:
    raise ValueError(
        f'gpu_ids={gpu_ids} includes {missing}, but this machine has '
        f'{_describe_gpus(available)}; pick ids from that list, or pass '
        'fallback_to_available_gpus=True to drop the missing ones.')
  kept = [gpu_id for gpu_id in gpu_ids if gpu_id < available]
  _log.warning(
      'gpu_ids=%s includes %s, but this machine has %s; using gpu_ids=%s '
      'because fallback_to_available_gpus=True.', gpu_ids, missing,
      _describe_gpus(available), kept)
  return len(kept), kept


def _resolve_gpu_count(num_gpus: Optional[int], available: int,
                       fallback: bool) -> int:
  """Returns how many GPUs to use when no explicit ids were given."""
  if num_gpus is None:
    return available
  if num_gpus <= available:
    return num_gpus
  if not fallback:
    raise ValueError(
        f'num_gpus={num_gpus} but this machine has '
        f'{_describe_gpus(available)}; ask for at most {available}, or pass '
        'fallback_to_available_gpus=True to use what is there.')
  _log.warning(
      'num_gpus=%d but this machine has %s; using %d because '
      'fallback_to_available_gpus=True.', num_gpus, _describe_gpus(available),
      available)
  return available


def _describe_gpus(available: int) -> str:
  return (f'{available} GPUs visible to TensorFlow '
          f'({list(range(available))})')


def _merge_distributed_defaults(
    session_config: tf.compat.v1.ConfigProto,
    defaults: Optional[tf.compat.v1.ConfigProto]) -> None:
  """Copies RunConfig's TF_CONFIG-derived settings into `session_config`.

  Without the device filters, a worker would wait on every other worker at
  session start and could see their variables; these are what RunConfig
  would have used had no session_config been given.
  """
  if defaults is None:
    return
  session_config.device_filters.extend(
      f for f in defaults.device_filters
      if f not in session_config.device_filters)
  session_config.graph_options.MergeFrom(defaults.graph_options)


def _estimator_default_graph_options() -> tf.compat.v1.GraphOptions:
  # Estimator applies these graph options itself when session_config is None;
  # keep them so giving a session_config changes only what we asked for.
  rewrite_options = rewriter_config_pb2.RewriterConfig(
      meta_optimizer_iterations=rewriter_config_pb2.RewriterConfig.ONE)
  return tf.compat.v1.GraphOptions(rewrite_options=rewrite_options)


def _check_mixed_precision(value: Any) -> None:
  if value is not None and value not in MIXED_PRECISIONS:
    choices = ', '.join(map(repr, MIXED_PRECISIONS))
    raise ValueError(
        f'mixed_precision must be None or one of {choices}, got {value!r}.')


def _set_mixed_precision(rewrite_options, mixed_precision: str,
                         gpu_count: int) -> None:
  """Switches on the grappler rewrite of `mixed_precision`, if it can work.

  Grappler's float16 rewrite converts GPU ops only (on CPUs it leaves every
  op in float32; its CPU variant merely rounds through float16 around
  float32 kernels, slower than float32), and the oneDNN bfloat16 rewrite
  converts CPU ops only. A rewrite that would change nothing on the
  session's towers is refused rather than silently ignored.
  """
  if mixed_precision == 'float16':
    if gpu_count == 0:
      raise ValueError(
          "mixed_precision='float16' needs GPU towers: TensorFlow's float16 "
          'rewrite converts GPU ops only, and on CPU towers it would train '
          "in float32. On CPUs use mixed_precision='bfloat16'.")
    rewrite_options.auto_mixed_precision = _ON
    return
  if gpu_count > 0:
    raise ValueError(
        "mixed_precision='bfloat16' is the oneDNN rewrite of CPU ops; it "
        f'would leave the {gpu_count} GPU towers in float32. On GPUs use '
        "mixed_precision='float16' (or num_gpus=0 with cpu_devices=N to "
        'train on CPUs).')
  if not _pywrap_util_port.IsMklEnabled():
    raise ValueError(
        "mixed_precision='bfloat16' needs TensorFlow's oneDNN CPU ops, which "
        'are off in this process (TensorFlow turns them on by default only '
        'on CPUs with AVX-512): set TF_ENABLE_ONEDNN_OPTS=1 before '
        'TensorFlow is imported, or leave mixed_precision unset.')
  rewrite_options.auto_mixed_precision_onednn_bfloat16 = _ON


def _check_int(name: str, value: Any, minimum: int) -> int:
  # bool is an Integral subclass, but num_gpus=True is almost surely a bug.
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f'{name} must be an int >= {minimum}, got {value!r} '
                    f'({type(value).__name__}).')
  if value < minimum:
    raise ValueError(f'{name} must be >= {minimum}, got {value}.')
  return int(value)


def _check_bool(name: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise TypeError(f'{name} must be True or False, got {value!r} '
                    f'({type(value).__name__}).')


def _check_gpu_ids(gpu_ids: Any) -> List[int]:
  """Returns `gpu_ids` as a list after checking they are distinct ints >= 0."""
  # A string is a Sequence too, but '0,1' would silently become ['0', ',', '1'].
  is_sequence = isinstance(gpu_ids, collections.abc.Sequence)
  if not is_sequence or isinstance(gpu_ids, (str, bytes)):
    raise TypeError(
        f'gpu_ids must be a list of ints such as [0, 1], got {gpu_ids!r}.')
  ids = [_check_int(f'gpu_ids[{i}]', gpu_id, minimum=0)
         for i, gpu_id in enumerate(gpu_ids)]
  duplicates = sorted({gpu_id for gpu_id in ids if ids.count(gpu_id) > 1})
  if duplicates:
    raise ValueError(
        f'gpu_ids={ids} repeats {duplicates}; list each GPU once.')
  return ids


def _check_memory_fraction(fraction: Any) -> float:
  if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
    raise TypeError('gpu_memory_fraction must be a number in (0, 1], got '
                    f'{fraction!r} ({type(fraction).__name__}).')
  # Written so NaN fails too.
  if not 0 < fraction <= 1:
    raise ValueError('gpu_memory_fraction must be in (0, 1], got '
                     f'{fraction}; for example 0.5 uses half of each GPU.')
  return float(fraction)
