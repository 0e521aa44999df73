"""One gate op in place of a long list of control inputs on every new op.

A model_fn commonly updates batch norm's moving averages with

  with tf.control_dependencies(tf.compat.v1.get_collection(UPDATE_OPS)):
    train_op = optimizer.minimize(loss)

and TensorFlow then gives EVERY op created inside (each gradient op whose
inputs come from outside the block, every constant of the backward pass)
one control input per update op: two per batch-norm layer. The towers'
one update differentiates every tower inside the last tower's block, so
the graph grows by (backward ops) x (update ops) edges, many of them
between devices; with batch_norm='global' (whose exchange has a backward
pass of its own per layer call) MobileNet's train graph holds ten control
edges per data edge, and grappler and the partitioner walk each of them on
every new fetch (start-up 5x slower than per-tower batch norm).

`gated` depends on the same ops through one NoOp: every op built inside
waits for it, so for the same ops as before (transitively), and the
values computed do not change, while the edges drop to one per op plus
one per control input.
"""

import contextlib
from typing import Iterator

import tensorflow as tf

tf1 = tf.compat.v1

# Fewer control inputs than this are left as they are: one gate would add
# an op and save almost nothing.
_MIN_CONTROLS = 3


@contextlib.contextmanager
def gated(name: str = 'control_inputs') -> Iterator[None]:
  """Ops built inside depend on the enclosing control inputs via one op.

  Inside a control-flow context (a `tf.cond` or `tf.while_loop` branch),
  or with few control inputs, nothing changes: clearing the control inputs
  would also leave the control-flow context.

  Args:
    name: The gate's name (a NoOp grouping the control inputs).

  Yields:
    Nothing; the graph's control inputs are the gate inside.
  """
  graph = tf1.get_default_graph()
  # pylint: disable=protected-access
  controls = graph._current_control_dependencies()
  in_control_flow = graph._get_control_flow_context() is not None
  # pylint: enable=protected-access
  if len(controls) < _MIN_CONTROLS or in_control_flow:
    yield
    return
  # Sorted: the same model_fn builds the same graph (set order varies).
  ordered = sorted(controls, key=lambda op: op.name)
  with graph.control_dependencies(None):
    gate = tf.group(*ordered, name=name)
    with graph.control_dependencies([gate]):
      yield
