"""Logs step, loss, learning rate and examples/sec while training."""

import time
from typing import Optional

from absl import logging
import tensorflow as tf

tf1 = tf.compat.v1


def _learning_rate_tensor(graph) -> Optional[tf.Tensor]:
  """The value of a scalar summary tagged 'learning_rate', if the model has one."""
  for op in graph.get_operations():
    if op.type != 'ScalarSummary':
      continue
    tags = tf.get_static_value(op.inputs[0])
    if tags is not None and tags in (b'learning_rate', 'learning_rate'):
      return op.inputs[1]
  return None


class StepLoggingHook(tf1.train.SessionRunHook):
  """Every `every_n_steps`, logs progress and throughput.

  Args:
    loss: The merged (global-batch) loss tensor.
    global_batch_size: Examples per step, across all towers.
    num_towers: Towers sharing each batch.
    every_n_steps: Logging period.
    summary_dir: Also write an `examples/sec` summary there (the model dir).
    max_steps: The last step, for the time-left estimate.
  """

  def __init__(self, loss: tf.Tensor, global_batch_size: int, num_towers: int,
               every_n_steps: int = 100, summary_dir: Optional[str] = None,
               max_steps: Optional[int] = None):
    self._summary_dir = summary_dir
    self._max_steps = max_steps
    self._loss = loss
    self._batch = global_batch_size
    self._towers = num_towers
    self._every = every_n_steps
    self._fetches = None
    self._last = None  # (step, time) of the last log line.

  def begin(self):
    fetches = {'step': tf1.train.get_global_step(), 'loss': self._loss}
    lr = _learning_rate_tensor(tf1.get_default_graph())
    if lr is not None:
      fetches['learning_rate'] = lr
    self._fetches = fetches

  def before_run(self, run_context):
    return tf1.train.SessionRunArgs(self._fetches)

  def after_run(self, run_context, run_values):
    results = run_values.results
    step, now = int(results['step']), time.time()
    if self._last is None:
      self._last = (step, now)
      return
    if step - self._last[0] < self._every:
      return
    rate = (step - self._last[0]) * self._batch / max(now - self._last[1], 1e-9)
    lr = results.get('learning_rate')
    lr_text = f' learning_rate={lr:.4g}' if lr is not None else ''
    eta = ''
    if self._max_steps:
      steps_per_sec = (step - self._last[0]) / max(now - self._last[1], 1e-9)
      eta = ' ETA %ds' % max(0, (self._max_steps - step) / steps_per_sec)
    logging.info('step %d: loss=%.4f%s examples/sec=%.0f (%.0f per tower, '
                 '%d towers)%s', step, results['loss'], lr_text, rate,
                 rate / self._towers, self._towers, eta)
    if self._summary_dir:
      # Beside the Estimator's global_step/sec, in the same event files.
      writer = tf1.summary.FileWriterCache.get(self._summary_dir)
      writer.add_summary(tf1.Summary(value=[tf1.Summary.Value(
          tag='examples/sec', simple_value=rate)]), step)
    self._last = (step, now)
