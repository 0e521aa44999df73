"""Runs `python -m trainer.cluster`; see trainer/cluster/main.py."""

from trainer.cluster import main

# absl prints the __main__ module's docstring as the usage text.
__doc__ = main.__doc__  # pylint: disable=redefined-builtin

main.run_main()
