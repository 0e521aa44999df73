"""One device's regularization losses in every tower.

`tf.compat.v1.losses.get_total_loss()` adds the REGULARIZATION_LOSSES
collection to a model's loss, and that collection is graph-wide: a tower
built after others would also see the entries they added. Entries get added
in later towers in three ways, and in each the tower would count a term
twice or more:

* `tf.compat.v1.layers` adds a weight's regularizer whenever the variable it
  gets is not a global variable. Under `aggregation='all_reduce'` a tower on
  another device gets its device's copy (a local variable), so its layer
  adds `l2(copy)` beside tower 0's `l2(primary)`: the tower's loss held the
  term twice (the logged TRAIN loss was off by the regularization of every
  later tower) and, with micro-batches sharing a copy, the second
  micro-batch counted its device's term twice in the gradient too.
* An activity regularizer, or a model_fn that adds a term to the
  collection itself, adds one per tower call: tower t counted towers 0..t.

Inside `tower`, REGULARIZATION_LOSSES as the tower sees it holds what one
device holds, in the tower's own variables and activations: tower 0's
entries (and any made before the towers), except those the tower replaced
with its own entries over the same variables, plus its own. Other towers'
entries are never seen. Entries made lazily from a variable
(`tf.compat.v1.get_variable(regularizer=...)`) are read in the tower that
asks and stay as they are.
"""

import contextlib
from typing import Callable, Dict, Iterator, List, Set, Tuple

import tensorflow as tf

from estimator_towers.graph import op_ledger
from estimator_towers.graph import patching

tf1 = tf.compat.v1
_KEY = tf1.GraphKeys.REGULARIZATION_LOSSES
_VARIABLE_OPS = frozenset(['VarHandleOp', 'VariableV2', 'Variable'])


@contextlib.contextmanager
def tower(index: int, ledger: op_ledger.TowerLedger,
          primary_name: Callable[[str, int], str]) -> Iterator[None]:
  """Inside, tower `index` sees one device's REGULARIZATION_LOSSES.

  Args:
    index: The tower being built (0 sees the collection as it is).
    ledger: The towers' regions, to tell which tower made an entry.
    primary_name: (variable op name, tower) -> the name of the variable
      one device has: a per-device copy's name without its prefix.

  Yields:
    Nothing.
  """
  if not index:
    yield
    return
  original = tf.Graph.get_collection
  reads: Dict[Tuple[str, int], Set[str]] = {}  # Entries do not change.

  def read(item, tower: int) -> Set[str]:
    if not isinstance(item, tf.Tensor):
      return set()  # Lazy: reading `.op` would build it here.
    key = (item.name, tower)
    if key not in reads:
      reads[key] = {primary_name(op.name, tower)
                    for op in op_ledger.ancestors([item.op])
                    if op.type in _VARIABLE_OPS}
    return reads[key]

  def get_collection(graph, name, scope=None):
    items = original(graph, name, scope)
    if name != _KEY:
      return items
    return _one_devices(items, index, ledger, read)

  with patching.Patcher() as patcher:
    patcher.set(tf.Graph, 'get_collection',
                patcher.guard(get_collection, original))
    yield


def _one_devices(items: List, index: int, ledger: op_ledger.TowerLedger,
                 read: Callable[[object, int], Set[str]]) -> List:
  """`items` as tower `index` should see them (see the module docstring).

  `read(item, tower)` names the one-device variables an entry reads.
  """
  towers = [_tower_of(item, ledger) for item in items]
  replaced: Set[str] = set()
  for item, tower in zip(items, towers):
    if tower == index:
      replaced |= read(item, index)
  kept = []
  for item, tower in zip(items, towers):
    if tower == index:
      kept.append(item)
    elif tower <= 0:  # Tower 0's, made before the towers, or lazy.
      variables = read(item, 0)
      if not (variables and variables <= replaced):
        kept.append(item)
  return kept


def _tower_of(item, ledger: op_ledger.TowerLedger) -> int:
  """The tower that made `item`; -1 for an entry made before the towers or
  evaluated lazily (reading `.op` would build it here)."""
  if not isinstance(item, tf.Tensor) or ledger.count == 0:
    return -1
  if not op_ledger.made_after(item.op, ledger.first):
    return -1
  return ledger.tower_of(item.op)

