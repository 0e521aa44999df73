"""The task group of training on one machine: a group of one task.

`task_sync.TaskGroup` makes the tasks of a synchronous cluster one
computation: sums over the tasks, the chief's start broadcast, a seed per
task. On one machine (and in EVAL and PREDICT, and in clusters with ps
tasks) there is one task, and each of those is the identity. `OneMachine`
is that group, so the tower builder and its collaborators take a task group
always and never ask whether there is one; only behaviour that exists
solely in a cluster (its error messages, its extra checks) asks
`across_tasks`.
"""

import contextlib
from typing import Callable, Iterator, List, Sequence

import tensorflow as tf


class OneMachine:
  """The one training task of a machine, with `task_sync.TaskGroup`'s
  interface.

  Attributes:
    across_tasks: False: nothing is summed or broadcast between tasks.
    size: 1.
    index: 0, as the chief of a cluster.
    is_chief: True: this task restores or initialises the variables.
  """

  across_tasks = False
  size = 1
  index = 0
  is_chief = True

  def own_part(self, gradient, has_rows: tf.Tensor):
    """`gradient`: the only task's part is the whole sum (an empty batch
    has no peers whose sums its zero row could disturb)."""
    del has_rows
    return gradient

  def sum(self, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """The tensors themselves: a sum over one task."""
    return list(tensors)

  def gather_slices(self, slices: tf.IndexedSlices) -> tf.IndexedSlices:
    """`slices`: the only task's rows are all the rows."""
    return slices

  def started(self, base: tf.Operation,
              init_op: Callable[[], tf.Operation],
              variables: Callable[[], Sequence[tf.Variable]]
              ) -> tf.Operation:
    """`base` unchanged: one task needs no common start.

    Args:
      base: The local_init_op the Scaffold would run.
      init_op: Unused (a worker of a cluster initialises its variables).
      variables: Unused (a cluster's chief broadcasts them).

    Returns:
      `base`.
    """
    del init_op, variables
    return base

  @contextlib.contextmanager
  def own_random_seed(self) -> Iterator[None]:
    """The graph seed unchanged: no peer repeats this task's draws."""
    yield
