"""The graph functions an op runs: `tf.cond` branches, loop bodies and
`tf.function` calls live in the graph's function library, named by the op's
type or by its function-valued attributes. TensorFlow's lookup by name is
private; this module is the one place that calls it.
"""

from typing import List, Optional

import tensorflow as tf

# What a tf.while_loop is in the graph: v2 control flow, or v1's frames.
LOOPS = frozenset(['While', 'StatelessWhile', 'Enter', 'RefEnter'])


def called(node_def) -> List[str]:
  """Names the op of `node_def` may run as functions: its type (a function
  called by name) and its function attributes (If's branches,
  PartitionedCall's `f`)."""
  names = [node_def.op]
  for value in node_def.attr.values():
    names.extend(f.name for f in [value.func, *value.list.func] if f.name)
  return names


def function(graph: tf.Graph, name: str):
  """The graph function `name` of `graph` (or of a graph it is nested in),
  or None."""
  return graph._get_function(name)  # pylint: disable=protected-access


def runs_functions(op: tf.Operation) -> bool:
  """Whether `op` needs its graph's function library to run."""
  return any(function(op.graph, name) is not None
             for name in called(op.node_def))


def called_body(op: tf.Operation) -> Optional[tf.Graph]:
  """The body (a FuncGraph) of the function a PartitionedCall runs, or None
  (also when its inputs or outputs do not match the call's)."""
  if op.type not in ('PartitionedCall', 'StatefulPartitionedCall'):
    return None
  body = getattr(function(op.graph, op.get_attr('f').name), 'graph', None)
  if body is None or len(body.outputs) != len(op.outputs) or (
      len(body.inputs) != len(op.inputs)):
    return None
  return body
