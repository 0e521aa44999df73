"""A TF_CONFIG cluster on loopback, with real processes and signals."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from cli_helpers import ROOT, read_json_lines, run_module, wait_until
from cli_helpers import write_tabular_csv
from trainer import core_share

pytestmark = pytest.mark.cluster

TASK_ARGS = ('--hidden-units=16', '--train-batch-size=32',
             '--eval-batch-size=360')
# How long a cluster may take to start training: four TensorFlow processes
# import and build graphs on two cores, slowly when the machine is busy.
_START_SECS = 300


def _launch(job_dir, *args, task_args=(), env=None, new_session=False):
  full_env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT,
              **(env or {})}
  full_env.pop('TF_CONFIG', None)
  return subprocess.Popen(
      [sys.executable, '-m', 'trainer.cluster', f'--job-dir={job_dir}', *args,
       '--', *TASK_ARGS, *task_args],
      cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, stdin=subprocess.DEVNULL, start_new_session=new_session)


def _state(job_dir):
  path = os.path.join(job_dir, 'logs', 'cluster.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return {t['name']: t for t in json.load(f)['tasks']}


def _wait(predicate, timeout, what, process=None):
  return wait_until(predicate, timeout, what, process,
                    lambda: process.stderr.read())


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f'/proc/{pid}/stat') as f:  # A zombie is not alive.
    return f.read().split()[2] != 'Z'


def _finish(process, timeout=300):
  try:
    out, err = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    out, err = process.communicate()
    raise AssertionError(f'launcher did not finish:\n{err[-3000:]}')
  return process.returncode, out, err


def _assert_all_stopped(job_dir):
  for task in _state(job_dir).values():
    assert not _alive(task['pid']), task['name']


def _step(job_dir):
  path = tf.train.latest_checkpoint(str(job_dir))
  return int(path.rsplit('-', 1)[1]) if path else 0


def _reached(job_dir, target, training_tasks=2):
  """The target step, give or take the steps racing workers add at the end.

  Between-graph replication is asynchronous: each training task stops when
  it sees the target, but the others may still add the step they are in.
  """
  return target <= _step(job_dir) <= target + 2 * training_tasks


def _kill_after_checkpoint(job_dir, process, task, step):
  """SIGKILLs `task` once a checkpoint of `step` or later is saved.

  Returns:
    The checkpoint step saved before the kill, the launcher's exit code and
    its stderr.
  """
  try:
    _wait(lambda: _step(job_dir) >= step, _START_SECS, 'a checkpoint',
          process)
    saved = _step(job_dir)
    os.kill(_state(job_dir)[task]['pid'], signal.SIGKILL)
  finally:
    code, _, err = _finish(process)
  return saved, code, err


def _log_has(job_dir, task, text):
  path = os.path.join(job_dir, 'logs', f'{task}.log')
  return os.path.exists(path) and text in open(path, errors='replace').read()


def _log_tail(job_dir, task, chars=3000):
  """The end of a task's log, for a failure message: pytest's temporary
  directories do not outlive a few runs."""
  path = os.path.join(job_dir, 'logs', f'{task}.log')
  if not os.path.exists(path):
    return f'(no {task} log)'
  return f'{task} log:\n' + open(path, errors='replace').read()[-chars:]


def test_cluster_trains_evaluates_and_reports_in_a_private_network(tmp_path):
  metric_file = tmp_path / 'metrics.txt'
  process = _launch(tmp_path / 'job', '--workers=1', '--ps=1',
                    task_args=('--train-steps=600',
                               '--save-checkpoints-steps=200',
                               '--cpu-towers=2'),
                    env={'CLOUD_ML_HP_METRIC_FILE': str(metric_file)})
  try:
    state = _wait(lambda: _state(tmp_path / 'job'), 120, 'cluster.json',
                  process)
    # The servers listen on all interfaces of their own network namespace:
    # from this (the host's) namespace, their ports are closed.
    # Once the chief trains, every server of the cluster is listening.
    _wait(lambda: _log_has(tmp_path / 'job', 'chief-0', 'examples/sec'),
          _START_SECS, 'the chief to train', process)
    host, port = state['ps:0']['address'].split(':')
    with pytest.raises(ConnectionRefusedError):
      socket.create_connection((host, int(port)), timeout=5).close()
    with open(f'/proc/{state["chief:0"]["pid"]}/cmdline') as f:
      chief_args = f.read().split('\0')
  finally:
    code, out, err = _finish(process)
  job = tmp_path / 'job'
  assert code == 0, err[-3000:]
  # The chief and the worker share the machine's cores (core_share): their
  # thread flags come before the user's, which would override them.
  assert f'2 training task(s) share {core_share.machine_cores()} core(s)' in err
  share = core_share.default_flags(2)
  first = chief_args.index(share[0])
  assert chief_args[first:first + 2] == share, chief_args
  assert first < chief_args.index(TASK_ARGS[0]), chief_args
  assert _reached(job, 600)
  _assert_all_stopped(job)
  # Towers inside each worker: the chief ran 2 of them, on the 2 virtual
  # CPUs its server has (a server started without them soft-places every
  # tower on one CPU).
  assert _log_has(job, 'chief-0', '2 towers')
  assert _log_has(job, 'chief-0', 'Task chief:0 has the devices CPU:0, CPU:1')
  assert _log_has(job, 'chief-0', 'trains asynchronously')
  # The chief scored the final checkpoint, exported it and reported the
  # tuning metric before it exited (the job may end with the chief); the
  # evaluator only scored checkpoints while training ran.
  assert _log_has(job, 'chief-0', 'evaluating and exporting')
  assert not _log_has(job, 'evaluator-0', 'evaluating and exporting')
  steps = [int(r['global_step']) for r in read_json_lines(metric_file)]
  assert steps[-1] >= 600
  (export,) = os.listdir(job / 'export' / 'final')
  assert _log_has(job, 'chief-0', export)
  # The launcher shows what the chief's log says of its progress and result.
  lines = out.splitlines()
  assert any(re.match(r'chief:0: step \d+: loss=', line) for line in lines)
  assert [line for line in lines if line.startswith('chief:0: eval: ') and
          'global_step=' in line and export in line], out
  assert lines[-1].startswith('cluster: done'), out


def _variables(checkpoint):
  reader = tf.train.load_checkpoint(str(checkpoint))
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()}


def test_sync_cluster_trains_as_one_process_on_the_global_batch(tmp_path):
  # 19 rows, one epoch in global batches of 9: the chief and the worker keep
  # 5+4, 5+4, then 1+0 rows (the worker has nothing in the last step), and
  # both stop when the epoch ends; one process splits the same batches over
  # its 4 towers. The model's batch norm tells a global batch from the same
  # rows read twice (each task reading the whole batch).
  train = write_tabular_csv(tmp_path / 'train.csv', rows=19)
  flags = (f'--train-files={train}', '--label-column=label',
           '--categorical-column=colour=red|green|blue', '--n-classes=2',
           '--model=tests.sync_cluster_task:batch_norm_classifier',
           '--learning-rate=0.05', '--tf-random-seed=5',
           '--train-batch-size=9', '--eval-batch-size=19', '--num-epochs=1',
           '--save-checkpoints-steps=1000', '--train-steps=100')
  one, cluster = tmp_path / 'one', tmp_path / 'cluster'
  process = _launch(cluster, '--workers=1', '--ps=0', '--no-evaluator',
                    task_args=(*flags, '--cpu-towers=2'))
  try:
    run_module('trainer.task', f'--job-dir={one}', *flags, '--cpu-towers=4')
  finally:
    code, _, err = _finish(process)
  assert code == 0, err[-3000:]
  assert 'sync: the chief and workers all-reduce' in err
  assert _log_has(cluster, 'chief-0', 'trains synchronously')
  assert _log_has(cluster, 'worker-0',
                  'Task worker:0 has the devices CPU:0, CPU:1')
  # The same start: --tf-random-seed initialises both graphs alike (the
  # step-0 checkpoints; the chief's values are what it broadcast).
  start_one, start_cluster = (_variables(d / 'model.ckpt-0')
                              for d in (one, cluster))
  for name in start_one:
    np.testing.assert_array_equal(start_cluster[name], start_one[name], name)
  expected, actual = _variables(one), _variables(cluster)
  assert int(expected['global_step']) == 3
  assert sorted(expected) == sorted(actual)
  assert {'dense/kernel/Adam', 'batch_normalization/moving_variance'} <= set(
      actual)
  for name in expected:
    np.testing.assert_allclose(actual[name], expected[name], rtol=1e-4,
                               atol=1e-5, err_msg=name)


def test_killed_worker_is_restarted_and_rejoins(tmp_path):
  job = tmp_path / 'job'
  # 6000 steps: the worker logs its first steps late (the chief was at
  # step 1700 then on a quiet machine, 14k examples/s); after the kill the
  # chief alone trains ~10 s more, longer than the worker's restart (a
  # fresh interpreter, ~4 s) takes. With 3000 the chief finished first
  # on a quiet machine and the restarted worker had no step left.
  process = _launch(job, '--workers=1', '--ps=1', '--no-evaluator',
                    '--max-restarts=1',
                    task_args=('--train-steps=6000',
                               '--save-checkpoints-steps=500'))
  try:
    _wait(lambda: _log_has(job, 'worker-0', 'examples/sec'), _START_SECS,
          'the worker to train', process)
    os.kill(_state(job)['worker:0']['pid'], signal.SIGKILL)
  finally:
    code, _, err = _finish(process)
  assert code == 0, err[-3000:]
  assert 'worker:0 exited with signal SIGKILL; restarting it' in err
  assert _state(job)['worker:0']['restarts'] == 1
  assert _reached(job, 6000)
  # Rejoined: the restarted worker trained steps of its own.
  log = open(job / 'logs' / 'worker-0.log', errors='replace').read()
  trained = re.findall(r'trained (\d+) steps',
                       log[log.rindex('(restart 1)'):])
  assert trained and int(trained[0]) > 0, _log_tail(job, 'worker-0')
  _assert_all_stopped(job)


def test_a_killed_worker_restarts_every_synchronous_task(tmp_path):
  # Without ps the chief and the worker train each step together: the
  # survivor cannot go on alone, so both restart from the chief's last
  # checkpoint, which nothing before it may undo.
  # 1200 steps: the kill lands a poll (0.3 s, ~50 steps) after the step-100
  # checkpoint, far before the end; the steps after the restart (~150/s)
  # are what this test spends its time on.
  # --grace-secs: the chief, blocked in a collective with the dead worker,
  # cannot stop on SIGTERM; it is SIGKILLed after the grace period, which
  # the restart then waits out (10 s by default).
  job = tmp_path / 'job'
  process = _launch(job, '--workers=1', '--ps=0', '--no-evaluator',
                    '--max-restarts=1', '--grace-secs=2',
                    task_args=('--aggregation=all_reduce', '--cpu-towers=2',
                               '--train-steps=1200',
                               '--save-checkpoints-steps=100'))
  saved, code, err = _kill_after_checkpoint(job, process, 'worker:0', 100)
  # A rare failure here (collectives broken after the restart, once in
  # ~40 runs) left no logs to read: the chief's is part of the message.
  assert code == 0, err[-3000:] + '\n' + _log_tail(job, 'chief-0')
  assert ('worker:0 exited with signal SIGKILL; the synchronous tasks '
          'cannot go on without it: restarting chief:0, worker:0') in err, (
              err[-3000:])
  state = _state(job)
  assert state['chief:0']['restarts'] == state['worker:0']['restarts'] == 1
  # In lockstep: no racing steps past the target. (A quiet machine runs
  # ~150 steps/s: 600 steps could end before the kill landed.)
  assert _step(job) == 1200
  log = open(job / 'logs' / 'chief-0.log', errors='replace').read()
  restart = log.rindex('(restart 1)')
  resumed = re.findall(r'Resuming from \S*model\.ckpt-(\d+)',
                       log[restart:])
  assert resumed and int(resumed[0]) >= saved, resumed
  _assert_all_stopped(job)


def test_restarted_ps_recovers_or_rerun_resumes(tmp_path):
  job = tmp_path / 'job'
  args = ('--workers=1', '--ps=1', '--no-evaluator', '--max-restarts=1')
  # 1200 steps: the kill lands a poll after the step-300 checkpoint, 900
  # steps (~6 s) before the end.
  task_args = ('--train-steps=1200', '--save-checkpoints-steps=300')
  saved, code, err = _kill_after_checkpoint(
      job, _launch(job, *args, task_args=task_args), 'ps:0', 300)
  _assert_all_stopped(job)
  if code != 0:
    # The workers failed clearly; a re-run resumes from the chief's last
    # checkpoint.
    assert 'stopped the cluster' in err, err[-3000:]
    before = _step(job)
    assert before >= saved
    code, _, err = _finish(_launch(job, *args, task_args=task_args))
    assert code == 0, err[-3000:]
    assert _log_has(job, 'chief-0', f'model.ckpt-{before}')
  assert _reached(job, 1200)


def test_a_failing_task_stops_the_whole_cluster(tmp_path):
  job = tmp_path / 'job'
  # Every task rejects the model name; the first failure stops the rest.
  code, _, err = _finish(_launch(job, '--workers=1', '--ps=1',
                                 task_args=('--model=no_such_model',)))
  assert code == 1
  assert 'stopped the cluster' in err and 'no_such_model' in err
  _assert_all_stopped(job)


def test_ctrl_c_lets_the_chief_save_before_the_ps_stops(tmp_path):
  job = tmp_path / 'job'
  # No periodic checkpoint after the first: only a save on the stop can
  # keep the steps trained. Each task must exit by itself, well within the
  # grace period, after its save (Python's exit with TensorFlow loaded used
  # to take many seconds when several processes exited together). Every
  # kind of task runs: the evaluator must stop too.
  process = _launch(job, '--workers=1', '--ps=1', '--grace-secs=4',
                    task_args=('--train-steps=1000000',
                               '--save-checkpoints-steps=1000000'),
                    new_session=True)
  try:
    _wait(lambda: _log_has(job, 'chief-0', 'examples/sec'), _START_SECS,
          'the chief to train', process)
  finally:
    # A terminal's Ctrl-C goes to the whole foreground process group.
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGINT)
    code, _, err = _finish(process, timeout=120)
  assert code == 130, err[-3000:]
  assert _log_has(job, 'chief-0', 'Received SIGTERM: saved'), err[-3000:]
  assert 'did not stop within' not in err, err[-3000:]
  assert _step(job) >= 100  # Past the first 'examples/sec' log.
  state = _state(job)
  assert {'chief:0', 'worker:0', 'ps:0', 'evaluator:0'} == set(state), state
  assert not any(task['running'] for task in state.values()), state
  _assert_all_stopped(job)
  assert 'interrupted by SIGINT; every task was stopped' in err

