"""`python -m trainer.sweep` end to end: real sweeps, real trial processes.

The trials run trainer.task on the embedded digits with a tiny DNN and 30
steps (5-10 s each), except where a stand-in trainer written below (no
TensorFlow, the real cloudml-hypertune library) makes pruning and the trial
environment quick to check. No process may outlive a test: an autouse
fixture looks for any left (by their job dir on the command line), kills
them and fails the test.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap

import optuna
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
import tensorflow as tf

from cli_helpers import wait_until
from trainer import core_share
from trainer.sweep import devices as sweep_devices
from trainer.sweep import process as sweep_process
from trainer.sweep import study as sweep_study

pytestmark = pytest.mark.cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ('--train-steps=30', '--cpu-towers=1', '--model=dnn',
        '--hidden-units=16', '--optimizer=sgd', '--eval-batch-size=360')
FAST = ('--poll-secs=0.2', '--termination-grace-secs=5')

optuna.logging.set_verbosity(optuna.logging.ERROR)


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  """Every job dir of this module lives here (so its processes are found)."""
  return tmp_path_factory.mktemp('sweeps')


def _processes_mentioning(text):
  """Pids of live processes whose command line contains `text`."""
  pids = []
  for entry in os.listdir('/proc'):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      with open(f'/proc/{entry}/cmdline', 'rb') as f:
        cmdline = f.read().decode(errors='replace')
    except OSError:
      continue  # Exited meanwhile.
    if text in cmdline and sweep_process.start_time(int(entry)):
      pids.append(int(entry))
  return pids


@pytest.fixture(autouse=True)
def no_process_survives(root):
  yield
  leftovers = _processes_mentioning(str(root))
  for pid in leftovers:
    os.kill(pid, signal.SIGKILL)
  assert not leftovers, f'processes outlived the test: {leftovers}'


def _env(extra_path=None):
  env = {**os.environ,
         'PYTHONPATH': os.pathsep.join(p for p in (ROOT, extra_path) if p)}
  env.pop('TF_CONFIG', None)
  env.pop('OMP_NUM_THREADS', None)
  # The package's own default, which keeps TensorFlow's import-time C++
  # noise off stderr (the sweep's errors are its first line).
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)
  return env


def _write_config(path, text):
  path.write_text(textwrap.dedent(text))
  return str(path)


def _sweep(config, job_dir, *args, fixed=TINY, extra_path=None, timeout=240):
  """Runs a sweep to its end; returns the completed process."""
  command = [sys.executable, '-m', 'trainer.sweep', f'--config={config}',
             f'--job-dir={job_dir}', *FAST, *args, '--', *fixed]
  return subprocess.run(command, cwd=ROOT, env=_env(extra_path),
                        capture_output=True, text=True, timeout=timeout,
                        stdin=subprocess.DEVNULL)


def _signalled_sweep(command, env, ready, what, signum):
  """Runs a sweep until `ready()`, sends it `signum`; (exit code, stderr)."""
  sweep = subprocess.Popen(command, cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, stdin=subprocess.DEVNULL,
                           start_new_session=True)
  try:
    wait_until(ready, 120, what, sweep)
    sweep.send_signal(signum)
    _, stderr = sweep.communicate(timeout=60)
  finally:
    if sweep.poll() is None:
      os.killpg(sweep.pid, signal.SIGKILL)
      sweep.wait()
  return sweep.returncode, stderr


def _csv(job_dir):
  with open(os.path.join(job_dir, 'sweep_results.csv'), newline='') as f:
    return list(csv.DictReader(f))


def _trials(job_dir):
  """The trials in a job dir's sweep.db (created, never changed, here)."""
  storage = optuna.storages.RDBStorage(sweep_study.storage_url(str(job_dir)),
                                       skip_table_creation=True)
  return optuna.load_study(study_name='sweep', storage=storage).get_trials()


def _first_trial_started(job_dir):
  # Before that, the sweep may still be creating sweep.db: opening it then
  # could race with the creation.
  return (job_dir / '1' / 'trial.log').exists()


# A 2x2 grid under a budget of 6: the grid runs out first.
GRID_CONFIG = """\
    trainingInput:
      hyperparameters:
        goal: MAXIMIZE
        hyperparameterMetricTag: accuracy
        maxTrials: 6
        maxParallelTrials: 2
        algorithm: GRID_SEARCH
        params:
          - parameterName: learning-rate
            type: DISCRETE
            discreteValues: [0.0001, 0.5]
          - parameterName: tf-random-seed
            type: INTEGER
            minValue: 1
            maxValue: 2
    """


@pytest.fixture(scope='module')
def grid_sweep(root):
  job_dir = root / 'grid'
  config = _write_config(root / 'grid.yaml', GRID_CONFIG)
  result = _sweep(config, job_dir, '--seed=0')
  return config, job_dir, result


def test_grid_sweep_finds_the_better_learning_rate(grid_sweep):
  _, job_dir, result = grid_sweep
  assert result.returncode == 0, result.stderr[-3000:]
  rows = _csv(job_dir)
  assert len(rows) == 4  # The 2x2 grid, although maxTrials is 6.
  assert {(r['learning-rate'], r['tf-random-seed']) for r in rows} == {
      ('0.0001', '1'), ('0.0001', '2'), ('0.5', '1'), ('0.5', '2')}
  assert all(r['status'] == 'complete' and r['exit_code'] == '0'
             for r in rows)
  by_lr = {}
  for r in rows:
    by_lr.setdefault(r['learning-rate'], []).append(float(r['objective']))
  assert min(by_lr['0.5']) > max(by_lr['0.0001']) + 0.2
  best = [l for l in result.stdout.splitlines()
          if l.startswith('sweep: best ')]
  assert len(best) == 1 and 'learning-rate=0.5 ' in best[0], result.stdout
  assert 'trial  learning-rate  tf-random-seed  objective' in result.stdout
  assert ' running | best ' in result.stdout  # Progress lines.
  cpus = core_share.machine_cores()
  for r in rows:
    trial_dir = job_dir / r['trial']
    assert r['job_dir'] == str(trial_dir)
    assert r['log'] == str(trial_dir / 'trial.log')
    assert 'eval: accuracy=' in (trial_dir / 'trial.log').read_text()
    reports = [json.loads(l) for l in
               (trial_dir / 'hypertune' / 'metrics').read_text().splitlines()]
    assert reports[-1]['trial'] == r['trial']
    assert float(reports[-1]['accuracy']) == pytest.approx(
        float(r['objective']))
    task = json.loads((trial_dir / 'trainer_config.json').read_text())
    assert task['learning_rate'] == float(r['learning-rate'])
    assert task['intra_op_threads'] == max(1, cpus // 2)


def test_hparams_summaries_show_the_sweep(grid_sweep):
  _, job_dir, _ = grid_sweep
  experiment = event_accumulator.EventAccumulator(str(job_dir))
  experiment.Reload()
  content = experiment.PluginTagToContent('hparams')
  info = hparams_metadata.parse_experiment_plugin_data(
      content[hparams_metadata.EXPERIMENT_TAG])
  assert sorted(h.name for h in info.hparam_infos) == [
      'learning-rate', 'tf-random-seed']
  assert [m.name.tag for m in info.metric_infos] == ['accuracy']
  for row in _csv(job_dir):
    session = event_accumulator.EventAccumulator(
        str(job_dir / row['trial'] / 'hparams'),
        size_guidance={event_accumulator.TENSORS: 0})
    session.Reload()
    content = session.PluginTagToContent('hparams')
    start = hparams_metadata.parse_session_start_info_plugin_data(
        content[hparams_metadata.SESSION_START_INFO_TAG])
    assert start.group_name == row['trial']
    assert start.hparams['learning-rate'].number_value == pytest.approx(
        float(row['learning-rate']))
    assert start.hparams['tf-random-seed'].number_value == int(
        row['tf-random-seed'])
    (event,) = session.Tensors('accuracy')
    assert float(tf.make_ndarray(event.tensor_proto)) == pytest.approx(
        float(row['objective']))


def test_existing_sweep_needs_resume_and_the_same_settings(grid_sweep, root):
  config, job_dir, _ = grid_sweep
  fresh = _sweep(config, job_dir)
  assert fresh.returncode == 2
  assert 'sweep: error: ' in fresh.stderr
  assert 'pass --resume to continue it' in fresh.stderr
  other = _write_config(root / 'other.yaml',
                        GRID_CONFIG.replace('maxTrials: 6', 'maxTrials: 5'))
  changed = _sweep(other, job_dir, '--resume')
  assert changed.returncode == 2
  assert 'hyperparameters.maxTrials: was 6, now 5' in changed.stderr
  flags = _sweep(config, job_dir, '--resume', fixed=TINY + ('--dropout=0.1',))
  assert flags.returncode == 2 and 'fixed_flags: was' in flags.stderr
  assert len(_csv(job_dir)) == 4  # Nothing was run or rewritten.


RESUME_CONFIG = """\
    hyperparameters:
      goal: MAXIMIZE
      hyperparameterMetricTag: accuracy
      maxTrials: 3
      algorithm: GRID_SEARCH
      params:
        - parameterName: tf-random-seed
          type: INTEGER
          minValue: 1
          maxValue: 3
    """


def test_resume_after_kill_9_reruns_nothing_finished(root):
  job_dir = root / 'resume'
  config = _write_config(root / 'resume.yaml', RESUME_CONFIG)
  fixed = TINY + ('--learning-rate=0.5',)
  command = [sys.executable, '-m', 'trainer.sweep', f'--config={config}',
             f'--job-dir={job_dir}', *FAST, '--', *fixed]
  sweep = subprocess.Popen(command, cwd=ROOT, env=_env(),
                           stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL,
                           stdin=subprocess.DEVNULL, start_new_session=True)
  try:

    def second_trial_running():
      if not _first_trial_started(job_dir):
        return None
      trials = _trials(job_dir)
      done = [t for t in trials if t.state.name == 'COMPLETE']
      running = [t for t in trials if t.state.name == 'RUNNING'
                 and 'pid_start' in t.user_attrs]
      return (done, running) if done and running else None

    done, running = wait_until(second_trial_running, 120,
                              'a finished and a running trial')
  finally:
    os.killpg(sweep.pid, signal.SIGKILL)
    sweep.wait()
  orphan = running[0].user_attrs
  # Trials run in their own sessions: killing the sweep left this one on.
  assert sweep_process.start_time(orphan['pid']) == orphan['pid_start']
  first = done[0]
  first_log = (job_dir / '1' / 'trial.log').read_text()

  resumed = _sweep(config, job_dir, '--resume', fixed=fixed)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert sweep_process.start_time(orphan['pid']) != orphan['pid_start']
  trials = _trials(job_dir)
  statuses = [sweep_study.status(t) for t in trials]
  assert statuses.count('complete') == 3
  assert statuses.count('interrupted') == len(running) == 1
  again = trials[first.number]
  assert again.datetime_complete == first.datetime_complete
  assert (job_dir / '1' / 'trial.log').read_text() == first_log
  interrupted = trials[running[0].number]
  (rerun,) = [t for t in trials
              if t.user_attrs.get('retry_of') == interrupted.number]
  assert rerun.params == interrupted.params
  assert sweep_study.status(rerun) == 'complete'
  seeds = sorted(t.params['tf-random-seed'] for t in trials
                 if sweep_study.status(t) == 'complete')
  assert seeds == [1, 2, 3]  # The whole grid, each point run to the end once.
  for t in trials:
    if sweep_study.status(t) == 'complete':
      with open(os.path.join(t.user_attrs['job_dir'], 'trial.log')) as f:
        evals = [l for l in f if l.startswith('eval: ')]
      # Each ran to the end once: the rerun's log also holds the orphan's
      # run, which may have finished before the resumed sweep stopped it.
      assert len(evals) == 1 or t.number == rerun.number, evals
      assert ' global_step=30 ' in evals[-1]
  # The rerun went on in the interrupted trial's directory.
  assert rerun.user_attrs['job_dir'] == interrupted.user_attrs['job_dir']
  rows = _csv(job_dir)
  assert [r['status'] for r in rows].count('complete') == 3


def test_sigterm_then_resume_continues_the_trial_from_its_checkpoint(root):
  job_dir = root / 'sigterm'
  config = _write_config(root / 'sigterm.yaml', RESUME_CONFIG.replace(
      'maxTrials: 3', 'maxTrials: 1').replace('maxValue: 3', 'maxValue: 1'))
  # Long enough that the signal lands mid-training; no periodic checkpoint
  # after step 0, so only the one saved on SIGTERM can be resumed.
  fixed = TINY[1:] + ('--train-steps=1000', '--train-batch-size=512',
                      '--log-step-count-steps=10',
                      '--save-checkpoints-steps=100000')
  command = [sys.executable, '-m', 'trainer.sweep', f'--config={config}',
             f'--job-dir={job_dir}', *FAST, '--', *fixed]
  log = job_dir / '1' / 'trial.log'
  code, stderr = _signalled_sweep(
      command, _env(), lambda: log.exists() and 'examples/sec' in
      log.read_text(), 'the trial to train', signal.SIGTERM)
  assert code == 143, stderr[-3000:]
  (stopped,) = _trials(job_dir)
  # It saved and exited by itself within the grace period (not SIGKILL).
  assert stopped.user_attrs['exit_code'] == 143, log.read_text()[-3000:]
  saved = tf.train.latest_checkpoint(str(job_dir / '1'))
  assert saved and f'Received SIGTERM: saved {saved}' in log.read_text()

  resumed = _sweep(config, job_dir, '--resume', fixed=fixed)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  _, rerun = _trials(job_dir)
  assert rerun.user_attrs['job_dir'] == str(job_dir / '1')
  assert not (job_dir / '2').exists()
  text = log.read_text()
  assert f'Resuming from {saved}' in text, text[-3000:]
  assert 'eval: accuracy=' in text and 'global_step=1000' in text
  assert [r['status'] for r in _csv(job_dir)] == ['interrupted', 'complete']


FAILING_CONFIG = """\
    hyperparameters:
      goal: MAXIMIZE
      hyperparameterMetricTag: accuracy
      maxTrials: 5
      maxFailedTrials: 2
      algorithm: GRID_SEARCH
      params:
        - parameterName: optimizer
          type: CATEGORICAL
          categoricalValues: [sgd, bogus-a, bogus-b, bogus-c, bogus-d]
    """


def test_failed_trials_are_recorded_until_too_many(root):
  job_dir = root / 'failing'
  config = _write_config(root / 'failing.yaml', FAILING_CONFIG)
  fixed = tuple(f for f in TINY if not f.startswith('--optimizer'))
  # Seed 0 puts sgd second in the grid: a failure, then a good trial.
  result = _sweep(config, job_dir, '--seed=0', fixed=fixed)
  assert result.returncode == 1, result.stderr[-3000:]
  assert ('sweep: error: 3 trials failed, more than maxFailedTrials allows '
          '(2)') in result.stderr
  rows = _csv(job_dir)
  statuses = [r['status'] for r in rows]
  assert statuses == ['failed', 'complete', 'failed', 'failed']
  assert rows[1]['optimizer'] == 'sgd'
  for r in rows:
    if r['status'] == 'failed':
      assert r['exit_code'] == '2'
      assert 'exited with code 2' in r['error']
      assert r['log'] == str(job_dir / r['trial'] / 'trial.log')
      assert r['optimizer'] in open(r['log']).read()
  assert not (job_dir / '5').exists()  # The sweep stopped.


FAKE_TRAINER = '''\
"""Stand-in trainer: speaks the Cloud trial protocol without TensorFlow."""
import json
import os
import signal
import sys
import time

import hypertune


def on_sigterm(signum, frame):
  print('terminated', flush=True)
  sys.exit(143)


def main():
  signal.signal(signal.SIGTERM, on_sigterm)
  args = dict(a[2:].split('=', 1) for a in sys.argv[1:] if '=' in a)
  trial = json.loads(os.environ['TF_CONFIG'])['task']['trial']
  out = os.path.join(args['job-dir'], trial)
  os.makedirs(out, exist_ok=True)
  keys = ('TF_CONFIG', 'CLOUD_ML_TRIAL_ID', 'CLOUD_ML_HP_METRIC_FILE',
          'CLOUD_ML_HP_METRIC_TAG', 'OMP_NUM_THREADS')
  with open(os.path.join(out, 'seen.json'), 'w') as f:
    json.dump({'argv': sys.argv[1:],
               'env': {k: os.environ.get(k) for k in keys}}, f)
  x = float(args['x'])
  if x == 0:
    return  # Exits 0 without reporting a metric.
  # A test holds trials running for as long as <job-dir>/hold exists.
  hold = os.path.join(args['job-dir'], 'hold')
  deadline = time.time() + 60
  while os.path.exists(hold) and time.time() < deadline:
    time.sleep(0.05)
  reporter = hypertune.HyperTune()
  for step in range(1, int(args.get('steps', '4')) + 1):
    time.sleep(float(args.get('sleep', '0.1')))
    reporter.report_hyperparameter_tuning_metric(
        hyperparameter_metric_tag=os.environ['CLOUD_ML_HP_METRIC_TAG'],
        metric_value=x, global_step=step)
  print('done', flush=True)


main()
'''


@pytest.fixture(scope='module')
def fake_trainer(root):
  directory = root / 'fake_module'
  directory.mkdir()
  (directory / 'fake_trainer.py').write_text(FAKE_TRAINER)
  return str(directory)


def test_trials_get_the_cloud_environment(root, fake_trainer):
  job_dir = root / 'environment'
  config = _write_config(root / 'environment.yaml', """\
      hyperparameters:
        goal: MAXIMIZE
        hyperparameterMetricTag: score
        maxTrials: 2
        maxParallelTrials: 2
        maxFailedTrials: 1
        algorithm: GRID_SEARCH
        params:
          - parameterName: x
            type: DISCRETE
            discreteValues: [0, 5]
      """)
  result = _sweep(config, job_dir, '--module-name=fake_trainer',
                  fixed=('--steps=2',), extra_path=fake_trainer, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = {r['x']: r for r in _csv(job_dir)}
  assert rows['5']['status'] == 'complete'
  assert float(rows['5']['objective']) == 5.0
  # x=0 exits 0 but reports nothing: a failure that names the tag.
  assert rows['0']['status'] == 'failed' and rows['0']['exit_code'] == '0'
  assert "reported no 'score'" in rows['0']['error']
  trial = rows['5']['trial']
  seen = json.loads((job_dir / trial / 'seen.json').read_text())
  env = seen['env']
  tf_config = json.loads(env['TF_CONFIG'])
  assert tf_config['cluster'] == {} and tf_config['environment'] == 'cloud'
  assert tf_config['task'] == {'trial': trial}
  assert tf_config['job']['python_module'] == 'fake_trainer'
  assert tf_config['job']['hyperparameters']['hyperparameter_metric_tag'] \
      == 'score'
  assert env['CLOUD_ML_TRIAL_ID'] == trial
  assert env['CLOUD_ML_HP_METRIC_FILE'] == str(
      job_dir / trial / 'hypertune' / 'metrics')
  assert env['CLOUD_ML_HP_METRIC_TAG'] == 'score'
  threads = max(1, core_share.machine_cores() // 2)
  assert env['OMP_NUM_THREADS'] == str(threads)
  assert seen['argv'] == [f'--job-dir={job_dir}', '--x=5', '--steps=2',
                          f'--intra-op-threads={threads}',
                          f'--inter-op-threads={max(1, threads // 2)}']


def test_early_stopping_prunes_worse_trials(root, fake_trainer):
  job_dir = root / 'pruning'
  config = _write_config(root / 'pruning.yaml', """\
      hyperparameters:
        goal: MAXIMIZE
        hyperparameterMetricTag: score
        maxTrials: 4
        enableTrialEarlyStopping: true
        algorithm: GRID_SEARCH
        params:
          - parameterName: x
            type: DISCRETE
            discreteValues: [1, 2, 3, 4]
      """)
  # Seed 1 runs x=4 first; with one startup trial the median rule then
  # stops every later (lower) trial at its first report.
  result = _sweep(config, job_dir, '--module-name=fake_trainer', '--seed=1',
                  '--prune-startup-trials=1', '--poll-secs=0.05',
                  fixed=('--steps=12', '--sleep=0.25'),
                  extra_path=fake_trainer, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = _csv(job_dir)
  assert [(r['x'], r['status']) for r in rows] == [
      ('4', 'complete'), ('3', 'pruned'), ('1', 'pruned'), ('2', 'pruned')]
  for r in rows[1:]:
    log = open(r['log']).read()
    assert 'terminated' in log and 'done' not in log  # Got SIGTERM.
    reports = open(job_dir / r['trial'] / 'hypertune' / 'metrics').read()
    assert 1 <= len(reports.splitlines()) < 12
    assert float(r['objective']) == float(r['x'])  # Its last report.


def test_ctrl_c_stops_the_trials_and_resume_reruns_them(root, fake_trainer):
  job_dir = root / 'interrupt'
  job_dir.mkdir()
  (job_dir / 'hold').write_text('')
  config = _write_config(root / 'interrupt.yaml', """\
      hyperparameters:
        goal: MINIMIZE
        hyperparameterMetricTag: score
        maxTrials: 2
        maxParallelTrials: 2
        algorithm: RANDOM_SEARCH
        params:
          - parameterName: x
            type: DOUBLE
            minValue: 1
            maxValue: 2
      """)
  command = [sys.executable, '-m', 'trainer.sweep', f'--config={config}',
             f'--job-dir={job_dir}', '--module-name=fake_trainer', *FAST,
             '--', '--steps=2']
  sweep = subprocess.Popen(command, cwd=ROOT, env=_env(fake_trainer),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, stdin=subprocess.DEVNULL,
                           start_new_session=True)
  try:

    def both_running():
      if not _first_trial_started(job_dir):
        return None
      running = [t for t in _trials(job_dir) if 'pid_start' in t.user_attrs]
      return running if len(running) == 2 else None

    running = wait_until(both_running, 60, 'two running trials')
    sweep.send_signal(signal.SIGINT)  # What Ctrl-C sends to the sweep.
    _, stderr = sweep.communicate(timeout=60)
  finally:
    if sweep.poll() is None:
      os.killpg(sweep.pid, signal.SIGKILL)
      sweep.wait()
  assert sweep.returncode == 130, stderr[-3000:]
  assert 'sweep: interrupted by SIGINT; 0 finished trial(s) are kept' in stderr
  assert 'with --resume' in stderr
  for trial in running:
    log = job_dir / sweep_study.trial_id_of(trial.number) / 'trial.log'
    assert 'terminated' in log.read_text()  # Stopped, not orphaned.
  assert [sweep_study.status(t) for t in _trials(job_dir)] == [
      'interrupted', 'interrupted']
  assert not (job_dir / 'sweep_results.csv').exists()

  (job_dir / 'hold').unlink()
  resumed = _sweep(config, job_dir, '--resume', '--module-name=fake_trainer',
                   fixed=('--steps=2',), extra_path=fake_trainer, timeout=120)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  trials = _trials(job_dir)
  reruns = {t.user_attrs.get('retry_of'): t for t in trials[2:]}
  assert sorted(reruns) == [0, 1]
  for number, rerun in reruns.items():
    assert sweep_study.status(rerun) == 'complete'
    assert rerun.params == trials[number].params
    assert rerun.value == pytest.approx(trials[number].params['x'])
  assert [r['status'] for r in _csv(job_dir)] == [
      'interrupted', 'interrupted', 'complete', 'complete']


@pytest.mark.parametrize('args,message', [
    ((), 'Flag --config must have a value other than None'),
    (('--config=c.yaml', '--job-dir=j', 'extra'),
     "unexpected arguments ['extra']; trainer flags go after --"),
    (('--config=c.yaml', '--job-dir=j', '--train-steps=3'),
     'Unknown command line flag'),
])
def test_bad_command_lines_exit_2(args, message):
  result = subprocess.run([sys.executable, '-m', 'trainer.sweep', *args],
                          cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 2
  assert result.stderr.startswith('sweep: error: ')
  assert message in result.stderr


@pytest.mark.parametrize('fixed,message', [
    (('--job-dir=/elsewhere',), 'set --job-dir; pass it to the sweep'),
    (('--learning_rate=0.1',), 'set --learning-rate, which the sweep sets'),
    # absl also reads single-dash flags and flags from a --flagfile.
    (('-job-dir=/elsewhere',), "hold '-job-dir=/elsewhere'; spell trainer "
     'flags with two dashes'),
    (('--optimizer', 'sgd', '-learning-rate', '0.1'),
     "hold '-learning-rate'"),
    (('--flagfile=/tmp/flags.txt',), 'use --flagfile, which the sweep cannot '
     'check'),
    (('--undefok=learning-rate',), 'use --undefok'),
    (('--only_check_args',), 'use --only-check-args'),
])
def test_fixed_flags_cannot_set_what_the_sweep_sets(root, fixed, message):
  config = _write_config(root / 'conflict.yaml', GRID_CONFIG)
  job_dir = root / 'conflict'
  result = _sweep(config, job_dir, fixed=fixed)
  assert result.returncode == 2 and message in result.stderr, result.stderr
  assert not (job_dir / 'sweep.db').exists()


@pytest.mark.parametrize('setting,message', [
    ('maxParallelTrials: 100000000', 'maxParallelTrials: 100000000 is more '
     'trials than this machine runs at once'),
    ('maxParallelTrials: 2\n        maxTrials: 3',
     "line 7, column 5: 'maxTrials' is set twice (also on line 5)"),
])
def test_impossible_configs_exit_2_in_one_line(root, setting, message):
  config = _write_config(root / 'impossible.yaml', GRID_CONFIG.replace(
      'maxParallelTrials: 2', setting).replace('maxTrials: 6',
                                               'maxTrials: 100000000'))
  job_dir = root / f'impossible-{setting.split(":")[1].split()[0]}'
  result = _sweep(config, job_dir, timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.startswith('sweep: error: ')
  assert message in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert not job_dir.exists()


def test_a_tag_the_model_does_not_report_stops_before_any_trial(root):
  # Each trial reported the accuracy under it, and the sweep minimised that.
  config = _write_config(root / 'rmse.yaml', GRID_CONFIG.replace(
      'goal: MAXIMIZE', 'goal: MINIMIZE').replace(
          'hyperparameterMetricTag: accuracy',
          'hyperparameterMetricTag: val_rmse'))
  job_dir = root / 'rmse'
  result = _sweep(config, job_dir, timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip().splitlines() == [
      "sweep: error: trainer.task refuses the sweep's settings (checked with "
      '--dry-run before any trial): CLOUD_ML_HP_METRIC_TAG=val_rmse '
      '(hyperparameterMetricTag) is not an evaluation result of --model=dnn, '
      'which reports accuracy, loss; set the tag to one of them, or pass '
      '--hypertune-metric=<one of them> to report it under the tag '
      'val_rmse.']
  assert not (job_dir / '1').exists() and not (job_dir / 'sweep.db').exists()


def test_damaged_sweep_db_is_one_line_error(root):
  config = _write_config(root / 'damaged.yaml', GRID_CONFIG)
  job_dir = root / 'damaged'
  job_dir.mkdir()
  (job_dir / 'sweep.db').write_bytes(b'not a database\n' * 200)
  result = _sweep(config, job_dir, '--resume', timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip() == (
      f'sweep: error: {job_dir}/sweep.db cannot be read as a sweep database '
      "(file is not a database); it is damaged or not a sweep's. Move it "
      'away and start the sweep again, or choose a new --job-dir.')


def test_invalid_config_stops_before_any_trial(root):
  config = _write_config(root / 'invalid.yaml', GRID_CONFIG.replace(
      'discreteValues: [0.0001, 0.5]', 'discreteValues: [0.5, 0.0001]'))
  job_dir = root / 'invalid'
  result = _sweep(config, job_dir)
  assert result.returncode == 2
  assert result.stderr.strip() == (
      'sweep: error: params[0] (learning-rate): discreteValues must be '
      'strictly increasing: [0] 0.5 then [1] 0.0001.')
  assert not job_dir.exists()


@pytest.mark.parametrize('algorithm', ['RANDOM_SEARCH',
                                       'ALGORITHM_UNSPECIFIED'])
def test_resume_with_the_same_seed_draws_new_values(root, fake_trainer,
                                                    algorithm):
  job_dir = root / f'seeded-{algorithm}'
  job_dir.mkdir()
  (job_dir / 'hold').write_text('')
  config = _write_config(root / f'seeded-{algorithm}.yaml', f"""\
      hyperparameters:
        goal: MINIMIZE
        hyperparameterMetricTag: score
        maxTrials: 3
        algorithm: {algorithm}
        params:
          - parameterName: x
            type: DOUBLE
            minValue: 1
            maxValue: 2
      """)
  args = ('--module-name=fake_trainer', '--seed=7')
  command = [sys.executable, '-m', 'trainer.sweep', f'--config={config}',
             f'--job-dir={job_dir}', *args, *FAST, '--', '--steps=1']
  code, stderr = _signalled_sweep(
      command, _env(fake_trainer), lambda: _first_trial_started(job_dir) and
      any('pid_start' in t.user_attrs for t in _trials(job_dir)),
      'a running trial', signal.SIGINT)
  assert code == 130, stderr[-3000:]
  (job_dir / 'hold').unlink()
  resumed = _sweep(config, job_dir, '--resume', *args, fixed=('--steps=1',),
                   extra_path=fake_trainer, timeout=120)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  trials = _trials(job_dir)
  drawn = [t.params['x'] for t in trials if 'retry_of' not in t.user_attrs]
  assert len(drawn) == 3  # The first run's trial and two after resuming.
  # Only the rerun of the interrupted trial may repeat its values.
  assert len(set(drawn)) == len(drawn), drawn
