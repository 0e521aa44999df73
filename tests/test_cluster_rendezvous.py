"""Tasks given different TF_CONFIG clusters stop before any server starts."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import preloaded
from cli_helpers import ROOT
from trainer import cluster_rendezvous

CHIEF = {'chief': ['127.0.0.1:2222'], 'worker': ['127.0.0.1:2223']}
MASTER = {'master': ['127.0.0.1:2222'], 'worker': ['127.0.0.1:2223']}
TWO_WORKERS = {'chief': ['127.0.0.1:2222'],
               'worker': ['127.0.0.1:2223', '127.0.0.1:2224']}


def _config(cluster, task_type, index=0):
  return {'cluster': cluster, 'task': {'type': task_type, 'index': index}}


def _together(model_dir, configs, wait_secs=20.0):
  """Runs check_same_cluster for each config at once, as the tasks do;
  returns what each raised (None when it passed)."""
  outcomes = [None] * len(configs)

  def task(i):
    try:
      cluster_rendezvous.check_same_cluster(str(model_dir), configs[i],
                                            wait_secs=wait_secs)
    except ValueError as e:
      outcomes[i] = e

  threads = [threading.Thread(target=task, args=(i,))
             for i in range(len(configs))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(wait_secs + 10)
  return outcomes


@pytest.mark.fast
def test_tasks_with_the_same_cluster_go_on(tmp_path, caplog):
  configs = [_config(TWO_WORKERS, 'chief'), _config(TWO_WORKERS, 'worker', 0),
             _config(TWO_WORKERS, 'worker', 1)]
  assert _together(tmp_path, configs) == [None, None, None]
  assert 'not compared' not in caplog.text  # All came: none waited it out.


@pytest.mark.fast
@pytest.mark.parametrize('theirs,named', [
    (MASTER, "master=['127.0.0.1:2222']"),
    (TWO_WORKERS, "worker=['127.0.0.1:2223', '127.0.0.1:2224']")])
def test_every_task_stops_on_another_cluster_naming_both(tmp_path, theirs,
                                                         named):
  outcomes = _together(tmp_path, [_config(CHIEF, 'chief'),
                                  _config(theirs, 'worker')])
  assert all(isinstance(e, ValueError) for e in outcomes), outcomes
  for e in outcomes:
    assert 'TF_CONFIG differs between the tasks' in str(e)
    assert named in str(e) and "chief=['127.0.0.1:2222']" in str(e)
    assert 'start them all again' in str(e)


@pytest.mark.fast
def test_a_stale_file_of_an_earlier_start_is_not_compared(tmp_path):
  # The wrong cluster of the last start, left behind: this start is right.
  folder = tmp_path / cluster_rendezvous.FOLDER
  folder.mkdir()
  stale = folder / 'worker-0.json'
  stale.write_text(json.dumps({'task': 'worker:0', 'cluster': MASTER}))
  old = time.time() - 5 * cluster_rendezvous.FRESH_SECS
  os.utime(stale, (old, old))
  outcomes = _together(tmp_path, [_config(CHIEF, 'chief'),
                                  _config(CHIEF, 'worker')])
  assert outcomes == [None, None]


@pytest.mark.fast
def test_a_task_restarted_alone_goes_on_at_once_beside_running_ones(tmp_path,
                                                                    caplog):
  # The chief started long ago and no longer rewrites its file.
  folder = tmp_path / cluster_rendezvous.FOLDER
  folder.mkdir()
  running = folder / 'chief-0.json'
  running.write_text(json.dumps({'task': 'chief:0', 'cluster': CHIEF}))
  old = time.time() - 600
  os.utime(running, (old, old))
  cluster_rendezvous.check_same_cluster(str(tmp_path),
                                        _config(CHIEF, 'worker'),
                                        wait_secs=20.0)
  assert 'not compared' not in caplog.text  # It did not wait the 20 s out.


@pytest.mark.fast
def test_a_task_that_never_comes_is_waited_for_a_bounded_time(tmp_path,
                                                              caplog):
  start = time.monotonic()
  cluster_rendezvous.check_same_cluster(str(tmp_path), _config(CHIEF, 'chief'),
                                        wait_secs=1.0)
  assert time.monotonic() - start >= 1.0
  assert 'not compared with worker:0' in caplog.text


@pytest.mark.fast
def test_a_later_task_still_compares_with_one_that_went_on(tmp_path):
  # The chief saw nobody (its wait ended) and went on; it keeps its file
  # fresh, so the worker starting after it still finds the difference.
  cluster_rendezvous.check_same_cluster(str(tmp_path), _config(CHIEF, 'chief'),
                                        wait_secs=3.0)
  time.sleep(2 * cluster_rendezvous._BEAT_SECS)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match='chief:0 has the cluster'):
    cluster_rendezvous.check_same_cluster(
        str(tmp_path), _config(MASTER, 'worker'), wait_secs=3.0)


@pytest.mark.fast
@pytest.mark.parametrize('config', [None, {}, {'task': {'trial': '2'}},
                                    _config(CHIEF, 'evaluator')])
def test_no_cluster_or_the_evaluator_writes_nothing(tmp_path, config):
  cluster_rendezvous.check_same_cluster(str(tmp_path), config, wait_secs=0)
  assert not (tmp_path / cluster_rendezvous.FOLDER).exists()


@pytest.mark.cli
def test_the_file_stops_being_kept_fresh_before_the_interpreter_exits(
    tmp_path):
  # A daemon thread still inside a TensorFlow file call when the
  # interpreter finalizes aborts the process (SIGABRT, "FATAL: exception
  # not rethrown"): a chief that had trained, evaluated and exported failed
  # its cluster so. The reporting handler is registered first, so it runs
  # after the module's own (exit handlers run last in, first out).
  cluster_rendezvous._Files(  # pylint: disable=protected-access
      str(tmp_path / cluster_rendezvous.FOLDER), 'worker:0', CHIEF).beat()
  script = textwrap.dedent(f"""
      import atexit, threading
      def report():
        print('beating at exit:', any(
            t.name == 'tf-config-beat' and t.is_alive()
            for t in threading.enumerate()), flush=True)
      atexit.register(report)
      from trainer import cluster_rendezvous
      cluster_rendezvous.check_same_cluster(
          {str(tmp_path)!r}, {_config(CHIEF, 'chief')!r}, wait_secs=600)
      print('compared', flush=True)
      """)
  result = subprocess.run(
      [sys.executable, '-c', script], cwd=ROOT, capture_output=True,
      text=True, timeout=120,
      env={**os.environ, 'PYTHONPATH': ROOT, 'TF_CPP_MIN_LOG_LEVEL': '2'})
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split('\n')[:2] == ['compared',
                                            'beating at exit: False']


@pytest.mark.cli
def test_a_leader_named_master_and_chief_ends_both_tasks_in_one_line(
    tmp_path):
  # Before: the worker crashed in native code (a segfault) at start-up.
  job_dir = tmp_path / 'job'
  processes = []
  for cluster, task_type in ((CHIEF, 'chief'), (MASTER, 'worker')):
    env = {**os.environ, 'PYTHONPATH': ROOT, 'TF_CPP_MIN_LOG_LEVEL': '2',
           'TF_CONFIG': json.dumps(_config(cluster, task_type))}
    processes.append(preloaded.start(
        'trainer.task', [f'--job-dir={job_dir}', '--train-steps=5'],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True))
  try:
    results = [p.communicate(timeout=120) for p in processes]
  finally:
    for p in processes:
      p.kill()
  for process, (_, stderr) in zip(processes, results):
    assert process.returncode == 1, stderr[-2000:]
    assert 'TF_CONFIG differs between the tasks' in stderr
    assert 'Traceback' not in stderr and 'Started server' not in stderr
  assert not list(job_dir.glob('model.ckpt*'))
