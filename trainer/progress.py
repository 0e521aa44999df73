"""Progress lines for long evaluations and predictions.

Training logs every --log-step-count-steps (trainer.step_logging); an
evaluation over the whole eval set, or a batch prediction of millions of
rows, said nothing until it ended. These log how far they are, at most once
per period of wall time.
"""

import time
from typing import Iterable, Iterator, Optional, TypeVar

from absl import logging
import tensorflow as tf

T = TypeVar('T')
EVERY_SECS = 30.0


class Progress:
  """Logs `<what>: <n>[ of <total>] <unit>` at most every `every_secs`.

  Args:
    what: What is in progress, e.g. 'predicting'.
    unit: What is counted, e.g. 'rows'.
    total: How many there will be, if known.
    every_secs: The least time between two lines (0: a line per update).
  """

  def __init__(self, what: str, unit: str, total: Optional[int] = None,
               every_secs: float = EVERY_SECS):
    self._what, self._unit, self._total = what, unit, total
    self._every = every_secs
    self._last = time.monotonic()
    self.count = 0

  def add(self, n: int = 1) -> None:
    self.count += n
    now = time.monotonic()
    if now - self._last >= self._every:
      self._last = now
      of = f' of {self._total}' if self._total else ''
      logging.info('%s: %d%s %s', self._what, self.count, of, self._unit)


def counted(items: Iterable[T], progress: Progress) -> Iterator[T]:
  """`items`, with a progress line now and then."""
  for item in items:
    yield item
    progress.add()


class EvalProgressHook(tf.compat.v1.train.SessionRunHook):
  """Logs the evaluation's batches now and then (an evaluation hook)."""

  def __init__(self, total_batches: Optional[int] = None,
               every_secs: float = EVERY_SECS):
    self._total, self._every = total_batches, every_secs
    self._progress = None

  def begin(self):
    # A new Progress per evaluation: the count starts again.
    self._progress = Progress('evaluating', 'batches', self._total,
                              self._every)

  def after_run(self, run_context, run_values):
    del run_context, run_values
    self._progress.add()
