"""Runs `python -m trainer.sweep`; see trainer/sweep/main.py."""

from trainer.sweep import main

# absl prints the __main__ module's docstring as the usage text.
__doc__ = main.__doc__  # pylint: disable=redefined-builtin

main.run_main()
