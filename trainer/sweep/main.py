"""`python -m trainer.sweep`: a Cloud-style hyperparameter sweep, locally.

    python -m trainer.sweep --config hptuning_config.yaml --job-dir DIR \\
        [--resume] [-- fixed trainer flags]

Reads the `trainingInput.hyperparameters` block gcloud takes and runs each
trial as `python -m trainer.task --job-dir=DIR --<param>=<value> <fixed
flags>` in its own process, with the environment a Cloud trial gets. Optuna
searches (TPE, random or grid), prunes with a median rule when early
stopping is on, and keeps every trial in DIR/sweep.db so that an
interrupted sweep goes on with --resume. Results: DIR/sweep_results.csv, a
table on stdout and TensorBoard's HParams dashboard. See docs/sweeps.md.
"""

import contextlib
import os
import signal
import sys
import threading
from typing import List, Sequence

from absl import flags
import optuna

from trainer.sweep import config as sweep_config
from trainer.sweep import devices as sweep_devices
from trainer.sweep import preflight as sweep_preflight
from trainer.sweep import report as sweep_report
from trainer.sweep import runner as sweep_runner
from trainer.sweep import space as sweep_space
from trainer.sweep import study as sweep_study
from trainer import cli
from trainer import core_share
from trainer.cli import value

FLAGS = flags.FLAGS

# Exit codes.
EXIT_FAILED = cli.EXIT_FAILED   # Too many failed trials, or none completed.
EXIT_USAGE = cli.EXIT_USAGE     # Bad flags, config or job dir.

# absl flags that change how a trial reads its flags, not what it trains:
# a --flagfile can set --job-dir or a swept parameter unseen, --undefok
# hides a misspelt flag, --only_check_args exits 0 untrained.
_FORBIDDEN_FIXED = ('flagfile', 'undefok', 'only-check-args', 'help',
                    'helpfull', 'helpshort', 'helpxml')


def define_flags() -> None:
  """Defines the sweep's flags (idempotent per process)."""
  if 'config' in FLAGS:
    return
  d = cli.define
  d(flags.DEFINE_string, 'config', None, 'hptuning_config.yaml: a file with '
    'trainingInput: hyperparameters: ... (as gcloud takes it) or a bare '
    'hyperparameters: block.')
  d(flags.DEFINE_string, 'job-dir', None, 'Local directory of the sweep: '
    'sweep.db, one directory per trial, the results.')
  d(flags.DEFINE_boolean, 'resume', False, 'Go on with the sweep in '
    '--job-dir (after Ctrl-C, a kill or a crash).')
  d(flags.DEFINE_integer, 'seed', None, 'Seed of the sampler\'s random draws; '
    'default: a fresh one each run. A resumed sweep mixes it with its trial '
    'count, so that it draws anew.', lower_bound=0, upper_bound=2**32 - 1)
  d(flags.DEFINE_string, 'module-name', 'trainer.task', 'The trainer module '
    'each trial runs with python -m (as gcloud\'s --module-name).')
  d(flags.DEFINE_integer, 'prune-startup-trials', 5, 'With '
    'enableTrialEarlyStopping: trials that must complete before the median '
    'rule prunes any.', lower_bound=0)
  d(flags.DEFINE_float, 'poll-secs', 1.0, 'How often a running trial\'s '
    'metric file is read.', lower_bound=0.05)
  d(flags.DEFINE_float, 'termination-grace-secs', 10.0, 'Time a stopped '
    'trial gets between SIGTERM and SIGKILL.', lower_bound=0.0)


define_flags()


def fail(message: str, code: int) -> None:
  """Prints `sweep: error: <message>` and exits with `code`."""
  cli.fail('sweep', message, code)


def check_fixed_flags(fixed: Sequence[str],
                      config: sweep_config.SweepConfig) -> None:
  """Refuses fixed flags the sweep sets itself, or that it cannot check.

  Raises:
    ValueError: the fixed flags set --job-dir or a swept parameter, use a
      single dash (which absl also accepts, as in -job-dir=...), or use
      --flagfile and the like.
  """
  for arg in fixed:
    if _is_single_dash_flag(arg):
      raise ValueError(f'the trainer flags after -- hold {arg!r}; spell '
                       'trainer flags with two dashes (--name=value) so that '
                       'the sweep can check them.')
  present = sweep_devices.flags_set(fixed)
  for name in _FORBIDDEN_FIXED:
    if name in present:
      raise ValueError(f'the trainer flags after -- use --{name}, which the '
                       'sweep cannot check; write the flags themselves after '
                       '--.')
  if 'job-dir' in present:
    raise ValueError('the trainer flags after -- set --job-dir; pass it to '
                     'the sweep (before --): each trial writes under '
                     '<job-dir>/<trial id>.')
  for spec in config.params:
    if spec.name.replace('_', '-') in present:
      raise ValueError(f'the trainer flags after -- set --{spec.name}, which '
                       'the sweep sets for each trial (params); remove it.')


def _is_single_dash_flag(arg: str) -> bool:
  """-name or -name=value; not a negative number (a flag's separate value)."""
  return (len(arg) > 1 and arg[0] == '-' and arg[1] != '-' and
          not arg[1].isdigit() and arg[1] != '.')


def prepare_job_dir(job_dir: str) -> str:
  """The job dir as an absolute local path, created if needed.

  Raises:
    ValueError: a remote path (the study's SQLite file must be local).
  """
  if '://' in job_dir:
    raise ValueError(f'--job-dir={job_dir}: a sweep needs a local directory '
                     '(its Optuna storage is a SQLite file there).')
  path = os.path.abspath(job_dir)
  os.makedirs(path, exist_ok=True)
  return path


def main(argv: List[str]) -> None:
  fixed = argv[1:]
  try:
    config = sweep_config.load(value('config'))
    check_fixed_flags(fixed, config)
    sweep_devices.check_parallel(config.max_parallel_trials,
                                 sweep_devices.visible_gpus(os.environ),
                                 core_share.machine_cores())
    job_dir = prepare_job_dir(value('job-dir'))
    lock = sweep_study.lock(job_dir)
    if not value('resume'):  # A resumed sweep passed it with these settings.
      sweep_preflight.check(value('module-name'), job_dir, fixed,
                            config.metric_tag, os.environ)
  except ValueError as e:
    fail(str(e), EXIT_USAGE)
  optuna.logging.set_verbosity(optuna.logging.ERROR)  # The sweep reports.
  options = sweep_runner.Options(
      job_dir=job_dir, config=config, fixed_flags=tuple(fixed),
      module=value('module-name'), poll_secs=value('poll-secs'),
      grace_secs=value('termination-grace-secs'))
  with lock:  # Held until the sweep exits, however it exits.
    sys.exit(run_locked(options))


def run_locked(options: sweep_runner.Options) -> int:
  """Opens the study, runs the sweep and reports; returns the exit code."""
  try:
    study = open_study(options)
  except ValueError as e:
    fail(str(e), EXIT_USAGE)
  slots = sweep_devices.make_slots(options.config.max_parallel_trials,
                                   sweep_devices.visible_gpus(os.environ),
                                   core_share.machine_cores())
  sweep = sweep_runner.Sweep(study, options, slots, os.environ)
  with stop_on_signals(sweep) as received:
    outcome = sweep.run()
  return finish(outcome, sweep, study, options, received)


def open_study(options: sweep_runner.Options) -> optuna.Study:
  """The job dir's study: a new one, or the one to resume.

  Raises:
    ValueError: see sweep_study.create and sweep_study.resume.
  """
  config = options.config
  settings = {'hyperparameters': config.to_dict(),
              'fixed_flags': list(options.fixed_flags),
              'module': options.module}
  pruner = sweep_space.pruner(config, value('prune-startup-trials'))
  if value('resume'):
    sampler = sweep_space.sampler(
        config, value('seed'), sweep_study.stored_trials(options.job_dir))
    return sweep_study.resume(options.job_dir, settings, len(config.params),
                              options.grace_secs, sampler, pruner)
  return sweep_study.create(options.job_dir, settings,
                            sweep_space.direction(config),
                            sweep_space.sampler(config, value('seed')), pruner)


@contextlib.contextmanager
def stop_on_signals(sweep: sweep_runner.Sweep, poll_secs: float = 0.1):
  """Ctrl-C, SIGTERM and SIGHUP stop the sweep's trials instead of killing it.

  The handler only records the signal: setting a threading.Event from a
  handler can deadlock, when the signal lands while the main thread holds
  that Event's lock. A watcher thread passes the request on.

  Args:
    sweep: The sweep to stop.
    poll_secs: How often the watcher looks for a recorded signal.

  Yields:
    A list that holds the numbers of the signals received.
  """
  received = []
  done = threading.Event()

  def handle(signum, frame):
    del frame  # Unused.
    received.append(signum)  # Atomic: no lock taken in the handler.

  def watch():
    while not done.wait(poll_secs):
      if received:
        sweep.request_stop()
        return

  caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
  previous = {signum: signal.signal(signum, handle) for signum in caught}
  watcher = threading.Thread(target=watch, name='sweep-signals', daemon=True)
  watcher.start()
  try:
    yield received
  finally:
    done.set()
    watcher.join()
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def finish(outcome: str, sweep: sweep_runner.Sweep, study: optuna.Study,
           options: sweep_runner.Options, received: List[int]) -> int:
  """Reports how the sweep ended; returns the exit code."""
  job_dir, config = options.job_dir, options.config
  if outcome == sweep_runner.INTERRUPTED:
    name = signal.Signals(received[0]).name if received else 'a stop request'
    kept = len(sweep_study.counted(study.get_trials(deepcopy=False)))
    sys.stderr.write(
        f'sweep: interrupted by {name}; {kept} finished trial(s) are kept in '
        f'{job_dir}/{sweep_study.DB_FILE}. Run the same command with '
        '--resume to finish the sweep.\n')
    return 128 + (received[0] if received else signal.SIGTERM)
  table = sweep_report.rows(study.get_trials(deepcopy=False), config)
  path = sweep_report.write_csv(job_dir, table, config)
  print(sweep_report.format_table(table, config))
  print(f'sweep: results in {path}; tensorboard --logdir {job_dir} shows '
        'them under HPARAMS.', flush=True)
  if outcome == sweep_runner.TOO_MANY_FAILURES:
    failed = sweep.failed_trials()
    details = '; '.join(
        f'trial {sweep_study.trial_id_of(t.number)}: '
        f'{t.user_attrs.get(sweep_study.ERROR_ATTR)}' for t in failed[:5])
    fail(f'{len(failed)} trials failed, more than maxFailedTrials allows '
         f'({config.failure_limit}); the sweep stopped. {details}',
         EXIT_FAILED)
  best = sweep_report.best_line(study, config)
  if best is None:
    fail('no trial completed; see the trial logs listed in '
         f'{path}.', EXIT_FAILED)
  print(f'sweep: best {best}', flush=True)
  return 0


def run_main() -> None:
  """The `python -m trainer.sweep` entry point."""
  flags.mark_flags_as_required(['config', 'job-dir'])
  cli.run(main, 'sweep', passthrough=True, hint='trainer flags go after --.')
