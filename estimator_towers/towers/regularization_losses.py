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
its own, so its entry `tower_<t>/X` stands for tower 0's `X`. An entry added
under an absolute name scope (`tf.name_scope('reg/')`) gets no such prefix:
it stands for the first tower-0 entry, not matched otherwise, that tower 0
added after the point the tower has reached (see `_Progress`), if its shape
and dtype agree; otherwise it is refused.

Inside `tower`, REGULARIZATION_LOSSES as tower t sees it is what one device
sees at the same point of its build: the entries made before the towers,
then tower 0's entries, each replaced by the tower's own counterpart if it
made one, and shown only once the tower made that counterpart or built past
the point where tower 0 added it (a kernel regularizer of a variable the
tower reuses is added by tower 0 alone). So a model_fn that counts the
entries before building and slices the new ones afterwards takes its own.
An entry of the tower's with no counterpart in tower 0 (a regularizer added
again for a copy) is left out, and so are other towers' entries. Entries
made lazily from a variable (`tf.compat.v1.get_variable(regularizer=...)`)
are read in the tower that asks and stay as they are.
"""

import bisect
import contextlib
import re
from typing import Iterator, List, Optional, Tuple

import tensorflow as tf

from estimator_towers.graph import op_ledger
from estimator_towers.graph import patching

tf1 = tf.compat.v1
_KEY = tf1.GraphKeys.REGULARIZATION_LOSSES


@contextlib.contextmanager
def tower(index: int, ledger: op_ledger.TowerLedger,
          scope: Optional[str] = None) -> Iterator[None]:
  """Inside, tower `index` sees one device's REGULARIZATION_LOSSES.

  Args:
    index: The tower being built (0 sees the collection as it is).
    ledger: The towers' regions, to tell which tower made an entry.
    scope: The tower's name scope; `tower_<index>` if None.

  Yields:
    Nothing.
  """
  if not index:
    yield
    return
  original = tf.Graph.get_collection
  prefix = f'{scope or f"tower_{index}"}/'
  progress = _Progress(index, ledger, prefix)

  def get_collection(graph, name, scope=None):
    items = original(graph, name, scope)
    if name != _KEY:
      return items
    return _one_devices(items, index, ledger, progress, prefix)

  with patching.Patcher() as patcher:
    patcher.set(tf.Graph, 'get_collection',
                patcher.guard(get_collection, original))
    yield


class _Progress:
  """How far tower t's build has come, in tower 0's terms.

  A tower's op `tower_<t>/X` stands for tower 0's op `X`; the point tower t
  has reached is the latest tower-0 op one of its ops stands for. An op
  outside the tower's scope (a layer object built by tower 0 and called
  again enters the scope of its first call: `dense/MatMul_1`) stands for
  the tower-0 op of the same name but for uniquifying suffixes, the k-th
  such op of the tower for the k-th of tower 0. Scanned incrementally: a
  tower's ops only grow while it builds.

  Args:
    index: The tower (> 0).
    ledger: The towers' regions.
    prefix: The tower's name scope, with its '/'.
  """

  def __init__(self, index: int, ledger: op_ledger.TowerLedger, prefix: str):
    self._prefix = prefix
    self._ledger = ledger
    self._index = index
    self._next = None  # The id of the next of the tower's ops to scan.
    # Tower 0's ops by name without suffixes, and how many of each the
    # tower's unscoped ops have stood for so far.
    self._firsts: Optional[dict] = None
    self._used: dict = {}
    # (id of a tower-t op, latest tower-0 id reached up to it), ascending.
    self._reached: List[Tuple[int, int]] = []

  def reached(self, before: Optional[tf.Operation] = None) -> int:
    """The latest tower-0 op id the tower stood for (before op `before`
    was made, if given); -1 if none."""
    self._scan()
    if before is None:
      return self._reached[-1][1] if self._reached else -1
    at = bisect.bisect_left(self._reached, (op_ledger.id_of(before), -1))
    return self._reached[at - 1][1] if at else -1

  def _scan(self) -> None:
    graph = tf1.get_default_graph()
    if self._next is None:
      self._next = self._ledger.start(self._index).next_id
    latest = self._reached[-1][1] if self._reached else -1
    end = op_ledger.position(graph).next_id
    for op in op_ledger.ops_between(graph, self._next, end):
      theirs = self._stands_for(graph, op)
      if theirs is not None:
        latest = max(latest, op_ledger.id_of(theirs))
      self._reached.append((op_ledger.id_of(op), latest))
    self._next = end

  def _stands_for(self, graph: tf.Graph,
                  op: tf.Operation) -> Optional[tf.Operation]:
    """Tower 0's op that the tower's `op` repeats, if any."""
    if op.name.startswith(self._prefix):
      theirs = op_ledger.op_named(graph, op.name[len(self._prefix):])
      if theirs is not None and self._ledger.tower_of(theirs) == 0 and (
          op_ledger.made_after(theirs, self._ledger.first)):
        return theirs
      return None
    if op.name.startswith('tower_'):
      return None  # Another tower's scope, or the wrapper's.
    if self._firsts is None:
      self._firsts = {}
      zero = self._ledger.region(0)
      for first in op_ledger.ops_between(graph, zero.start.next_id,
                                         self._ledger.start(1).next_id):
        self._firsts.setdefault(_without_suffixes(first.name),
                                []).append(first)
    name = _without_suffixes(op.name)
    candidates = self._firsts.get(name, [])
    used = self._used.get(name, 0)
    if used >= len(candidates):
      return None
    self._used[name] = used + 1
    return candidates[used]


def _one_devices(items: List, index: int, ledger: op_ledger.TowerLedger,
                 progress: _Progress, prefix: str) -> List:
  """`items` as tower `index` should see them (see the module docstring)."""
  firsts = [item for item in items if _tower_of(item, ledger) == 0]
  own = {}  # Tower 0's entry name -> the tower's entry standing for it.
  unscoped = []  # Own entries not named under the tower's scope.
  for item in items:
    if _tower_of(item, ledger) == index:
      if item.name.startswith(prefix):
        own[item.name[len(prefix):]] = item
      else:
        unscoped.append(item)
  for item in unscoped:
    first = _counterpart(item, firsts, own, progress)
    own[first.name] = item
  reached = progress.reached()
  seen = []
  for item in items:
    tower = _tower_of(item, ledger)
    if tower < 0:  # Made before the towers, or lazy.
      seen.append(item)
    elif tower == 0:
      if item.name in own:
        seen.append(own[item.name])
      elif op_ledger.id_of(item.op) < reached:
        seen.append(item)  # The tower built past it without its own.
  return seen


def _counterpart(item: tf.Tensor, firsts: List[tf.Tensor], own: dict,
                 progress: _Progress) -> tf.Tensor:
  """Tower 0's entry that the tower's unscoped entry `item` stands for.

  Raises:
    ValueError: There is none, or its shape or dtype differs.
  """
  reached = progress.reached(before=item.op)
  open_firsts = [first for first in firsts if first.name not in own
                 and op_ledger.id_of(first.op) > reached]
  # A name scope entered again keeps its name and uniquifies the ops in it
  # ('d/ActivityRegularizer_1/truediv'): the entry of the same name but for
  # those suffixes is the one this entry repeats. Shape alone would pair a
  # layer's activity term with the kernel term before it (two scalars).
  name = _without_suffixes(item.name)
  for first in open_firsts:
    if _without_suffixes(first.name) == name and _alike(first, item):
      return first
  if open_firsts and _alike(open_firsts[0], item):
    return open_firsts[0]
  raise ValueError(
      f'A tower added {item.name} to REGULARIZATION_LOSSES outside its '
      "name scope (an absolute tf.name_scope such as 'reg/'), and tower 0 "
      'added no entry of the same shape and dtype at that point of its '
      "build. replicate_model_fn matches each tower's entries to tower 0's "
      'to count every term once, as one device does: add the entry under a '
      "relative name scope (tf.name_scope('reg'), without the trailing "
      'slash), or add the same entries in every tower.')


def _without_suffixes(name: str) -> str:
  """`name` without the `_<n>` TensorFlow appends inside a scope entered
  again. The scope itself is entered by its full name (a layer's first
  call's, `tf.name_scope('reg/')`) and keeps it: its first part stays, so
  `dense_1/BiasAdd` (another layer) is not `dense/BiasAdd_1`."""
  strip = lambda part: re.sub(r'_\d+$', '', part)  # pylint: disable=unnecessary-lambda-assignment
  first, *rest = name.split('/')
  return '/'.join([first if rest else strip(first)] + [strip(p) for p in rest])


def _alike(first: tf.Tensor, item: tf.Tensor) -> bool:
  """Whether the two entries have the same dtype and shape."""
  return first.dtype == item.dtype and first.shape.as_list() == (
      item.shape.as_list() if item.shape.rank is not None else None)


def _tower_of(item, ledger: op_ledger.TowerLedger) -> int:
  """The tower that made `item`; -1 for an entry made before the towers or
  evaluated lazily (reading `.op` would build it here)."""
  if not isinstance(item, tf.Tensor) or ledger.count == 0:
    return -1
  if not op_ledger.made_after(item.op, ledger.first):
    return -1
  return ledger.tower_of(item.op)
