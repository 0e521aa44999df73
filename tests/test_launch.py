"""The cluster supervisor names the task whose death stopped the others."""

import signal
import subprocess
import sys

import pytest

from trainer.cluster import launch

pytestmark = pytest.mark.cli


def _exited(task_type, code_or_signal, tmp_path):
  if code_or_signal == signal.SIGKILL:
    script = 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'
  else:
    script = f'raise SystemExit({code_or_signal})'
  task = launch.Task(task_type, 0, {}, str(tmp_path / f'{task_type}.log'))
  task.process = subprocess.Popen([sys.executable, '-c', script])
  task.process.wait()
  return task


def test_the_killed_task_is_named_not_the_peer_that_failed_after_it(
    tmp_path):
  # The chief fails on the broken collective after the worker is killed;
  # by the check both have exited, the chief listed first.
  tasks = [_exited('chief', 1, tmp_path),
           _exited('worker', signal.SIGKILL, tmp_path)]
  supervisor = launch.Supervisor(tasks, [], max_restarts=0,
                                 state_path=str(tmp_path / 'state.json'),
                                 restart_together=True)
  with pytest.raises(launch.ClusterFailed, match='^worker:0 exited with '
                     'signal SIGKILL'):
    supervisor._check_tasks()  # pylint: disable=protected-access
