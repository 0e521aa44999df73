"""One device's regularization losses in every tower.

`tf.compat.v1.losses.get_total_loss()` adds the REGULARIZATION_LOSSES
collection to a model's loss, and that collection is graph-wide: a tower
built after others would also see the entries they added. Entries get added
in later towers in two ways, and in each the tower counted a term twice or
more:

* `tf.compat.v1.layers` adds a weight's regularizer whenever the variable it
  gets is not a global variable. Under `aggregation='all_reduce'` a tower on
  another device gets its device's copy (a local variable), so its layer
  adds `l2(copy)` beside tower 0's `l2(primary)` (the tower's TRAIN loss
  held the term twice), once more for every further call of the same layer
  (one device adds it once, when the variable is made).
* An activity regularizer, or a term the model_fn adds to the collection
  itself, is added by every tower call: tower t counted towers 0..t.

A later tower builds its ops under `tower_<t>/` with the names tower 0 gave
its own, so its entry `tower_<t>/X` stands for tower 0's `X`. Inside
`tower`, REGULARIZATION_LOSSES as tower t sees it is tower 0's entries (and
those made before the towers), each replaced by the tower's own entry of
the same name if it made one: one device's terms, over the tower's own
variables and activations. An entry of the tower's with no counterpart in
tower 0 (a regularizer added again for a copy) is left out, and so are other
towers' entries. Entries made lazily from a variable
(`tf.compat.v1.get_variable(regularizer=...)`) are read in the tower that
asks and stay as they are.
"""

import contextlib
from typing import Iterator, List

import tensorflow as tf

from estimator_towers.graph import op_ledger
from estimator_towers.graph import patching

tf1 = tf.compat.v1
_KEY = tf1.GraphKeys.REGULARIZATION_LOSSES


@contextlib.contextmanager
def tower(index: int, ledger: op_ledger.TowerLedger) -> Iterator[None]:
  """Inside, tower `index` sees one device's REGULARIZATION_LOSSES.

  Args:
    index: The tower being built (0 sees the collection as it is).
    ledger: The towers' regions, to tell which tower made an entry.

  Yields:
    Nothing.
  """
  if not index:
    yield
    return
  original = tf.Graph.get_collection

  def get_collection(graph, name, scope=None):
    items = original(graph, name, scope)
    if name != _KEY:
      return items
    return _one_devices(items, index, ledger)

  with patching.Patcher() as patcher:
    patcher.set(tf.Graph, 'get_collection',
                patcher.guard(get_collection, original))
    yield


def _one_devices(items: List, index: int,
                 ledger: op_ledger.TowerLedger) -> List:
  """`items` as tower `index` should see them (see the module docstring)."""
  prefix = f'tower_{index}/'
  own = {}  # Tower 0's name -> the tower's entry standing for it.
  unmatched = []  # Own entries not named under the tower's scope.
  for item in items:
    if _tower_of(item, ledger) == index:
      if item.name.startswith(prefix):
        own[item.name[len(prefix):]] = item
      else:
        unmatched.append(item)
  seen = []
  for item in items:
    if _tower_of(item, ledger) <= 0:  # Tower 0's, earlier, or lazy.
      name = item.name if isinstance(item, tf.Tensor) else None
      seen.append(own.get(name, item))
  # An own entry named outside the tower's scope cannot be matched: it is
  # kept (as before this module), beside whatever tower 0's it stands for.
  return seen + unmatched


def _tower_of(item, ledger: op_ledger.TowerLedger) -> int:
  """The tower that made `item`; -1 for an entry made before the towers or
  evaluated lazily (reading `.op` would build it here)."""
  if not isinstance(item, tf.Tensor) or ledger.count == 0:
    return -1
  if not op_ledger.made_after(item.op, ledger.first):
    return -1
  return ledger.tower_of(item.op)
