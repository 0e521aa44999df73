"""The creation order of a graph's ops: which tower, or which phase, made an op.

The towers are built one after another in one graph, so every op a tower's
model_fn call creates lies between two points of the graph's creation order;
so do the ops of the one update and of the global loss. TensorFlow numbers
ops in creation order (`Operation._id`), a private attribute but the only
record of that order. This module is the one place that reads it: the rest
of the package takes `Mark`s (a point in the order) and `Region`s (the ops
made between two marks) and asks the predicates here.
"""

import bisect
import contextlib
import dataclasses
from typing import Iterable, Iterator, List, Optional, Set

import tensorflow as tf

tf1 = tf.compat.v1


@dataclasses.dataclass(frozen=True, order=True)
class Mark:
  """A point in a graph's creation order, taken before building something.

  Ops made after the mark was taken are `made_after` it; ops that existed
  already are `made_before` it.

  Attributes:
    next_id: The id the graph's next op gets once the mark is taken.
  """
  next_id: int


# Before every op of any graph: ops are numbered from 1.
GRAPH_START = Mark(0)


def position(graph: Optional[tf.Graph] = None) -> Mark:
  """The current end of `graph`'s creation order (the default graph's).

  Args:
    graph: The graph; None for the default graph.

  Returns:
    A mark every op created from now on is `made_after`.
  """
  graph = graph or tf1.get_default_graph()
  # Private, but the only way to tell later ops from earlier ones.
  return Mark(max(graph._nodes_by_id, default=0) + 1)  # pylint: disable=protected-access


def id_of(op: tf.Operation) -> int:
  """`op`'s place in its graph's creation order."""
  return op._id  # pylint: disable=protected-access


def ops_between(graph: tf.Graph, start: int, end: int
                ) -> List[tf.Operation]:
  """The ops of `graph` whose ids lie in [start, end), in creation order."""
  # Private, but the only index of ops by creation order.
  nodes = graph._nodes_by_id  # pylint: disable=protected-access
  return [nodes[i] for i in range(start, end) if i in nodes]


def op_named(graph: tf.Graph, name: str) -> Optional[tf.Operation]:
  """The op of `graph` named `name`; None if there is none."""
  # Private, but get_operation_by_name raises for a miss.
  nodes = graph._nodes_by_name  # pylint: disable=protected-access
  return nodes[name] if name in nodes else None


def made_before(op: tf.Operation, mark: Mark) -> bool:
  """Whether `op` existed when `mark` was taken."""
  return id_of(op) < mark.next_id


def made_after(op: tf.Operation, mark: Mark) -> bool:
  """Whether `op` was created after `mark` was taken."""
  return id_of(op) >= mark.next_id


def by_creation(ops: Iterable[tf.Operation]) -> List[tf.Operation]:
  """`ops` sorted in the order they were created."""
  return sorted(ops, key=id_of)


def ancestors(ops: Iterable[tf.Operation],
              since: Mark = GRAPH_START) -> Set[tf.Operation]:
  """`ops` and the ops they wait for (data and control inputs), among
  those made after `since` (by default, all)."""
  found, pending = set(), list(ops)
  while pending:
    op = pending.pop()
    if op in found or made_before(op, since):
      continue
    found.add(op)
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  return found


@dataclasses.dataclass
class Region:
  """The ops created between two marks, [start, end).

  Attributes:
    start: Taken before the first op of the region.
    end: Taken after its last op; None while the region is being built.
  """
  start: Mark
  end: Optional[Mark] = None

  def contains(self, op: tf.Operation) -> bool:
    """Whether `op` was created inside the region.

    Raises:
      ValueError: The region is still open (its end is unknown).
    """
    if self.end is None:
      raise ValueError('The region is still being built; its ops are not '
                       'known yet.')
    return self.start.next_id <= id_of(op) < self.end.next_id


@contextlib.contextmanager
def region(graph: Optional[tf.Graph] = None) -> Iterator[Region]:
  """Records the ops created inside as one region.

  Args:
    graph: The graph; None for the default graph (read on entry).

  Yields:
    The region, whose end is set on exit (also when an error leaves it).
  """
  graph = graph or tf1.get_default_graph()
  recorded = Region(position(graph))
  try:
    yield recorded
  finally:
    recorded.end = position(graph)


def in_any(op: tf.Operation, regions: Iterable[Region]) -> bool:
  """Whether `op` was created inside one of `regions`."""
  return any(r.contains(op) for r in regions)


class TowerLedger:
  """Records where each tower's ops lie, to tell which tower made an op.

  Made before the towers are built and handed to whoever asks about them;
  `tower` records each tower's region as the builder builds it.

  Args:
    graph: The towers' graph; None for the default graph.
  """

  def __init__(self, graph: Optional[tf.Graph] = None):
    self._graph = graph or tf1.get_default_graph()
    self._regions: List[Region] = []

  @contextlib.contextmanager
  def tower(self, index: int) -> Iterator[Region]:
    """Records the ops created inside as tower `index`'s.

    Args:
      index: The tower: towers are recorded in order, one after another.

    Yields:
      The tower's region.
    """
    if index != len(self._regions):
      raise ValueError(f'Tower {index} recorded after {len(self._regions)} '
                       'towers; towers are built in order.')
    with region(self._graph) as recorded:
      self._regions.append(recorded)
      yield recorded

  @property
  def count(self) -> int:
    """How many towers were recorded so far."""
    return len(self._regions)

  @property
  def first(self) -> Mark:
    """Before tower 0: ops made before it are not the towers'."""
    return self._regions[0].start

  def start(self, tower: int) -> Mark:
    """The mark taken before tower `tower` was built."""
    return self._regions[tower].start

  def region(self, tower: int) -> Region:
    """The ops tower `tower` created (its model_fn call and its checks)."""
    return self._regions[tower]

  def tower_of(self, op: tf.Operation) -> int:
    """The tower that made `op`, an op made after tower 0's start.

    An op made after the last tower's region (the one update the last
    tower built) counts as the last tower's.
    """
    ids = [r.start.next_id for r in self._regions]
    return bisect.bisect_right(ids, id_of(op)) - 1
