"""The group and instance keys of the collective ops the towers build.

A collective op names its peers by a group key and itself by an instance
key. Two kinds are built, with different needs:

* within one machine (cross_device: the towers' all-reduce in one session),
  each session gets its own collective executor, so keys need only be
  unique within one graph: a group key per set of devices and instance keys
  counted in the graph;
* across the tasks of a synchronous cluster (task_sync), a collective must
  get the same instance key on every task and no two collectives of one
  process may share one (the servers cache them). Each task builds the same
  model_fn, so a hash of what the op carries and of its rank among the
  graph's task collectives gives every task the same key without talking.

`of_graph` holds the keys of one graph; the two counters are kept apart so
that the ranks of task collectives do not depend on local ones.
"""

import hashlib
import threading
import weakref
from typing import Dict, Optional, Sequence

import tensorflow as tf

# The tasks of a synchronous cluster form one group.
TASK_GROUP = 0x7E58_0001
# Batch norm's global moments in a synchronous cluster (global_batch_norm):
# the towers of task k, and the towers of index i of every task.
_TASK_TOWERS_GROUP_BASE = 0x7E59_0000
_TOWER_INDEX_GROUP_BASE = 0x7E5A_0000
# Group keys of local device sets; well away from small keys a user might
# pick.
_LOCAL_GROUP_BASE = 0x7E57_0000
_KEY_SPACE = 2**30

# Every task instance key this process handed out: key -> what it carries.
_issued: Dict[int, str] = {}
_issued_lock = threading.Lock()
# graph -> its CollectiveKeys.
_of_graph = weakref.WeakKeyDictionary()


class CollectiveKeys:
  """Hands out the keys of one graph's collective ops."""

  def __init__(self):
    self._local_groups: Dict[tuple, int] = {}
    self._local_instances = 0
    self._task_collectives = 0

  def local_group(self, devices: Sequence[str]) -> int:
    """The group key of an in-machine collective over `devices`."""
    return self._local_groups.setdefault(
        tuple(devices), _LOCAL_GROUP_BASE + len(self._local_groups))

  def local_instance(self) -> int:
    """A new instance key for an in-machine collective of this graph."""
    self._local_instances += 1
    return self._local_instances

  def task_instance(self, size: int, carries: str) -> int:
    """An instance key the same on every task for the same collective.

    Args:
      size: How many tasks take part.
      carries: What the collective carries (dtype, shapes, names).

    Returns:
      The key, from a hash of the collective's rank among this graph's task
      collectives and of `carries`.

    Raises:
      ValueError: Another collective of this process got the same key.
    """
    rank = self._task_collectives
    self._task_collectives += 1
    return _issue(f'{size}:{rank}:{carries}')

  def fixed_task_instance(self, size: int, name: str) -> int:
    """An instance key from `name` alone, not from the graph's collectives.

    The start of a synchronous cluster (the tasks' agreement, the chief's
    broadcast) must meet between tasks whose graphs differ: the session run
    that holds it is keyed by a hash of its collectives' instance keys.
    """
    return _issue(f'{size}:fixed:{name}')


def task_towers_group(task: int) -> int:
  """The group key of the towers of task `task` of a synchronous cluster.

  The cluster's group leader resolves every group, so each task's towers
  need a key no other task uses (a local group key is the same on every
  task).
  """
  return _TASK_TOWERS_GROUP_BASE + task


def tower_index_group(tower: int) -> int:
  """The group key of tower `tower` of every task of a synchronous cluster."""
  return _TOWER_INDEX_GROUP_BASE + tower


def _issue(signature: str) -> int:
  """The instance key of `signature`, unique in this process."""
  digest = hashlib.sha256(signature.encode()).digest()
  key = 1 + int.from_bytes(digest[:8], 'big') % (_KEY_SPACE - 1)
  with _issued_lock:
    if _issued.setdefault(key, signature) != signature:
      raise ValueError(
          f'Two collectives of this process hash to instance key {key} '
          f'({_issued[key]!r} and {signature!r}). Build the training '
          'graph in a fresh process.')
  return key


def of_graph(graph: Optional[tf.Graph] = None) -> CollectiveKeys:
  """The keys of `graph`'s collectives (the default graph's).

  Args:
    graph: The graph; None for the default graph.

  Returns:
    The graph's CollectiveKeys, made on first use.
  """
  graph = graph or tf.compat.v1.get_default_graph()
  if graph not in _of_graph:
    _of_graph[graph] = CollectiveKeys()
  return _of_graph[graph]
