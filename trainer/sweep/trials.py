"""Running one trial the way the Cloud tuning service does.

A trial is `python -m <module> --job-dir=DIR --<param>=<value>...
<fixed flags>` in its own process, with the environment a Cloud trial gets:
TF_CONFIG carrying the trial id, CLOUD_ML_HP_METRIC_FILE naming the trial's
own metric file, CLOUD_ML_HP_METRIC_TAG the tag to report, and any AIP_*
output location with the trial id appended. The trainer
writes under DIR/<trial id>; its stdout and stderr go to
DIR/<trial id>/trial.log. `run` supervises the process: it polls the metric
file, hands every new report to the caller (who may ask to prune), and stops
the process when asked to.
"""

import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from trainer.sweep import metrics as sweep_metrics
from trainer.sweep import process as sweep_process
from trainer.sweep import space as sweep_space

COMPLETE = 'complete'
FAILED = 'failed'
PRUNED = 'pruned'
INTERRUPTED = 'interrupted'

LOG_FILE = 'trial.log'


@dataclasses.dataclass(frozen=True)
class TrialSpec:
  """Everything needed to start one trial."""
  trial_id: str
  trial_dir: str
  log_path: str
  metric_path: str
  metric_tag: str
  command: List[str]
  env: Dict[str, str]
  resume: bool = False


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How a trial ended.

  Attributes:
    status: COMPLETE, FAILED, PRUNED or INTERRUPTED.
    value: The last reported metric value (the objective when COMPLETE).
    step: The global step of that report.
    exit_code: The process's exit code (negative: killed by that signal);
      None when no process was started.
    error: Why a FAILED trial failed.
    duration_sec: Wall time from start to exit.
  """
  status: str
  value: Optional[float] = None
  step: Optional[int] = None
  exit_code: Optional[int] = None
  error: Optional[str] = None
  duration_sec: float = 0.0


def make_spec(job_dir: str, trial_id: str, module: str,
              values: Mapping[str, Any], fixed_flags: Sequence[str],
              extra_flags: Sequence[str], base_env: Mapping[str, str],
              extra_env: Mapping[str, str], metric_tag: str,
              job: Mapping[str, Any], resume: bool = False) -> TrialSpec:
  """The command line, environment and paths of one trial.

  Args:
    job_dir: The sweep's job dir (the trial writes under job_dir/trial_id).
    trial_id: The trial id ('1', '2', ...), already a safe directory name.
    module: The trainer module to run (python -m).
    values: {parameterName: value} of this trial.
    fixed_flags: The trainer flags every trial gets.
    extra_flags: Flags the sweep adds (thread pools), after the fixed ones.
    base_env: The sweep's environment.
    extra_env: Variables for this trial's device slot.
    metric_tag: hyperparameterMetricTag.
    job: TF_CONFIG's "job" entry.
    resume: Whether the trial goes on in the existing directory of an
      interrupted trial with this id (the trainer resumes its checkpoint).

  Returns:
    The TrialSpec.
  """
  trial_dir = os.path.join(job_dir, trial_id)
  metric_path = sweep_metrics.metric_file(trial_dir)
  command = [sys.executable, '-m', module, f'--job-dir={job_dir}']
  command += [f'--{name}={sweep_space.flag_value(value)}'
              for name, value in values.items()]
  command += list(fixed_flags) + list(extra_flags)
  tf_config = {'cluster': {}, 'environment': 'cloud',
               'task': {'trial': trial_id}, 'job': dict(job)}
  env = dict(base_env)
  env.update(extra_env)
  env.update(_trial_output_dirs(base_env, trial_id))
  env.update({'TF_CONFIG': json.dumps(tf_config),
              'CLOUD_ML_TRIAL_ID': trial_id,
              'CLOUD_ML_HP_METRIC_FILE': metric_path,
              'CLOUD_ML_HP_METRIC_TAG': metric_tag})
  return TrialSpec(trial_id, trial_dir, os.path.join(trial_dir, LOG_FILE),
                   metric_path, metric_tag, command, env, resume)


# Vertex AI's output locations (trainer/vertex.py). A shared AIP_MODEL_DIR
# would hold whichever trial exported last, so each trial gets a folder of
# its own under each, as Vertex's own tuning jobs do.
_VERTEX_OUTPUTS = ('AIP_MODEL_DIR', 'AIP_CHECKPOINT_DIR',
                   'AIP_TENSORBOARD_LOG_DIR')


def _trial_output_dirs(base_env: Mapping[str, str],
                       trial_id: str) -> Dict[str, str]:
  """<value>/<trial id> for each Vertex output location that is set."""
  return {name: f'{base_env[name].rstrip("/")}/{trial_id}'
          for name in _VERTEX_OUTPUTS if base_env.get(name)}


def tf_config_job(module: str, job_dir: str, fixed_flags: Sequence[str],
                  hyperparameters: Mapping[str, Any]) -> Dict[str, Any]:
  """TF_CONFIG["job"]: the job's training input, snake_case like Cloud's."""
  return {'python_module': module, 'job_dir': job_dir,
          'args': list(fixed_flags),
          'hyperparameters': _snake_case(hyperparameters)}


def _snake_case(value: Any) -> Any:
  if isinstance(value, dict):
    return {re.sub(r'(?<!^)([A-Z])', r'_\1', k).lower(): _snake_case(v)
            for k, v in value.items()}
  if isinstance(value, list):
    return [_snake_case(v) for v in value]
  return value


# Callbacks of `run`.
OnStart = Callable[[int, Optional[str]], None]
OnReport = Callable[[sweep_metrics.Report], bool]


def run(spec: TrialSpec, on_start: OnStart, on_report: OnReport,
        stop: threading.Event, poll_secs: float,
        grace_secs: float) -> Outcome:
  """Runs one trial to its end.

  Args:
    spec: The trial.
    on_start: Called with (pid, kernel start time) once the process runs.
    on_report: Called with every new report of the metric, in step order;
      returns True to prune the trial (its process is then stopped).
    stop: Set when the sweep is interrupted: the process is stopped and the
      trial is INTERRUPTED.
    poll_secs: How often the metric file is read.
    grace_secs: Time between SIGTERM and SIGKILL when stopping it.

  Returns:
    The Outcome.

  Raises:
    OSError: the trial directory or log cannot be created or the process
      cannot be started (a problem of the machine, not of the trial).
  """
  try:
    # Exclusive: a trial never mixes its checkpoints with an older run's;
    # only the rerun of an interrupted trial goes on in that trial's.
    os.makedirs(spec.trial_dir, exist_ok=spec.resume)
  except FileExistsError:
    return Outcome(FAILED, error=f'trial directory {spec.trial_dir} exists '
                   'already; the sweep never reuses one, so it is not from '
                   'this sweep: choose a new --job-dir.')
  started = time.monotonic()
  with open(spec.log_path, 'a' if spec.resume else 'x',
            encoding='utf-8') as log:
    process = sweep_process.start(spec.command, spec.env, log)
  try:
    on_start(process.pid, sweep_process.start_time(process.pid))
    watcher = _Watcher(spec, on_report)
    status, error = _supervise(process, watcher, stop, poll_secs, grace_secs)
  except BaseException:
    # Whatever went wrong in the sweep, no trial outlives its supervisor.
    if process.poll() is None:
      sweep_process.stop(process, grace_secs)
    raise
  exit_code = process.returncode
  duration = time.monotonic() - started
  if status is None:
    status, error = _judge(spec, exit_code, watcher, stop)
  last = watcher.last
  return Outcome(status, value=last.value if last else None,
                 step=last.step if last else None, exit_code=exit_code,
                 error=error, duration_sec=duration)


class _Watcher:
  """Reads the metric file and passes on reports it has not seen yet."""

  def __init__(self, spec: TrialSpec, on_report: OnReport):
    self._spec = spec
    self._on_report = on_report
    self.last: Optional[sweep_metrics.Report] = None

  def poll(self, final: bool) -> bool:
    """Reads new reports; True when the caller asked to prune.

    Raises:
      ValueError: the metric file holds a malformed line.
    """
    prune = False
    for report in sweep_metrics.read_reports(self._spec.metric_path,
                                             self._spec.metric_tag, final):
      # The file is rewritten whole each time: skip what was seen before.
      if self.last is not None and report.step <= self.last.step:
        continue
      self.last = report
      prune = self._on_report(report) or prune
    return prune


def _supervise(process, watcher: _Watcher, stop: threading.Event,
               poll_secs: float, grace_secs: float):
  """Waits for the process; (status, error) if it had to be stopped."""
  while process.poll() is None:
    if stop.wait(poll_secs):
      sweep_process.stop(process, grace_secs)
      return INTERRUPTED, None
    try:
      prune = watcher.poll(final=False)
    except ValueError as e:
      sweep_process.stop(process, grace_secs)
      return FAILED, str(e)
    if prune:
      sweep_process.stop(process, grace_secs)
      return PRUNED, None
  return None, None


def _judge(spec: TrialSpec, exit_code: int, watcher: _Watcher,
           stop: threading.Event):
  """(status, error) of a trial whose process exited by itself."""
  try:
    watcher.poll(final=True)
  except ValueError as e:
    return FAILED, str(e)
  if exit_code != 0:
    if stop.is_set():
      # It ended as the sweep was stopping: run it again on --resume.
      return INTERRUPTED, None
    return FAILED, f'{_describe_exit(exit_code)}; see {spec.log_path}'
  if watcher.last is None:
    return FAILED, (f'exited 0 but reported no {spec.metric_tag!r} in '
                    f'{spec.metric_path}; the trainer must report '
                    'hyperparameterMetricTag (trainer.task: pass '
                    '--hypertune-metric=<eval metric> after --)')
  if not sweep_metrics.is_number(watcher.last.value):
    return FAILED, (f'reported {spec.metric_tag}={watcher.last.value} at '
                    f'step {watcher.last.step}')
  return COMPLETE, None


def _describe_exit(exit_code: int) -> str:
  if exit_code < 0:
    try:
      name = signal.Signals(-exit_code).name
    except ValueError:
      name = f'signal {-exit_code}'
    return f'killed by {name}'
  return f'exited with code {exit_code}'
