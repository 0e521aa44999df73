"""Ends a worker of a synchronous cluster whose chief's server is gone.

In a synchronous cluster (task_sync) the chief's server leads the
collectives: before a session runs a graph with collectives, a worker asks
the chief for a sequence of step ids. TensorFlow 2.15 retries that request
(MasterSession::NewStepId) for as long as the chief does not answer, with no
timeout, inside the C++ session run: a worker whose chief is gone when it
asks (measured: a worker started after its chief failed) waits forever,
and no Python exception can reach it there.

`PeerWatch` is a training hook that probes the chief's address from a
background thread while the worker trains: from `begin` to `end`, and only
while the call that made the MonitoredSession (Estimator.train) is still on
the training thread's stack, since a session that fails skips `end` and its
caller may catch the error and go on. When no TCP connection to the chief
succeeds for `timeout_secs` (the cluster's sync_timeout_secs, the bound of
every other wait of the cluster), it writes one line naming the chief and
the remedy to stderr and ends the process with exit code 1: the main thread
is stuck in C++ and cannot be unwound. Only the chief is watched: it leads,
so it never waits for step ids, and a dead or stuck worker makes the
collectives of every other task fail or time out.

A stuck (e.g. stopped) chief still accepts connections; its collectives'
timeout ends the workers instead.
"""

import os
import socket
import sys
import threading
import time
from typing import Callable, Optional

from absl import logging
import tensorflow as tf

from estimator_towers import task_sync

tf1 = tf.compat.v1
EXIT_CODE = 1


def _exit_process(line: str) -> None:
  """Writes `line` to stderr and ends the process at once."""
  sys.stderr.write(line + '\n')
  sys.stderr.flush()
  sys.stdout.flush()
  logging.flush()
  os._exit(EXIT_CODE)  # pylint: disable=protected-access


class PeerWatch(tf1.train.SessionRunHook):
  """Ends the process when the chief's server stays unreachable.

  Args:
    task: This task's name, e.g. 'worker:0', for the message.
    peer: The watched task's name, e.g. 'chief:0'.
    address: Its 'host:port'.
    timeout_secs: How long it may stay unreachable while this task trains;
      counted from `begin` if it never answered (it may start late).
    poll_secs: Seconds between probes.
    on_lost: Called with the message instead of ending the process (tests).
  """

  def __init__(self, task: str, peer: str, address: str,
               timeout_secs: float, poll_secs: float = 1.0,
               on_lost: Optional[Callable[[str], None]] = None):
    self._task, self._peer = task, peer
    host, _, port = address.rpartition(':')
    self._address = (host.strip('[]'), int(port))
    self._timeout = float(timeout_secs)
    self._poll = float(poll_secs)
    self._on_lost = on_lost or _exit_process
    self._stop = threading.Event()
    self._thread = None

  def begin(self):
    self._stop.clear()
    # A list, so that the watch can drop the frame and what it holds.
    trainer = [threading.get_ident(), _session_maker(sys._getframe(1))]  # pylint: disable=protected-access
    self._thread = threading.Thread(target=self._watch, args=(trainer,),
                                    daemon=True, name='peer_watch')
    self._thread.start()

  def end(self, session):
    del session
    self._stop.set()
    self._thread.join()

  @staticmethod
  def _training(trainer) -> bool:
    """Whether the call that made the session is still running."""
    thread, maker = trainer
    frame = sys._current_frames().get(thread)  # pylint: disable=protected-access
    while frame is not None and frame is not maker:
      frame = frame.f_back
    return frame is not None

  def _reachable(self) -> bool:
    try:
      with socket.create_connection(self._address,
                                    timeout=min(self._poll, 5.0)):
        return True
    except OSError:
      return False

  def _watch(self, trainer) -> None:
    try:
      self._probe(trainer)
    finally:
      trainer.clear()

  def _probe(self, trainer) -> None:
    last_answer = time.monotonic()
    while not self._stop.wait(self._poll) and self._training(trainer):
      now = time.monotonic()
      if self._reachable():
        last_answer = now
      elif (now - last_answer > self._timeout and
            self._training(trainer)):
        host, port = self._address
        self._on_lost(
            f'{self._task}: the chief ({self._peer} at {host}:{port}) has '
            f'not answered for {self._timeout:g} s (sync_timeout_secs); '
            'a synchronous cluster cannot train without it. Restart every '
            'task; they resume from the chief\'s last checkpoint.')
        return


def _session_maker(frame):
  """The first frame, from `frame` outwards, outside monitored_session.py.

  That is the caller that made the MonitoredSession whose hooks begin: it
  returns when training ends, normally or by an error.
  """
  while frame is not None and (
      os.path.basename(frame.f_code.co_filename) == 'monitored_session.py'):
    frame = frame.f_back
  return frame


def for_task(config, timeout_secs: float) -> Optional[PeerWatch]:
  """The watch a training task of a synchronous cluster needs, if any.

  Args:
    config: The Estimator's RunConfig (a cluster where
      `task_sync.is_sync_cluster`).
    timeout_secs: The cluster's sync_timeout_secs.

  Returns:
    A PeerWatch of the chief for a worker; None for the chief.
  """
  if config.is_chief:
    return None
  cluster = config.cluster_spec.as_dict()
  job = task_sync.leader(cluster).split('/')[1][len('job:'):]
  return PeerWatch(f'{config.task_type}:{config.task_id}', f'{job}:0',
                   cluster[job][0], timeout_secs)
