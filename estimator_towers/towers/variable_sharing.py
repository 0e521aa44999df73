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

While a later tower builds, the variable collections show it tower 0's
variables only once it has asked for them (variable_views), as one device
shows them at that point of the model_fn.

Keras names a layer made without a name after a per-graph counter
(`dense`, `dense_1`, ...): later towers start from the counts tower 0
started from, so that their layers get tower 0's names. Layers that make
their weights through `get_variable` under their name (feature columns'
`SequenceFeatures` in the canned RNN estimators) then find tower 0's.

With the 'all_reduce' aggregation, later towers get their own copy of each
trainable variable instead of tower 0's (see replicas.py): the sharing above
decides which of tower 0's variables a request means, and `copies` maps it
to the tower's copy. A variable named after a copy (an EMA's shadow of the
tower's copy, `tower_1_replica/w/ExponentialMovingAverage`) is the one tower
0 named after the primary: one device has one shadow.
"""

import contextlib
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List
import weakref

from keras.src import backend as keras_backend
import tensorflow as tf

from estimator_towers.graph import op_ledger
from estimator_towers.towers import variable_views

tf1 = tf.compat.v1
# Op types that make a variable.
_VARIABLE_OPS = frozenset(['VarHandleOp', 'VariableV2', 'Variable'])
# Graph -> names of variable ops tower 0 imported that the later towers
# map their own imports onto (saved_model_estimator), so none is refused.
_SHARED_IMPORTS = weakref.WeakKeyDictionary()


def share_imported(graph: tf.Graph, op_names: Iterable[str]) -> None:
  """Accepts variables tower 0 imported with a graph.

  Args:
    graph: The graph being built.
    op_names: The imported variable ops, which the later towers' imports
      take from tower 0 instead of making their own.
  """
  _SHARED_IMPORTS.setdefault(graph, set()).update(op_names)


class VariableSharing:
  """Records tower 0's variables and hands them to the later towers."""

  def __init__(self):
    self._created: List[tf.Variable] = []
    self._made_ops = set()  # Every variable tower 0 made through a creator.
    self._keras_counts: Dict[str, int] = {}
    self._named = set()  # What tower 0 asked get_variable for.
    self._local = threading.local()
    # What a later tower reads from the variable collections.
    self._views = variable_views.VariableViews()
    # More views told when a later tower reuses a variable (own_collections).
    self._listeners: List[Callable[[Any], None]] = []
    # The aggregation strategy's gradient path (the builder sets it):
    # `tower_variable` (primary, tower index) -> what that tower uses,
    # `primary_name`; all_reduce's replica_path.ReplicaPath hands out copies.
    self.copies = None

  def on_reached(self, listener: Callable[[Any], None]) -> None:
    """Tells `listener` of every tower-0 variable a later tower reuses."""
    self._listeners.append(listener)

  def _reached(self, variable) -> None:
    self._views.reached(variable)
    for listener in self._listeners:
      listener(variable)

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
    if (self.copies is not None and index and not unshared and
        name not in self._named):  # A user's own 'tower_1_replica/x'.
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
    if not index:
      self._named.add(name)
    elif not unshared:
      self._reached(variable)
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
    self._keras_names(index)
    start = op_ledger.position()
    with tf1.variable_scope(root, reuse=tf1.AUTO_REUSE if index else None,
                            custom_getter=self._counting_getter,
                            auxiliary_name_scope=False):
      with tf1.variable_creator_scope(creator), self._views.tower(index):
        yield
    if index:
      self._check_all_reused(index, start)
    else:
      self._check_none_imported(start)

  def _keras_names(self, index: int) -> None:
    """Starts Keras' layer-name counters where tower 0's started."""
    counts = keras_backend.get_default_graph_uid_map()
    if index == 0:
      self._keras_counts = dict(counts)
    else:
      counts.clear()
      counts.update(self._keras_counts)

  def _check_none_imported(self, start: op_ledger.Mark) -> None:
    """Refuses variables tower 0 made past every creator (an import).

    A model_fn that imports a graph with its variables (SavedModelEstimator,
    `import_meta_graph`) makes them from the graph's protos: no creator sees
    them, so no later tower could reuse them, and each would hold a model of
    its own (SavedModelEstimator's second import fails on global_step).
    """
    graph = tf1.get_default_graph()
    shared = _SHARED_IMPORTS.get(graph, ())
    imported = [op.name for op in graph.get_operations()
                if op.type in _VARIABLE_OPS and op_ledger.made_after(op, start)
                and op.name not in self._made_ops and op.name not in shared]
    if imported:
      raise ValueError(
          f'The model_fn made variables without tf.Variable or get_variable '
          f'({", ".join(imported[:3])}): it imports a graph with its '
          'variables (SavedModelEstimator, import_meta_graph), so every '
          'tower would import a model of its own instead of sharing one. Run '
          'it without replicate_model_fn; for a SavedModelEstimator on '
          'several devices, use '
          'estimator_towers.merge.saved_model_estimator.'
          'TowersSavedModelEstimator.')

  def _record(self, next_creator, **kwargs):
    variable = next_creator(**kwargs)
    self._made_ops.add(variable.op.name)
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
      self._reached(variable)
      return self._for_tower(variable, index)

    return reuse

  def _check_all_reused(self, index: int, start: op_ledger.Mark) -> None:
    used = getattr(self._local, 'cursor', 0)
    if used != len(self._created):
      missing = [v.name for v in self._created[used:]]
      raise ValueError(
          f'Tower {index} created {used} variables outside get_variable but '
          f'tower 0 created {len(self._created)}; tower {index} did not ask '
          f'for {missing}. Every tower must build the same model.'
          f'{_reuse_hint(index, self._created[used:], start)}')


def _reuse_hint(index: int, missing: List, start: op_ledger.Mark) -> str:
  """Why a tower may have used variables without asking for them: it read
  them, so it called a layer object tower 0 built."""
  handles = {getattr(v, 'handle', v).name for v in missing}
  graph = tf1.get_default_graph()
  end = op_ledger.position(graph).next_id
  if not any(op.type == 'ReadVariableOp' and op.inputs[0].name in handles
             for op in op_ledger.ops_between(graph, start.next_id, end)):
    return ''
  return (f' Tower {index} read them without asking: it called a layer or '
          'model object that tower 0 built (kept across model_fn calls). '
          'Build the Keras layers inside the model_fn, so that each tower '
          "makes its own and they share tower 0's variables.")


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
