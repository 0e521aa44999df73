"""Runs `python -m trainer.sweep`; see trainer/sweep/main.py."""

import importlib.util
import sys

from trainer import environment

# The --verbosity names (and the trials' TensorFlow defaults) as trainer.task
# takes them; the sweep itself never loads TensorFlow.
environment.configure(sys.argv)

# Optuna and PyYAML are the `sweep` extra: trainer images do not need them.
_MISSING = [name for name in ('optuna', 'yaml')
            if importlib.util.find_spec(name) is None]
if _MISSING:
  sys.stderr.write(
      f'sweep: error: python -m trainer.sweep needs {" and ".join(_MISSING)}'
      ", the package's `sweep` extra: pip install 'estimator-towers[sweep]' "
      "(or pip install -e '.[sweep]' in a checkout).\n")
  sys.exit(2)

from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

from trainer import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from trainer.sweep import main  # pylint: disable=g-import-not-at-top,wrong-import-position

# absl prints the __main__ module's docstring as the usage text.
__doc__ = main.__doc__  # pylint: disable=redefined-builtin
# --help lists the flags (absl registers them under trainer.cli).
flags.adopt_module_key_flags(cli)

main.run_main()
