"""Later towers see the variable collections as tower 0 saw them.

A model_fn may pick variables by reading a collection while it builds:
tensorflow/tpu's EfficientNet averages (EMA) `tf.trainable_variables()` plus
every global variable whose name holds 'moving_mean' or 'moving_variance'.
On one device it reads the collection before its EMA has made any variable.
A later tower read it after tower 0 had built everything, EMA shadows
included, so it averaged tower 0's shadows too ('.../moving_mean/
ExponentialMovingAverage/ExponentialMovingAverage'), a variable tower 0
never made: refused as another model.

So while a later tower builds, each non-trainable variable tower 0 added
to these collections is hidden from them until the tower asks for it
(reuses it); what the tower reads is then what tower 0 read at the same
point. Trainable variables are never hidden: an optimizer call without a
var_list reads them, and the last tower's call is the one update (the v1
canned DNN's partitioned layers failed with "No variables to optimize"). Variables
made before tower 0 (global_step) and those the later tower makes itself
stay visible. On exit the collections hold everything again.
"""

import contextlib
from typing import Dict, Iterator, List, Optional, Set

import tensorflow as tf
from tensorflow.python.ops import variable_scope as vs  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import variables as variables_lib

tf1 = tf.compat.v1
# The collections a model_fn reads to choose what to train or average.
KEYS = (tf1.GraphKeys.GLOBAL_VARIABLES, tf1.GraphKeys.TRAINABLE_VARIABLES,
        tf1.GraphKeys.MODEL_VARIABLES,
        tf1.GraphKeys.MOVING_AVERAGE_VARIABLES)


class VariableViews:
  """Hides tower 0's variables from a later tower until it reuses them."""

  def __init__(self):
    self._tower0: Set[int] = set()  # ids of what tower 0 added.
    self._shown: Set[int] = set()
    self._saved: Optional[Dict[str, List]] = None

  @contextlib.contextmanager
  def tower(self, index: int) -> Iterator[None]:
    """Scopes one tower's model_fn call (module docstring).

    Args:
      index: The tower index; tower 0's additions are recorded, later
        towers see them as they reuse them.

    Yields:
      Nothing.
    """
    graph = tf1.get_default_graph()
    if index == 0:
      before = {key: {id(v) for v in graph.get_collection(key)}
                for key in KEYS}
      yield
      # Trainable variables stay visible: an optimizer call without a
      # var_list reads them, and the last tower's is the one update, which
      # must see every one of them.
      trainable = {id(v) for v in tf1.trainable_variables()}
      self._tower0 = {id(v) for key in KEYS
                      for v in graph.get_collection(key)
                      if id(v) not in before[key] and id(v) not in trainable}
      return
    self._saved = {key: list(graph.get_collection(key)) for key in KEYS}
    self._shown = set()
    self._refresh(graph)
    try:
      yield
    finally:
      saved, self._saved = self._saved, None
      for key in KEYS:
        ref = graph.get_collection_ref(key)
        ref[:] = saved[key] + _added(ref, saved[key])

  def reached(self, variable) -> None:
    """A later tower asked for tower 0's `variable`: show it from now on.

    Args:
      variable: A variable, or a partitioned one (its parts are shown).
    """
    if self._saved is None:
      return
    parts = {id(v) for v in _parts(variable)} & self._tower0
    if parts - self._shown:
      self._shown |= parts
      self._refresh(tf1.get_default_graph())

  def _refresh(self, graph: tf.Graph) -> None:
    """Each collection: what the tower may see, then what it added."""
    for key in KEYS:
      ref = graph.get_collection_ref(key)
      visible = [v for v in self._saved[key]
                 if id(v) not in self._tower0 or id(v) in self._shown]
      ref[:] = visible + _added(ref, self._saved[key])


@contextlib.contextmanager
def hidden(variables: List) -> Iterator[None]:
  """Hides `variables` from the collections and from get_variable's store.

  The model_fn's copy on the whole batch (first_step_check) is built after
  the one update made its optimizer slots; one device's model_fn, at the
  same point of its build, has none. Code that picks variables by scope
  (`init_from_checkpoint(ckpt, {'dense/': 'dense/'})` would warm-start the
  slots) or by collection (a penalty over `tf.global_variables()`) must
  not see them.

  Args:
    variables: The variables to hide.

  Yields:
    Nothing.
  """
  graph = tf1.get_default_graph()
  ids = {id(v) for v in variables}
  saved = {key: list(graph.get_collection(key)) for key in KEYS}
  store = vs._get_default_variable_store()._vars  # pylint: disable=protected-access
  # Slots are stored as 'dense/kernel/Adam/': found by identity, not name.
  taken = {name: store.pop(name) for name, v in list(store.items())
           if id(v) in ids}
  for key in KEYS:
    graph.get_collection_ref(key)[:] = [v for v in saved[key]
                                        if id(v) not in ids]
  try:
    yield
  finally:
    for key in KEYS:
      ref = graph.get_collection_ref(key)
      ref[:] = saved[key] + _added(ref, saved[key])
    store.update(taken)


def _parts(variable) -> List:
  """A partitioned variable's parts (they are what collections hold)."""
  if isinstance(variable, variables_lib.PartitionedVariable):
    return list(variable)
  return [variable]


def _added(current: List, saved: List) -> List:
  """Entries of `current` that `saved` does not hold."""
  known = {id(v) for v in saved}
  return [v for v in current if id(v) not in known]
