"""A stop request that travels with the step across a synchronous cluster.

In a synchronous cluster a task that stops alone breaks its peers' next
collective: they lose every step since the last checkpoint. So a task that
is asked to stop (a signal, say) does not stop at once: it raises a local
flag, and the next step carries every task's flags, summed over the tasks
in the collective that already sums the step's loss (no collective of its
own). After that step every task reads the same sum, so every task stops
after the same step and the chief can save it.

The flags are a short float vector, one slot per reason to stop (the
trainer uses one per stop signal), in a local variable: never saved, never
broadcast, zero at every start. On one machine nothing is built: a stop
there needs no agreement.
"""

from typing import Optional

import tensorflow as tf

tf1 = tf.compat.v1

# Reasons a task may ask to stop for; the trainer maps its signals to them.
SLOTS = 3
_COLLECTION = 'estimator_towers_stop_request'


class StopRequest:
  """This task's stop flags and the step's sum of every task's flags.

  Args:
    flags: The local float variable of shape [SLOTS].
    summed: The flags summed over the tasks, computed by each step.
  """

  def __init__(self, flags: tf.Variable, summed: tf.Tensor):
    self.flags = flags
    self.summed = summed

  def ask_op(self, slot: int) -> tf.Operation:
    """An op that raises this task's flag `slot`; the next step carries it.

    Build it before the graph is finalized (a hook's `begin`).

    Raises:
      ValueError: `slot` is not in [0, SLOTS).
    """
    if not 0 <= slot < SLOTS:
      raise ValueError(f'Stop request slot {slot} is not in [0, {SLOTS}).')
    return tf1.scatter_update(self.flags, [slot], [1.0]).op


def sum_loss_with_flags(task_group, loss: tf.Tensor) -> tf.Tensor:
  """`loss` summed over the tasks; the tasks' stop flags ride along.

  The flags are packed with the loss (same dtype), so the step's loss
  collective carries them and no collective is added.

  Args:
    task_group: A task_sync.TaskGroup (tasks of a synchronous cluster).
    loss: This task's part of the step's loss, a scalar.

  Returns:
    The loss summed over the tasks. `of_graph()` then finds the flags.
  """
  with tf.device(task_group.device):
    flags = tf1.Variable(tf.zeros([SLOTS]), trainable=False,
                         collections=[tf1.GraphKeys.LOCAL_VARIABLES],
                         name='stop_request_flags', use_resource=True)
  carried = tf.cast(flags.read_value(), loss.dtype)
  total, summed = task_group.sum([loss, carried])
  graph = tf1.get_default_graph()
  graph.add_to_collection(_COLLECTION, flags)
  graph.add_to_collection(_COLLECTION, tf.cast(summed, tf.float32))
  return total


def of_graph(graph: Optional[tf.Graph] = None) -> Optional[StopRequest]:
  """The stop request of a graph of a synchronous cluster's task, or None.

  Args:
    graph: Default: the default graph.

  Returns:
    None where no step carries stop flags (one machine, evaluation).
  """
  graph = graph or tf1.get_default_graph()
  found = graph.get_collection(_COLLECTION)
  if not found:
    return None
  flags, summed = found[-2:]  # The latest model_fn call's.
  return StopRequest(flags, summed)
