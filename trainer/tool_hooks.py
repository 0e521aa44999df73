"""Training hooks of the run's tools: --stop-at and --profile-steps.

Stop at a target: locally each checkpoint is evaluated as soon as it is
saved (the events land in <model_dir>/eval), before training goes on; the
hook reads the newest evaluation at the first step after each checkpoint and
stops training once it meets the target. The Estimator then saves the last
step, which is evaluated and exported as at the end of any run.

Profile: TensorFlow's profiler traces the session's steps FIRST to LAST
into <model_dir>/plugins/profile/<run>/, which TensorBoard's Profile tab
reads.
"""

import os
from typing import Optional, Tuple

from absl import logging
import tensorflow as tf

from trainer.stop_at import Target


class StopAtHook(tf.compat.v1.train.SessionRunHook):
  """Stops training once the newest evaluation in `eval_dir` meets `target`.

  Args:
    target: What to reach.
    eval_dir: The Estimator's evaluation directory (<model_dir>/eval).
    every_n_steps: Read the evaluations this often (the checkpoint period):
      at the first step, then at the first step after each checkpoint.
  """

  def __init__(self, target: Target, eval_dir: str, every_n_steps: int):
    self._target, self._eval_dir = target, eval_dir
    self._every = every_n_steps
    self._step = None
    self._checked = None  # The step whose evaluation was read last.

  def begin(self):
    self._step = tf.compat.v1.train.get_global_step()

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._step)

  def after_run(self, run_context, run_values):
    step = int(run_values.results)
    if self._checked is not None and step - self._checked < self._every:
      return
    self._checked = step
    reached = self._reached()
    if reached:
      logging.info('Stopping training: the evaluation of step %d reached '
                   '--stop-at=%s (%s=%.4g).', *reached)
      run_context.request_stop()

  def _reached(self) -> Optional[tuple]:
    """(eval step, target, metric value) if the newest evaluation meets it."""
    found = _newest_scalar(self._eval_dir, self._target.metric)
    if found is None or not self._target.reached(found[1]):
      return None
    return found[0], self._target, self._target.metric, found[1]


def _newest_scalar(directory: str, tag: str) -> Optional[Tuple[int, float]]:
  """(step, value) of the newest `tag` scalar in the event files, if any.

  The Estimator writes each evaluation's metrics as scalar summaries; the
  estimator library's reader of them is not public.
  """
  if not tf.io.gfile.isdir(directory):
    return None
  newest = None
  for path in tf.io.gfile.glob(os.path.join(directory, 'events.out.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag and (newest is None or event.step >= newest[0]):
          newest = (event.step, float(value.simple_value))
  return newest


class ProfileHook(tf.compat.v1.train.SessionRunHook):
  """Traces the training steps `first` to `last` into `logdir`.

  A step is numbered by the global step its run reads (the Estimator's
  "step = N" lines); a resumed run traces what is left of the range.

  Args:
    logdir: The TensorBoard log dir (the model dir).
    first: The first step traced.
    last: The last step traced.
  """

  def __init__(self, logdir: str, first: int, last: int):
    self._logdir, self._first, self._last = logdir, first, last
    self._step_tensor = None
    self._next = None  # The step the next run reads.
    self._tracing = False
    self._started = None  # The first step traced.

  def begin(self):
    self._step_tensor = tf.compat.v1.train.get_global_step()

  def after_create_session(self, session, coord):
    del coord
    self._next = int(session.run(self._step_tensor))

  def before_run(self, run_context):
    if (not self._tracing and
        self._first <= self._next <= self._last):
      tf.profiler.experimental.start(self._logdir)
      self._tracing, self._started = True, self._next
    return tf.compat.v1.train.SessionRunArgs(self._step_tensor)

  def after_run(self, run_context, run_values):
    step = int(run_values.results)
    self._next = step + 1
    if self._tracing and step >= self._last:
      self._stop(step)

  def end(self, session):
    del session
    if self._tracing:  # Training ended inside the range.
      self._stop(self._next - 1)

  def _stop(self, step: int) -> None:
    tf.profiler.experimental.stop()
    self._tracing = False
    logging.info('Profiled training steps %d-%d into %s/plugins/profile '
                 '(TensorBoard\'s Profile tab).', self._started, step,
                 self._logdir)
