"""Sanity limits a run is checked against before it starts.

A batch too large for the machine is killed by the kernel's OOM killer,
without a word from Python. An estimate of a step's memory catches the
absurd cases (a batch of 10^8 examples) with a clear error instead; it is
deliberately rough and generous, so it never refuses a batch that fits.
"""

import os
from typing import Iterable, Optional

import numpy as np
import tensorflow as tf

# Each float of an example's input and hidden activations is held several
# times in a step: the batch in the input pipeline (and its prefetched
# successor), the forward activations, their gradients.
_COPIES = 4
_SHARE_OF_MEMORY = 0.5


def machine_memory_bytes() -> Optional[int]:
  """Physical memory of this machine, or None where it cannot be read."""
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return None


def floats_per_example(signature, hidden_units: Iterable[int] = ()) -> int:
  """Input floats of one example (dense features) plus hidden units."""
  total = sum(int(units) for units in hidden_units)
  for spec in signature.values():
    if isinstance(spec, tf.TensorSpec) and spec.shape.is_fully_defined():
      total += max(1, int(np.prod(spec.shape.as_list())))
    else:
      total += 1
  return total


def check_batch_size(flag: str, batch_size: int, floats: int,
                     memory: Optional[int]) -> None:
  """Refuses a batch whose step could not fit in memory.

  Args:
    flag: The flag that set the batch size, for the message.
    batch_size: The global batch.
    floats: `floats_per_example` of the model and data.
    memory: `machine_memory_bytes()`; None skips the check.

  Raises:
    ValueError: the estimate exceeds half the machine's memory.
  """
  if memory is None:
    return
  need = batch_size * floats * 4 * _COPIES
  limit = memory * _SHARE_OF_MEMORY
  if need > limit:
    largest = max(1, int(limit // (floats * 4 * _COPIES)))
    raise ValueError(
        f'--{flag}={batch_size} needs about {need / 2**30:.1f} GiB per step '
        f'for {floats} floats per example, more than half of this machine\'s '
        f'{memory / 2**30:.1f} GiB; use at most about {largest}.')
