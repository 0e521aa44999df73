"""peer_watch: a task that would wait for its peers forever ends instead.

The multi-process case (a worker started after its chief gave up) is in
tests/test_sync_faults.py; here the watch probes a plain loopback socket.
"""

import json
import socket
import subprocess
import sys
import threading

import pytest
import tensorflow as tf

from cli_helpers import ROOT
from estimator_towers.cluster import peer_watch

# A child process that asks for the main thread's frame from another
# thread while freeing cyclic garbage that holds a threading.local (the GC
# threshold low, so the frame's allocation starts a collection): before
# peer_watch held collection off, CPython 3.11 deadlocked there holding the
# GIL - a hung test worker that pytest-timeout could not end.
_FRAMES_UNDER_GC = """
import gc, sys, threading
from estimator_towers.cluster import peer_watch
main = threading.get_ident()

def probe():
  for threshold in (1, 2, 3, 4, 5):
    gc.set_threshold(threshold)
    for _ in range(2000):
      holder = {'local': threading.local()}
      holder['self'] = holder
      del holder
      assert peer_watch._current_frame(main) is not None

thread = threading.Thread(target=probe)
thread.start()
thread.join()
print('done')
"""


class _Chief:
  """A listening loopback socket that can stop answering."""

  def __init__(self):
    self.socket = socket.socket()
    self.socket.bind(('127.0.0.1', 0))
    self.socket.listen(64)
    self.address = '127.0.0.1:%d' % self.socket.getsockname()[1]

  def close(self):
    self.socket.close()


def _watch(address, reports, timeout_secs=0.3):
  done = threading.Event()

  def on_lost(line):
    reports.append(line)
    done.set()

  watch = peer_watch.PeerWatch('worker:0', 'chief:0', address, timeout_secs,
                               poll_secs=0.05, on_lost=on_lost)
  return watch, done


@pytest.mark.fast
def test_a_chief_that_stops_answering_is_reported_once():
  chief, reports = _Chief(), []
  watch, lost = _watch(chief.address, reports)
  watch.begin()
  try:
    # Answering for many timeouts: no report.
    assert not lost.wait(1.0)
    chief.close()
    assert lost.wait(30), 'the watch did not notice the chief was gone'
  finally:
    watch.end(None)
  assert reports == [
      f'worker:0: the chief (chief:0 at {chief.address}) has not answered '
      'for 0.3 s (sync_timeout_secs); a synchronous cluster cannot train '
      'without it. Restart every task; they resume from the chief\'s last '
      'checkpoint.']


@pytest.mark.fast
def test_the_watch_ends_with_training():
  chief, reports = _Chief(), []
  watch, lost = _watch(chief.address, reports)
  watch.begin()
  watch.end(None)
  chief.close()
  assert not lost.wait(1.0), reports


@pytest.mark.fast
def test_the_watch_ends_when_training_fails():
  # A failing session skips end(); its caller may catch the error and go
  # on, and must not be ended for a chief it no longer needs.
  chief, reports = _Chief(), []
  watch, lost = _watch(chief.address, reports)

  def train():
    watch.begin()
    raise RuntimeError('the training failed')

  with pytest.raises(RuntimeError):
    train()
  chief.close()
  assert not lost.wait(1.0), reports


def _config(monkeypatch, task_type):
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': {'chief': ['127.0.0.1:1111'], 'worker': ['127.0.0.1:2222']},
       'task': {'type': task_type, 'index': 0}}))
  return tf.estimator.RunConfig()


@pytest.mark.fast
def test_every_task_times_its_steps_and_workers_watch_the_chief(
    monkeypatch):
  (chief_watch,) = peer_watch.for_task(_config(monkeypatch, 'chief'), 5)
  assert isinstance(chief_watch, peer_watch.StepWatch)
  step, watch = peer_watch.for_task(_config(monkeypatch, 'worker'), 5)
  assert isinstance(step, peer_watch.StepWatch)
  assert isinstance(watch, peer_watch.PeerWatch)
  assert watch._address == ('127.0.0.1', 1111)  # pylint: disable=protected-access


def _step_watch(reports, timeout_secs=0.3):
  done = threading.Event()

  def on_stuck(line):
    reports.append(line)
    done.set()

  return peer_watch.StepWatch('chief:0', timeout_secs, poll_secs=0.05,
                              on_stuck=on_stuck), done


@pytest.mark.fast
def test_a_step_longer_than_the_timeout_is_reported_and_short_ones_not():
  reports = []
  watch, stuck = _step_watch(reports)
  watch.begin()
  try:
    # Many short steps, and long pauses between steps (checkpoints): fine.
    for _ in range(20):
      watch.before_run(None)
      watch.after_run(None, None)
    assert not stuck.wait(1.0), reports
    watch.before_run(None)  # A step that never returns.
    assert stuck.wait(30), 'the watch did not notice the stuck step'
  finally:
    watch.end(None)
  assert len(reports) == 1
  assert reports[0].startswith(
      'chief:0: a training step of the synchronous cluster waited longer '
      'than sync_timeout_secs (0.3 s)')
  assert reports[0].endswith("resume from the chief's last checkpoint.")


@pytest.mark.fast
def test_the_step_watch_ends_when_training_fails():
  reports = []
  watch, stuck = _step_watch(reports)

  def train():
    watch.begin()
    watch.before_run(None)
    raise RuntimeError('the training failed')

  with pytest.raises(RuntimeError):
    train()
  assert not stuck.wait(1.0), reports


@pytest.mark.cli
def test_looking_for_the_training_call_survives_a_collection():
  done = subprocess.run([sys.executable, '-c', _FRAMES_UNDER_GC],
                        capture_output=True, text=True, timeout=120,
                        cwd=ROOT, stdin=subprocess.DEVNULL,
                        env={'PYTHONPATH': ROOT, 'TF_CPP_MIN_LOG_LEVEL': '2',
                             'PATH': '/usr/bin:/bin'})
  assert done.returncode == 0 and done.stdout.strip() == 'done', done.stderr
