"""Loss-scale optimizers under towers: one scale, one overflow check.

A loss-scale optimizer (`tf.compat.v1.mixed_precision` and
`enable_mixed_precision_graph_rewrite`'s `MixedPrecisionLossScaleOptimizer`,
Keras's `LossScaleOptimizer` around a legacy optimizer) overrides the
gradient and apply methods to multiply the loss by the scale, divide the
gradients by it, and skip the update (and, when dynamic, lower the scale)
when a gradient is not finite.

Called once per tower, each tower would check only its own shard and update
the scale once per tower. Instead `one_update` routes a wrapper's OUTERMOST
call as it routes a plain optimizer's: earlier towers record their loss and
get placeholders; the last tower calls the wrapper's own method once, on
the weighted global-batch loss, with the calls it makes to the optimizer it
wraps passing straight through. So the scale multiplies the global loss,
the overflow check sees every tower's gradients (a step is skipped on all
towers or on none) and a dynamic scale changes once per step: one device's
semantics on the global batch. The scale variables are those of the last
tower's wrapper, created in tower 0's name scope, so checkpoints keep one
device's names.
"""

from typing import Dict, Tuple

import tensorflow as tf
from tensorflow.python.training.experimental import loss_scale_optimizer

__all__ = ['loss_scale_wrappers']

# The methods each wrapper overrides that one_update must route; Keras's
# `_compute_gradients` (its `minimize` in graph mode) stays refused.
_TF1_METHODS = ('compute_gradients', 'apply_gradients')
_KERAS_METHODS = ('get_gradients', 'apply_gradients')


def loss_scale_wrappers() -> Dict[type, Tuple[str, ...]]:
  """{loss-scale optimizer class: the methods to route at its outermost call}.

  Returns:
    The TF1 `MixedPrecisionLossScaleOptimizer` and, when Keras is installed,
    Keras's legacy `LossScaleOptimizer`, with the overridden methods that
    one_update routes instead of refusing.
  """
  wrappers = {
      loss_scale_optimizer.MixedPrecisionLossScaleOptimizer: _TF1_METHODS}
  keras_wrapper = _keras_loss_scale_optimizer()
  if keras_wrapper is not None:
    wrappers[keras_wrapper] = _KERAS_METHODS
  return wrappers


def _keras_loss_scale_optimizer():
  """Keras's LossScaleOptimizer for legacy optimizers, if Keras is there."""
  try:
    front = tf.keras.mixed_precision.LossScaleOptimizer
    legacy = tf.keras.optimizers.legacy.Optimizer
  except (AttributeError, ImportError):
    return None
  # Keras 2.15: a metaclass makes `front(opt)` an instance of the subclass
  # for legacy optimizers (another one wraps the new optimizers, which do
  # not run in graph mode).
  for cls in [front, *front.__subclasses__()]:
    if issubclass(cls, legacy):
      return cls
  return None
