"""estimator_towers: every device of a machine from a one-device model_fn.

The library. `replicate_model_fn` wraps a `tf.estimator` model_fn written for
one device into in-graph towers that compute what one device computes on the
same global batch; `make_run_config` builds the session the towers run in.
It never imports the trainer application (`trainer/`), which is built on it.

Public API:
  make_run_config: a RunConfig with devices, placement, memory and threads.
  replicate_model_fn: wraps a one-device model_fn into in-graph towers.
  tower_context: which tower the model_fn being built is (index, count).
  task_slice: a task's part of each global batch in a synchronous cluster.
  TowerContext: what tower_context returns.
  whole_batch: inside a tower, every tower's rows of a tensor (in-batch
    negatives) and where the tower's rows begin.

Importing it patches nothing and loads nothing: each public name imports its
module (and TensorFlow) on first use. `make_run_config` installs the cluster
server hook for a TF_CONFIG cluster (see cluster_server.py).
"""

import sys

if not (3, 9) <= sys.version_info[:2] <= (3, 11):
  raise ImportError(
      'estimator_towers needs Python 3.9, 3.10 or 3.11: tf.estimator ships '
      'only up to TensorFlow 2.15, which has no wheels for Python '
      f'{sys.version_info[0]}.{sys.version_info[1]}. Create the environment '
      'with python3.11 (run.sh does this).')

# pylint: disable=g-import-not-at-top,wrong-import-position
import importlib
from typing import Any

# Public name -> the module that defines it. Each loads on first use, so
# that importing a TensorFlow-free module of the package (choices) does not
# load TensorFlow.
_EXPORTS = {
    'TowerContext': 'estimator_towers.tower',
    'make_run_config': 'estimator_towers.run_config',
    'replicate_model_fn': 'estimator_towers.replicate',
    'task_slice': 'estimator_towers.cluster.task_input',
    'tower_context': 'estimator_towers.tower',
    'whole_batch': 'estimator_towers.towers.whole_batch',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  """Imports a public name on first use; the import loads TensorFlow."""
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # Later lookups skip this function.
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
