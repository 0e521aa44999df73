"""Use every device of a machine from an unchanged tf.estimator model_fn.

Public API:
  make_run_config: a RunConfig with devices, placement, memory and threads.
  replicate_model_fn: wraps a one-device model_fn into in-graph towers.
  tower_context: which tower the model_fn being built is (index, count).
"""

import sys

if not (3, 9) <= sys.version_info[:2] <= (3, 11):
  raise ImportError(
      'trainer needs Python 3.9, 3.10 or 3.11: tf.estimator ships only up to '
      'TensorFlow 2.15, which has no wheels for Python '
      f'{sys.version_info[0]}.{sys.version_info[1]}. Create the environment '
      'with python3.11 (run.sh does this).')

# pylint: disable=g-import-not-at-top,wrong-import-position
from trainer.replicate import replicate_model_fn
from trainer.run_config import make_run_config
from trainer.tower import TowerContext
from trainer.tower import tower_context

__all__ = ['make_run_config', 'replicate_model_fn', 'tower_context',
           'TowerContext']
