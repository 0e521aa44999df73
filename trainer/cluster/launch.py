"""Starting and supervising the processes of a local TF_CONFIG cluster.

One process per task, each `python -m trainer.task` with its own TF_CONFIG
and log file. The supervisor restarts a task that dies (up to a limit, like
a Kubeflow TFJob's OnFailure policy), stops everything when one task fails
for good, and stops the parameter servers (which never exit by themselves)
once the chief and the evaluator are done. Stopping is ordered: the chief,
workers and evaluator first (the chief saves a checkpoint on SIGTERM, which
needs the parameter servers that hold the variables), the ps last.

A synchronous cluster (no ps: the chief and workers train one step together)
cannot restart one task alone: the others have failed or are waiting for a
peer that will never rejoin their collectives. There, the death of a chief
or worker restarts every chief and worker task (the group), up to the limit
counted per group restart; they resume from the chief's last checkpoint.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from absl import logging

from trainer.cluster import private_network

# Signals that must not cut a stop short: a second Ctrl-C would otherwise
# leave tasks running and logs/cluster.json saying so.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The tasks of a synchronous cluster's group.
_TRAINING_JOBS = ('chief', 'worker')
# The chief's lines the launcher repeats on its stdout: its progress (absl
# log lines of trainer.step_logging and the like) and its last line.
_ECHOED = re.compile(
    r'\] ((?:step \d+: |trained \d+ steps|evaluated step |Resuming from |'
    r'Stopping training).*)$|^((?:eval|done): .*)$')


@dataclasses.dataclass
class Task:
  """One process of the cluster."""
  type: str
  index: int
  tf_config: Dict
  log_path: str
  process: Optional[subprocess.Popen] = None
  restarts: int = 0
  exit_code: Optional[int] = None

  @property
  def name(self) -> str:
    return f'{self.type}:{self.index}'


class LogEcho:
  """Prints a task's progress and final lines as its log file grows.

  Args:
    task: The task (its log file and name).
    write: Where the lines go (print by default).
  """

  def __init__(self, task: Task,
               write: Optional[Callable[[str], None]] = None):
    self._task = task
    self._write = write or (lambda line: print(line, flush=True))
    self._offset = 0
    self._partial = ''

  def poll(self) -> None:
    """Prints the matching complete lines written since the last poll."""
    try:
      with open(self._task.log_path, errors='replace') as f:
        f.seek(self._offset)
        text = f.read()
        self._offset = f.tell()
    except OSError:
      return  # Not written yet.
    lines = (self._partial + text).split('\n')
    self._partial = lines.pop()  # A line still being written.
    for line in lines:
      match = _ECHOED.search(line)
      if match:
        self._write(f'{self._task.name}: {match.group(1) or match.group(2)}')


class ClusterFailed(RuntimeError):
  """A task failed and could not be restarted; the cluster was stopped."""


def cluster_spec(num_workers: int, num_ps: int) -> Dict[str, List[str]]:
  """A chief, `num_workers` more workers and `num_ps` ps on free ports."""
  spec = {'chief': [f'127.0.0.1:{private_network.free_port()}']}
  if num_workers:
    spec['worker'] = [f'127.0.0.1:{private_network.free_port()}'
                      for _ in range(num_workers)]
  if num_ps:
    spec['ps'] = [f'127.0.0.1:{private_network.free_port()}'
                  for _ in range(num_ps)]
  return spec


def is_synchronous(spec: Dict[str, List[str]]) -> bool:
  """Whether the cluster's chief and workers train in lockstep (no ps)."""
  return not spec.get('ps') and sum(
      len(spec.get(job, [])) for job in _TRAINING_JOBS) > 1


def make_tasks(spec: Dict[str, List[str]], evaluator: bool,
               log_dir: str) -> List[Task]:
  """A Task for every address of `spec`, plus an evaluator if asked."""
  tasks = []
  roles = [(job, i) for job in ('ps', 'chief', 'worker')
           for i in range(len(spec.get(job, [])))]
  if evaluator:
    roles.append(('evaluator', 0))
  for job, index in roles:
    config = {'cluster': spec, 'task': {'type': job, 'index': index},
              'environment': 'cloud'}
    tasks.append(Task(job, index, config,
                      os.path.join(log_dir, f'{job}-{index}.log')))
  return tasks


class Supervisor:
  """Runs the tasks until the chief and evaluator finish or one fails.

  Args:
    tasks: What to run.
    task_args: Flags for every `trainer.task` process.
    max_restarts: How often each task may be restarted after dying.
    state_path: Where to keep a JSON view of the tasks and their pids.
    grace_secs: How long a task gets to stop after SIGTERM before SIGKILL.
    restart_together: A synchronous cluster: a chief or worker that dies
      restarts them all, and `max_restarts` counts these group restarts.
    echo: Print the chief's progress and final lines (its log has all).
  """

  def __init__(self, tasks: Sequence[Task], task_args: Sequence[str],
               max_restarts: int, state_path: str, grace_secs: float = 10.0,
               restart_together: bool = False, echo: bool = False):
    self._tasks = list(tasks)
    self._echoes = [LogEcho(t) for t in tasks if t.type == 'chief' and echo]
    self._args = list(task_args)
    self._max_restarts = max_restarts
    self._state_path = state_path
    self._grace = grace_secs
    self._together = restart_together
    self._group_restarts = 0

  def run(self, poll_secs: float = 0.5) -> None:
    """Starts every task and supervises them.

    Raises:
      ClusterFailed: a task failed beyond its restarts.
    """
    try:
      for task in self._tasks:
        self._start(task)
      self._write_state()
      while not self._finished():
        time.sleep(poll_secs)
        self._echo()
        self._check_tasks()
    finally:
      self.stop_all()
      self._echo()  # The chief's last lines.

  def _echo(self) -> None:
    for echo in self._echoes:
      echo.poll()

  def _start(self, task: Task) -> None:
    env = {**os.environ, 'TF_CONFIG': json.dumps(task.tf_config)}
    with open(task.log_path, 'a') as log:
      log.write(f'=== {time.strftime("%H:%M:%S")} starting {task.name} '
                f'(restart {task.restarts}) ===\n')
      log.flush()
      task.process = subprocess.Popen(
          [sys.executable, '-m', 'trainer.task', *self._args], env=env,
          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          preexec_fn=private_network.die_with_parent,
          # Its own session: a Ctrl-C in the terminal reaches the launcher
          # alone, which stops the tasks in order. Sent to the whole group,
          # it would stop the ps while the chief saves.
          start_new_session=True)
    task.exit_code = None
    logging.info('Started %s (pid %d), log %s', task.name, task.process.pid,
                 task.log_path)

  def _check_tasks(self) -> None:
    for task in self._exited_first():
      code = task.process.returncode
      if code == 0:
        task.exit_code = 0
        logging.info('%s finished.', task.name)
        continue
      if self._in_group(task):
        self._restart_group(task, code)
        return
      if task.restarts >= self._max_restarts:
        task.exit_code = code
        raise ClusterFailed(
            f'{task.name} exited with {_describe(code)} after '
            f'{task.restarts} restart(s); stopped the cluster. Its log: '
            f'{task.log_path}\n{_tail(task.log_path)}')
      task.restarts += 1
      logging.warning('%s exited with %s; restarting it (%d of %d).',
                      task.name, _describe(code), task.restarts,
                      self._max_restarts)
      self._start(task)
      self._write_state()

  def _exited_first(self) -> List[Task]:
    """The tasks that exited since the last check, their cause first.

    A task killed by a signal comes before those that exited on their own:
    when a synchronous worker is killed, the chief fails on the broken
    collective a moment later, and both may have exited by this check.
    """
    exited = [t for t in self._tasks
              if t.exit_code is None and t.process.poll() is not None]
    return sorted(exited, key=lambda t: t.process.returncode >= 0)

  def _in_group(self, task: Task) -> bool:
    """Whether `task` trains in lockstep with others still training."""
    chief_done = any(t.type == 'chief' and t.exit_code == 0
                     for t in self._tasks)
    return self._together and task.type in _TRAINING_JOBS and not chief_done

  def _restart_group(self, failed: Task, code: int) -> None:
    """Stops and restarts every chief and worker after `failed` died.

    Raises:
      ClusterFailed: the group was restarted `max_restarts` times already.
    """
    if self._group_restarts >= self._max_restarts:
      failed.exit_code = code
      raise ClusterFailed(
          f'{failed.name} exited with {_describe(code)} after '
          f'{self._group_restarts} restart(s) of the synchronous tasks; '
          f'stopped the cluster. Its log: {failed.log_path}\n'
          f'{_tail(failed.log_path)}')
    self._group_restarts += 1
    group = [t for t in self._tasks if t.type in _TRAINING_JOBS]
    logging.warning(
        '%s exited with %s; the synchronous tasks cannot go on without it: '
        'restarting %s from the chief\'s last checkpoint (%d of %d).',
        failed.name, _describe(code), ', '.join(t.name for t in group),
        self._group_restarts, self._max_restarts)
    self._stop([t for t in group if t.process.poll() is None],
               signal.SIGTERM)
    for task in group:
      task.restarts += 1
      self._start(task)
    self._write_state()

  def _finished(self) -> bool:
    """Done when the chief and the evaluator (if any) exited cleanly."""
    return all(t.exit_code == 0 for t in self._tasks
               if t.type in ('chief', 'evaluator'))

  def stop_all(self) -> None:
    """Stops every live task, the parameter servers last.

    The chief, workers and evaluator get SIGTERM (the chief then saves a
    checkpoint, reading the variables from the ps) and SIGKILL after the
    grace period. Only then do the parameter servers get SIGKILL: they block
    in C++ where no signal handler runs, and hold nothing a checkpoint lacks
    once the chief has saved. Ctrl-C, SIGTERM and SIGHUP wait until the stop
    is complete and logs/cluster.json says so.
    """
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
      live = [t for t in self._tasks
              if t.process and t.process.poll() is None]
      self._stop([t for t in live if t.type != 'ps'], signal.SIGTERM)
      self._stop([t for t in live if t.type == 'ps'], signal.SIGKILL)
      if live:
        logging.info('Stopped %s.', ', '.join(t.name for t in live))
      self._write_state()
    finally:
      signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

  def _stop(self, tasks: Sequence[Task], signum: int) -> None:
    """Sends `signum`, waits the grace period, then SIGKILLs the rest."""
    for task in tasks:
      task.process.send_signal(signum)
    deadline = time.time() + self._grace
    for task in tasks:
      try:
        task.process.wait(max(0.0, deadline - time.time()))
      except subprocess.TimeoutExpired:
        logging.warning('%s did not stop within %.0f s of %s; killing it.',
                        task.name, self._grace, signal.Signals(signum).name)
        task.process.kill()
        task.process.wait()

  def _write_state(self) -> None:
    state = {'tasks': [
        {'name': t.name, 'type': t.type, 'index': t.index,
         'pid': t.process.pid if t.process else None,
         'running': bool(t.process and t.process.poll() is None),
         'restarts': t.restarts, 'log': t.log_path,
         'address': (t.tf_config['cluster'].get(t.type) or [None])[t.index]
                    if t.type != 'evaluator' else None}
        for t in self._tasks]}
    temp = self._state_path + '.tmp'
    with open(temp, 'w') as f:
      json.dump(state, f, indent=2)
    os.replace(temp, self._state_path)


def _describe(code: int) -> str:
  if code < 0:
    return f'signal {signal.Signals(-code).name}'
  return f'exit code {code}'


def _tail(path: str, lines: int = 15) -> str:
  try:
    with open(path, errors='replace') as f:
      return ''.join(f.readlines()[-lines:])
  except OSError:
    return ''
