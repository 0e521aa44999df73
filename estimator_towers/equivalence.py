"""`compare`: does a model_fn train the same on towers as on one device?

`replicate_model_fn` promises one device's numbers on the same global
batch. `compare` checks that promise on the user's own model_fn: it writes
ONE start checkpoint, trains `steps` steps from it on one device and on
`num_towers` towers (GPUs when the machine has that many, else virtual
CPUs) with the same batches, and reports every checkpointed variable's
difference (optimizer slots and batch-norm moving statistics included),
the eval metrics of both runs side by side and the largest difference of
their predictions on one batch.

Some models are not meant to train identically. The report names what in
the towered graph explains a difference (difference_sources: random ops,
batch norm, reduced precision, GPU kernels without determinism) and, when
none is there, measures the rounding the model amplifies (Adam on
gradients that nearly cancel) with one more one-device run on every batch
reversed, which adds in another order as towers do. A difference beyond
the tolerance that none of these explains is a failure: a bug of the
library, or of the model_fn in a way the library did not catch (a loss
that uses the batch size, a model changed by `tower_context()`).
"""

import contextlib
import dataclasses
import inspect
import logging
import math
import numbers
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from estimator_towers import difference_sources
from estimator_towers.replicate import replicate_model_fn
from estimator_towers.run_config import available_gpu_count
from estimator_towers.run_config import make_run_config

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys

EQUAL, EXPLAINED, FAILURE = 'equal', 'explained', 'failure'
Source = difference_sources.Source
_DEVICE_TYPES = ('CPU', 'GPU')
# Set by compare, never by the user: the comparison chooses the devices.
_OWN_ARGUMENTS = ('devices',)
# How much more than one device's own rounding noise (the same batches in
# another order) a difference may be and still count as rounding: the two
# noises are draws of one kind (up to 9x apart on a model of pure noise),
# while the bugs seen differ by 1e3x and more.
_ROUNDING_FACTOR = 20
_EXPLAINED_WARNING = (
    'warning: the towers differ from one device, as the expected sources '
    'above explain; rule them out (the options named) to check the rest.')
_BEFORE_REPORTING = (
    'Before reporting: a loss_reduction passed to replicate_model_fn that '
    'the loss does not have, a loss that uses the batch size '
    '(tf.shape(x)[0]) or a model changed by tower_context() also make '
    'towers differ; see docs/writing_model_fns.md, "Check your model_fn".')


@dataclasses.dataclass(frozen=True)
class Difference:
  """How far the towers' value of one tensor is from one device's.

  Attributes:
    name: The variable, metric or prediction key.
    shape: Its shape.
    max_abs: The largest absolute difference.
    max_rel: The largest difference relative to one device's value (over
      the elements where that is not zero; inf where only it is zero).
    ratio: The largest |towers - one device| / (atol + rtol |one device|):
      above 1 is beyond the tolerance. inf for a NaN on one side only, a
      shape mismatch, or unequal non-numeric values.
  """
  name: str
  shape: Tuple[int, ...]
  max_abs: float
  max_rel: float
  ratio: float

  @property
  def within(self) -> bool:
    """Whether the towers match one device within the tolerance."""
    return self.ratio <= 1


@dataclasses.dataclass(frozen=True)
class MetricPair:
  """One eval metric of both runs, side by side."""
  name: str
  one_device: Any
  towers: Any
  difference: Difference


@dataclasses.dataclass(frozen=True)
class Report:
  """What `compare` found.

  Attributes:
    num_towers: Towers of the towered run.
    devices: The towers' device type, 'CPU' (virtual) or 'GPU'.
    steps: Training steps of each run.
    rtol: Relative tolerance.
    atol: Absolute tolerance.
    variables: Every variable both checkpoints hold, worst first.
    unmatched: Variables only one checkpoint holds ('name (towers only)').
    metrics: The eval metrics of both runs (empty without eval_input_fn).
    predictions: Each prediction key's difference on the first batch.
    sources: The expected sources of difference found, and the tolerance.
    batches: Training batches each run read, the same in both (checked by
      their fingerprints).
  """
  num_towers: int
  devices: str
  steps: int
  rtol: float
  atol: float
  variables: Tuple[Difference, ...]
  unmatched: Tuple[str, ...]
  metrics: Tuple[MetricPair, ...]
  predictions: Tuple[Difference, ...]
  sources: Tuple[Source, ...]
  batches: int

  @property
  def beyond_tolerance(self) -> List[str]:
    """Names of what differs beyond the tolerance (or exists once only)."""
    keyed = _keyed(self.variables, self.metrics, self.predictions)
    return ([k for k, d in keyed.items() if not d.within] +
            list(self.unmatched))

  @property
  def verdict(self) -> str:
    """EQUAL, EXPLAINED (every difference has an expected source), or
    FAILURE (a difference nothing explains)."""
    if not self.beyond_tolerance:
      return EQUAL
    if not self.unmatched and any(s.explains for s in self.sources):
      return EXPLAINED
    return FAILURE

  def verdict_line(self) -> str:
    """One line: the verdict and why."""
    what = (f'{self.num_towers} {self.devices} towers vs one device, '
            f'{self.steps} steps, rtol={self.rtol:g} atol={self.atol:g}')
    verdict, beyond = self.verdict, self.beyond_tolerance
    if verdict == EQUAL:
      return (f'verdict: EQUAL: every variable, metric and prediction '
              f'matches within tolerance ({what}).')
    count = f'{len(beyond)} value(s) differ beyond tolerance ({what})'
    if verdict == EXPLAINED:
      names = ', '.join(s.name for s in self.sources if s.explains)
      return (f'verdict: EXPLAINED: {count}; expected from: {names}.')
    if self.unmatched:
      return (f'verdict: FAILURE: {count}: the two checkpoints hold '
              'different variables; this looks like a bug: please report it '
              'with this output.')
    return (f'verdict: FAILURE: {count}, and nothing in the towered graph '
            'explains it; this looks like a bug: please report it with this '
            'output.')

  def format(self, max_rows: int = 20) -> str:
    """The whole report as text: variables (worst first, `max_rows` at
    most), metrics, predictions, expected sources, a warning line when the
    differences are explained, and the verdict as the last line."""
    lines = [f'training: {self.batches} identical batches per run, '
             f'from one start checkpoint',
             f'variables ({len(self.variables)}), worst first:',
             _row('name', 'shape', 'max abs', 'max rel', 'tol ratio')]
    for diff in self.variables[:max_rows]:
      lines.append(_difference_row(diff))
    if len(self.variables) > max_rows:
      lines.append(f'... {len(self.variables) - max_rows} more')
    lines.extend(f'only in one checkpoint: {name}' for name in self.unmatched)
    if self.metrics:
      lines.append('eval metrics:')
      lines.append(_row('name', 'one device', 'towers', 'max abs',
                        'tol ratio'))
      for metric in self.metrics:
        lines.append(_row(metric.name, _value(metric.one_device),
                          _value(metric.towers),
                          f'{metric.difference.max_abs:.3g}',
                          _ratio(metric.difference)))
    if self.predictions:
      lines.append('predictions (first batch):')
      lines.extend(_difference_row(d) for d in self.predictions)
    lines.append('expected sources of difference:')
    lines.extend(f'  {"*" if s.explains else "-"} {s.name}: {s.detail}'
                 for s in self.sources)
    if self.verdict == FAILURE:
      lines.append(_BEFORE_REPORTING)
    if self.verdict == EXPLAINED:
      lines.append(_EXPLAINED_WARNING)
    lines.append(self.verdict_line())
    return '\n'.join(lines)

  def __str__(self) -> str:
    return self.format()


def compare(model_fn: Callable[..., Any],
            input_fn: Callable[..., Any],
            *,
            num_towers: int,
            steps: int,
            params: Optional[Dict[str, Any]] = None,
            model_dir: Optional[str] = None,
            tf_random_seed: int = 7,
            rtol: float = 1e-4,
            atol: float = 1e-5,
            eval_input_fn: Optional[Callable[..., Any]] = None,
            eval_steps: Optional[int] = None,
            predict_input_fn: Optional[Callable[..., Any]] = None,
            device_type: Optional[str] = None,
            **replicate_kwargs: Any) -> Report:
  """Trains `model_fn` on one device and on towers and compares them.

  Both runs start from one checkpoint of `model_fn` (its initial values,
  optimizer slots included), written once and copied, and must read the
  same batches: `input_fn` must yield the same batches each time it is
  called in a graph with the same seed (a seeded shuffle does; see
  `tf_random_seed`). A fingerprint of every training batch checks it.

  Args:
    model_fn: A one-device model_fn, as for `tf.estimator.Estimator`.
    input_fn: The training input_fn; it batches the GLOBAL batch.
    num_towers: Towers of the towered run, >= 2.
    steps: Training steps of each run, >= 1. A few are enough to show a
      difference; rounding differences grow with more.
    params: The Estimators' params.
    model_dir: Where the start checkpoint and the runs go (subfolders
      `start`, `one_device`, `towers` and, when measured, `rounding`,
      which must not exist yet); None uses a temporary folder, removed
      afterwards.
    tf_random_seed: The graph-level seed of every run, so that seeded
      shuffles and random ops repeat.
    rtol: Relative tolerance, as numpy.isclose's.
    atol: Absolute tolerance, as numpy.isclose's.
    eval_input_fn: If given, both runs are evaluated on it.
    eval_steps: Evaluation steps; None evaluates until the input ends.
    predict_input_fn: Whose first batch both runs predict; default
      `eval_input_fn`, else `input_fn`.
    device_type: 'GPU' or 'CPU' (virtual CPU devices); None takes GPUs when
      the machine has `num_towers` of them, else CPUs. One device is one
      of the same type.
    **replicate_kwargs: Passed to `replicate_model_fn` for the towered run
      (e.g. loss_reduction, aggregation; `random_ops` and `batch_norm`
      decide whether random ops and batch norm explain a difference).

  Returns:
    A `Report`; `report.verdict` is EQUAL, EXPLAINED or FAILURE and
    `print(report)` shows it all.

  Raises:
    TypeError: model_fn or an input_fn is not callable, or a number is of
      the wrong type.
    ValueError: a number is out of range, `device_type` is unknown or asks
      for GPUs the machine lacks, `model_dir` already holds a run,
      `replicate_kwargs` sets `devices`, or the runs read different
      batches (then nothing is compared). What replicate_model_fn or the
      Estimator raise for the model_fn passes through.
  """
  _check_arguments(model_fn, input_fn, eval_input_fn, predict_input_fn,
                   num_towers, steps, tf_random_seed, rtol, atol, eval_steps,
                   replicate_kwargs)
  device_type = _device_type(device_type, num_towers)
  # Unknown replicate_model_fn arguments fail here, before any training.
  runs = {'one_device': _Observed(replicate_model_fn(model_fn)),
          'towers': _Observed(replicate_model_fn(model_fn,
                                                 **replicate_kwargs))}
  plan = _Plan(input_fn, steps, params, eval_input_fn, eval_steps,
               predict_input_fn or eval_input_fn or input_fn)
  tolerance = (rtol, atol)
  temporary = model_dir is None
  root = tempfile.mkdtemp(prefix='compare-') if temporary else model_dir
  try:
    dirs = _run_dirs(root)
    configs = {name: _run_config(dirs[name], num_towers if name == 'towers'
                                 else 1, device_type, tf_random_seed)
               for name in dirs}
    # On a one-device session replicate_model_fn calls the model_fn as it
    # is (a TPUEstimatorSpec becomes an EstimatorSpec).
    start = _write_start(runs['one_device'].model_fn(), input_fn, params,
                         configs['start'])
    outputs = {name: _trained(runs[name], plan, configs[name], start)
               for name in runs}
    _check_same_batches(runs['one_device'].batches, runs['towers'].batches,
                        'towered')
    found = _Differences.between(outputs['one_device'], outputs['towers'],
                                 tolerance)
    sources = runs['towers'].graph.sources(device_type, replicate_kwargs,
                                           tolerance)
    if (found.beyond() and not found.unmatched and
        not any(s.explains for s in sources)):
      # Nothing in the graph explains it: is it rounding the model
      # amplifies? One device again, on every batch reversed.
      runs['rounding'] = _Observed(replicate_model_fn(model_fn),
                                   reverse_batches=True)
      noise = _Differences.between(
          outputs['one_device'],
          _trained(runs['rounding'], plan, configs['rounding'], start),
          tolerance)
      _check_same_batches(runs['one_device'].batches,
                          runs['rounding'].batches, 'rounding')
      sources = (*sources[:-1],
                 _rounding_source(found, noise,
                                  runs['rounding'].reversed_all),
                 sources[-1])
  finally:
    if temporary:
      shutil.rmtree(root, ignore_errors=True)
  return Report(num_towers=num_towers, devices=device_type, steps=steps,
                rtol=rtol, atol=atol, variables=found.variables,
                unmatched=found.unmatched, metrics=found.metrics,
                predictions=found.predictions, sources=tuple(sources),
                batches=len(runs['towers'].batches))


# ----------------------------------------------------------------------------
# Arguments and runs.


def _check_arguments(model_fn, input_fn, eval_input_fn, predict_input_fn,
                     num_towers, steps, seed, rtol, atol, eval_steps,
                     replicate_kwargs) -> None:
  for name, fn in (('model_fn', model_fn), ('input_fn', input_fn),
                   ('eval_input_fn', eval_input_fn),
                   ('predict_input_fn', predict_input_fn)):
    if fn is not None and not callable(fn):
      raise TypeError(f'{name} must be callable, got {fn!r}.')
  _check_int('num_towers', num_towers, 2,
             'compare one device with at least 2 towers')
  _check_int('steps', steps, 1, 'train at least one step')
  _check_int('tf_random_seed', seed, 0, 'use a non-negative int')
  if eval_steps is not None:
    _check_int('eval_steps', eval_steps, 1,
               'evaluate at least one step, or pass None for the whole input')
  for name, value in (('rtol', rtol), ('atol', atol)):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise TypeError(f'{name} must be a number, got {value!r}.')
    if not value >= 0 or math.isinf(value):  # NaN fails too.
      raise ValueError(f'{name}={value!r}; use a finite number >= 0, e.g. '
                       f'rtol=1e-4, atol=1e-5 for float32.')
  own = sorted(set(_OWN_ARGUMENTS) & set(replicate_kwargs))
  if own:
    raise ValueError(f'replicate_kwargs sets {own}; compare chooses the '
                     'tower devices itself (see num_towers and device_type).')


def _check_int(name: str, value: Any, minimum: int, advice: str) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f'{name} must be an int, got {value!r}.')
  if value < minimum:
    raise ValueError(f'{name}={value}; {advice} ({name} >= {minimum}).')


def _device_type(device_type: Optional[str], num_towers: int) -> str:
  """The towers' device type: as asked, else GPUs if there are enough."""
  gpus = available_gpu_count()
  if device_type is None:
    return 'GPU' if gpus >= num_towers else 'CPU'
  if device_type not in _DEVICE_TYPES:
    raise ValueError(f'device_type={device_type!r}; use one of '
                     f'{_DEVICE_TYPES}, or None to choose by the machine.')
  if device_type == 'GPU' and gpus < num_towers:
    raise ValueError(f"device_type='GPU' with num_towers={num_towers}, but "
                     f'TensorFlow sees {gpus} GPU(s); ask for at most '
                     f"{gpus} towers, or use device_type='CPU'.")
  return device_type


def _run_dirs(root: str) -> Dict[str, str]:
  """The runs' folders under `root`, refused when one is there already."""
  dirs = {name: os.path.join(root, name)
          for name in ('start', 'one_device', 'towers', 'rounding')}
  taken = [d for d in dirs.values() if tf.io.gfile.exists(d)]
  if taken:
    raise ValueError(f'model_dir={root!r} already holds {taken}; a comparison '
                     'must start from a fresh folder: pass a new model_dir, '
                     'or None for a temporary one.')
  return dirs


def _run_config(model_dir: str, towers: int, device_type: str,
                seed: int) -> tf.estimator.RunConfig:
  devices = ({'num_gpus': towers} if device_type == 'GPU' else
             {'num_gpus': 0, 'cpu_devices': towers})
  # Only the final checkpoint matters; summaries would only cost time.
  return make_run_config(model_dir, tf_random_seed=seed,
                         save_checkpoints_steps=10**9, save_summary_steps=0,
                         log_step_count_steps=10**9, **devices)


# The Estimator's warning when the start checkpoint is written: expected.
_NO_STEPS = 'Training with estimator made no steps'


@contextlib.contextmanager
def _filtered(logger: logging.Logger, start: str):
  """Drops `logger`'s records that start with `start`, for a while."""
  record_filter = lambda record: not record.getMessage().startswith(start)
  logger.addFilter(record_filter)
  try:
    yield
  finally:
    logger.removeFilter(record_filter)


class _StopAtStart(tf1.train.SessionRunHook):
  """Ends training once the session exists: after the Estimator's saver has
  written the step-0 checkpoint, before the first step."""

  def after_create_session(self, session, coord):
    del session
    coord.request_stop()


def _write_start(model_fn, input_fn, params, config) -> str:
  """Writes ONE step-0 checkpoint of `model_fn`; returns its path.

  Initializers without an op-level seed do not draw the same values in
  the one-device and the towered graph, so every run resumes from these
  values. A one-device Estimator writes it, as it would start training:
  its Saver, scaffold and input_fn conventions apply.
  """
  estimator = tf.estimator.Estimator(model_fn, config=config, params=params)
  with _filtered(tf.get_logger(), _NO_STEPS):
    estimator.train(input_fn, hooks=[_StopAtStart()])
  checkpoint = tf.train.latest_checkpoint(config.model_dir)
  if checkpoint is None:
    raise ValueError(f'The start checkpoint was not written in '
                     f'{config.model_dir}; does input_fn yield a batch?')
  return checkpoint


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What every run of a comparison trains on, evaluates and predicts."""
  input_fn: Callable[..., Any]
  steps: int
  params: Optional[Dict[str, Any]]
  eval_input_fn: Optional[Callable[..., Any]]
  eval_steps: Optional[int]
  predict_input_fn: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class _Outputs:
  """What one trained run gives the comparison."""
  model_dir: str
  metrics: Optional[Dict[str, Any]]
  predictions: Dict[str, np.ndarray]


def _trained(run: '_Observed', plan: _Plan, config: tf.estimator.RunConfig,
             start: str) -> _Outputs:
  """Trains `run` from a copy of the `start` checkpoint; its outputs."""
  model_dir = config.model_dir
  tf.io.gfile.makedirs(model_dir)
  for path in tf.io.gfile.glob(start + '.*'):
    tf.io.gfile.copy(path, os.path.join(model_dir, os.path.basename(path)))
  tf1.train.update_checkpoint_state(
      model_dir, os.path.join(model_dir, os.path.basename(start)))
  estimator = tf.estimator.Estimator(run.model_fn(), config=config,
                                     params=plan.params)
  estimator.train(plan.input_fn, steps=plan.steps)
  metrics = None
  if plan.eval_input_fn is not None:
    metrics = estimator.evaluate(plan.eval_input_fn, steps=plan.eval_steps)
  outputs = estimator.predict(plan.predict_input_fn,
                              yield_single_examples=False)
  try:
    batch = next(outputs)
  finally:
    outputs.close()  # Ends the prediction session.
  return _Outputs(model_dir, metrics,
                  batch if isinstance(batch, dict) else {'': batch})


# ----------------------------------------------------------------------------
# Differences.


def _difference(name: str, one, towers, tolerance) -> Difference:
  """How far `towers` is from `one` (the reference)."""
  rtol, atol = tolerance
  one, towers = np.asarray(one), np.asarray(towers)
  shape = tuple(one.shape)
  if one.shape != towers.shape:
    return Difference(name, shape, math.inf, math.inf, math.inf)
  numeric = all(np.issubdtype(a.dtype, np.number) or a.dtype == bool
                for a in (one, towers))
  if not numeric:
    same = np.array_equal(one, towers)
    return Difference(name, shape, 0.0 if same else math.inf,
                      0.0 if same else math.inf, 0.0 if same else math.inf)
  if one.size == 0:
    return Difference(name, shape, 0.0, 0.0, 0.0)
  a, b = one.astype(np.float64), towers.astype(np.float64)
  both_nan = np.isnan(a) & np.isnan(b)
  same_inf = np.isinf(a) & (a == b)
  error = np.where(both_nan | same_inf, 0.0, np.abs(b - a))
  error = np.where(np.isnan(error), math.inf, error)  # NaN on one side.
  with np.errstate(divide='ignore', invalid='ignore'):
    relative = np.where(error == 0, 0.0, error / np.abs(a))
    bound = atol + rtol * np.where(np.isfinite(a), np.abs(a), 0.0)
    ratio = np.where(error == 0, 0.0, error / bound)
  return Difference(name, shape, float(error.max()), float(relative.max()),
                    float(ratio.max()))


@dataclasses.dataclass(frozen=True)
class _Differences:
  """How far one run's outputs are from one device's."""
  variables: Tuple[Difference, ...]
  unmatched: Tuple[str, ...]
  metrics: Tuple[MetricPair, ...]
  predictions: Tuple[Difference, ...]

  @classmethod
  def between(cls, one: _Outputs, other: _Outputs,
              tolerance) -> '_Differences':
    variables, unmatched = _compare_checkpoints(one.model_dir,
                                                other.model_dir, tolerance)
    metrics = ()
    if one.metrics is not None:
      metrics = _compare_metrics(one.metrics, other.metrics, tolerance)
    return cls(variables, unmatched, metrics, _compare_predictions(
        one.predictions, other.predictions, tolerance))

  def keyed(self) -> Dict[str, Difference]:
    """Every difference by the name the report gives it."""
    return _keyed(self.variables, self.metrics, self.predictions)

  def beyond(self) -> List[str]:
    """What differs beyond the tolerance, by name."""
    return [k for k, d in self.keyed().items() if not d.within]


def _keyed(variables, metrics, predictions) -> Dict[str, Difference]:
  return {**{d.name: d for d in variables},
          **{f'metric {m.name}': m.difference for m in metrics},
          **{f'prediction {d.name}': d for d in predictions}}


def _compare_checkpoints(one_dir: str, towers_dir: str, tolerance
                         ) -> Tuple[Tuple[Difference, ...], Tuple[str, ...]]:
  """Every variable of the two runs' final checkpoints, worst first."""
  readers = [tf.train.load_checkpoint(d) for d in (one_dir, towers_dir)]
  names = [set(r.get_variable_to_shape_map()) -
           {'_CHECKPOINTABLE_OBJECT_GRAPH'} for r in readers]
  unmatched = tuple(sorted(
      [f'{n} (one device only)' for n in names[0] - names[1]] +
      [f'{n} (towers only)' for n in names[1] - names[0]]))
  differences = [_difference(name, readers[0].get_tensor(name),
                             readers[1].get_tensor(name), tolerance)
                 for name in sorted(names[0] & names[1])]
  return _worst_first(differences), unmatched


def _worst_first(differences: Sequence[Difference]
                 ) -> Tuple[Difference, ...]:
  return tuple(sorted(differences, key=lambda d: (-d.ratio, -d.max_abs,
                                                  d.name)))


def _compare_metrics(one: Dict[str, Any], towers: Dict[str, Any],
                     tolerance) -> Tuple[MetricPair, ...]:
  pairs = []
  for name in sorted(set(one) | set(towers)):
    if name in one and name in towers:
      difference = _difference(name, one[name], towers[name], tolerance)
    else:
      difference = Difference(name, (), math.inf, math.inf, math.inf)
    pairs.append(MetricPair(name, one.get(name), towers.get(name),
                            difference))
  return tuple(pairs)


def _compare_predictions(one: Dict[str, np.ndarray],
                         towers: Dict[str, np.ndarray],
                         tolerance) -> Tuple[Difference, ...]:
  """Each prediction key's difference on the first batch."""
  differences = [_difference(key, one[key], towers[key], tolerance)
                 for key in sorted(set(one) & set(towers))]
  differences += [Difference(key, (), math.inf, math.inf, math.inf)
                  for key in sorted(set(one) ^ set(towers))]
  return _worst_first(differences)


def _rounding_source(found: _Differences, noise: _Differences,
                     measured: bool) -> Source:
  """Whether rounding explains every difference beyond the tolerance.

  `noise` is how far one device trained on every batch reversed is from
  one device: the same computation, summed in another order, which is
  all the towers should change. A model that amplifies rounding (an
  Adam-like optimizer on gradients that nearly cancel) differs there as
  it does on towers; a bug makes towers differ far more.
  """
  if not measured:
    return Source('rounding', 'not measured: the batches hold sparse or '
                  'ragged tensors, which the check does not reverse.',
                  explains=False)
  baseline = noise.keyed()
  worst = max(baseline, key=lambda k: baseline[k].max_abs)
  said = (f'one device trained again on every batch reversed (another '
          f'summation order, as towers add in) differs from one device by '
          f'up to {baseline[worst].max_abs:.3g} ({worst})')
  excess = {}
  for key in found.beyond():
    floor = baseline[key].max_abs if key in baseline else 0.0
    difference = found.keyed()[key].max_abs
    excess[key] = difference / floor if floor > 0 else math.inf
  over = sorted((k for k in excess if excess[k] > _ROUNDING_FACTOR),
                key=lambda k: -excess[k])
  if over:
    return Source('rounding', f'{said}; but {over[0]} differs '
                  f'{excess[over[0]]:.3g}x more on towers than there: not '
                  'rounding.', explains=False)
  return Source('rounding', f'{said}; every difference beyond tolerance is '
                f'within {_ROUNDING_FACTOR}x of that run\'s in the same '
                'value: the model amplifies float32 rounding (as Adam does '
                'on gradients that nearly cancel). Train with SGD to see '
                'exact numbers, or raise the tolerance.', explains=True)


# ----------------------------------------------------------------------------
# The runs' model_fns.


class _Observed:
  """A model_fn of one run: records a fingerprint of each training batch,
  and what its TRAIN graph holds that can make towers differ from one
  device (`graph`).

  Args:
    fn: The run's model_fn (replicated, as Estimator calls it).
    reverse_batches: Train on every batch in reversed order (the rounding
      run).
  """

  def __init__(self, fn, reverse_batches: bool = False):
    self._fn = fn
    self._reverse = reverse_batches
    # Whether every batch could be reversed (dense tensors only).
    self.reversed_all = reverse_batches
    self.batches: List[np.ndarray] = []
    self.graph = difference_sources.GraphSources()

  def model_fn(self):
    """The model_fn to give the run's Estimator."""

    def observed_model_fn(features, labels=None, mode=None, params=None,
                          config=None):
      if mode != ModeKeys.TRAIN:
        return self._fn(features, labels, mode, params, config)
      given = self._reversed(features, labels) if self._reverse else (
          features, labels)
      spec = self._fn(*given, mode, params, config)
      self.graph.read(spec)
      # Of the batch as read; made after the model, so that the model's ops
      # (and the op seeds drawn from their ids) are as without the check.
      fingerprint = _fingerprint(features, labels)
      return spec._replace(training_hooks=[
          *spec.training_hooks, _Fingerprints(fingerprint, self.batches)])

    # Estimator passes the arguments the wrapped model_fn presents (the
    # user's model_fn's own), and checks them as for that model_fn.
    observed_model_fn.__signature__ = inspect.signature(self._fn)
    return observed_model_fn

  def _reversed(self, features, labels):
    """The batch in reversed order, if it holds only dense tensors."""
    leaves = tf.nest.flatten((features, labels))
    if not all(leaf is None or isinstance(leaf, tf.Tensor)
               for leaf in leaves):
      self.reversed_all = False
      return features, labels
    return tf.nest.map_structure(
        lambda t: t if t is None or t.shape.rank == 0 else tf.reverse(t, [0]),
        (features, labels))

class _Fingerprints(tf1.train.SessionRunHook):
  """Appends each step's batch fingerprint to a list."""

  def __init__(self, fingerprint: tf.Tensor, out: List[np.ndarray]):
    self._fingerprint = fingerprint
    self._out = out

  def before_run(self, run_context):
    del run_context
    return tf1.train.SessionRunArgs(self._fingerprint)

  def after_run(self, run_context, run_values):
    del run_context
    self._out.append(run_values.results)


def _fingerprint(features, labels) -> tf.Tensor:
  """float64 [3 * tensors]: each tensor's sum, position-weighted sum and
  size, so that other values or another order change it."""
  parts = []
  with tf.name_scope('compare_batch_fingerprint'):
    for leaf in tf.nest.flatten((features, labels), expand_composites=True):
      if not isinstance(leaf, tf.Tensor):
        continue
      if leaf.dtype == tf.string:
        leaf = tf.strings.to_hash_bucket_fast(leaf, 2**31 - 1)
      elif not (leaf.dtype.is_numeric or leaf.dtype.is_bool):
        continue  # Resources, variants: no values of their own.
      flat = tf.reshape(tf.cast(leaf, tf.float64), [-1])
      positions = tf.cast(tf.range(1, tf.size(flat) + 1), tf.float64)
      parts.append(tf.stack([tf.reduce_sum(flat),
                             tf.reduce_sum(flat * positions),
                             tf.cast(tf.size(flat), tf.float64)]))
    return tf.concat(parts, 0) if parts else tf.zeros([0], tf.float64)


def _check_same_batches(one: Sequence[np.ndarray],
                        other: Sequence[np.ndarray], other_name: str) -> None:
  """Refuses a comparison whose runs read different batches.

  Args:
    one: The one-device run's batch fingerprints.
    other: Those of the run compared with it.
    other_name: That run, e.g. 'towered'.

  Raises:
    ValueError: a step's batch, or the number of steps, differs.
  """
  for step, (a, b) in enumerate(zip(one, other)):
    # float64 sums of the same values in the same order: equal, unless
    # the batches differ (rtol leaves room for another summation order).
    if a.shape != b.shape or not np.allclose(a, b, rtol=1e-9, atol=0,
                                             equal_nan=True):
      raise ValueError(
          f'The input_fn gave the one-device and the {other_name} run '
          f'different batches (first at step {step + 1}), so their weights '
          'cannot be compared. Make it yield the same batches on every '
          'call: shuffle with a seed, and no parallel map or interleave '
          'with deterministic=False.')
  if len(one) != len(other):
    raise ValueError(
        f'The input_fn gave the one-device run {len(one)} batches and the '
        f'{other_name} run {len(other)}; it must yield the same batches on '
        'every call.')


# ----------------------------------------------------------------------------
# Text.


def _row(*cells) -> str:
  name, *rest = cells
  return f'  {name:<48} ' + ' '.join(f'{c:>12}' for c in rest)


def _difference_row(diff: Difference) -> str:
  return _row(diff.name, 'x'.join(map(str, diff.shape)) or 'scalar',
              f'{diff.max_abs:.3g}', f'{diff.max_rel:.3g}', _ratio(diff))


def _ratio(diff: Difference) -> str:
  return f'{diff.ratio:.3g}' + ('' if diff.within else ' !')


def _value(value) -> str:
  array = np.asarray(value)
  if array.size == 1 and np.issubdtype(array.dtype, np.number):
    return f'{array.item():.6g}'
  return f'{array.dtype.name}{list(array.shape)}'
