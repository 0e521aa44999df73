"""The trainer application: `python -m trainer.task`, `.predict`, `.sweep`,
`.cluster`, `.check`, built on the `estimator_towers` library.

For users of the library, `trainer` re-exports its public API, so
`trainer.replicate_model_fn` and `trainer.make_run_config` are the same
objects as in `estimator_towers`.

Importing `trainer` does nothing else: it leaves sys.argv, the environment
and the loaded modules as they were (TensorFlow is imported on the first use
of a re-exported name). The entry points set TensorFlow's environment
defaults themselves (`trainer.environment`); `quiet_tensorflow()` quiets
TensorFlow for scripts.
"""

import importlib
from typing import Any

# Re-exported name -> the module of the library that defines it.
_EXPORTS = {
    'TowerContext': 'estimator_towers',
    'make_run_config': 'estimator_towers',
    'replicate_model_fn': 'estimator_towers',
    'task_slice': 'estimator_towers',
    'tower_context': 'estimator_towers',
    'whole_batch': 'estimator_towers',
    'quiet_tensorflow': 'trainer.environment',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  """Imports a re-exported name on first use; the import loads TensorFlow."""
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # Later lookups skip this function.
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
