"""Orders the global step's increment after the step counter's read of it.

The Estimator's StepCounterHook fetches `global_step/add` (a copy of the
step) together with the train op, and warns "global step has not been
increased" when two steps in a row fetch the same value. Nothing orders that
read against the optimizer's `assign_add` of the same run: under load the
read of one step sees the increment and the next one does not, the values
repeat, and the warning reports a stall that is not there. With the
increment made to wait for the read, each run fetches the step before its
own update, so the values repeat only when a train op really does not
advance the step, and that stall is still reported.
"""

import tensorflow as tf
from tensorflow.python.training import training_util  # The read's key.

tf1 = tf.compat.v1
# The ops that change a variable (resource and reference variables).
_WRITES = ('AssignAddVariableOp', 'AssignVariableOp', 'AssignSubVariableOp',
           'AssignAdd', 'Assign', 'AssignSub')


def order_increment_after_read(graph: tf.Graph) -> int:
  """Makes every write of the global step in `graph` wait for its read.

  Call after the TRAIN graph is built, before the Saver (whose restore
  ops write the step too, and must not wait for it).

  Args:
    graph: A graph with a global step and the Estimator's read of it.

  Returns:
    How many writes were ordered (0 without a global step or its read).
  """
  step = tf1.train.get_global_step(graph)
  reads = graph.get_collection(training_util.GLOBAL_STEP_READ_KEY)
  if step is None or len(reads) != 1:
    return 0
  read = reads[0].op
  target = step.handle if hasattr(step, 'handle') else step._ref()  # pylint: disable=protected-access
  ordered = 0
  for op in graph.get_operations():
    if (op.type in _WRITES and op is not step.initializer and op.inputs and
        op.inputs[0] is target and read not in op.control_inputs and
        # Inside a v1 cond or while loop an outside control input is an
        # error; such a write stays as it was.
        op._control_flow_context is None):  # pylint: disable=protected-access
      op._add_control_input(read)  # pylint: disable=protected-access
      ordered += 1
  return ordered
