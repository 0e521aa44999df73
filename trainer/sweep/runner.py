"""Running a sweep: Optuna's optimize loop over supervised trial processes.

`Sweep.run` calls `Study.optimize` with one thread per parallel trial
(`n_jobs` = maxParallelTrials). Each thread's objective draws the trial's
parameters, takes a device slot, runs the trainer process (see
sweep_trials), feeds the metric it reports to the pruner, and ends the
Optuna trial as the process ended: complete with the last reported value,
pruned, or failed (recorded, and the sweep goes on). A stop request (the
CLI's signal handler) interrupts every running trial; the study keeps what
finished and `--resume` goes on from there.
"""

import contextlib
import dataclasses
import glob
import os
import queue
import threading
from typing import Dict, List, Mapping, Optional, Sequence

import optuna

from trainer.sweep import devices as sweep_devices
from trainer.sweep import hparams as sweep_hparams
from trainer.sweep import report as sweep_report
from trainer.sweep import space as sweep_space
from trainer.sweep import study as sweep_study
from trainer.sweep import trials as sweep_trials
from trainer.sweep.config import SweepConfig

DONE = 'done'
TOO_MANY_FAILURES = 'too_many_failures'
INTERRUPTED = 'interrupted'


class TrialFailed(Exception):
  """The trial failed by itself: recorded, and the sweep goes on."""


class TrialInterrupted(Exception):
  """The sweep is stopping; the trial runs again on --resume."""


@dataclasses.dataclass(frozen=True)
class Options:
  """How the sweep runs its trials.

  Attributes:
    job_dir: The sweep's job dir (absolute).
    config: The checked hyperparameters block.
    fixed_flags: Trainer flags every trial gets.
    module: The trainer module (python -m).
    poll_secs: How often a running trial's metric file is read.
    grace_secs: Time between SIGTERM and SIGKILL when stopping a trial.
  """
  job_dir: str
  config: SweepConfig
  fixed_flags: Sequence[str]
  module: str = 'trainer.task'
  poll_secs: float = 1.0
  grace_secs: float = 10.0


class Sweep:
  """Runs the trials of one study until its budget is spent.

  Args:
    study: The study (new or resumed).
    options: How to run trials.
    slots: Device slots, one per parallel trial.
    environ: The environment trials start from.
  """

  def __init__(self, study: optuna.Study, options: Options,
               slots: Sequence[sweep_devices.Slot],
               environ: Mapping[str, str]):
    self._study = study
    self._options = options
    self._config = options.config
    self._environ = dict(environ)
    self._job = sweep_trials.tf_config_job(
        options.module, options.job_dir, options.fixed_flags,
        self._config.to_dict())
    self._slots: 'queue.Queue[sweep_devices.Slot]' = queue.Queue()
    for slot in slots:
      self._slots.put(slot)
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._running = 0
    self._error: Optional[BaseException] = None

  def request_stop(self) -> None:
    """Stops every running trial and starts no new one.

    Not for a signal handler (it sets a threading.Event); see
    trainer.sweep.stop_on_signals.
    """
    self._stop.set()

  def run(self) -> str:
    """Runs trials until the budget is spent, too many failed, or stopped.

    Returns:
      DONE, TOO_MANY_FAILURES or INTERRUPTED.

    Raises:
      Exception: whatever went wrong in the sweep itself (not in a trial),
        after the running trials were stopped.
    """
    sweep_hparams.prepare()
    if not glob.glob(os.path.join(self._options.job_dir, 'events.out.*')):
      # Written once: a resumed sweep has the same config (checked).
      sweep_hparams.write_experiment(self._options.job_dir, self._config)
    # GridSampler stops an optimize call early when it believes its grid is
    # covered, counting interrupted trials whose reruns are still queued:
    # go on until the budget, by this sweep's count, is spent.
    while True:
      if self._stop.is_set():
        return INTERRUPTED
      if self.failed_trials_over_limit():
        return TOO_MANY_FAILURES
      left = sweep_study.remaining(self._study, self._config.trial_budget)
      if left == 0:
        return DONE
      try:
        self._study.optimize(
            self._objective, n_trials=left,
            n_jobs=min(self._config.max_parallel_trials, left),
            catch=(TrialFailed,), callbacks=[self._after_trial])
      except TrialInterrupted:
        pass  # The loop's first check returns INTERRUPTED.
      if self._error is not None:
        raise self._error

  def failed_trials(self) -> List[optuna.trial.FrozenTrial]:
    """The trials that failed by themselves (not the interrupted ones)."""
    return sweep_study.with_status(self._study.get_trials(deepcopy=False),
                                   sweep_study.FAILED)

  def failed_trials_over_limit(self) -> bool:
    """True once more trials failed than maxFailedTrials allows."""
    return len(self.failed_trials()) > self._config.failure_limit

  def _objective(self, trial: optuna.Trial) -> float:
    try:
      return self._run_trial(trial)
    except (TrialFailed, TrialInterrupted, optuna.TrialPruned):
      raise
    except BaseException as e:
      # A fault of the sweep, not of the trial. Optuna drops exceptions of
      # parallel trials that end after the last one was submitted, so keep
      # it to raise from run(), and stop the other trials meanwhile.
      with self._lock:
        self._error = self._error or e
      self._stop.set()
      raise

  def _run_trial(self, trial: optuna.Trial) -> float:
    values = sweep_space.suggest(trial, self._config)
    trial.set_user_attr(sweep_study.VALUES_ATTR, values)
    if self._stop.is_set():
      # Drawn but never started: a rerun with these values is queued on
      # --resume, as for any interrupted trial. Raises TrialInterrupted.
      return self._conclude(trial, values, sweep_trials.Outcome(
          sweep_trials.INTERRUPTED))
    slot = self._slots.get()
    try:
      outcome = self._run_process(trial, values, slot)
    finally:
      self._slots.put(slot)
    return self._conclude(trial, values, outcome)

  def _run_process(self, trial: optuna.Trial, values: Dict[str, object],
                   slot: sweep_devices.Slot) -> sweep_trials.Outcome:
    options = self._options
    trial_id = sweep_study.trial_id_of(trial.number)
    resumes = trial.user_attrs.get(sweep_study.RESUMES_ATTR)
    spec = sweep_trials.make_spec(
        options.job_dir, os.path.basename(resumes) if resumes else trial_id,
        options.module, values, options.fixed_flags,
        sweep_devices.thread_flags(slot, options.fixed_flags),
        self._environ,
        sweep_devices.slot_env(slot, self._environ, options.fixed_flags),
        self._config.metric_tag, self._job, resume=bool(resumes))
    trial.set_user_attr(sweep_study.TRIAL_DIR_ATTR, spec.trial_dir)
    trial.set_user_attr(sweep_study.LOG_ATTR, spec.log_path)
    resuming = (f', resuming trial {spec.trial_id} from its checkpoint'
                if resumes else '')
    self._print(f'sweep: trial {trial_id} started: '
                f'{sweep_report.describe_values(values)} '
                f'(log {spec.log_path}{resuming})')

    def on_start(pid: int, started: Optional[str]) -> None:
      trial.set_user_attr(sweep_study.PID_ATTR, pid)
      trial.set_user_attr(sweep_study.PID_START_ATTR, started)

    def on_report(report) -> bool:
      trial.report(report.value, report.step)
      return self._config.early_stopping and trial.should_prune()

    with self._counted_running():
      return sweep_trials.run(spec, on_start, on_report, self._stop,
                              options.poll_secs, options.grace_secs)

  @contextlib.contextmanager
  def _counted_running(self):
    with self._lock:
      self._running += 1
    try:
      yield
    finally:
      with self._lock:
        self._running -= 1

  def _conclude(self, trial: optuna.Trial, values: Dict[str, object],
                outcome: sweep_trials.Outcome) -> float:
    """Records the outcome; returns the objective or raises as Optuna wants.

    Raises:
      TrialInterrupted, optuna.TrialPruned, TrialFailed: as the trial ended.
    """
    attrs = {sweep_study.OUTCOME_ATTR: outcome.status,
             sweep_study.EXIT_CODE_ATTR: outcome.exit_code,
             sweep_study.DURATION_ATTR: outcome.duration_sec,
             sweep_study.LAST_VALUE_ATTR: outcome.value,
             sweep_study.LAST_STEP_ATTR: outcome.step,
             sweep_study.ERROR_ATTR: outcome.error}
    for key, value in attrs.items():
      trial.set_user_attr(key, value)
    trial_id = sweep_study.trial_id_of(trial.number)
    if outcome.status == sweep_trials.INTERRUPTED:
      raise TrialInterrupted(f'trial {trial_id} interrupted')
    if outcome.exit_code is not None:  # Else it never ran: no session.
      sweep_hparams.write_trial(
          trial.user_attrs[sweep_study.TRIAL_DIR_ATTR], trial_id, values,
          self._config.metric_tag, outcome.value, outcome.step,
          outcome.status)
    if outcome.status == sweep_trials.COMPLETE:
      return outcome.value
    if outcome.status == sweep_trials.PRUNED:
      raise optuna.TrialPruned(f'trial {trial_id} pruned at step '
                               f'{outcome.step}')
    raise TrialFailed(f'trial {trial_id}: {outcome.error}')

  def _after_trial(self, study: optuna.Study,
                   trial: optuna.trial.FrozenTrial) -> None:
    # Optuna calls this in the trial's thread once the trial is stored.
    with self._lock:
      running = self._running
    self._print(sweep_report.progress_line(trial, study, self._config,
                                           running))
    if self.failed_trials_over_limit():
      study.stop()  # Start no new trial; running ones finish.

  def _print(self, line: str) -> None:
    with self._lock:
      print(line, flush=True)
