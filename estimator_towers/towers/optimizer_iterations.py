"""Keras optimizer instances that every tower hands `global_step` again.

The TF2 canned Estimators (DNN, Linear, DNNLinearCombined, Baseline, RNN)
set `optimizer.iterations = global_step` in each TRAIN call of their
model_fn, on the optimizer the user passed. One device calls the model_fn
once per graph; towers call it once each, and a Keras legacy optimizer
refuses a second assignment once it has an `iterations` variable, even
when it is the same variable. While towers are built, assigning the
variable the optimizer already counts with is accepted as the no-op it is;
any other variable is still refused, as Keras does.
"""

import contextlib
from typing import Iterator, Optional

import tensorflow as tf

from estimator_towers.graph import patching


def _keras_legacy_optimizer() -> Optional[type]:
  try:
    return tf.keras.optimizers.legacy.Optimizer
  except (AttributeError, ImportError):
    return None


@contextlib.contextmanager
def same_iterations_accepted() -> Iterator[None]:
  """Accepts `opt.iterations = v` when `v` already is `opt.iterations`.

  Only in the default graph and thread of the caller, while the context is
  open; elsewhere the optimizer behaves as Keras defines it.

  Yields:
    Nothing.
  """
  base = _keras_legacy_optimizer()
  original = base.__dict__.get('iterations') if base is not None else None
  if not isinstance(original, property):
    yield
    return
  with patching.Patcher() as patcher:

    def set_iterations(opt, variable):
      current = getattr(opt, '_iterations', None)
      if current is not None and current is variable:
        return  # A later tower repeats tower 0's assignment.
      original.fset(opt, variable)

    # Guarded: elsewhere (another thread or graph) Keras' setter runs as is.
    patcher.set(base, 'iterations', property(
        original.fget, patcher.guard(set_iterations, original.fset),
        original.fdel, original.__doc__))
    yield
