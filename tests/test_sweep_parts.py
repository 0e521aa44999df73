"""The sweep's parts on their own: search space, metric files, devices,
processes, the study's storage and the results file. Fast: no trainer runs.
"""

import csv
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest

from trainer.sweep import config as sweep_config
from trainer.sweep import devices as sweep_devices
from trainer.sweep import metrics as sweep_metrics
from trainer.sweep import process as sweep_process
from trainer.sweep import report as sweep_report
from trainer.sweep import space as sweep_space
from trainer.sweep import study as sweep_study
from trainer.sweep import trials as sweep_trials

optuna.logging.set_verbosity(optuna.logging.ERROR)


def _config(params, **fields):
  block = {'goal': 'MAXIMIZE', 'hyperparameterMetricTag': 'accuracy',
           'maxTrials': 4, 'params': params}
  block.update(fields)
  return sweep_config.parse(block)


def _draw(config, n, seed=0):
  study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed))
  out = []
  for _ in range(n):
    trial = study.ask()
    out.append((trial, sweep_space.suggest(trial, config)))
    study.tell(trial, 0.0)
  return out


# Search space.


@pytest.mark.fast
def test_reverse_log_scale_crowds_values_near_the_maximum():
  config = _config([{'parameterName': 'momentum', 'type': 'DOUBLE',
                     'minValue': 0.01, 'maxValue': 1.0,
                     'scaleType': 'UNIT_REVERSE_LOG_SCALE'}])
  draws = _draw(config, 200)
  values = [v['momentum'] for _, v in draws]
  assert all(0.01 <= v <= 1.0 for v in values)
  # Log-uniform t in [0.01, 1] has median 0.1, so v = 1.01 - t has median
  # 0.91: nine in ten draws above the linear midpoint would be 50%.
  assert sorted(values)[100] > 0.8
  # Optuna keeps t, drawn on a log scale, under the documented name.
  trial, value = draws[0]
  stored = trial.params['momentum' + sweep_space.REVERSE_LOG_SUFFIX]
  assert value['momentum'] == pytest.approx(0.01 + 1.0 - stored)
  assert trial.distributions['momentum:reverse_log'].log


@pytest.mark.fast
def test_scales_and_types_map_to_optuna_distributions():
  config = _config([
      {'parameterName': 'lr', 'type': 'DOUBLE', 'minValue': 1e-4,
       'maxValue': 1.0, 'scaleType': 'UNIT_LOG_SCALE'},
      {'parameterName': 'units', 'type': 'INTEGER', 'minValue': 8,
       'maxValue': 64, 'scaleType': 'UNIT_LOG_SCALE'},
      {'parameterName': 'depth', 'type': 'INTEGER', 'minValue': 1,
       'maxValue': 4, 'scaleType': 'UNIT_REVERSE_LOG_SCALE'},
      {'parameterName': 'batch', 'type': 'DISCRETE',
       'discreteValues': [16, 32, 64]},
      {'parameterName': 'opt', 'type': 'CATEGORICAL',
       'categoricalValues': ['sgd', 'adam']}])
  for trial, values in _draw(config, 20):
    dists = trial.distributions
    assert dists['lr'].log and isinstance(values['lr'], float)
    assert dists['units'].log and isinstance(values['units'], int)
    assert isinstance(values['depth'], int) and 1 <= values['depth'] <= 4
    assert values['batch'] in (16, 32, 64)
    assert isinstance(values['batch'], int)  # Numbers stay numbers.
    assert values['opt'] in ('sgd', 'adam')
  assert sweep_space.flag_value(0.0001) == '0.0001'
  assert sweep_space.flag_value(1e-05) == '1e-05'
  assert sweep_space.flag_value(32) == '32'


@pytest.mark.fast
def test_samplers_and_pruners_follow_the_config():
  params = [{'parameterName': 'b', 'type': 'DISCRETE',
             'discreteValues': [1, 2]}]
  assert isinstance(sweep_space.sampler(_config(params)),
                    optuna.samplers.TPESampler)
  assert isinstance(
      sweep_space.sampler(_config(params, algorithm='RANDOM_SEARCH')),
      optuna.samplers.RandomSampler)
  assert isinstance(
      sweep_space.sampler(_config(params, algorithm='GRID_SEARCH')),
      optuna.samplers.GridSampler)
  assert isinstance(sweep_space.pruner(_config(params), 5),
                    optuna.pruners.NopPruner)
  assert isinstance(
      sweep_space.pruner(_config(params, enableTrialEarlyStopping=True), 5),
      optuna.pruners.MedianPruner)
  assert sweep_space.direction(_config(params, goal='MINIMIZE')) == 'minimize'


@pytest.mark.fast
def test_grid_covers_every_point_around_a_queued_rerun():
  config = _config([{'parameterName': 's', 'type': 'INTEGER', 'minValue': 1,
                     'maxValue': 3}], algorithm='GRID_SEARCH', maxTrials=3)
  study = optuna.create_study(sampler=sweep_space.sampler(config, 0))
  first = study.ask()
  sweep_space.suggest(first, config)
  study.tell(first, 1.0)
  interrupted = study.ask()
  sweep_space.suggest(interrupted, config)
  study.tell(interrupted, state=optuna.trial.TrialState.FAIL)
  study.enqueue_trial(interrupted.params)
  # Plain GridSampler raises KeyError('grid_id') after the rerun, with one
  # grid point left (optuna/optuna#6844).
  study.optimize(lambda t: float(sweep_space.suggest(t, config)['s']),
                 n_trials=2)
  complete = [t.params['s'] for t in study.trials
              if t.state == optuna.trial.TrialState.COMPLETE]
  assert sorted(complete) == [1, 2, 3]
  assert complete[1] == interrupted.params['s']


# Metric files.


def _line(step, value, tag='accuracy'):
  return json.dumps({'timestamp': 1.0, 'trial': '1', tag: str(value),
                     'global_step': str(step), 'checkpoint_path': ''})


@pytest.mark.fast
def test_metric_file_reads_complete_lines_and_skips_other_tags(tmp_path):
  path = tmp_path / 'metrics'
  assert sweep_metrics.read_reports(str(path), 'accuracy', False) == []
  half = _line(30, 0.9)[:20]
  path.write_text(_line(10, 0.5) + '\n' + _line(20, 0.7, tag='loss') + '\n' +
                  half)
  polled = sweep_metrics.read_reports(str(path), 'accuracy', final=False)
  assert polled == [sweep_metrics.Report(10, 0.5)]
  path.write_text(_line(10, 0.5) + '\n' + _line(30, 0.9))  # No final \n.
  final = sweep_metrics.read_reports(str(path), 'accuracy', final=True)
  assert final == [sweep_metrics.Report(10, 0.5), sweep_metrics.Report(30, 0.9)]


@pytest.mark.fast
def test_malformed_metric_line_names_file_and_line(tmp_path):
  path = tmp_path / 'metrics'
  path.write_text(_line(10, 0.5) + '\n{oops\n')
  with pytest.raises(ValueError, match=r'metrics line 2 is not JSON'):
    sweep_metrics.read_reports(str(path), 'accuracy', final=False)
  path.write_text('{"accuracy": "high", "global_step": "3"}\n')
  with pytest.raises(ValueError, match=r"line 1: accuracy='high'"):
    sweep_metrics.read_reports(str(path), 'accuracy', final=True)


# Devices and threads.


@pytest.mark.fast
@pytest.mark.parametrize('value,expected', [
    ('0,1', ['0', '1']), ('', []), ('-1', []), ('2,-1,3', ['2']),
    (' 1 , 3 ', ['1', '3']), ('GPU-abc', ['GPU-abc'])])
def test_cuda_visible_devices_is_honoured(value, expected):
  assert sweep_devices.visible_gpus({'CUDA_VISIBLE_DEVICES': value}) == \
      expected


@pytest.mark.fast
@pytest.mark.parametrize('gpus,parallel,shares', [
    (4, 2, [('0', '1'), ('2', '3')]),
    (3, 2, [('0', '1'), ('2',)]),
    (1, 2, [('0',), ('0',)]),
    (0, 3, [(), (), ()])])
def test_gpus_are_divided_among_parallel_trials(gpus, parallel, shares):
  slots = sweep_devices.make_slots(parallel, [str(i) for i in range(gpus)],
                                   cpus=8)
  assert [s.gpus for s in slots] == shares


@pytest.mark.fast
def test_threads_are_shared_unless_the_fixed_flags_set_them():
  slot = sweep_devices.make_slots(2, [], cpus=8)[1]
  assert (slot.intra_op_threads, slot.inter_op_threads) == (4, 2)
  assert sweep_devices.make_slots(4, [], cpus=2)[0].intra_op_threads == 1
  assert sweep_devices.thread_flags(slot, ['--model=dnn']) == [
      '--intra-op-threads=4', '--inter-op-threads=2']
  assert sweep_devices.thread_flags(slot, ['--intra_op_threads=3']) == [
      '--inter-op-threads=2']
  assert sweep_devices.slot_env(slot, {}, []) == {'OMP_NUM_THREADS': '4'}
  assert sweep_devices.slot_env(slot, {}, ['--intra-op-threads', '3']) == {
      'OMP_NUM_THREADS': '3'}
  assert sweep_devices.slot_env(slot, {'OMP_NUM_THREADS': '1'}, []) == {}
  gpu_slot = sweep_devices.make_slots(2, ['0', '1'], cpus=8)[1]
  assert sweep_devices.slot_env(gpu_slot, {}, [])['CUDA_VISIBLE_DEVICES'] \
      == '1'


# Processes.


def _sleeper():
  return subprocess.Popen([sys.executable, '-c', 'import time; '
                           'time.sleep(60)'], start_new_session=True)


@pytest.mark.cli
def test_stop_orphan_stops_only_the_recorded_process():
  process = _sleeper()
  try:
    started = sweep_process.start_time(process.pid)
    assert started is not None
    # Same pid, other start time: a recycled pid is left alone.
    assert not sweep_process.stop_orphan(process.pid, started + '0', 5)
    assert process.poll() is None
    # stop_orphan watches /proc, where our unreaped child stays a zombie.
    assert sweep_process.stop_orphan(process.pid, started, 5)
    assert process.wait(timeout=5) == -signal.SIGTERM
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


@pytest.mark.cli
def test_stop_escalates_to_sigkill_after_the_grace_period(tmp_path):
  log = open(tmp_path / 'log', 'w')
  with log:
    process = sweep_process.start(
        [sys.executable, '-c', 'import signal, time; '
         'signal.signal(signal.SIGTERM, signal.SIG_IGN); print("up", '
         'flush=True); time.sleep(60)'], dict(os.environ), log)
  try:
    deadline = time.monotonic() + 20
    while 'up' not in (tmp_path / 'log').read_text():
      assert time.monotonic() < deadline
      time.sleep(0.05)
    # The child ignores SIGTERM and would exit 0 after its 60 s sleep.
    assert sweep_process.stop(process, grace_secs=0.5) == -signal.SIGKILL
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


# The study's storage.


def _study(job_dir, config, settings):
  return sweep_study.create(str(job_dir), settings,
                            sweep_space.direction(config),
                            sweep_space.sampler(config, 0),
                            sweep_space.pruner(config, 5))


@pytest.mark.fast
def test_resume_interrupts_running_trials_and_queues_one_rerun(tmp_path):
  config = _config([{'parameterName': 'lr', 'type': 'DOUBLE',
                     'minValue': 0.1, 'maxValue': 0.5}])
  settings = {'hyperparameters': config.to_dict(), 'fixed_flags': ['--a=1'],
              'module': 'trainer.task'}
  study = _study(tmp_path, config, settings)
  done = study.ask()
  sweep_space.suggest(done, config)
  study.tell(done, 0.7)
  left_running = study.ask()
  lr = sweep_space.suggest(left_running, config)['lr']
  # A sweep that dies leaves the trial RUNNING; resuming twice (say the
  # first resume died too) queues a single rerun.
  for _ in range(2):
    resumed = sweep_study.resume(str(tmp_path), settings, 1, 1.0,
                                 sweep_space.sampler(config, 0),
                                 sweep_space.pruner(config, 5))
  trials = resumed.get_trials()
  assert [sweep_study.status(t) for t in trials] == [
      'complete', 'interrupted', 'waiting']
  assert trials[2].user_attrs['retry_of'] == 1
  assert sweep_space.suggest(resumed.ask(), config)['lr'] == lr
  assert sweep_study.remaining(resumed, 4) == 3


@pytest.mark.fast
def test_resume_refuses_other_settings_and_new_start_refuses_old_db(tmp_path):
  config = _config([{'parameterName': 'lr', 'type': 'DOUBLE',
                     'minValue': 0.1, 'maxValue': 0.5}])
  settings = {'hyperparameters': config.to_dict(), 'fixed_flags': [],
              'module': 'trainer.task'}
  _study(tmp_path, config, settings)
  with pytest.raises(ValueError, match=r'pass --resume to continue it'):
    _study(tmp_path, config, settings)
  other = dict(settings, hyperparameters=dict(config.to_dict(), maxTrials=9))
  with pytest.raises(ValueError, match=r'hyperparameters.maxTrials: was 4, '
                     r'now 9'):
    sweep_study.resume(str(tmp_path), other, 1, 1.0,
                       sweep_space.sampler(config),
                       sweep_space.pruner(config, 5))
  with pytest.raises(ValueError, match=r'has no sweep.db to resume'):
    sweep_study.resume(str(tmp_path / 'empty'), settings, 1, 1.0,
                       sweep_space.sampler(config),
                       sweep_space.pruner(config, 5))


@pytest.mark.fast
def test_parallel_trials_never_take_the_same_queued_trial(tmp_path):
  # Without the sweep's storage lock, SQLite lets two threads pop one
  # queued trial (a few times in these 48 pops, almost always).
  taken = []
  for attempt in range(3):
    job_dir = tmp_path / str(attempt)
    job_dir.mkdir()
    config = _config([{'parameterName': 'x', 'type': 'INTEGER',
                       'minValue': 0, 'maxValue': 99}])
    study = _study(job_dir, config, {})
    for x in range(16):
      study.enqueue_trial({'x': x})

    def pop_two(study=study):
      for _ in range(2):
        taken.append((attempt, study.ask().number))

    threads = [threading.Thread(target=pop_two) for _ in range(8)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
  assert len(taken) == 48 and len(set(taken)) == 48


@pytest.mark.fast
def test_job_dir_lock_keeps_a_second_sweep_out(tmp_path):
  first = sweep_study.lock(str(tmp_path))
  with first:
    with pytest.raises(ValueError, match=r'another sweep is running'):
      sweep_study.lock(str(tmp_path))
  sweep_study.lock(str(tmp_path)).close()  # Free again.


# Results.


@pytest.mark.fast
def test_results_csv_is_written_whole(tmp_path):
  config = _config([{'parameterName': 'lr', 'type': 'DOUBLE',
                     'minValue': 0.1, 'maxValue': 0.5}])
  table = [{'trial': '1', 'lr': 0.25, 'objective': 0.9, 'status': 'complete',
            'duration_sec': 1.5, 'job_dir': '/j/1', 'exit_code': 0,
            'log': '/j/1/trial.log', 'error': ''}]
  path = sweep_report.write_csv(str(tmp_path), table, config)
  assert sorted(os.listdir(tmp_path)) == ['sweep_results.csv']  # No temp.
  with open(path, newline='') as f:
    rows = list(csv.DictReader(f))
  assert list(rows[0]) == ['trial', 'lr', 'objective', 'status',
                           'duration_sec', 'job_dir', 'exit_code', 'log',
                           'error']
  assert math.isclose(float(rows[0]['objective']), 0.9)
  text = sweep_report.format_table(table, config)
  assert text.splitlines()[0].split() == ['trial', 'lr', 'objective',
                                          'status', 'duration_sec']


@pytest.mark.cli
def test_sweep_without_its_extra_says_how_to_install_it(tmp_path):
  # A Python where Optuna is not installed: an import path whose `optuna`
  # cannot be found (find_spec returns None for a None entry in sys.modules).
  blocker = tmp_path / 'sitecustomize.py'
  blocker.write_text('import sys\nsys.modules["optuna"] = None\n')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
      [sys.executable, '-m', 'trainer.sweep', '--config=x.yaml',
       '--job-dir=j'], cwd=root, capture_output=True, text=True, timeout=60,
      env={**os.environ, 'PYTHONPATH': f'{tmp_path}{os.pathsep}{root}'})
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith(
      'sweep: error: python -m trainer.sweep needs optuna')
  assert "pip install 'estimator-towers[sweep]'" in result.stderr


@pytest.mark.fast
def test_each_trial_gets_its_own_vertex_output_dirs(tmp_path):
  base_env = {'AIP_MODEL_DIR': '/out/model/', 'PATH': '/bin',
              'AIP_CHECKPOINT_DIR': 'gs://b/ckpt',
              'AIP_TENSORBOARD_LOG_DIR': '/out/logs'}
  specs = [sweep_trials.make_spec(str(tmp_path), trial, 'trainer.task', {},
                                  [], [], base_env, {}, 'accuracy', {})
           for trial in ('1', '2')]
  for spec, trial in zip(specs, ('1', '2')):
    # One shared AIP_MODEL_DIR would keep whichever trial exported last.
    assert spec.env['AIP_MODEL_DIR'] == f'/out/model/{trial}'
    assert spec.env['AIP_CHECKPOINT_DIR'] == f'gs://b/ckpt/{trial}'
    assert spec.env['AIP_TENSORBOARD_LOG_DIR'] == f'/out/logs/{trial}'
    assert spec.env['PATH'] == '/bin'
  assert 'AIP_MODEL_DIR' not in sweep_trials.make_spec(
      str(tmp_path), '1', 'trainer.task', {}, [], [], {'PATH': '/bin'}, {},
      'accuracy', {}).env
