"""Temporary attribute patches that only their owner sees.

While towers are built, several modules replace methods of classes they do
not own (optimizers, Keras batch normalisation, lookup tables) so that each
tower's calls can be intercepted. A class attribute is global to the
process, so such a patch would also catch a model_fn another thread builds at
the same time, or a graph the caller builds on the side. `Patcher` scopes
every patch to its owner: the default graph (with the function graphs nested
in it, such as `tf.cond` branches) and the thread that opened it. A
replacement wrapped by `Patcher.guard` runs only for its owner and calls the
original everywhere else.

Patches nest (the inner one restores the outer one on exit) and are undone on
exit even when the body raises. A patch on an attribute that another thread
has patched and not yet restored is refused: the two exits could come in
either order, and the later one would put back a patch whose owner is gone.

`replace_for_process` is the permanent, process-wide variant for hooks that
must stay for the rest of the process (see cluster_server.py).
"""

import functools
import threading
from typing import Any, Callable, Dict, List, Tuple

import tensorflow as tf

tf1 = tf.compat.v1

_MISSING = object()

# (id(target), name) -> the open Patchers that replaced it, oldest first.
# Keyed by id because targets (classes, modules) may not be hashable in a
# useful way; a Patcher keeps its targets alive while it is open.
_open: Dict[Tuple[int, str], List['Patcher']] = {}
_lock = threading.Lock()


class PatchConflictError(RuntimeError):
  """An attribute is already patched by another thread."""


def _outermost(graph):
  """The graph `graph` is nested in (itself unless a function graph)."""
  while getattr(graph, 'outer_graph', None) is not None:
    graph = graph.outer_graph
  return graph


class Patcher:
  """Replaces attributes for the graph and thread that open it.

  Use as a context manager: `set` replaces, exit restores, in reverse
  order, every attribute it replaced, also when the body raises.

  Attributes:
    graph: The default graph when the Patcher was created.
    thread: The id of the thread that created it.
  """

  def __init__(self):
    self.graph = tf1.get_default_graph()
    self.thread = threading.get_ident()
    # (target, name, value before, value set), in the order of `set`.
    self._saved: List[Tuple[Any, str, Any, Any]] = []

  def owns(self) -> bool:
    """Whether the current thread and default graph are this Patcher's."""
    return (threading.get_ident() == self.thread and
            _outermost(tf1.get_default_graph()) is _outermost(self.graph))

  def guard(self, replacement: Callable[..., Any],
            original: Callable[..., Any]) -> Callable[..., Any]:
    """`replacement` for the owner, `original` for every other caller.

    Args:
      replacement: What the owner's calls run.
      original: What every other thread and graph runs (the attribute as it
        was before the patch).

    Returns:
      A function with `original`'s name and docstring.
    """

    @functools.wraps(original)
    def guarded(*args, **kwargs):
      if self.owns():
        return replacement(*args, **kwargs)
      return original(*args, **kwargs)

    return guarded

  def set(self, target: Any, name: str, value: Any) -> None:
    """Sets `target.name = value` until this Patcher exits.

    Args:
      target: A class or module.
      name: The attribute to replace; absent from `target` itself (say,
        inherited) is fine, exit then deletes it again.
      value: The replacement; wrap functions with `guard` so that other
        threads and graphs keep the original.

    Raises:
      PatchConflictError: Another thread has an open patch of the
        attribute.
    """
    key = (id(target), name)
    with _lock:
      others = [p for p in _open.get(key, ()) if p.thread != self.thread]
      if others:
        raise PatchConflictError(
            f'{_describe(target)}.{name} is already patched by thread '
            f'{others[0].thread} (estimator_towers builds towers by patching '
            'it); this thread cannot patch it before that thread is done. '
            'Build replicated model_fns one thread at a time.')
      _open.setdefault(key, []).append(self)
    before = vars(target).get(name, _MISSING)
    self._saved.append((target, name, before, value))
    setattr(target, name, value)

  def restore(self) -> None:
    """Puts back every attribute `set` replaced, newest first."""
    while self._saved:
      target, name, before, _ = self._saved.pop()
      if before is _MISSING:
        if name in vars(target):
          delattr(target, name)
      else:
        setattr(target, name, before)
      key = (id(target), name)
      with _lock:
        stack = _open.get(key, [])
        if self in stack:
          # The newest entry: `set` may have been called twice.
          del stack[len(stack) - 1 - stack[::-1].index(self)]
        if not stack:
          _open.pop(key, None)

  def __enter__(self) -> 'Patcher':
    return self

  def __exit__(self, *exc_info) -> None:
    self.restore()


def is_patched(target: Any, name: str) -> bool:
  """Whether an open Patcher has replaced `target.name`."""
  with _lock:
    return bool(_open.get((id(target), name)))


def replace_for_process(target: Any, name: str, value: Any) -> Any:
  """Sets `target.name = value` for the rest of the process, once.

  Args:
    target: A class or module.
    name: The attribute, which must exist.
    value: The replacement. Setting it again is a no-op.

  Returns:
    The attribute it replaced (or `value`, if already set).

  Raises:
    PatchConflictError: An open Patcher has replaced the attribute:
      restoring it would drop `value`.
  """
  if is_patched(target, name):
    raise PatchConflictError(
        f'{_describe(target)}.{name} is temporarily patched; it cannot be '
        'replaced for the process until that patch is restored.')
  before = getattr(target, name)
  if before is not value:
    setattr(target, name, value)
  return before


def _describe(target: Any) -> str:
  return getattr(target, '__qualname__', None) or getattr(
      target, '__name__', repr(target))
