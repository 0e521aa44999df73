"""Which reads and writes of a variable the executor leaves unordered.

The Python graph is not what runs: the session lowers `tf.cond`s and
`tf.while_loop`s (If, While) to Switch/Merge, inlines their functions,
lets grappler rewrite control edges, and splits the graph per device with
_Send/_Recv pairs. A control edge out of a lowered If reaches only the
branch's pivot, not what the branch body does, so an order that holds in
the Python graph can be gone in the graph that runs (a Lookahead-style
snapshot under a tf.cond read the updated weights in 7 of 250 tower runs).
This check reads the partition graphs the session really ran and reports
every read of a variable that has no path to or from a write of it there.

A call op still present after the session's rewrites (an If kept whole, a
function call) ends only when its function has ended, so it stands for
every access its function makes.
"""

from typing import Dict, Iterable, List, Set, Tuple

import tensorflow as tf

tf1 = tf.compat.v1

# Ops that pass a resource handle or ref on to the op that uses it.
_FORWARDING = ('Identity', 'RefIdentity', 'Switch', 'RefSwitch', 'Enter',
               'RefEnter', 'Merge', 'RefMerge')
_VARIABLES = ('VarHandleOp', 'VariableV2', 'Variable')
_WRITE_MARKS = ('Assign', 'Apply', 'Scatter', 'Insert')
_RECEIVES = ('_Recv', '_HostRecv')
_SENDS = ('_Send', '_HostSend')


def unordered_in_run(session: tf1.Session, fetches) -> List[Tuple[str, str]]:
  """Runs `fetches` once and checks the graphs the session ran.

  Args:
    session: A session of the graph.
    fetches: What one step runs (the train_op, the loss).

  Returns:
    (read, write) node names of one variable with no order between them in
    the executed graph; a write counts only when it changes the variable.
  """
  metadata = tf1.RunMetadata()
  session.run(fetches,
              options=tf1.RunOptions(output_partition_graphs=True),
              run_metadata=metadata)
  return unordered_nodes(metadata.partition_graphs)


def unordered_nodes(partitions: Iterable) -> List[Tuple[str, str]]:
  """(read, write) pairs of one variable with no path between them.

  Args:
    partitions: The GraphDefs of one run (RunMetadata.partition_graphs).

  Returns:
    The unordered pairs, sorted.
  """
  nodes = {node.name: node for graph in partitions for node in graph.node}
  inputs = _inputs(nodes)
  reads: Dict[str, Set[str]] = {}
  writes: Dict[str, Set[str]] = {}
  for name, node in nodes.items():
    for variable in _variables_taken(node, nodes, inputs):
      kind = writes if any(m in node.op for m in _WRITE_MARKS) else reads
      kind.setdefault(variable, set()).add(name)
  unordered = []
  for variable, writers in writes.items():
    for write in writers:
      before = _ancestors(write, inputs)
      for read in reads.get(variable, ()):
        if read not in before and write not in _ancestors(read, inputs):
          unordered.append((read, write))
  return sorted(unordered)


def _inputs(nodes) -> Dict[str, List[str]]:
  """Each node's predecessors, a _Recv's being the _Send it receives."""
  senders = {_key(node): name for name, node in nodes.items()
             if node.op in _SENDS}
  inputs = {}
  for name, node in nodes.items():
    found = [i.lstrip('^').split(':')[0] for i in node.input]
    if node.op in _RECEIVES and _key(node) in senders:
      found.append(senders[_key(node)])
    inputs[name] = found
  return inputs


def _key(node) -> Tuple[str, str, str]:
  attr = node.attr
  return (attr['tensor_name'].s, attr['send_device'].s,
          attr['recv_device'].s)


def _variables_taken(node, nodes, inputs) -> List[str]:
  """The variables a node takes as a handle or ref, by their op names."""
  if node.op in _VARIABLES or node.op in _FORWARDING or node.op in _SENDS:
    return []
  sources = [_source(name.split(':')[0], nodes, inputs)
             for name in node.input if not name.startswith('^')]
  return [source for source in sources if source is not None]


def _source(name, nodes, inputs):
  """The variable op a handle or ref comes from, or None."""
  seen = set()
  while name in nodes and name not in seen:
    seen.add(name)
    node = nodes[name]
    if node.op in _VARIABLES:
      return name
    if node.op in _FORWARDING or node.op in _RECEIVES or node.op in _SENDS:
      if not inputs[name]:
        return None
      # A _Recv's last predecessor is its _Send (see _inputs).
      name = inputs[name][-1 if node.op in _RECEIVES else 0]
      continue
    return None
  return None


def _ancestors(name: str, inputs) -> Set[str]:
  found, pending = set(), [name]
  while pending:
    current = pending.pop()
    if current not in found:
      found.add(current)
      pending.extend(inputs.get(current, ()))
  return found
