"""Stops training the moment a weight becomes nan or inf.

A NaN loss is caught by the Estimator, but not a NaN that a ReLU hides from
the loss: such a model trains on, evaluates to a plausible accuracy and gets
exported. This hook checks every trainable variable after each step and
raises before the next checkpoint, evaluation or export.
"""

from typing import List

import tensorflow as tf

tf1 = tf.compat.v1


class NonFiniteWeightsError(ValueError):
  """A trainable variable holds nan or inf."""


class FiniteWeightsHook(tf1.train.SessionRunHook):
  """Raises NonFiniteWeightsError when a trainable variable is not finite."""

  def begin(self):
    self._variables: List[tf.Variable] = tf1.trainable_variables()
    with tf.name_scope('finite_weights'):
      self._each = [tf.reduce_all(tf.math.is_finite(v))
                    for v in self._variables]
      self._all = tf.reduce_all(tf.stack(self._each)) if self._each else None
    self._step = tf1.train.get_global_step()

  def after_run(self, run_context, run_values):
    del run_values
    # Read after the step, not fetched with it: a fetch may see the weights
    # from before the update. This hook runs before the checkpoint saver's.
    session = run_context.session
    if self._all is None or session.run(self._all):
      return
    finite = session.run(self._each)
    bad = [v.op.name for v, ok in zip(self._variables, finite) if not ok]
    step = session.run(self._step) if self._step is not None else '?'
    raise NonFiniteWeightsError(
        f'Training made {len(bad)} variable(s) nan or inf at step {step} '
        f'({", ".join(bad[:5])}{", ..." if len(bad) > 5 else ""}). Nothing '
        'more was saved or exported. Look for nan/inf in the data (allowed '
        'only with --allow-non-finite) or lower --learning-rate.')
