"""Logs step, loss, learning rate and examples/sec while training.

A line every `every_n_steps` steps, or sooner once `every_secs` of wall time
passed (a slow model on a CPU said nothing for minutes before its first
line at step 100), and when training ends a summary: the steps trained and
the examples/sec over the steady steps, the first `warmup_steps` (graph
optimisation, the input pipeline filling) excluded, as tf_cnn_benchmarks
reports throughput.
"""

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
    every_secs: Also log once this much wall time passed since the last line.
    warmup_steps: Steps of this session left out of the summary's rate.
    run_log: Also write each line as a record there (a run_log.RunLog).
  """

  def __init__(self, loss: tf.Tensor, global_batch_size: int, num_towers: int,
               every_n_steps: int = 100, summary_dir: Optional[str] = None,
               max_steps: Optional[int] = None, every_secs: float = 30.0,
               warmup_steps: int = 10, run_log=None):
    self._run_log = run_log
    self._every_secs = every_secs
    self._warmup = warmup_steps
    self._steady = None  # (step, time) once the warm-up steps are done.
    self._final = None  # (step, time) of the last step run.
    self._first_step = None
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
    self._note_for_summary(step, now)
    if self._last is None:
      self._last = (step, now)
      return
    if step == self._last[0] or (step - self._last[0] < self._every and
                                 now - self._last[1] < self._every_secs):
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
    if self._run_log:
      self._run_log.write('progress', step=step, loss=float(results['loss']),
                          examples_per_sec=round(rate, 1),
                          learning_rate=None if lr is None else float(lr))
    if self._summary_dir:
      # Beside the Estimator's global_step/sec, in the same event files.
      writer = tf1.summary.FileWriterCache.get(self._summary_dir)
      writer.add_summary(tf1.Summary(value=[tf1.Summary.Value(
          tag='examples/sec', simple_value=rate)]), step)
    self._last = (step, now)

  def _note_for_summary(self, step: int, now: float) -> None:
    if self._first_step is None:
      self._first_step = step
    if self._steady is None and step - self._first_step >= self._warmup:
      self._steady = (step, now)
    self._final = (step, now)

  def end(self, session):
    del session  # The summary needs only what after_run saw.
    if self._final is None:
      return
    trained = self._final[0] - self._first_step + 1
    if self._steady is None or self._final[0] == self._steady[0]:
      logging.info('trained %d steps (too few after %d warm-up steps for a '
                   'steady examples/sec)', trained, self._warmup)
      self._record(trained, None)
      return
    steps = self._final[0] - self._steady[0]
    rate = steps * self._batch / max(self._final[1] - self._steady[1], 1e-9)
    logging.info('trained %d steps; examples/sec=%.0f (%.0f per tower, %d '
                 'towers) over steps %d-%d, the first %d steps excluded as '
                 'warm-up', trained, rate, rate / self._towers, self._towers,
                 self._steady[0] + 1, self._final[0], self._warmup)
    self._record(trained, rate)

  def _record(self, trained: int, rate: Optional[float]) -> None:
    if self._run_log:
      self._run_log.write(
          'trained', steps=trained, last_step=self._final[0],
          steady_examples_per_sec=None if rate is None else round(rate, 1),
          warmup_steps=self._warmup)

