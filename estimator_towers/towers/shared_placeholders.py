"""A later tower's placeholder reads the value fed to tower 0's.

A model_fn may make a placeholder that a hook feeds by name: a learning rate
`tf.compat.v1.placeholder(tf.float32, [], name='lr')` that a SessionRunHook
feeds as 'lr:0'. One device has one such tensor. A later tower made its own,
`tower_1/lr`, which nothing fed, and every step failed ("You must feed a
value for placeholder tensor 'tower_1/lr'").

Inside `tower`, a placeholder a later tower (or the model_fn's copy on the
whole batch) makes under the name tower 0 gave its own, with its dtype, is
a `placeholder_with_default` of tower 0's: the value fed to 'lr:0' reaches
every tower, and an unfed one fails as on one device, naming 'lr' (a
later tower's own may still be fed). The same holds for a
`placeholder_with_default` of a constant (`placeholder_with_default(0.2,
[], name='lr')`: the later tower's took its default while 'lr:0' was fed);
one whose default depends on the tower's shard stays the tower's. A
placeholder tower 0 did not make stays as it is.
"""

import contextlib
from typing import Iterator, Optional

import tensorflow as tf
from tensorflow.python.ops import gen_array_ops  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.graph import op_ledger
from estimator_towers.graph import patching

tf1 = tf.compat.v1


@contextlib.contextmanager
def tower(name_scope: str, first: op_ledger.Region) -> Iterator[None]:
  """Inside, a placeholder matching one of tower 0's reads tower 0's.

  Args:
    name_scope: The tower's name scope ('' for tower 0: nothing changes).
    first: Tower 0's ops.

  Yields:
    Nothing.
  """
  if not name_scope:
    yield
    return
  prefix = name_scope.rstrip('/') + '/'
  original = gen_array_ops.placeholder
  with_default = gen_array_ops.placeholder_with_default
  graph = tf1.get_default_graph()

  def counterpart(kind: str, name, dtype, shape) -> Optional[tf.Tensor]:
    current = tf1.get_default_graph()
    if current is not graph:  # A function graph's argument.
      return None
    full = current.unique_name(name or kind, mark_as_used=False)
    return _counterpart(current, full, prefix, first, kind,
                        tf.as_dtype(dtype), tf.TensorShape(shape))

  def placeholder(dtype, shape=None, name=None):
    shared = counterpart('Placeholder', name, dtype, shape)
    if shared is None:
      return original(dtype=dtype, shape=shape, name=name)
    return with_default(shared, shape=tf.TensorShape(shape), name=name)

  def placeholder_with_default(input, shape, name=None):  # pylint: disable=redefined-builtin
    # Only a default every tower has alike (a constant learning rate): one
    # computed from the tower's shard stays the tower's.
    value = tf.convert_to_tensor(input)
    shared = (counterpart('PlaceholderWithDefault', name, value.dtype, shape)
              if tf.get_static_value(value) is not None else None)
    return with_default(shared if shared is not None else value,
                        shape=shape, name=name)

  with patching.Patcher() as patcher:
    patcher.set(gen_array_ops, 'placeholder',
                patcher.guard(placeholder, original))
    patcher.set(gen_array_ops, 'placeholder_with_default',
                patcher.guard(placeholder_with_default, with_default))
    yield


def _counterpart(graph: tf.Graph, name: str, prefix: str,
                 first: op_ledger.Region, kind: str, dtype: tf.DType,
                 shape: tf.TensorShape) -> Optional[tf.Tensor]:
  """Tower 0's op of type `kind` named `name` without the tower's scope, of
  `dtype` and a shape compatible with `shape`, or None."""
  if not name.startswith(prefix):
    return None
  try:
    op = graph.get_operation_by_name(name[len(prefix):])
  except KeyError:
    return None
  tensor = op.outputs[0] if op.outputs else None
  if (op.type != kind or not first.contains(op) or
      tensor.dtype != dtype or not tensor.shape.is_compatible_with(shape)):
    return None
  return tensor
