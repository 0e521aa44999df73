"""One set of variables for all towers.

Tower 0 creates every variable, exactly as the unwrapped model_fn would, so
the names (and so checkpoints) are those of one-device training. Later towers
must reuse them. Two mechanisms cover the ways variables get made:

* `tf.compat.v1.get_variable` (tf.compat.v1.layers, feature columns, slot
  variables): later towers re-enter the root variable scope with AUTO_REUSE.
  Re-entering a scope *object* restores the unique-name counters on exit, so
  an unnamed `dense` layer is called `dense` again in every tower.
* Everything else (`tf.keras.layers`, metric variables, `tf.Variable`):
  these bypass the variable store. A variable creator hands the k-th such
  variable a later tower asks for to the k-th one tower 0 made, after checking
  that shape and dtype agree. Metric variables are shared this way too, so
  every tower's update accumulates into one state and the metric equals the
  one-device value.

Later towers also see the graph's variable collections as tower 0 saw
them at the same point of its model_fn: a variable tower 0 made is listed
(in `tf.compat.v1.global_variables()`, a layer's `moving_vars`...) only
once the later tower has asked for it. A model_fn that collects variables
by listing them (EfficientNet's EMA over every `moving_mean`) would
otherwise find tower 0's EMA shadows too, and shadow them again.

With the 'all_reduce' aggregation, later towers get their own copy of each
trainable variable instead of tower 0's (see replicas.py): the sharing above
decides which of tower 0's variables a request means, and `copies` maps it
to the tower's copy. A variable named after a copy (an EMA's shadow of the
tower's copy, `tower_1_replica/w/ExponentialMovingAverage`) is the one tower
0 named after the primary: one device has one shadow.
"""

import contextlib
import threading
from typing import Dict, Iterator, List

import tensorflow as tf
from tensorflow.python.ops import variables as variables_lib  # pylint: disable=g-direct-tensorflow-import

tf1 = tf.compat.v1


class VariableSharing:
  """Records tower 0's variables and hands them to the later towers."""

  def __init__(self):
    self._created: List[tf.Variable] = []
    self._collections = _CollectionView()
    self._local = threading.local()
    # The all_reduce aggregation's replicas.Replicas: `tower_variable`
    # (primary, tower index) -> what that tower uses, `primary_name`.
    self.copies = None

  def _for_tower(self, variable, index: int):
    if self.copies is None or not index:
      return variable
    return self.copies.tower_variable(variable, index)

  @property
  def _get_variable_depth(self) -> int:
    return getattr(self._local, 'depth', 0)

  def _counting_getter(self, getter, name, *args, **kwargs):
    """Marks creations that come from `get_variable`, which the store shares."""
    self._local.depth = self._get_variable_depth + 1
    index = getattr(self._local, 'index', 0)
    unshared = getattr(self._local, 'unshared', False)
    if self.copies is not None and index and not unshared:
      name = self.copies.primary_name(name, index)
    initializer = kwargs.get('initializer')
    if isinstance(initializer, tf.Tensor):
      # Slots (e.g. an EMA's) pass only a Tensor initial value, whose dtype
      # the variable takes; the scope fills in float32, which reuse then
      # checks against, failing float64 variables. (An explicit dtype that
      # disagrees with the Tensor was refused before this point.)
      kwargs['dtype'] = initializer.dtype.base_dtype
    try:
      variable = getter(name, *args, **kwargs)
    finally:
      self._local.depth -= 1
    if index and not unshared:
      self._collections.show(variable)
    if self._get_variable_depth or unshared:
      return variable
    return self._for_tower(variable, index)

  @contextlib.contextmanager
  def unshared(self) -> Iterator[None]:
    """Lets variables be created freely (optimizer slots in the one update)."""
    previous = getattr(self._local, 'unshared', False)
    self._local.unshared = True
    try:
      yield
    finally:
      self._local.unshared = previous

  @contextlib.contextmanager
  def tower(self, index: int) -> Iterator[None]:
    """Scopes one tower's model_fn call.

    Args:
      index: The tower index; tower 0 creates, the others reuse.

    Yields:
      Nothing; variables created inside are shared as described above.
    """
    creator = self._record if index == 0 else self._reuser(index)
    self._local.index = index
    root = tf1.get_variable_scope()
    view = self._collections.tower(index)
    with tf1.variable_scope(root, reuse=tf1.AUTO_REUSE if index else None,
                            custom_getter=self._counting_getter,
                            auxiliary_name_scope=False):
      with tf1.variable_creator_scope(creator), view:
        yield
    if index:
      self._check_all_reused(index)

  def _record(self, next_creator, **kwargs):
    variable = next_creator(**kwargs)
    if not self._get_variable_depth and not getattr(self._local, 'unshared',
                                                    False):
      self._created.append(variable)
    return variable

  def _reuser(self, index: int):
    self._local.cursor = 0

    def reuse(next_creator, **kwargs):
      if getattr(self._local, 'unshared', False):
        return next_creator(**kwargs)
      name = _requested_name(kwargs)
      if self._get_variable_depth:
        raise ValueError(
            f'Tower {index} created variable {name!r}, which tower 0 did not '
            'create. Every tower must build the same model: do not make '
            'variables depend on the tower index or on the data.')
      cursor = self._local.cursor
      if cursor >= len(self._created):
        raise ValueError(
            f'Tower {index} created variable {name!r} (number {cursor + 1} '
            f'made outside get_variable), but tower 0 made only '
            f'{len(self._created)}. Every tower must build the same model.')
      self._local.cursor = cursor + 1
      variable = self._created[cursor]
      _check_same_kind(index, name, kwargs, variable)
      self._collections.show(variable)
      return self._for_tower(variable, index)

    return reuse

  def _check_all_reused(self, index: int) -> None:
    used = getattr(self._local, 'cursor', 0)
    if used != len(self._created):
      missing = [v.name for v in self._created[used:]]
      raise ValueError(
          f'Tower {index} created {used} variables outside get_variable but '
          f'tower 0 created {len(self._created)}; tower {index} did not ask '
          f'for {missing}. Every tower must build the same model.')


class _CollectionView:
  """Hides tower 0's variables from the collections of a later tower until
  it asks for them; afterwards the collections are tower 0's again."""

  def __init__(self):
    self._before: Dict[str, list] = {}
    # id(variable tower 0 added) -> the collections it was added to.
    self._homes: Dict[int, List[str]] = {}

  @contextlib.contextmanager
  def tower(self, index: int) -> Iterator[None]:
    """Scopes one tower's view of the collections."""
    graph = tf1.get_default_graph()
    if index == 0:
      self._before = {key: list(graph.get_collection(key))
                      for key in graph.get_all_collection_keys()}
      yield
      self._record_homes(graph)
      return
    full = {key: list(graph.get_collection(key))
            for key in graph.get_all_collection_keys()}
    for key, items in full.items():
      graph.get_collection_ref(key)[:] = [
          item for item in items if not self._is_hidden(item, key)]
    try:
      yield
    finally:
      for key in graph.get_all_collection_keys():
        ref = graph.get_collection_ref(key)
        listed = full.get(key, [])
        seen = {id(item) for item in listed}
        # What the tower added itself (a copy, a metric) stays, once.
        ref[:] = listed + [item for item in ref if id(item) not in seen]

  def _record_homes(self, graph) -> None:
    for key in graph.get_all_collection_keys():
      if key == tf1.GraphKeys.GLOBAL_STEP:
        # Looked up, never listed: `get_or_create_global_step` in a later
        # tower must find tower 0's (its name alone would give the handle).
        continue
      before = {id(item) for item in self._before.get(key, [])}
      for item in graph.get_collection(key):
        if id(item) not in before and _is_variable(item):
          self._homes.setdefault(id(item), []).append(key)

  def _is_hidden(self, item, key: str) -> bool:
    return key in self._homes.get(id(item), ())

  def show(self, variable) -> None:
    """Lists `variable` (one tower 0 made) where tower 0 listed it."""
    graph = tf1.get_default_graph()
    parts = (list(variable) if isinstance(
        variable, variables_lib.PartitionedVariable) else [variable])
    for part in parts:
      for key in self._homes.get(id(part), ()):
        ref = graph.get_collection_ref(key)
        if all(item is not part for item in ref):
          ref.append(part)


def _is_variable(item) -> bool:
  return isinstance(item, (tf.Variable, variables_lib.PartitionedVariable))


def _requested_name(kwargs) -> str:
  name = kwargs.get('name') or 'Variable'
  scope = tf1.get_default_graph().get_name_scope()
  return f'{scope}/{name}' if scope else str(name)


def _check_same_kind(index: int, name: str, kwargs, variable) -> None:
  """Fails when a later tower's variable is not the one tower 0 made."""
  shape = kwargs.get('shape')
  if shape is None and isinstance(kwargs.get('initial_value'), tf.Tensor):
    shape = kwargs['initial_value'].shape
  if shape is not None and not tf.TensorShape(shape).is_compatible_with(
      variable.shape):
    raise ValueError(
        f'Tower {index} asked for variable {name!r} of shape '
        f'{tf.TensorShape(shape)}, but the matching variable of tower 0, '
        f'{variable.name}, has shape {variable.shape}. Every tower must build '
        'the same model.')
  dtype = kwargs.get('dtype')
  if dtype is not None and tf.as_dtype(dtype).base_dtype != (
      variable.dtype.base_dtype):
    raise ValueError(
        f'Tower {index} asked for variable {name!r} of dtype '
        f'{tf.as_dtype(dtype).name}, but the matching variable of tower 0, '
        f'{variable.name}, is {variable.dtype.base_dtype.name}.')
