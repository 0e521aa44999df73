"""Ends a task of a synchronous cluster that would wait for its peers forever.

Two watches, both training hooks with a background thread that ends the
process with one line (the main thread is stuck in C++ and cannot be
unwound): `StepWatch`, on every task, bounds each training step, and
`PeerWatch`, on workers, bounds the wait for a chief that is gone.

A step whose collectives wait for a task that is stuck, killed or whose
input ended would wait forever: the steps' collectives have no timeout of
their own (see task_sync). `StepWatch` arms at each step's `before_run`
and disarms at its `after_run`; a step still running after timeout_secs
(the cluster's sync_timeout_secs) ends the process.

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

A stuck (e.g. stopped) chief still accepts connections; the workers' step
watch ends them instead.
"""

import gc
import os
import socket
import sys
import threading
import time
from typing import Callable, List, Optional

from absl import logging
import tensorflow as tf

from estimator_towers.cluster import task_sync

tf1 = tf.compat.v1
EXIT_CODE = 1


def _exit_process(line: str) -> None:
  """Writes `line` to stderr and ends the process at once."""
  sys.stderr.write(line + '\n')
  sys.stderr.flush()
  sys.stdout.flush()
  logging.flush()
  os._exit(EXIT_CODE)  # pylint: disable=protected-access


def _current_frame(thread: int):
  """The frame `thread` is running, with garbage collection held off.

  CPython 3.11's sys._current_frames() makes frame objects while it holds
  the interpreter's thread-list lock; a collection started by one of those
  allocations that frees a threading.local takes the same lock again, and
  the process stops for good holding the GIL (a test worker hung so, the
  watch thread's C stack ending in local_clear under
  _PyFrame_GetFrameObject).
  """
  enabled = gc.isenabled()
  gc.disable()
  try:
    return sys._current_frames().get(thread)  # pylint: disable=protected-access
  finally:
    if enabled:
      gc.enable()


class _Watch(tf1.train.SessionRunHook):
  """A hook whose thread checks, while the task trains, for a lost peer.

  From `begin` to `end`, and only while the call that made the
  MonitoredSession (Estimator.train) is on the training thread's stack,
  every `poll_secs` it calls `_lost()`; a message it returns goes to
  `report` (by default: stderr, then the process ends).
  """

  _thread_name = 'watch'

  def __init__(self, timeout_secs: float, poll_secs: float,
               report: Optional[Callable[[str], None]]):
    self._timeout = float(timeout_secs)
    self._poll = float(poll_secs)
    self._report = report or _exit_process
    self._stop = threading.Event()
    self._thread = None

  def begin(self):
    self._stop.clear()
    self._reset()
    # A list, so that the watch can drop the frame and what it holds.
    trainer = [threading.get_ident(), _session_maker(sys._getframe(1))]  # pylint: disable=protected-access
    self._thread = threading.Thread(target=self._watch, args=(trainer,),
                                    daemon=True, name=self._thread_name)
    self._thread.start()

  def end(self, session):
    del session
    self._stop.set()
    self._thread.join()

  def _reset(self) -> None:
    """Called by `begin`, before the thread starts."""

  def _lost(self) -> Optional[str]:
    """The message if the peer is lost, else None."""
    raise NotImplementedError

  @staticmethod
  def _training(trainer) -> bool:
    """Whether the call that made the session is still running."""
    thread, maker = trainer
    frame = _current_frame(thread)
    while frame is not None and frame is not maker:
      frame = frame.f_back
    return frame is not None

  def _watch(self, trainer) -> None:
    try:
      while not self._stop.wait(self._poll) and self._training(trainer):
        message = self._lost()
        if message is not None and self._training(trainer):
          self._report(message)
          return
    finally:
      trainer.clear()


class PeerWatch(_Watch):
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

  _thread_name = 'peer_watch'

  def __init__(self, task: str, peer: str, address: str,
               timeout_secs: float, poll_secs: float = 1.0,
               on_lost: Optional[Callable[[str], None]] = None):
    super().__init__(timeout_secs, poll_secs, on_lost)
    self._task, self._peer = task, peer
    host, _, port = address.rpartition(':')
    self._address = (host.strip('[]'), int(port))
    self._last_answer = 0.0

  def _reset(self) -> None:
    self._last_answer = time.monotonic()

  def _reachable(self) -> bool:
    try:
      with socket.create_connection(self._address,
                                    timeout=min(self._poll, 5.0)):
        return True
    except OSError:
      return False

  def _lost(self) -> Optional[str]:
    now = time.monotonic()
    if self._reachable():
      self._last_answer = now
      return None
    if now - self._last_answer <= self._timeout:
      return None
    host, port = self._address
    return (f'{self._task}: the chief ({self._peer} at {host}:{port}) has '
            f'not answered for {self._timeout:g} s (sync_timeout_secs); '
            'a synchronous cluster cannot train without it. Restart every '
            'task; they resume from the chief\'s last checkpoint.')


class StepWatch(_Watch):
  """Ends the process when one training step runs longer than the timeout.

  Args:
    task: This task's name, e.g. 'chief:0', for the message.
    timeout_secs: How long one step may run.
    poll_secs: Seconds between checks.
    on_stuck: Called with the message instead of ending the process (tests).
  """

  _thread_name = 'step_watch'

  def __init__(self, task: str, timeout_secs: float, poll_secs: float = 1.0,
               on_stuck: Optional[Callable[[str], None]] = None):
    super().__init__(timeout_secs, poll_secs, on_stuck)
    self._task = task
    self._started: Optional[float] = None  # The running step's start.

  def _reset(self) -> None:
    self._started = None

  def before_run(self, run_context):
    del run_context
    self._started = time.monotonic()

  def after_run(self, run_context, run_values):
    del run_context, run_values
    self._started = None

  def _lost(self) -> Optional[str]:
    started = self._started
    if started is None or time.monotonic() - started <= self._timeout:
      return None
    return (f'{self._task}: a training step of the synchronous cluster '
            f'waited longer than sync_timeout_secs ({self._timeout:g} s) '
            'for another task, which is stuck, failed, or stopped because '
            'its input ended after fewer steps (every task\'s input must '
            'give the same number of steps). Restart every task; they '
            'resume from the chief\'s last checkpoint.')


def _session_maker(frame):
  """The first frame, from `frame` outwards, outside monitored_session.py.

  That is the caller that made the MonitoredSession whose hooks begin: it
  returns when training ends, normally or by an error.
  """
  while frame is not None and (
      os.path.basename(frame.f_code.co_filename) == 'monitored_session.py'):
    frame = frame.f_back
  return frame


def for_task(config, timeout_secs: float) -> List[tf1.train.SessionRunHook]:
  """The watches a training task of a synchronous cluster needs.

  Args:
    config: The Estimator's RunConfig (a cluster where
      `task_sync.is_sync_cluster`).
    timeout_secs: The cluster's sync_timeout_secs.

  Returns:
    A StepWatch first (so that it times the step, not other hooks' work
    around it), then, for a worker, a PeerWatch of the chief.
  """
  task = f'{config.task_type}:{config.task_id}'
  watches = [StepWatch(task, timeout_secs)]
  if not config.is_chief:
    cluster = config.cluster_spec.as_dict()
    job = task_sync.leader(cluster).split('/')[1][len('job:'):]
    watches.append(PeerWatch(task, f'{job}:0', cluster[job][0],
                             timeout_secs))
  return watches
