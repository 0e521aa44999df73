"""peer_watch: a worker whose chief's server is gone ends instead of looping.

The multi-process case (a worker started after its chief gave up) is in
tests/test_sync_faults.py; here the watch probes a plain loopback socket.
"""

import json
import socket
import threading

import pytest
import tensorflow as tf

from estimator_towers import peer_watch


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


def test_the_watch_ends_with_training():
  chief, reports = _Chief(), []
  watch, lost = _watch(chief.address, reports)
  watch.begin()
  watch.end(None)
  chief.close()
  assert not lost.wait(1.0), reports


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


def test_only_workers_watch_and_they_watch_the_chief(monkeypatch):
  assert peer_watch.for_task(_config(monkeypatch, 'chief'), 5) is None
  watch = peer_watch.for_task(_config(monkeypatch, 'worker'), 5)
  assert isinstance(watch, peer_watch.PeerWatch)
  assert watch._address == ('127.0.0.1', 1111)  # pylint: disable=protected-access
