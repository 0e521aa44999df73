"""Trial processes: started in their own process group, stopped as a group.

Each trial runs in a new session, so its process group holds the trainer
and anything it starts, and a signal to the group reaches all of them. A
Ctrl-C in the terminal therefore reaches only the sweep, which stops its
trials itself and knows they were interrupted rather than failed.

A sweep killed with SIGKILL cannot stop its trials; they go on as orphans.
The sweep records each trial's pid and the kernel's start time of that
process, so a resumed sweep can stop exactly those processes (a recycled
pid has another start time) before running the trials again.
"""

import os
import signal
import subprocess
import time
from typing import Dict, IO, Optional, Sequence

from absl import logging


def start(command: Sequence[str], env: Dict[str, str],
          log_file: IO) -> subprocess.Popen:
  """Starts a command in a new session, stdout and stderr to `log_file`.

  Raises:
    OSError: the command cannot be started.
  """
  return subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL,
                          stdout=log_file, stderr=subprocess.STDOUT,
                          start_new_session=True)


def stop(process: subprocess.Popen, grace_secs: float) -> int:
  """SIGTERM to the process group, then SIGKILL after `grace_secs`.

  Args:
    process: A process from `start` (it leads its own group).
    grace_secs: How long it may take to exit after SIGTERM.

  Returns:
    The process's exit code (negative: the signal that ended it).
  """
  # The process is not reaped before wait() below, so its pid, which is
  # also its group id, cannot have been reused by another process yet.
  _signal_group(process.pid, signal.SIGTERM)
  try:
    return process.wait(timeout=grace_secs)
  except subprocess.TimeoutExpired:
    logging.warning('Process %d did not exit %.0f s after SIGTERM; sending '
                    'SIGKILL.', process.pid, grace_secs)
  _signal_group(process.pid, signal.SIGKILL)
  return process.wait()


def _signal_group(pgid: int, signum: int) -> None:
  try:
    os.killpg(pgid, signum)
  except ProcessLookupError:
    pass  # Every process of the group has exited already: nothing to stop.


def start_time(pid: int) -> Optional[str]:
  """When the kernel started process `pid` (clock ticks since boot).

  Returns:
    The start time as a string, or None when the process does not exist,
    has exited (a zombie) or /proc is not available.
  """
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8') as f:
      stat = f.read()
  except (FileNotFoundError, ProcessLookupError):
    return None
  # The command name (field 2) is in parentheses and may hold spaces, so
  # count fields after its closing parenthesis: state is field 3 and the
  # start time field 22.
  fields = stat[stat.rindex(')') + 2:].split()
  if fields[0] in ('Z', 'X'):
    return None
  return fields[19]


def can_identify_processes() -> bool:
  """True when /proc lets `start_time` tell processes apart."""
  return os.path.isdir(f'/proc/{os.getpid()}')


def stop_orphan(pid: int, started: str, grace_secs: float) -> bool:
  """Stops a trial left running by a sweep that died, if it still runs.

  Args:
    pid: The trial's pid, as recorded when it started.
    started: Its `start_time` then; a different process with the same pid
      is left alone.
    grace_secs: How long it may take to exit after SIGTERM.

  Returns:
    True when the process was still running and has been stopped.
  """
  if start_time(pid) != started:
    return False
  _signal_group(pid, signal.SIGTERM)
  if not _wait_gone(pid, started, grace_secs):
    _signal_group(pid, signal.SIGKILL)
    if not _wait_gone(pid, started, 30.0):
      raise RuntimeError(f'Process {pid} of an interrupted trial survives '
                         'SIGKILL; stop it before resuming the sweep.')
  return True


def _wait_gone(pid: int, started: str, timeout: float) -> bool:
  # Not our child, so it cannot be waited for: watch /proc instead.
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if start_time(pid) != started:
      return True
    time.sleep(0.1)
  return start_time(pid) != started
