"""Thread pools for tasks that share one machine's cores.

TensorFlow sizes each process's inter-op and intra-op pools to every core of
the machine. One task per machine (Vertex AI, a TFJob) is what that default
is for; `python -m trainer.cluster` starts every task on this machine, and
each then runs as many threads as there are cores: a chief and a worker on
2 cores run 4 pool threads each, and their collectives wait on each other
while the kernel time-slices them. Giving each task its share of the cores
(like `torchrun`, which sets one OpenMP thread per process it starts) made
the loopback synchronous cluster 1.2-1.3x faster (docs/benchmarks.md,
"Thread pools of tasks sharing a machine").

The share is a default only: the flags go before the user's task flags, so
`--intra-op-threads`/`--inter-op-threads` given after `--` (or in a
flagfile) win, and `=0` gives TensorFlow's own choice back.
"""

import os
from typing import List, Optional


def machine_cores() -> int:
  """Cores this process may run on (its CPU affinity, not the machine's
  total: a container or `taskset` may allow fewer)."""
  return len(os.sched_getaffinity(0))


def threads_per_task(training_tasks: int, cores: int) -> int:
  """Each task's pool size when `training_tasks` share `cores`.

  The training tasks (chief and workers) do nearly all of the work; a
  parameter server or an evaluator gets the same share, being light or idle
  most of the time.

  Args:
    training_tasks: The chief and the workers (at least 1).
    cores: The cores they share (at least 1).

  Returns:
    cores // training_tasks, at least 1.

  Raises:
    ValueError: a count below 1.
  """
  if training_tasks < 1 or cores < 1:
    raise ValueError(f'training_tasks={training_tasks} and cores={cores} '
                     'must both be at least 1.')
  return max(1, cores // training_tasks)


def default_flags(training_tasks: int,
                  cores: Optional[int] = None) -> List[str]:
  """trainer.task flags giving each task its share of the cores.

  Put them before the user's flags: absl keeps a flag's last value, so the
  user's own thread flags override these.

  Args:
    training_tasks: The chief and the workers.
    cores: Default: `machine_cores()`.

  Returns:
    `--inter-op-threads=N` and `--intra-op-threads=N`.
  """
  threads = threads_per_task(training_tasks,
                             machine_cores() if cores is None else cores)
  return [f'--inter-op-threads={threads}', f'--intra-op-threads={threads}']
