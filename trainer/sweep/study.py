"""The sweep's Optuna study: stored in the job dir, resumable.

Trials live in an Optuna RDB storage, `sqlite:///<job-dir>/sweep.db`, study
`sweep`, next to the settings the sweep was started with (the
hyperparameters block, the fixed trainer flags and the trainer module). A
sweep stopped by Ctrl-C, SIGTERM or SIGKILL resumes with `--resume`:

- finished trials (complete, pruned, failed) are kept and never run again;
- a trial that was running is marked failed and *interrupted*: it does not
  count against maxTrials or maxFailedTrials, and a new trial with the same
  parameters is queued in its place (once: its `retry_of` names the
  original), which runs in the original's directory and so resumes from
  its last checkpoint (the one saved on SIGTERM);
- a trial process a killed sweep left running is stopped first.

A lock on `<job-dir>/sweep.lock` keeps a second sweep out of a running one;
the kernel releases it when the sweep dies, however it dies, so a trial
still RUNNING in the storage when the lock is free belongs to a dead sweep.
"""

import contextlib
import fcntl
import os
import threading
from typing import Any, Dict, IO, Iterator, List, Sequence

from absl import logging
import optuna
from optuna.trial import FrozenTrial
from optuna.trial import TrialState
import sqlalchemy.exc

from trainer.sweep import process as sweep_process
from trainer.sweep import trials as sweep_trials

DB_FILE = 'sweep.db'
LOCK_FILE = 'sweep.lock'
STUDY_NAME = 'sweep'
SETTINGS_ATTR = 'settings'
# User attributes of a trial, set by the sweep while the trial runs.
VALUES_ATTR = 'values'          # {parameterName: value given to the trial}
OUTCOME_ATTR = 'outcome'        # How it ended, as sweep_trials says.
RETRY_ATTR = 'retry_of'         # On a queued rerun: the interrupted trial,
RESUMES_ATTR = 'resumes'        # and its directory, whose checkpoints it
                                # resumes (absent if it never started).
PID_ATTR = 'pid'                # Its process, to stop it if the sweep dies,
PID_START_ATTR = 'pid_start'    # told apart from a recycled pid by this.
TRIAL_DIR_ATTR = 'job_dir'      # <job-dir>/<trial id>
LOG_ATTR = 'log'
LAST_VALUE_ATTR = 'last_value'  # The last reported metric value and step.
LAST_STEP_ATTR = 'last_step'
EXIT_CODE_ATTR = 'exit_code'
DURATION_ATTR = 'duration_sec'
ERROR_ATTR = 'error'

# The statuses of a trial: how it ended (as sweep_trials names it) or where
# it is.
COMPLETE = sweep_trials.COMPLETE
PRUNED = sweep_trials.PRUNED
FAILED = sweep_trials.FAILED
INTERRUPTED = sweep_trials.INTERRUPTED
RUNNING = 'running'
WAITING = 'waiting'


def storage_url(job_dir: str) -> str:
  """The Optuna storage URL of a job dir's sweep."""
  return 'sqlite:///' + os.path.join(os.path.abspath(job_dir), DB_FILE)


def lock(job_dir: str) -> IO:
  """Takes the job dir's sweep lock; keep the returned file open.

  Raises:
    ValueError: another sweep holds it.
  """
  handle = open(os.path.join(job_dir, LOCK_FILE), 'a', encoding='utf-8')
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError as e:
    handle.close()
    raise ValueError(f'another sweep is running in {job_dir}; wait for it to '
                     'end (or stop it) before resuming, or choose a new '
                     '--job-dir.') from e
  return handle


def create(job_dir: str, settings: Dict[str, Any], direction: str,
           sampler: optuna.samplers.BaseSampler,
           pruner: optuna.pruners.BasePruner) -> optuna.Study:
  """Starts a new study in a job dir that holds no sweep yet.

  Args:
    job_dir: The sweep's job dir (exists).
    settings: What the sweep runs; stored to check a later --resume.
    direction: 'maximize' or 'minimize'.
    sampler: The study's sampler.
    pruner: The study's pruner.

  Returns:
    The study.

  Raises:
    ValueError: the job dir already holds a sweep or trial directories.
  """
  if os.path.exists(os.path.join(job_dir, DB_FILE)):
    raise ValueError(f'{job_dir} already holds a sweep ({DB_FILE}); pass '
                     '--resume to continue it, or choose a new --job-dir.')
  trial_dirs = sorted((name for name in os.listdir(job_dir)
                       if name.isdigit()
                       and os.path.isdir(os.path.join(job_dir, name))),
                      key=int)
  if trial_dirs:
    raise ValueError(f'{job_dir} already holds trial directories '
                     f'{trial_dirs[:5]} but no {DB_FILE}; choose a new '
                     '--job-dir.')
  study = optuna.create_study(storage=_storage(job_dir),
                              study_name=STUDY_NAME, direction=direction,
                              sampler=sampler, pruner=pruner)
  study.set_user_attr(SETTINGS_ATTR, settings)
  return study


def resume(job_dir: str, settings: Dict[str, Any], num_params: int,
           grace_secs: float, sampler: optuna.samplers.BaseSampler,
           pruner: optuna.pruners.BasePruner) -> optuna.Study:
  """Loads the job dir's study and readies it to go on.

  Checks the settings, stops trial processes a killed sweep left running,
  marks the trials that were running as interrupted and queues one rerun
  of each. Call only while holding the job dir's lock.

  Args:
    job_dir: The sweep's job dir.
    settings: What the sweep runs now; must equal the stored settings.
    num_params: Parameters per trial (see `ensure_reruns`).
    grace_secs: Time between SIGTERM and SIGKILL for leftover processes.
    sampler: The study's sampler.
    pruner: The study's pruner.

  Returns:
    The study.

  Raises:
    ValueError: there is no sweep to resume, or its settings differ.
  """
  if not os.path.exists(os.path.join(job_dir, DB_FILE)):
    raise ValueError(f'--resume: {job_dir} has no {DB_FILE} to resume; run '
                     'without --resume to start a sweep there.')
  with _readable(job_dir):
    return _resume(job_dir, settings, num_params, grace_secs, sampler, pruner)


def _resume(job_dir, settings, num_params, grace_secs, sampler, pruner):
  storage = _storage(job_dir)
  study_id = _study_id(job_dir, storage)
  stored = storage.get_study_user_attrs(study_id).get(SETTINGS_ATTR)
  if stored is None and not storage.get_all_trials(study_id):
    # The sweep died between creating the study and storing its settings.
    storage.set_study_user_attr(study_id, SETTINGS_ATTR, settings)
  else:
    changes = differences(stored or {}, settings)
    if changes:
      raise ValueError('--resume: this sweep was started with other settings '
                       '(' + '; '.join(changes) + '); resume with the '
                       'original --config and trainer flags, or choose a new '
                       '--job-dir.')
  _interrupt_running(storage, study_id, grace_secs)
  study = optuna.load_study(study_name=STUDY_NAME, storage=storage,
                            sampler=sampler, pruner=pruner)
  ensure_reruns(study, num_params)
  return study


def _study_id(job_dir: str, storage: optuna.storages.RDBStorage) -> int:
  try:
    return storage.get_study_id_from_name(STUDY_NAME)
  except KeyError as e:
    raise ValueError(f'--resume: {job_dir}/{DB_FILE} holds no study '
                     f'{STUDY_NAME!r}; choose a new --job-dir.') from e


def stored_trials(job_dir: str) -> int:
  """How many trials the job dir's sweep holds (0 without a sweep).

  Raises:
    ValueError: sweep.db is not a readable sweep database.
  """
  if not os.path.exists(os.path.join(job_dir, DB_FILE)):
    return 0
  with _readable(job_dir):
    storage = _storage(job_dir)
    try:
      study_id = storage.get_study_id_from_name(STUDY_NAME)
    except KeyError:
      return 0  # resume() says what is wrong.
    return len(storage.get_all_trials(study_id, deepcopy=False))


@contextlib.contextmanager
def _readable(job_dir: str) -> Iterator[None]:
  """Turns a damaged sweep.db's database errors into a ValueError."""
  try:
    yield
  except sqlalchemy.exc.SQLAlchemyError as e:
    cause = str(getattr(e, 'orig', None) or e).splitlines()[0]
    raise ValueError(
        f'{os.path.join(job_dir, DB_FILE)} cannot be read as a sweep '
        f'database ({cause}); it is damaged or not a sweep\'s. Move it away '
        'and start the sweep again, or choose a new --job-dir.') from e


def _interrupt_running(storage: optuna.storages.RDBStorage, study_id: int,
                       grace_secs: float) -> None:
  """Marks trials left RUNNING by a dead sweep as interrupted (FAIL).

  This goes to the storage directly, as Optuna's own stale-trial handling
  does: `Study.tell` would also run the sampler's after-trial hook, which
  for GridSampler may try to stop an optimize loop that is not running.
  """
  for trial in storage.get_all_trials(study_id, deepcopy=False,
                                      states=(TrialState.RUNNING,)):
    _stop_leftover(trial, grace_secs)
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        study_id, trial.number)
    storage.set_trial_user_attr(trial_id, OUTCOME_ATTR, INTERRUPTED)
    storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
    logging.info('Trial %s was running when the sweep stopped: it will run '
                 'again.', trial_id_of(trial.number))


class _SweepStorage(optuna.storages.RDBStorage):
  """RDBStorage whose trial state changes are atomic among threads.

  Taking a queued trial reads its state, then writes RUNNING. SQLite ignores
  SELECT ... FOR UPDATE, so two parallel trials' threads can both read
  WAITING and run the same queued trial. Only one sweep process uses a job
  dir (sweep.lock), so a lock in the process makes the change atomic.
  """

  def __init__(self, url: str, **kwargs):
    super().__init__(url, **kwargs)
    self._state_lock = threading.Lock()

  def set_trial_state_values(self, trial_id, state, values=None) -> bool:
    with self._state_lock:
      return super().set_trial_state_values(trial_id, state, values)


def _storage(job_dir: str) -> optuna.storages.RDBStorage:
  # Parallel trials write from several threads: wait for SQLite's lock
  # rather than fail with "database is locked".
  return _SweepStorage(storage_url(job_dir),
                       engine_kwargs={'connect_args': {'timeout': 60}})


def differences(stored: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
  """What differs between two settings, field by field, for a message."""
  out = []
  for key in sorted(set(stored) | set(current)):
    old, new = stored.get(key), current.get(key)
    if isinstance(old, dict) and isinstance(new, dict):
      out += [f'{key}.{change}' for change in differences(old, new)]
    elif old != new:
      out.append(f'{key}: was {old!r}, now {new!r}')
  return out


def status(trial: FrozenTrial) -> str:
  """complete, pruned, failed, interrupted, running or waiting.

  A FAIL the sweep did not record as the trial's own failure is an
  interruption: the sweep stopped, or died, while the trial ran.
  """
  if trial.state == TrialState.COMPLETE:
    return COMPLETE
  if trial.state == TrialState.PRUNED:
    return PRUNED
  if trial.state == TrialState.FAIL:
    return FAILED if trial.user_attrs.get(OUTCOME_ATTR) == FAILED \
        else INTERRUPTED
  if trial.state == TrialState.WAITING:
    return WAITING
  return RUNNING


def with_status(trials: Sequence[FrozenTrial],
                *statuses: str) -> List[FrozenTrial]:
  """The trials whose `status` is one of `statuses`."""
  return [t for t in trials if status(t) in statuses]


def counted(trials: Sequence[FrozenTrial]) -> List[FrozenTrial]:
  """Trials that used up budget: complete, pruned or failed."""
  return with_status(trials, COMPLETE, PRUNED, FAILED)


def remaining(study: optuna.Study, budget: int) -> int:
  """Trials still to run of `budget`."""
  return max(0, budget - len(counted(study.get_trials(deepcopy=False))))


def ensure_reruns(study: optuna.Study, num_params: int) -> List[int]:
  """Queues one rerun, with the same parameters, of each interrupted trial.

  Idempotent: a trial whose rerun is queued already (its `retry_of`) gets
  no second one, so a sweep that dies while resuming loses nothing and
  runs nothing twice.

  Args:
    study: The study.
    num_params: Parameters per trial; a trial interrupted before all were
      drawn never ran, and the sampler fills its place anew.

  Returns:
    The numbers of the trials whose rerun was queued now.
  """
  trials = study.get_trials(deepcopy=False)
  rerun = {t.user_attrs.get(RETRY_ATTR) for t in trials}
  queued = []
  for trial in with_status(trials, INTERRUPTED):
    if trial.number in rerun or len(trial.params) != num_params:
      continue
    attrs = {RETRY_ATTR: trial.number}
    if trial.user_attrs.get(TRIAL_DIR_ATTR):
      attrs[RESUMES_ATTR] = trial.user_attrs[TRIAL_DIR_ATTR]
    study.enqueue_trial(dict(trial.params), user_attrs=attrs)
    queued.append(trial.number)
  return queued


def trial_id_of(number: int) -> str:
  """The trial id of Optuna trial `number`: Cloud counts trials from 1."""
  return str(number + 1)


def _stop_leftover(trial: FrozenTrial, grace_secs: float) -> None:
  pid = trial.user_attrs.get(PID_ATTR)
  started = trial.user_attrs.get(PID_START_ATTR)
  if pid is None:
    return
  if started is None or not sweep_process.can_identify_processes():
    logging.warning('Cannot tell whether process %s of interrupted trial %s '
                    'still runs; make sure it has stopped.', pid,
                    trial_id_of(trial.number))
    return
  if sweep_process.stop_orphan(pid, started, grace_secs):
    logging.info('Stopped process %d of interrupted trial %s.', pid,
                 trial_id_of(trial.number))
