"""The trainer application: `python -m trainer.task`, `.predict`, `.sweep`,
`.cluster`, built on the `estimator_towers` library.

For users of the library, `trainer` re-exports its public API, so
`trainer.replicate_model_fn` and `trainer.make_run_config` are the same
objects as in `estimator_towers`.

TensorFlow reads some environment variables (log level, oneDNN) once, when it
is imported; the package sets their defaults from the command line before it
imports the library, so every entry point gets them. Values already in the
environment win.
"""

import sys

from trainer import environment

environment.configure(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
from estimator_towers import make_run_config
from estimator_towers import replicate_model_fn
from estimator_towers import task_slice
from estimator_towers import tower_context
from estimator_towers import TowerContext

__all__ = ['TowerContext', 'make_run_config', 'replicate_model_fn',
           'task_slice', 'tower_context']
