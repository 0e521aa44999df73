"""Thread pools for processes that share one machine's cores.

TensorFlow sizes each process's inter-op and intra-op pools to every core of
the machine. One process per machine (a Vertex AI task, a TFJob's pod) is
what that default is for. Two launchers here start several TensorFlow
processes on one machine, and give each its share instead:
`python -m trainer.cluster` (every task of a cluster; the default made the
loopback synchronous chief + worker 1.1-1.3x slower, docs/benchmarks.md,
"Thread pools of tasks sharing a machine") and `python -m trainer.sweep`
(parallel trials, trainer/sweep/devices.py). `torchrun` does the same with
one OpenMP thread per process it starts.
"""

import os
from typing import Dict, List, Optional, Tuple


def machine_cores() -> int:
  """Cores this process may run on: its CPU affinity where there is one (a
  container or `taskset` may allow fewer than the machine has)."""
  if hasattr(os, 'sched_getaffinity'):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def pool_sizes(processes: int, cores: int) -> Tuple[int, int]:
  """Each process's (intra-op, inter-op) pool sizes when `processes` busy
  TensorFlow processes share `cores`.

  Args:
    processes: Processes that compute at the same time (a cluster's chief
      and workers; parallel trials), at least 1.
    cores: The cores they share, at least 1.

  Returns:
    intra-op = max(1, cores // processes) and inter-op = max(1, intra-op //
    2): one process's independent ops rarely keep more than half of its
    share busy at once.

  Raises:
    ValueError: a count below 1.
  """
  if processes < 1 or cores < 1:
    raise ValueError(f'processes={processes} and cores={cores} must both be '
                     'at least 1.')
  intra = max(1, cores // processes)
  return intra, max(1, intra // 2)


def default_flags(processes: int, cores: Optional[int] = None) -> List[str]:
  """trainer.task flags giving a process its share of the cores.

  Put them before the user's flags: absl keeps a flag's last value, so the
  user's own thread flags (also in a flagfile) override these, and `=0`
  gives TensorFlow's own choice back.

  Args:
    processes: As for `pool_sizes`.
    cores: Default: `machine_cores()`.

  Returns:
    `--inter-op-threads=N` and `--intra-op-threads=M`.
  """
  intra, inter = pool_sizes(processes,
                            machine_cores() if cores is None else cores)
  return list(pool_flags(intra, inter).values())


def pool_flags(intra: int, inter: int) -> Dict[str, str]:
  """{flag name: the trainer.task flag} for pools of these sizes; the one
  spelling of the thread flags the launchers pass."""
  return {'inter-op-threads': f'--inter-op-threads={inter}',
          'intra-op-threads': f'--intra-op-threads={intra}'}
