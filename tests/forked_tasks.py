"""The tasks of a test cluster, forked from a launcher that loaded TensorFlow.

tests/sync_cluster_pair.py and tests/sync_fault_cluster.py start a chief
and a worker inside a network namespace of their own. Started as fresh
interpreters, both tasks would import TensorFlow (about 5 s of one core
each, at the same moment); the launcher imports it once (`preload`, before
any session or thread pool exists) and forks each task from itself. A task
is still a process of its own, with its pid, signals, exit status and log,
and it runs its script as `python SCRIPT ARGS` would (`runpy`, `sys.argv`).
"""

import os
import runpy
import signal
import sys
import traceback
from typing import IO, Dict, Optional, Sequence

from trainer.cluster import private_network


def preload() -> None:
  """Imports what every task imports first; call it before the first fork."""
  # pylint: disable=g-import-not-at-top,unused-import
  import numpy
  import tensorflow
  import tensorflow_estimator


class Task:
  """A forked `python SCRIPT ARGS`, used as a `subprocess.Popen`.

  It dies with the launcher (as `preexec_fn=private_network.die_with_parent`
  made the fresh interpreters do).
  """

  def __init__(self, script: str, args: Sequence[str],
               environ: Dict[str, str], log: Optional[IO] = None):
    sys.stdout.flush()
    sys.stderr.flush()
    self.returncode: Optional[int] = None
    self.pid = os.fork()
    if self.pid == 0:
      _become(script, list(args), environ, log)

  def poll(self) -> Optional[int]:
    if self.returncode is None:
      pid, status = os.waitpid(self.pid, os.WNOHANG)
      if pid:
        self.returncode = os.waitstatus_to_exitcode(status)
    return self.returncode

  def wait(self) -> int:
    if self.returncode is None:
      _, status = os.waitpid(self.pid, 0)
      self.returncode = os.waitstatus_to_exitcode(status)
    return self.returncode

  def send_signal(self, signum: int) -> None:
    if self.poll() is None:
      os.kill(self.pid, signum)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


def _become(script: str, args, environ, log) -> None:
  """Runs `script` in this forked child; never returns."""
  code = 1
  try:
    private_network.die_with_parent()
    if os.getppid() == 1:
      return  # The launcher died before the line above.
    import numpy  # pylint: disable=g-import-not-at-top
    numpy.random.seed()  # As a fresh process: not the launcher's state.
    if log is not None:
      os.dup2(log.fileno(), 1)
      os.dup2(log.fileno(), 2)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name='__main__')
    code = 0
  except SystemExit as exited:
    if exited.code is None or isinstance(exited.code, int):
      code = exited.code or 0
    else:
      print(exited.code, file=sys.stderr)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()  # As the interpreter would, then exit 1.
  finally:
    try:
      sys.stdout.flush()
      sys.stderr.flush()
    except BaseException:  # pylint: disable=broad-except
      pass  # Nothing may unwind into the launcher's code in this child.
    finally:
      os._exit(code)  # pylint: disable=protected-access
