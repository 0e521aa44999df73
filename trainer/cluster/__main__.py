"""Runs `python -m trainer.cluster`; see trainer/cluster/main.py."""

import sys

from trainer import environment

# The --verbosity names (and the tasks' TensorFlow defaults) as trainer.task
# takes them; the launcher itself never loads TensorFlow.
environment.configure(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags

from trainer import cli
from trainer.cluster import main

# absl prints the __main__ module's docstring as the usage text.
__doc__ = main.__doc__  # pylint: disable=redefined-builtin
# --help lists the flags (absl registers them under trainer.cli).
flags.adopt_module_key_flags(cli)

main.run_main()
