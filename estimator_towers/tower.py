"""Which tower is being built: an accessor for code inside a model_fn.

A model_fn written for one device rarely needs to know it is replicated, but
some do (e.g. to log only from one tower, or to scale a per-tower quantity).
`replicate_model_fn` sets the context while it calls the model_fn for each
tower; outside of it the model_fn sees a single tower.
"""

import contextlib
import dataclasses
import threading
from typing import Iterator, Optional

_state = threading.local()


@dataclasses.dataclass(frozen=True)
class TowerContext:
  """Where the model_fn being built runs.

  Attributes:
    index: 0-based index of this tower. Tower 0 creates the variables.
    num_towers: How many towers share the global batch.
    device: The device this tower's ops are placed on, or None when the
      model_fn is not replicated.
    micro_batch: With `replicate_model_fn(..., micro_batches=M)` in TRAIN,
      which of the device's M micro-batches this call builds (each is built
      as a tower of its own on the device); else 0.
    num_micro_batches: M in TRAIN, else 1.
  """
  index: int = 0
  num_towers: int = 1
  device: Optional[str] = None
  micro_batch: int = 0
  num_micro_batches: int = 1


_SINGLE = TowerContext()


def tower_context() -> TowerContext:
  """Returns the tower the current model_fn call builds.

  Returns:
    A `TowerContext`; `TowerContext(0, 1, None)` outside `replicate_model_fn`.
  """
  return getattr(_state, 'context', _SINGLE)


@contextlib.contextmanager
def _entered(context: TowerContext) -> Iterator[TowerContext]:
  """Makes `context` the one `tower_context()` returns, for one tower."""
  previous = getattr(_state, 'context', _SINGLE)
  _state.context = context
  try:
    yield context
  finally:
    _state.context = previous
