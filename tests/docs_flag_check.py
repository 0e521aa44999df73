"""Parses command lines with one entry point's flags, in one process.

`python tests/docs_flag_check.py MODULE` reads a JSON list of argument lists
from stdin and prints a JSON list with, for each, None when MODULE's command
line takes it, else the error the command would print. Used by
tests/test_docs_commands.py: one process per entry point checks every
command of the docs, instead of starting TensorFlow once per command.
"""

import contextlib
import importlib
import io
import json
import sys
from typing import Optional

from absl import app
from absl import flags

from trainer import cli
from trainer import options as options_lib


def _error(prog: str, args) -> Optional[str]:
  """The usage error of `python -m MODULE args`, or None."""
  flags.FLAGS.unparse_flags()
  stderr = io.StringIO()
  try:
    with contextlib.redirect_stderr(stderr), \
        contextlib.redirect_stdout(io.StringIO()):
      cli.parse([prog, *args], prog, passthrough=prog in ('sweep', 'cluster'))
      if prog in ('task', 'check'):  # The values must make options too.
        options_lib.from_flags()
  except SystemExit as e:
    return None if e.code == 0 else stderr.getvalue().strip()
  except cli.UsageError as e:
    return str(e)
  return None


def main() -> None:
  name = sys.argv[1]
  importlib.import_module(name)  # Defines its flags.
  app.define_help_flags()  # --helpfull and the like, as app.run does.
  prog = name.split('.')[1]
  print(json.dumps([_error(prog, args)
                    for args in json.load(sys.stdin)]))


if __name__ == '__main__':
  main()
