"""Surviving a stop: SIGTERM, SIGINT or SIGHUP saves a checkpoint, then exits.

Cloud machines get a SIGTERM before they are reclaimed; a person presses
Ctrl-C (SIGINT) or closes the terminal (SIGHUP). While training, the signal
only raises a flag; the next step's hook saves a checkpoint with the
Estimator's own saver (chief only: it owns the checkpoints) and raises
`Preempted`, which the task turns into a clear log line and exit code
128 + the signal number (143, 130, 129), as shells report a signal.
Outside the training loop (graph building, evaluation, export) the signal
raises `Preempted` at once: nothing there is worth finishing, and the last
checkpoint is already on disk. Re-running the same command resumes; in a
synchronous cluster every task stops after the same step (whichever got
the signal) and restarting every task resumes.
"""

import contextlib
import os
import signal
import threading
from typing import Iterator, Optional

from absl import logging
import tensorflow as tf

from estimator_towers.cluster import stop_request

tf1 = tf.compat.v1

EXIT_CODE = 128 + signal.SIGTERM
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Preempted(Exception):
  """Training stopped on a signal; the message says what was saved.

  Attributes:
    exit_code: 128 + the signal's number.
  """

  def __init__(self, message: str, signum: int = signal.SIGTERM):
    super().__init__(message)
    self.exit_code = 128 + signum


class _State:
  requested = 0  # The signal received, 0 for none.
  in_training = 0


_state = _State()
_lock = threading.Lock()


def _name(signum: int) -> str:
  return signal.Signals(signum).name


def _on_signal(signum, frame):
  del frame
  _state.requested = signum
  if not _state.in_training:
    raise Preempted(f'Received {_name(signum)} outside the training loop; '
                    'the latest checkpoint is the one to resume from.',
                    signum)


@contextlib.contextmanager
def sigterm_handled() -> Iterator[None]:
  """Installs the stop-signal handlers for the duration (main thread only)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {signum: signal.signal(signum, _on_signal) for signum in SIGNALS}
  _state.requested = 0
  try:
    yield
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


class PreemptionHook(tf1.train.SessionRunHook):
  """Saves a checkpoint and stops training once a stop signal has arrived.

  On one machine the task stops after the step during which the signal
  arrived. In a synchronous cluster a task that stopped alone would break
  its peers' next step, so the signal only raises this task's stop flag
  (estimator_towers.cluster.stop_request); the next step carries every
  task's flags, and every task stops after that same step, the chief
  saving it, whichever task received the signal.

  Args:
    model_dir: Where the Estimator writes checkpoints.
    is_chief: Only the chief saves; other workers just stop.
  """

  def __init__(self, model_dir: str, is_chief: bool = True):
    self._model_dir = model_dir
    self._is_chief = is_chief
    self._saver: Optional[tf1.train.Saver] = None
    self._step = None
    self._counted = False  # Whether in_training counts this hook.
    self._request: Optional[stop_request.StopRequest] = None
    self._ask_ops = {}
    self._asked = False
    self._stopped: Optional[Preempted] = None

  def begin(self):
    savers = tf1.get_collection(tf1.GraphKeys.SAVERS)
    self._saver = savers[0] if savers else None
    self._step = tf1.train.get_global_step()
    self._request = stop_request.of_graph()
    self._asked = False
    if self._request is not None:
      self._ask_ops = {signum: self._request.ask_op(slot)
                       for slot, signum in enumerate(SIGNALS)}

  def after_create_session(self, session, coord):
    # Not in begin(): creating the session can wait a long time (a worker
    # polls every 30 s until the chief has initialized the variables), and
    # a signal meanwhile must stop the task then, not at a first step that
    # may be minutes away.
    del session, coord
    with _lock:
      _state.in_training += 1
      self._counted = True

  def before_run(self, run_context):
    if self._request is None:
      return None
    return tf1.train.SessionRunArgs(self._request.summed)

  def after_run(self, run_context, run_values):
    if self._request is None:
      signum = _state.requested
    else:
      signum = self._agreed_signal(run_context.session, run_values.results)
    if not signum:
      return
    step = run_context.session.run(self._step)
    if self._is_chief and self._saver is not None:
      path = self._saver.save(run_context.session,
                              os.path.join(self._model_dir, 'model.ckpt'),
                              global_step=step)
      message = f'Received {_name(signum)}: saved {path} at step {step}.'
    else:
      message = (f'Received {_name(signum)} at step {step} (not the chief: '
                 'no save).')
    if self._request is None:
      logging.warning('%s Re-run the same command to resume.', message)
      self._leave()  # end() is not called after an exception.
      raise Preempted(message, signum)
    message = message.replace('Received', 'A task of the synchronous '
                              'cluster received', 1)
    logging.warning('%s Restart every task of the cluster (the same '
                    'commands) to resume.', message)
    # Not raised here: the other hooks' after_run must still end the step
    # (the step watch would otherwise time the session's close as a step
    # and end the task with exit code 1); end() raises it.
    self._stopped = Preempted(message, signum)
    run_context.request_stop()

  def _agreed_signal(self, session, summed) -> int:
    """The signal every task of a synchronous cluster stops on, or 0.

    Raises this task's flag for a signal it received (the next step carries
    it); returns a signal once the step's sum of flags holds one, this
    task's own first, else the first of SIGNALS a peer received.
    """
    own = _state.requested
    if own and not self._asked:
      session.run(self._ask_ops[own])
      self._asked = True
    peers = [signum for slot, signum in enumerate(SIGNALS) if summed[slot] > 0]
    if not peers:
      return 0
    return own if own in peers else peers[0]

  def end(self, session):
    del session
    self._leave()
    stopped, self._stopped = self._stopped, None
    if stopped is not None:
      raise stopped

  def _leave(self):
    with _lock:
      if self._counted:
        _state.in_training -= 1
        self._counted = False
