"""A later tower sees only its own entries of the model_fn's collections.

A model_fn may file tensors in a collection and read them back while it
builds: `tf.compat.v1.add_to_collection('my_losses', ce)` and then
`tf.add_n(tf.compat.v1.get_collection('my_losses'))`. On one device the read
returns the one entry it filed. The towers are built one after another in
one graph, so tower 1's read also returned tower 0's entry: its loss held
both shards' terms, and training drifted from one device without a word
(0.13 off after 3 steps; EVAL's loss 1.47 for 0.90). A shared variable the
model_fn files (`add_to_collection('weights', w)`) was filed again by every
tower, so a penalty summed over the collection counted it once per tower
built so far.

So while a later tower builds (and the model_fn's copy on the whole batch,
see first_step_check), each collection shows the entries made before tower
0, then the ones that tower files itself: what one device sees at the same
point. On exit the collection holds every earlier tower's entries again,
then this tower's that it does not hold yet (a shared variable is filed
once, as on one device: the v1 feature columns' shared embeddings require
one entry); the copy's are dropped. Variables are the exception: every
tower shares tower 0's, which a later tower reuses without filing them
again (`get_variable(..., collections=['my_vars'])` files a variable when
it is made), so each of tower 0's enters a later tower's view when the
tower asks for it (where one device makes and files it: `reached`), and a
later tower filing one again files nothing, as one device files it once.

`per_tower` gives the losses, update ops and summaries their stricter view:
a tower sees only its own (`tf.compat.v1.losses.get_total_loss()` must not
add up earlier towers), and the caller gets what each tower added.

Left as they are by `OwnCollections`: the collections with a per-tower view
of their own (`OWN_VIEWS`: `PER_TOWER`, regularization losses, the variable
collections in variable_views), TensorFlow's records
of state every tower shares (`SHARED`: the global step, local and metric
variables, tables, savers, resources, control-flow contexts), and keys that
are not strings (get_variable's store).
"""

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional

import tensorflow as tf
from tensorflow.python.ops import variables as variables_lib  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.graph import patching
from estimator_towers.towers import variable_views

tf1 = tf.compat.v1
_Keys = tf1.GraphKeys
PER_TOWER = (_Keys.LOSSES, _Keys.UPDATE_OPS, _Keys.SUMMARIES)
OWN_VIEWS = frozenset([*PER_TOWER, _Keys.REGULARIZATION_LOSSES,
                       *variable_views.KEYS])
SHARED = frozenset([
    _Keys.GLOBAL_STEP, _Keys.EVAL_STEP, _Keys.LOCAL_VARIABLES,
    _Keys.METRIC_VARIABLES, _Keys.TRAINABLE_RESOURCE_VARIABLES,
    _Keys.CONCATENATED_VARIABLES, _Keys.RESOURCES, _Keys.LOCAL_RESOURCES,
    _Keys.TABLE_INITIALIZERS, _Keys.SAVEABLE_OBJECTS, _Keys.ASSET_FILEPATHS,
    _Keys.SAVERS, _Keys.QUEUE_RUNNERS, _Keys.INIT_OP, _Keys.LOCAL_INIT_OP,
    _Keys.READY_OP, _Keys.READY_FOR_LOCAL_INIT_OP, _Keys.SUMMARY_OP,
    _Keys.TRAIN_OP, _Keys.COND_CONTEXT, _Keys.WHILE_CONTEXT,
    _Keys._SUMMARY_COLLECTION, _Keys._STREAMING_MODEL_PORTS,  # pylint: disable=protected-access
])


def viewed(key) -> bool:
  """Whether a later tower sees only its own entries of collection `key`."""
  return isinstance(key, str) and key not in OWN_VIEWS and key not in SHARED


@contextlib.contextmanager
def per_tower(graph: tf.Graph, index: int,
              keep: bool = True) -> Iterator[Dict[str, List]]:
  """Shows the tower only its own entries of the `PER_TOWER` collections.

  Args:
    graph: The towers' graph.
    index: The tower index.
    keep: Whether the tower's entries stay in the collections afterwards
      (False for the model_fn's copy on the whole batch).

  Yields:
    A dict that, on exit, holds what the tower added to each collection.
    Afterwards the collections hold every tower's entries again, except
    that summaries of towers after the first are dropped: TensorBoard shows
    tower 0.
  """
  saved = {key: list(graph.get_collection(key)) for key in PER_TOWER}
  for key in PER_TOWER:
    del graph.get_collection_ref(key)[:]
  added = {}
  try:
    yield added
  finally:
    for key in PER_TOWER:
      ref = graph.get_collection_ref(key)
      added[key] = list(ref)
      kept = added[key] if keep and (
          index == 0 or key != _Keys.SUMMARIES) else []
      ref[:] = saved[key] + kept


@contextlib.contextmanager
def additions_dropped(graph: tf.Graph, key: str) -> Iterator[None]:
  """Drops what is added to the collection `key` inside."""
  before = list(graph.get_collection(key))
  try:
    yield
  finally:
    graph.get_collection_ref(key)[:] = before


class OwnCollections:
  """Shows each tower of one model_fn call only its own collection entries
  (module docstring).

  Args:
    primary_of: The variable a tower's copy stands for (all_reduce's
      copies: see replica_path), the variable itself if none.
  """

  def __init__(self, primary_of: Callable[[Any], Any] = lambda v: v):
    self._primary_of = primary_of
    # How many entries each viewed collection held when tower 0 started.
    self._before: Optional[Dict[str, int]] = None
    # While a later tower builds, per collection: tower 0's variables not
    # reached yet, and the ones in the tower's view.
    self._pending: Optional[Dict[str, List]] = None
    self._shown: Dict[str, List] = {}

  @contextlib.contextmanager
  def tower(self, index: int, keep: bool = True) -> Iterator[None]:
    """Scopes one tower's model_fn call.

    Args:
      index: The tower index; what the collections hold when tower 0 starts
        is what every tower sees besides its own entries.
      keep: Whether the tower's entries stay in the collections afterwards
        (False for the model_fn's copy on the whole batch).

    Yields:
      Nothing.
    """
    graph = tf1.get_default_graph()
    if index == 0 or self._before is None:
      self._before = {key: len(graph.get_collection(key))
                      for key in _viewed_keys(graph)}
    # Collections only grow: entries past the count are the towers'.
    earlier = {}
    self._pending, self._shown = {}, {}
    for key in _viewed_keys(graph):
      ref = graph.get_collection_ref(key)
      count = self._before.get(key, 0)
      earlier[key] = ref[count:]
      del ref[count:]
      self._pending[key] = [v for v in earlier[key] if _is_variable(v)]
      self._shown[key] = []
    try:
      with self._filing_watched(graph):
        yield
    finally:
      for key in _viewed_keys(graph):
        ref = graph.get_collection_ref(key)
        count = self._before.get(key, 0)
        shown = {id(item) for item in self._shown.get(key, [])}
        own = [item for item in ref[count:]
               if id(item) not in shown] if keep else []
        filed = {id(item) for item in earlier.get(key, [])}
        ref[count:] = earlier.get(key, []) + [
            item for item in own if id(item) not in filed]
      self._pending, self._shown = None, {}

  def reached(self, variable) -> None:
    """A later tower asked for tower 0's `variable`: it enters the tower's
    view of each collection tower 0 filed it in, as one device files it
    when it makes it.

    Args:
      variable: A variable, or a partitioned one (its parts count too).
    """
    if not self._pending:
      return
    ids = {id(variable)}
    if isinstance(variable, variables_lib.PartitionedVariable):
      ids.update(id(part) for part in variable)
    graph = tf1.get_default_graph()
    for key, pending in self._pending.items():
      for item in [v for v in pending if id(v) in ids]:
        pending.remove(item)
        self._shown[key].append(item)
        graph.get_collection_ref(key).append(item)

  @contextlib.contextmanager
  def _filing_watched(self, graph: tf.Graph) -> Iterator[None]:
    """Inside, filing tower 0's variable (or the tower's copy of one) files
    it once: a copy takes its primary's place in the tower's view."""
    if not any(self._pending.values()):
      yield
      return
    original = tf.Graph.add_to_collection

    def add_to_collection(owner, name, value):
      primary = self._primary_of(value) if _is_variable(value) else value
      self.reached(primary)
      shown = self._shown.get(name, [])
      place = next((i for i, item in enumerate(shown)
                    if self._primary_of(item) is primary), None)
      if place is None:
        original(owner, name, value)
      elif shown[place] is not value:
        ref = graph.get_collection_ref(name)
        ref[next(i for i, item in enumerate(ref)
                 if item is shown[place])] = value
        shown[place] = value

    with patching.Patcher() as patcher:
      patcher.set(tf.Graph, 'add_to_collection',
                  patcher.guard(add_to_collection, original))
      yield


def _is_variable(item) -> bool:
  return isinstance(item, (tf.Variable, variables_lib.PartitionedVariable))


def _viewed_keys(graph: tf.Graph) -> List[str]:
  return [key for key in graph.get_all_collection_keys() if viewed(key)]
