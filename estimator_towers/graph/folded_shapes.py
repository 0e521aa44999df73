"""What a constant folded from a static shape was folded from.

With a static batch size, `tf.size(x)`, `tf.shape(x)`, `tf.ones_like(x)` and
`tf.zeros_like(x)` read no op of `x`: TensorFlow folds `x`'s static shape
into a constant (a size, a shape, or a small tensor of ones) while the graph
is built. A loss divided by such a constant looks like a fixed scaling, yet
when `x` is computed from the tower's shard the constant counts the shard's
elements, and each tower's differs from one device's. Only where the
constant came from tells the two apart.

`recording()` patches TensorFlow's folding functions while the towers are
built (for the build's graph and thread only, see patching.py) and
remembers, for each constant they fold, the tensor it was folded from and
what it holds; `source(op)` and `kind(op)` answer afterwards.

Inside a function body (a `tf.function`, a control-flow-v2 branch or loop)
a fold of a tensor from outside the body leaves no trace in the op that
calls the function: the tensor is never captured, so the call reads
nothing of it (a `tf.size(labels)` written inside a `tf.cond`).
`folded_in(body)` names such tensors. (Not folding there would also make
the call read them, but changes the graph one device builds: static shapes
inside loops and branches that code may rely on.)
"""

import contextlib
import functools
from typing import Callable, Iterator, List, Optional
import weakref

import tensorflow as tf
from tensorflow.python.ops import array_ops  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.graph import patching

SIZE, SHAPE, FILL = 'size', 'shape', 'fill'
# The functions of array_ops that fold a static shape into a constant
# (tf.size, tf.shape), and what their constant holds.
_KINDS = {'size_internal': SIZE, 'shape_internal': SHAPE}
FOLDING_FUNCTIONS = tuple(_KINDS)
# ones_like / zeros_like: a constant tensor (or a Fill of a constant shape)
# shaped like their input, when its shape is static.
_LIKE = 'array_like_impl'

# graph -> {constant op name: (a weak reference to the source's graph, the
# source's name, the kind)}. Weak both ways: a graph is freed with its
# records (a record holding the tensor would keep its graph alive).
_sources: 'weakref.WeakKeyDictionary' = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def recording() -> Iterator[None]:
  """Records the source of every shape constant folded inside the context.

  Yields:
    Nothing.
  """
  with patching.Patcher() as patcher:
    for name in FOLDING_FUNCTIONS:
      original = getattr(array_ops, name)
      patcher.set(array_ops, name, patcher.guard(
          _recorder(original, _KINDS[name]), original))
    original = getattr(array_ops, _LIKE)
    patcher.set(array_ops, _LIKE, patcher.guard(_like_recorder(original),
                                                original))
    yield


def _record(constant: tf.Operation, source, kind: str) -> None:
  if (isinstance(source, tf.Tensor) and not tf.executing_eagerly() and
      constant.type == 'Const'):
    _sources.setdefault(constant.graph, {})[constant.name] = (
        weakref.ref(source.graph), source.name, kind)


def _recorder(original, kind: str):

  @functools.wraps(original)
  def folding(input, *args, **kwargs):  # pylint: disable=redefined-builtin
    result = original(input, *args, **kwargs)
    if isinstance(result, tf.Tensor):
      _record(result.op, input, kind)
    return result

  return folding


def _like_recorder(original):

  @functools.wraps(original)
  def like(array_fn, array_like_fn, tensor, *args, **kwargs):
    result = original(array_fn, array_like_fn, tensor, *args, **kwargs)
    if isinstance(result, tf.Tensor):
      if result.op.type == 'Fill':  # Too big for a constant: its shape.
        _record(result.op.inputs[0].op, tensor, SHAPE)
      else:
        _record(result.op, tensor, FILL)
    return result

  return like


def folded_in(body: tf.Graph) -> List[tf.Tensor]:
  """The tensors of enclosing graphs whose static shapes were folded into
  constants of `body` (a function's graph) while `recording`."""
  found = []
  for graph_ref, name, _ in _sources.get(body, {}).values():
    graph = graph_ref()
    if graph is not None and graph is not body:
      found.append(graph.get_tensor_by_name(name))
  return found


def source(op: tf.Operation) -> Optional[tf.Tensor]:
  """The tensor whose static shape `op` (a constant) was folded from while
  `recording`, or None."""
  record = _sources.get(op.graph, {}).get(op.name)
  graph = record[0]() if record else None
  return None if graph is None else graph.get_tensor_by_name(record[1])


def kind(op: tf.Operation) -> Optional[str]:
  """What a recorded constant holds: SIZE (tf.size), SHAPE (tf.shape, or a
  big ones_like's shape) or FILL (a small ones_like / zeros_like); None if
  not recorded."""
  record = _sources.get(op.graph, {}).get(op.name)
  return record[2] if record else None


def computed_from(tensor: tf.Tensor,
                  folded: Callable[[tf.Operation], bool] = (
                      lambda op: kind(op) in (SIZE, SHAPE)),
                  skip: Callable[[tf.Operation], bool] = lambda op: False,
                  max_ops: int = 2000) -> bool:
  """Whether `tensor` is computed from a constant `folded` accepts (by
  default, a recorded size or shape), walking its inputs but not through
  the ops `skip` names; a walk past `max_ops` ops answers False."""
  pending, seen = [tensor.op], set()
  while pending and len(seen) < max_ops:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if skip(op):
      continue
    if folded(op):
      return True
    pending.extend(t.op for t in op.inputs)
  return False
