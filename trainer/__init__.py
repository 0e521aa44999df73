"""Use every device of a machine from an unchanged tf.estimator model_fn.

Public API:
  make_run_config: a RunConfig with devices, placement, memory and threads.
  replicate_model_fn: wraps a one-device model_fn into in-graph towers.
  tower_context: which tower the model_fn being built is (index, count).
  TowerContext: what tower_context returns.

The names load on first use, so that the command-line entry points
(`python -m trainer.task`, ...) can set TensorFlow's environment variables
before TensorFlow is imported.
"""

import importlib
import sys

if not (3, 9) <= sys.version_info[:2] <= (3, 11):
  raise ImportError(
      'trainer needs Python 3.9, 3.10 or 3.11: tf.estimator ships only up to '
      'TensorFlow 2.15, which has no wheels for Python '
      f'{sys.version_info[0]}.{sys.version_info[1]}. Create the environment '
      'with python3.11 (run.sh does this).')

_PUBLIC = {
    'make_run_config': 'trainer.run_config',
    'replicate_model_fn': 'trainer.replicate',
    'tower_context': 'trainer.tower',
    'TowerContext': 'trainer.tower',
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
  if name not in _PUBLIC:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(list(globals()) + list(_PUBLIC))
