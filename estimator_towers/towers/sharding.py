"""Splitting a global batch into per-tower shards.

The split is computed at run time from the actual batch size, so the short
last batch of an epoch and a serving request of one example work: shard sizes
differ by at most one, and towers beyond the batch size get empty shards.
A scalar feature (one value for the whole batch, such as a temperature: a
scalar Tensor, a Python number or string, a numpy scalar) is not split:
every tower gets it, as one device does. A numpy array with a first
dimension is a batch like a Tensor (`with_array_rows_as_tensors`).
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

_BATCHED_TYPES = (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)
# One value for the whole batch when an input_fn returns it as it is.
_PYTHON_SCALARS = (bool, int, float, complex, str, bytes, np.generic)


def _leaves_with_paths(structure: Any, prefix: str = '') -> List[Tuple[str, Any]]:
  """Flattens like `tf.nest.flatten`, naming each leaf for error messages."""
  if isinstance(structure, dict):
    out = []
    for key in _sorted_keys(structure):
      out.extend(_leaves_with_paths(structure[key], f'{prefix}[{key!r}]'))
    return out
  if isinstance(structure, (list, tuple)):
    out = []
    for i, item in enumerate(structure):
      out.extend(_leaves_with_paths(item, f'{prefix}[{i}]'))
    return out
  return [(prefix, structure)]


def _sorted_keys(mapping: dict) -> List[Any]:
  """Keys sorted as tf.nest sorts them, and mixed int and str keys too."""
  # tf.estimator allows any key ({42: ...}); tf.nest cannot sort 42 and 'b'.
  return sorted(mapping, key=lambda key: (type(key).__name__, key))


def map_leaves(fn: Callable[[Any], Any], structure: Any) -> Any:
  """`structure` with `fn` applied to each leaf, its dict keys as they are.

  Like tf.nest.map_structure for the dicts, lists, tuples and namedtuples
  an input_fn returns, without sorting keys that do not sort together.
  """
  if isinstance(structure, dict):
    return type(structure)((key, map_leaves(fn, value))
                           for key, value in structure.items())
  if isinstance(structure, tuple) and hasattr(structure, '_fields'):
    return type(structure)(*[map_leaves(fn, item) for item in structure])
  if isinstance(structure, (list, tuple)):
    return type(structure)(map_leaves(fn, item) for item in structure)
  return fn(structure)


def leaves(structure: Any, expand_composites: bool = False) -> List[Any]:
  """Like tf.nest.flatten, for features whose dict keys do not sort
  together (see `map_leaves`)."""
  found = [leaf for _, leaf in _leaves_with_paths(structure)]
  if not expand_composites:
    return found
  return [part for leaf in found
          for part in tf.nest.flatten(leaf, expand_composites=True)]


def _check_leaf(name: str, leaf: Any) -> None:
  if not isinstance(leaf, (*_BATCHED_TYPES, np.ndarray)) and (
      not is_per_batch(leaf)):
    raise TypeError(
        f'{name} is a {type(leaf).__name__}; replicate_model_fn splits only '
        'Tensors, SparseTensors, RaggedTensors and numpy arrays (in dicts, '
        'lists or tuples) and gives every tower a scalar. Convert it to a '
        'Tensor in the input_fn.')


def is_per_batch(leaf: Any) -> bool:
  """Whether `leaf` is one value for the whole batch (a scalar Tensor, a
  Python or numpy scalar), which every tower gets as it is."""
  if isinstance(leaf, tf.Tensor):
    return leaf.shape.rank == 0
  if isinstance(leaf, np.ndarray):
    return leaf.ndim == 0
  return isinstance(leaf, _PYTHON_SCALARS)


def with_array_rows_as_tensors(structure: Any) -> Any:
  """`structure` with each array that has rows as a constant Tensor.

  An input_fn may return numpy arrays (Keras' `model_to_estimator` model_fn
  converts them itself) or nested Python lists of values (`[[b'iroh'],
  [b'iroh']]`, which a head converts); an array of shape [batch, ...] is a
  batch like a Tensor of that shape, so it is split like one. (A vector of
  one value per batch must be a scalar per key instead, as for Tensors.)
  """
  return map_leaves(
      lambda leaf: tf.constant(leaf) if isinstance(leaf, np.ndarray) and
      leaf.ndim else leaf, _lists_as_arrays(structure))


def _lists_as_arrays(structure: Any) -> Any:
  """Lists and tuples of Python values (rectangular) as numpy arrays."""
  if isinstance(structure, dict):
    return type(structure)((key, _lists_as_arrays(value))
                           for key, value in structure.items())
  if not isinstance(structure, (list, tuple)) or hasattr(structure, '_fields'):
    return structure
  found = [leaf for _, leaf in _leaves_with_paths(list(structure))]
  if found and all(isinstance(leaf, _PYTHON_SCALARS) for leaf in found):
    try:
      array = np.asarray(structure)
    except ValueError:  # Ragged: not one array.
      array = None
    if array is not None and array.dtype != object:
      return array
  return type(structure)(_lists_as_arrays(item) for item in structure)


def has_batch(features: Any, labels: Any) -> bool:
  """Whether any feature or label has a batch dimension to split.

  Args:
    features: The input_fn's features.
    labels: Its labels, or None.

  Returns:
    False when every leaf is None or one value for the whole batch (a
    model_fn given Python scalars, or lists of them, as tf.estimator
    allows; a numpy array with rows is a batch).

  Raises:
    TypeError: a leaf is neither batched nor a scalar.
  """
  found = named_leaves(features, labels)
  for name, leaf in found:
    if leaf is not None:
      _check_leaf(name, leaf)
  return any(leaf is not None and not is_per_batch(leaf)
             for _, leaf in found)


def batch_size_of(leaf: Any) -> tf.Tensor:
  """The leading dimension of `leaf` as an int32 scalar tensor."""
  if isinstance(leaf, tf.SparseTensor):
    return tf.cast(leaf.dense_shape[0], tf.int32)
  if isinstance(leaf, tf.RaggedTensor):
    return tf.cast(leaf.nrows(), tf.int32)
  return tf.shape(leaf, out_type=tf.int32)[0]


def _static_batch_size(leaf: Any):
  if isinstance(leaf, tf.SparseTensor):
    return tf.get_static_value(leaf.dense_shape[0])
  if leaf.shape.rank is None:
    return None
  # An int or None, also where tf.compat.v1.disable_v2_tensorshape() makes
  # shape[0] a Dimension (SimCLR's and other TF1 code's setting).
  return tf.compat.dimension_value(leaf.shape[0])


def global_batch_size(named_leaves: Sequence[Tuple[str, Any]]) -> tf.Tensor:
  """Checks that every leaf has the same batch size and returns it.

  Sizes known while the graph is built are compared at once; the others are
  compared when the step runs, failing with the same message.

  Args:
    named_leaves: (name, tensor) pairs, as from `_leaves_with_paths`.

  Returns:
    The batch size, an int32 scalar tensor.

  Raises:
    ValueError: no leaf has a batch dimension, or the static batch sizes of
      two leaves differ.
    TypeError: a leaf is not a Tensor, SparseTensor or RaggedTensor.
  """
  named_leaves = [(name, leaf) for name, leaf in named_leaves
                  if leaf is not None]
  for name, leaf in named_leaves:
    _check_leaf(name, leaf)
  named_leaves = [(name, leaf) for name, leaf in named_leaves
                  if not is_per_batch(leaf)]
  if not named_leaves:
    raise ValueError(
        'replicate_model_fn found no feature or label with a batch '
        'dimension to split over the towers (scalars are one value per '
        'batch). Give the batched inputs shape [batch, ...] in the input_fn.')
  first_name, first = named_leaves[0]
  static = {name: _static_batch_size(leaf) for name, leaf in named_leaves}
  known = {name: size for name, size in static.items() if size is not None}
  if len(set(known.values())) > 1:
    raise ValueError(
        'Features and labels must share one batch size, got ' +
        ', '.join(f'{name}: {size}' for name, size in known.items()) +
        '. Batch them together in the input_fn (e.g. one Dataset.batch).')
  size = batch_size_of(first)
  checks = []
  for name, leaf in named_leaves[1:]:
    if static[name] is not None and static[first_name] is not None:
      continue
    checks.append(tf.debugging.assert_equal(
        batch_size_of(leaf), size,
        message=(f'Features and labels must share one batch size: {name} '
                 f'differs from {first_name}.')))
  if checks:
    with tf.control_dependencies(checks):
      size = tf.identity(size)
  return size


def shard_sizes(batch_size: tf.Tensor, num_towers: int) -> tf.Tensor:
  """Sizes of the towers' shards: as even as possible, larger ones first."""
  base = batch_size // num_towers
  remainder = batch_size % num_towers
  return base + tf.cast(tf.range(num_towers) < remainder, tf.int32)


def slice_rows(leaf: Any, start: tf.Tensor, size: tf.Tensor) -> Any:
  """Rows [start, start + size) of a batched leaf."""
  if isinstance(leaf, tf.SparseTensor):
    rest = leaf.dense_shape[1:]
    begin = tf.concat([[tf.cast(start, tf.int64)], tf.zeros_like(rest)], 0)
    extent = tf.concat([[tf.cast(size, tf.int64)], rest], 0)
    return tf.sparse.slice(leaf, begin, extent)
  return leaf[start:start + size]


def _with_a_row(leaf: Any, batch: tf.Tensor) -> Any:
  """`leaf`, or one row of zeros of its dtype and row shape if it has none."""
  if (_static_batch_size(leaf) or 0) > 0:
    return leaf  # Never empty: keep its static shape.

  def zero_row():
    if isinstance(leaf, tf.SparseTensor):  # One row without values.
      return tf.SparseTensor(leaf.indices, leaf.values, tf.concat(
          [tf.ones([1], leaf.dense_shape.dtype), leaf.dense_shape[1:]], 0))
    if isinstance(leaf, tf.RaggedTensor):  # One empty row.
      return tf.RaggedTensor.from_row_splits(
          leaf.values, tf.zeros([2], leaf.row_splits.dtype), validate=False)
    return tf.zeros(tf.concat([[1], tf.shape(leaf)[1:]], 0), leaf.dtype)

  return tf.cond(batch > 0, lambda: leaf, zero_row)


def split_batch(structure: Any, sizes: tf.Tensor, num_towers: int,
                pad_empty: bool) -> List[Any]:
  """Splits every leaf of `structure` into `num_towers` consecutive shards.

  Args:
    structure: Tensors, SparseTensors or RaggedTensors, possibly nested in
      dicts, lists and tuples, all with the same batch size.
    sizes: Shard sizes from `shard_sizes`.
    num_towers: How many shards to make.
    pad_empty: Give an empty shard a copy of the first example instead. In
      training, an empty shard would make the tower's mean loss NaN, and
      0 * NaN poisons the gradients even at weight zero; the copy is finite
      and is weighted by zero. An empty batch (a task of a synchronous
      cluster whose part of a small last global batch is nothing) has no
      example to copy: its shards get one row of zeros (empty strings, an
      empty sparse or ragged row), also weighted by zero.

  Returns:
    A list of `num_towers` structures shaped like `structure`.
  """
  if structure is None:
    return [None] * num_towers
  starts, rows = shard_rows(sizes, pad_empty)
  if pad_empty:
    batch = tf.reduce_sum(sizes)
    structure = map_leaves(
        lambda leaf: leaf if is_per_batch(leaf) else _with_a_row(leaf, batch),
        structure)
  return [map_leaves(lambda leaf, i=i: leaf if is_per_batch(leaf) else
                     slice_rows(leaf, starts[i], rows[i]), structure)
          for i in range(num_towers)]


def unknown_rows(structure: Any) -> Any:
  """`structure` with the first dimension of every batched leaf unknown.

  A static batch size (`drop_remainder=True`) gives the shards static
  sizes, and TensorFlow folds a count of a shard's examples
  (`tf.size(values)`, `ones_like(values)`) into a constant while building.
  A constant looks like a count per call, which metric_adds lets only
  tower 0 add: evaluation counted only tower 0's examples (an accuracy
  above 1). With the rows unknown, as for an epoch's short last batch,
  such counts stay computed from the shard.

  Args:
    structure: One tower's shard: batched leaves (and scalar features,
      kept as they are) in dicts, lists and tuples.

  Returns:
    The same values, with shapes `[None, ...]`.
  """
  def loosen(leaf):
    if is_per_batch(leaf):
      return leaf
    if isinstance(leaf, tf.SparseTensor):
      shape = tf.compat.v1.placeholder_with_default(
          leaf.dense_shape, leaf.dense_shape.shape)
      return tf.SparseTensor(leaf.indices, leaf.values, shape)
    if isinstance(leaf, tf.Tensor) and leaf.shape.rank:
      return tf.compat.v1.placeholder_with_default(
          leaf, [None] + leaf.shape.as_list()[1:])
    return leaf  # Ragged rows come from row_splits, already run-time.

  return map_leaves(loosen, structure)


def shard_rows(sizes: tf.Tensor,
               pad_empty: bool) -> Tuple[tf.Tensor, tf.Tensor]:
  """Where each tower's shard starts in the batch, and its rows.

  Args:
    sizes: Shard sizes from `shard_sizes`.
    pad_empty: As in `split_batch`: an empty shard is then one copy of the
      batch's first row (row 0, one row).

  Returns:
    (starts, rows): int32 vectors, one entry per tower.
  """
  starts = tf.cumsum(sizes, exclusive=True)
  if not pad_empty:
    return starts, sizes
  return (tf.where(sizes > 0, starts, tf.zeros_like(starts)),
          tf.maximum(sizes, 1))


def named_leaves(features: Any, labels: Any) -> List[Tuple[str, Any]]:
  """Leaves of features and labels with names like features['age']."""
  out = _leaves_with_paths(features, 'features')
  if labels is not None:
    out.extend(_leaves_with_paths(labels, 'labels'))
  return out


def static_rows(shard: Any) -> Optional[int]:
  """A shard's number of examples if its first leaf's shape tells it."""
  for _, leaf in _leaves_with_paths(shard):
    shape = getattr(leaf, 'shape', None)
    if shape is not None and shape.rank:
      return tf.compat.dimension_value(shape[0])
  return None
