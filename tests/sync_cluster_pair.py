"""Runs a synchronous loopback pair of tests/sync_cluster_task.py tasks.

    python tests/sync_cluster_pair.py pair MODEL_DIR STEPS ROWS...

(run inside a network namespace of its own: `unshare --net`) starts a chief
and a worker, each `python tests/sync_cluster_task.py task MODEL_DIR STEPS
ROWS...`, on free loopback ports and waits for both; it exits non-zero if
either fails or both are not done within 240 s. `dropout-pair` and
`sliced-pair` (and `micro-pair`) start `dropout-task`s and `sliced-task`s
(`micro-task`s) the same way.

It loads TensorFlow once and forks both tasks from itself
(tests/forked_tasks.py): each task would otherwise spend seconds of CPU
loading it again.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import forked_tasks  # pylint: disable=g-import-not-at-top
from trainer.cluster import private_network  # pylint: disable=g-import-not-at-top

TASK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           'sync_cluster_task.py')


def run_pair(argv, timeout_secs=240, mode='task', script=TASK_SCRIPT):
  """Starts a chief and a worker of `script` in this namespace; their exit
  code."""
  private_network.bring_up_loopback()
  cluster = {'chief': [f'127.0.0.1:{private_network.free_port()}'],
             'worker': [f'127.0.0.1:{private_network.free_port()}']}
  forked_tasks.preload()
  children = []
  for job in ('chief', 'worker'):
    tf_config = {'cluster': cluster, 'task': {'type': job, 'index': 0}}
    children.append(forked_tasks.Task(
        script, [mode, *argv],
        {**os.environ, 'TF_CONFIG': json.dumps(tf_config)}))
  deadline = time.monotonic() + timeout_secs
  try:
    while time.monotonic() < deadline:
      codes = [child.poll() for child in children]
      if any(code not in (None, 0) for code in codes):
        return 1
      if all(code == 0 for code in codes):
        return 0
      time.sleep(0.5)
    print(f'the cluster was not done within {timeout_secs} s', flush=True)
    return 1
  finally:
    for child in children:
      if child.poll() is None:
        child.kill()
        child.wait()


if __name__ == '__main__':
  sys.exit(run_pair(sys.argv[2:], mode=sys.argv[1].replace('pair', 'task')))
