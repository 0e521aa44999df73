"""Writes that read nothing of the shard must be the same in every tower.

A train_op write that reads none of the shard's values (a hand-stepped
global_step, an EMA of the weights, a constant counter) runs once, in the
last tower (tower_effects). That is one device's write only if the value is
the same whichever tower computes it. It is not when the model_fn built it
from the shard's static shape as Python numbers: `v.assign_add(x.shape[0])`
or `tf.ones(x.shape[:1])` under a static batch size hold the shard's row
count as a constant, which TensorFlow cannot trace back to the shard
(`tf.size(x)` and `tf.shape(x)` can: see folded_shapes). One device would
write the whole batch's count.

Each tower's free writes are compared by what they compute within the
tower: how many it makes into each variable, and for each the op types,
attributes, constant values and static shapes its value is built from (and
a TF1 cond's predicate or loop's condition around it). Where two towers of
different static sizes differ, the write depends on the shard and is
refused. Gradients compare as gradients: earlier towers get zeros in their
place, and what they compute from them never runs. Towers of equal sizes
hold equal constants, and such a write cannot be told from a true
constant; nor can a number hidden in a `tf.numpy_function`, a random seed
or a variable's initial value (made once, by tower 0). The docs
(writing_model_fns.md, rule 6) say to count with `tf.shape(x)[0]`.
"""

import collections
import hashlib
import itertools
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from estimator_towers.graph import functions
from estimator_towers.graph import op_ledger
from estimator_towers.towers import tower_effects

# Enough for any value a counter or an EMA computes; past it the rest of
# the graph is not compared.
_MAX_OPS = 10000
# Attributes that differ between two ops computing alike: random seeds
# (drawn per op), a py_func's token, a resource's name.
_PER_OP_ATTRIBUTES = frozenset(['seed', 'seed2', 'token', 'shared_name',
                                'container'])
# Constants past this size are compared by their ops (a big fill is not
# evaluated).
_MAX_ELEMENTS = 10000
# Ops with no inputs that hold no constant.
_FED = frozenset(['Placeholder', 'PlaceholderWithDefault', 'PlaceholderV2'])

Fingerprint = Tuple[Tuple[str, bytes, str], ...]


def fingerprint(op: tf.Operation, since: op_ledger.Mark,
                gradients: AbstractSet[str] = frozenset()) -> Fingerprint:
  """What `op` computes its written value from inside its tower.

  Args:
    op: A variable write (its value inputs are read) or an op that runs a
      function (all inputs, and the constants of the functions it runs).
    since: The mark taken before the tower's model_fn call.
    gradients: Names of the ops giving gradient calls their results
      (`OneUpdate.routed_gradients`): compared as "a gradient", not by
      value, since earlier towers get zeros in their place.

  Returns:
    For each op in a depth-first walk of the value's inputs: its type,
    the constants of the functions it runs and its static output shapes,
    or its value when known while the graph is built (then its inputs are
    not walked). Names are left out: equal in two towers whose values are
    computed alike from equal constants.
  """
  called = functions.runs_functions(op)
  roots = list(op.inputs if called else op.inputs[1:]) + _conditions(op)
  known = _known_values(roots, since, gradients)
  pending = list(reversed(roots))
  found, seen = [_element(op)] if called else [], set()
  while pending and len(seen) < _MAX_OPS:
    tensor = pending.pop()
    node = tensor.op
    if _is_variable(tensor):
      # Tower 0 creates the variables the other towers reuse.
      found.append(('variable', b'', str(tensor.shape)))
      continue
    if node.name in gradients:
      found.append(('gradient', b'', str(tensor.shape)))
      continue
    if tensor.name in known:
      # Compared by value: `tf.shape(x)[1]` slices a folded shape that
      # holds each tower's rows too, yet is the same in every tower.
      value = known[tensor.name]
      found.append(('value', value.tobytes(),
                    np.array2string(value, threshold=8)))
      continue
    if node.name in seen or op_ledger.made_before(node, since):
      continue
    seen.add(node.name)
    found.append(_element(node))
    pending.extend(reversed(node.inputs))
  return tuple(found)


def _conditions(op: tf.Operation) -> List[tf.Tensor]:
  """What decides whether a write inside TF1 control flow runs, and how
  often: its conds' predicates, its loops' conditions. (They reach the
  write through control edges, which the walk does not follow.)"""
  found = []
  context = op._control_flow_context  # pylint: disable=protected-access
  while context is not None:
    if context.IsCondContext():
      found.append(context.pred)
    elif context.IsWhileContext() and context.pivot is not None:
      found.append(context.pivot)
    context = context.outer_context
  return found


def _is_variable(tensor: tf.Tensor) -> bool:
  """A variable or a read of one (a ref variable's `read` snapshot is
  made with the variable, in tower 0)."""
  if tensor.op.type in ('Identity', 'ReadVariableOp') and tensor.op.inputs:
    tensor = tensor.op.inputs[0]
  return tensor.dtype == tf.resource or tensor.dtype._is_ref_dtype  # pylint: disable=protected-access


def _known_values(roots: Sequence[tf.Tensor], since: op_ledger.Mark,
                  gradients: AbstractSet[str]) -> Dict[str, np.ndarray]:
  """The values of the tower's tensors computed from constants only, by
  name, evaluated inputs first."""
  order, pending, seen = [], [(t.op, False) for t in roots], set()
  while pending:
    node, inputs_done = pending.pop()
    if inputs_done:
      order.append(node)
    elif (node.name not in seen and len(seen) < _MAX_OPS and
          not op_ledger.made_before(node, since)):
      seen.add(node.name)
      pending.append((node, True))
      pending.extend((t.op, False) for t in node.inputs
                     if not _is_variable(t))
  constant = {}
  for node in order:
    if (node.op_def.is_stateful or functions.runs_functions(node) or
        node.type in _FED or node.name in gradients or
        not all(t.name in constant for t in node.inputs)):
      continue
    for tensor in node.outputs:
      if (tensor.shape.is_fully_defined() and
          tensor.shape.num_elements() <= _MAX_ELEMENTS):
        constant[tensor.name] = tensor
  return _evaluate(list(constant.values()))


def _evaluate(tensors: Sequence[tf.Tensor]) -> Dict[str, np.ndarray]:
  """Runs tensors computed from constants only, in a scratch session:
  their ops copied without control inputs (a train_op is built under
  `control_dependencies`), devices or colocation."""
  values = {}
  for tensor in tensors:  # Most fold without a session (a Const, a shape).
    value = tf.get_static_value(tensor)
    if value is not None:
      values[tensor.name] = np.asarray(value)
  missing = [t for t in tensors if t.name not in values]
  if not missing:
    return values
  # Every constant op goes in: the missing ones' inputs are among them.
  graph_def = tf.compat.v1.GraphDef()
  graph_def.versions.CopyFrom(tensors[0].graph.graph_def_versions)
  for op in {t.op.name: t.op for t in tensors}.values():
    node = graph_def.node.add()
    node.CopyFrom(op.node_def)
    node.device = ''
    del node.input[:]
    node.input.extend(t.name for t in op.inputs)
    if '_class' in node.attr:
      del node.attr['_class']
  names = [t.name for t in missing]
  with tf.Graph().as_default() as scratch:
    copies = tf.graph_util.import_graph_def(
        graph_def, return_elements=names, name='')
  with tf.compat.v1.Session(graph=scratch) as session:
    values.update(zip(names, map(np.asarray, session.run(copies))))
  return values


def _element(op: tf.Operation) -> Tuple[str, bytes, str]:
  return (op.type, _attributes(op) + _constants(op),
          ','.join(str(t.shape) for t in op.outputs))


def _attributes(op: tf.Operation) -> bytes:
  """The op's attributes that say what it computes (`alpha`, a width, a
  constant's value), not those that differ per op (names, seeds, function
  names: the functions' constants are compared instead)."""
  found = []
  for key in sorted(op.node_def.attr):
    value = op.node_def.attr[key]
    if (key.startswith('_') or key in _PER_OP_ATTRIBUTES or
        value.HasField('func') or value.list.func):
      continue
    found.append(key.encode() + hashlib.sha1(
        value.SerializeToString(deterministic=True)).digest())
  return b''.join(found)


def _constants(op: tf.Operation) -> bytes:
  """The constants of the functions `op` runs (nested included)."""
  values, pending, seen = [], functions.called(op.node_def), set()
  while pending:
    name = pending.pop()
    body = functions.function(op.graph, name)
    if name in seen or body is None:
      continue
    seen.add(name)
    for node in body.definition.node_def:
      if node.op == 'Const':
        values.append(hashlib.sha1(node.attr['value'].tensor.SerializeToString(
            deterministic=True)).digest())
      pending.extend(functions.called(node))
  # Sorted: the order a node's function attributes come in varies.
  return b''.join(sorted(values))


def check_agree(per_tower: Sequence[Sequence[tf.Operation]],
                marks: Sequence[op_ledger.Mark],
                rows: Sequence[Optional[int]],
                gradients: AbstractSet[str] = frozenset()) -> None:
  """Refuses a free write whose value differs between towers.

  Only towers whose shards differ in static rows are compared: what two
  towers of one size compute differently does not come from the size (an
  earlier tower's stand-in for the update).

  Args:
    per_tower: Each tower's writes (or function calls that write) that read
      nothing of its shard, as tower_effects found them.
    marks: The mark taken before each tower's model_fn call.
    rows: Each tower's static number of rows (None: unknown, no constant
      can hold it).
    gradients: See `fingerprint`.

  Raises:
    ValueError: two towers compute one such write from different constants,
      attributes or shapes, or make a different number of such writes
      (a Python loop over `range(x.shape[0])`).
  """
  prints = [_by_target(ops, mark, gradients)
            for ops, mark in zip(per_tower, marks)]
  for i, j in itertools.combinations(range(len(prints)), 2):
    if rows[i] is None or rows[j] is None or rows[i] == rows[j]:
      continue
    for target in sorted(set(prints[i]) | set(prints[j])):
      mine, theirs = prints[i].get(target, []), prints[j].get(target, [])
      if len(mine) != len(theirs):
        _refuse(target, i, j, f'{len(mine)} such writes',
                f'{len(theirs)}')
      for a, b in zip(mine, theirs):
        difference = _differing_constants(a, b)
        if difference:
          _refuse(target, i, j, *difference)


def _refuse(target: Tuple[str, str], i: int, j: int, mine: str,
            theirs: str) -> None:
  raise ValueError(
      f'The train_op writes {target[1]} (a {target[0]} op) from no value '
      f"of the tower's shard, yet tower {i} computes it from {mine} and "
      f"tower {j} from {theirs}: it comes from the shard's static shape "
      '(x.shape[0], or a shape built from it as Python numbers). Under '
      "replicate_model_fn it would be written once, from one tower's "
      'shard; one device writes it from the whole batch. Count examples '
      'with tf.shape(x)[0] or tf.size(labels), which the wrapper adds up '
      'over the towers.')


def _by_target(ops: Sequence[tf.Operation], since: op_ledger.Mark,
               gradients: AbstractSet[str]
               ) -> Dict[Tuple[str, str], List[Fingerprint]]:
  """Fingerprints by (op type, what it writes), sorted: walk order is the
  same in every tower, but the last tower also holds the one update."""
  found = collections.defaultdict(list)
  for op in ops:
    found[(op.type, _written(op))].append(fingerprint(op, since, gradients))
  return {target: sorted(prints) for target, prints in found.items()}


def _written(op: tf.Operation) -> str:
  if op.type in tower_effects.WRITES:
    return f'variable {tower_effects.variable_source(op.inputs[0]).name}'
  return 'a variable inside the function it runs'


def _differing_constants(a: Fingerprint, b: Fingerprint
                         ) -> Optional[Tuple[str, str]]:
  """Where two towers compute a write differently: the first differing
  elements, readable; else None."""
  for x, y in zip(a, b):
    if x == y:
      continue
    if x[0] == y[0] == 'value':
      return f'the constant {x[2]}', f'the constant {y[2]}'
    if x[0] != y[0]:
      return _readable(x), _readable(y)
    if x[2] != y[2]:
      return f'a {x[0]} shaped {x[2]}', f'a {y[0]} shaped {y[2]}'
    return (f'a {x[0]} op with some attributes or function constants',
            'other ones')
  if len(a) != len(b):  # Alike as far as the shorter goes: a Python loop.
    return f'{len(a)} ops', f'{len(b)}'
  return None


def _readable(element: Tuple[str, bytes, str]) -> str:
  kind, _, text = element
  if kind == 'value':
    return f'the constant {text}'
  return f'a {kind} shaped {text}' if kind != 'variable' else 'a variable'


