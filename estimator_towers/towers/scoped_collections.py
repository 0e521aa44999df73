"""Scoped collection queries that see a later tower's ops as tower 0's.

Towers after the first are built under a name scope of their own
(`tower_1/...`), so that their ops do not clash with tower 0's, while their
variable scopes are tower 0's (they share its variables). A model_fn that
selects its ops by scope, `tf.compat.v1.get_collection(UPDATE_OPS,
scope='Generator')` as TF-GAN's estimators, slim's model_deploy and other
multi-network model_fns do, would find none of tower 1's
`tower_1/Generator/...` ops and, e.g., fail its own "unused update ops"
check, or train without its batch-norm updates. Inside `tower`, a scope
also matches an item's name below the tower's name scope.
"""

import contextlib
import re
from typing import Iterator

import tensorflow as tf

from estimator_towers.graph import patching


@contextlib.contextmanager
def tower(name_scope: str) -> Iterator[None]:
  """Inside, scoped `get_collection` calls also match below `name_scope`.

  Args:
    name_scope: The tower's name scope ('' for tower 0: nothing changes).

  Yields:
    Nothing.
  """
  if not name_scope:
    yield
    return
  prefix = name_scope.rstrip('/') + '/'
  original = tf.Graph.get_collection

  def get_collection(graph, name, scope=None):
    items = original(graph, name)
    if scope is None:
      return items
    regex = re.compile(scope)
    return [item for item in items if _matches(regex, item, prefix)]

  with patching.Patcher() as patcher:
    patcher.set(tf.Graph, 'get_collection',
                patcher.guard(get_collection, original))
    yield


def _matches(regex, item, prefix: str) -> bool:
  name = getattr(item, 'name', None)
  if not isinstance(name, str):
    return False  # As TensorFlow: items without a name are left out.
  if regex.match(name):
    return True
  return name.startswith(prefix) and bool(regex.match(name[len(prefix):]))
