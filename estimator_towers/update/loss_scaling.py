"""Loss-scale optimizers under towers: one scale, one overflow check.

A loss-scale optimizer (`tf.compat.v1.mixed_precision` and
`enable_mixed_precision_graph_rewrite`'s `MixedPrecisionLossScaleOptimizer`,
Keras's `LossScaleOptimizer` around a legacy optimizer) overrides the
gradient and apply methods to multiply the loss by the scale, divide the
gradients by it, and skip the update (and, when dynamic, lower the scale)
when a gradient is not finite.

Called once per tower, each tower would check only its own shard and update
the scale once per tower. Instead a wrapper is routed like any optimizer
that delegates to another (gradient_routing, one_update): at its OUTERMOST
call. Earlier towers record their loss and get placeholders; the last tower
calls the wrapper's own method once, on the weighted global-batch loss (or
the global-batch gradients), and the calls it makes to the optimizer it
wraps are the one update's inner calls. So the scale multiplies the global
loss, the overflow check sees every tower's gradients (a step is skipped on
all towers or on none) and a dynamic scale changes once per step: one
device's semantics on the global batch. The last tower builds the update in
tower 0's name scope, so checkpoints keep one device's names.

With `make_run_config(mixed_precision='float16')` the model_fn's optimizer
is not wrapped; `AutomaticScaling` wraps it in the last tower's call
instead.
"""

from typing import Any, Dict, Optional, Tuple

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.training.experimental import loss_scale_optimizer

from estimator_towers.update import gradient_routing as calls

__all__ = ['AutomaticScaling', 'automatic', 'loss_scale_wrappers']


def loss_scale_wrappers() -> Tuple[type, ...]:
  """The loss-scale optimizer classes.

  Returns:
    The TF1 `MixedPrecisionLossScaleOptimizer` and, when Keras is installed,
    Keras's legacy `LossScaleOptimizer`.
  """
  keras_wrapper = _keras_loss_scale_optimizer()
  return (loss_scale_optimizer.MixedPrecisionLossScaleOptimizer,
          *([keras_wrapper] if keras_wrapper is not None else []))


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


def automatic(config: Any) -> bool:
  """Whether the run's session config asks for grappler's float16 rewrite.

  `make_run_config(mixed_precision='float16')` sets it. Then the one update
  scales the loss itself (see `AutomaticScaling`), so that the model_fn's
  optimizer needs no wrapping.
  """
  session_config = getattr(config, 'session_config', None)
  return (session_config is not None and
          session_config.graph_options.rewrite_options.auto_mixed_precision
          == rewriter_config_pb2.RewriterConfig.ON)


class AutomaticScaling:
  """A dynamic loss scale around the optimizers of the one update.

  What `enable_mixed_precision_graph_rewrite(optimizer)` does on one
  device, done in the last tower: the optimizer of each routed call is
  wrapped in a loss-scale optimizer (TF1 or Keras, as the optimizer is),
  once, and the wrapper's method runs instead of the optimizer's. The
  scale's variables (`current_loss_scale`, `good_steps`) get one device's
  names, since the last tower builds the update in tower 0's name scope.
  """

  def __init__(self):
    # id -> (optimizer, wrapper); the optimizer is kept so ids stay unique.
    self._wrappers: Dict[int, Tuple[Any, Any]] = {}

  def wraps(self, call: calls.Call) -> bool:
    """Whether the last tower's outermost `call` goes through a wrapper.

    `tf.gradients` is not an optimizer's (on one device the rewrite leaves
    it unscaled too), and an optimizer the model_fn already wrapped in a
    loss scale keeps its own.
    """
    return call.optimizer is not None and not isinstance(
        call.optimizer, loss_scale_wrappers())

  def run(self, call: calls.Call,
          replace: Optional[Dict[Any, Any]] = None) -> Any:
    """Makes `call` on the wrapper of its optimizer instead.

    The wrapper's method is itself routed: inside the last tower's call it
    is an inner call, as a model_fn's own wrapper's would be.

    Args:
      call: The last tower's outermost call (see `wraps`).
      replace: Arguments to replace, as in `Call.run`.

    Returns:
      The wrapper's method's result.
    """
    args, kwargs = call.arguments(replace)
    return getattr(self._wrapper(call.optimizer), call.name)(*args, **kwargs)

  def _wrapper(self, opt):
    if id(opt) not in self._wrappers:
      if isinstance(opt, tf.compat.v1.train.Optimizer):
        wrapper = loss_scale_optimizer.MixedPrecisionLossScaleOptimizer(
            opt, 'dynamic')
      else:
        wrapper = tf.keras.mixed_precision.LossScaleOptimizer(opt)
      self._wrappers[id(opt)] = (opt, wrapper)
    return self._wrappers[id(opt)][1]
