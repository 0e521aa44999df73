"""The command-line rules shared by the trainer's entry points.

`python -m trainer.task`, `.predict`, `.sweep`, `.cluster` and `.check` all:
- take hyphenated flags as Cloud spells them (`--job-dir`), with the
  underscore spellings (`--job_dir`, absl aliases) and `--no-FLAG` besides
  absl's `--noFLAG` for booleans;
- end a bad command line with `<prog>: error: <message>` and exit code 2,
  and a run that cannot go on with `<prog>: error: <message>` and its own
  exit code (1 unless said otherwise), never a traceback;
- exit 0 after `--help`;
- leave what follows `--` to the entry point (trainer flags for the sweep
  and the cluster launcher); anything else left over is an error.

Entry points call `run(main, prog)` in place of `absl.app.run(main)`.
"""

import atexit
import gc
import glob
import re
import sys
import textwrap
from typing import Callable, List, NoReturn, Optional, Sequence

from absl import app
from absl import flags

FLAGS = flags.FLAGS

EXIT_FAILED = 1
EXIT_USAGE = 2
# Other spellings are listed apart, so that --help shows each flag once.
_SPELLINGS = 'other spellings (trainer.cli)'
_HELP_FLAGS = ('--help', '--helpfull', '--helpshort', '--helpxml', '-h', '-?')
# The help flags answered by help_text (absl answers --helpxml).
_TOPIC_HELP = ('--help', '--helpfull', '--helpshort', '-?')
# Flags of these modules are no entry point's own: --helpfull lists them.
_LIBRARIES = ('absl.', 'tensorflow.', 'keras.', 'tf_keras.')


class UsageError(app.UsageError):
  """A command line that parses but cannot be used: exit code 2."""

  def __init__(self, message: str):
    super().__init__(message, exitcode=EXIT_USAGE)


class Failure(Exception):
  """A run that cannot go on; its message says why and what to do.

  Args:
    message: One line for the user.
    exit_code: The process's exit code.
  """

  def __init__(self, message: str, exit_code: int = EXIT_FAILED):
    super().__init__(message)
    self.exit_code = exit_code


class _Negation(flags.Flag):
  """`--no-NAME`: sets the boolean flag NAME to false, as `--noNAME` does."""

  def __init__(self, name: str, target: flags.Flag):
    super().__init__(flags.BooleanParser(), None, name, None,
                     f'Same as --no{target.name}.', boolean=True)
    self._target = target

  def parse(self, argument):
    super().parse(argument)
    self._target.parse(not self.value)


def define(kind: Callable, name: str, default, help_text: str,
           topic: Optional[str] = None, **kwargs) -> None:
  """Defines a flag with absl's `kind` (e.g. flags.DEFINE_string).

  A hyphenated name also gets its underscore spelling as an absl alias; a
  boolean also gets `--no-NAME`.

  Args:
    kind: absl's DEFINE_* function.
    name: The flag's (hyphenated) name.
    default: Its default.
    help_text: Its help.
    topic: The heading `--help` lists it under (absl's module name of the
      flag); default: the entry point's flags, under 'flags'.
    **kwargs: More arguments of `kind`.
  """
  if topic:
    kwargs['module_name'] = topic
  kind(name, default, help=help_text, **kwargs)
  spellings = [name]
  if '-' in name:
    spellings.append(name.replace('-', '_'))
    flags.DEFINE_alias(spellings[-1], name, module_name=_SPELLINGS)
  if FLAGS[name].boolean:
    for spelling in spellings:
      flags.DEFINE_flag(_Negation(f'no-{spelling}', FLAGS[name]),
                        module_name=_SPELLINGS)


def value(name: str):
  """The parsed value of a (possibly hyphenated) flag."""
  return FLAGS[name].value


def split_multi(values: Sequence[str]) -> List[str]:
  """Flattens repeated, comma- and space-separated flag values.

  The census sample passes several files in one flag value separated by
  spaces (`--train-files "a.csv b.csv"`); others use commas. A value with a
  comma is split at commas only, so that names may hold spaces
  (`--train-files="my data.csv,other.csv"`); so is a value without commas
  that names an existing local file or glob as a whole
  (`--train-files="my data.csv"`).
  """
  parts = []
  for value in values:
    if ',' in value or _matches_whole(value):
      parts += [part.strip() for part in value.split(',')]
    else:
      parts += value.split()
  return [part for part in parts if part]


def _matches_whole(value: str) -> bool:
  """Whether a value with whitespace names local files as it stands."""
  return (bool(re.search(r'\s', value.strip())) and '://' not in value and
          bool(glob.glob(value.strip())))


def fail(prog: str, message: str, exit_code: int) -> NoReturn:
  """Prints `<prog>: error: <message>` (stderr, which Cloud logs), exits."""
  sys.stderr.write(f'{prog}: error: {message}\n')
  sys.exit(exit_code)


def parse(argv: Sequence[str], prog: str, passthrough: bool = False,
          hint: str = '') -> List[str]:
  """Parses the flags before `--`; returns [program, *args after `--`].

  Exits with code 2 on a bad command line (0 after asking for help).
  """
  argv = list(argv)
  split = argv.index('--') if '--' in argv else len(argv)
  own, rest = _short_help(_file_lists(argv[:split])), argv[split + 1:]
  ending = f'; {hint}' if hint else '.'
  asked = _help_asked(own)
  if asked:
    sys.stdout.write(help_text(full=asked == '--helpfull'))
    sys.exit(0)
  try:
    unparsed = FLAGS(own)
  except flags.Error as e:
    fail(prog, f'{e}\nRun with --helpfull to see every flag{ending}',
         EXIT_USAGE)
  except SystemExit as e:
    # absl's help flags exit 1 after printing; asking for help is no error.
    if e.code == 1 and any(a in _HELP_FLAGS for a in own[1:]):
      sys.exit(0)
    raise
  stray = unparsed[1:] + ([] if passthrough else rest)
  if stray:
    fail(prog, f'unexpected arguments {stray}{ending}', EXIT_USAGE)
  return [argv[0], *rest]


def _help_asked(args: List[str]) -> Optional[str]:
  """The help flag among `args` (not as the value of a flag), or None."""
  for i, arg in enumerate(args[1:], 1):
    if arg in _TOPIC_HELP and not _takes_next(args[i - 1]):
      return arg
  return None


def help_text(full: bool = False) -> str:
  """The entry point's `--help` (full: `--helpfull`), grouped by topic.

  The entry point's own flags come first, under the topics they were
  defined with (`define(..., topic=...)`); `--helpfull` adds absl's and
  TensorFlow's. The underscore and `--no-NAME` spellings are left out (one
  line says they exist): absl would list each flag again as an alias.
  """
  groups = FLAGS.flags_by_module_dict()
  own = [m for m in groups if not m.startswith(_LIBRARIES) and
         m not in (_SPELLINGS, __name__) and _listed(groups[m])]
  if __name__ in groups:  # Defined with no topic: the entry point's own.
    own.insert(0, __name__)
  modules = own + ([m for m in sorted(groups)
                    if m.startswith(_LIBRARIES) and _listed(groups[m])]
                   if full else [])
  doc = (getattr(sys.modules['__main__'], '__doc__', None) or '').strip()
  sections = [doc] if doc else []
  for module in modules:
    section = _without_aliases(FLAGS.module_help(module).strip())
    if module == __name__:
      section = 'flags' + section[len(module):]
    sections.append(section)
  sections.append(textwrap.fill(
      'Every hyphenated flag also takes its underscore spelling (--job_dir), '
      'and a boolean --no-NAME and --noNAME.' +
      ('' if full else ' --helpfull adds the flags of absl (logging) and '
       'TensorFlow.'), 80))
  return '\n\n'.join(sections) + '\n'


def _without_aliases(section: str) -> str:
  """absl's help of a module, less its aliases' entries (a flag's first line
  and the indented lines that follow it)."""
  lines, skipping = [], False
  for line in section.splitlines():
    if line.startswith('  --'):
      skipping = ': Alias for --' in line
    elif not line.startswith('    '):
      skipping = False
    if not skipping:
      lines.append(line)
  return '\n'.join(lines)


def _listed(group: List[flags.Flag]) -> bool:
  """Whether a module's flags include one that is no alias of another."""
  return any(not flag.help.startswith('Alias for --') for flag in group)


def _file_lists(args: List[str]) -> List[str]:
  """`--train-files a.csv b.csv` as `--train-files a.csv --train-files b.csv`.

  The census sample takes its file flags so (argparse's nargs='+'); absl
  would leave the second file over as an unexpected argument. Applies to
  the repeatable `--*-files` flags: the arguments after one, up to the next
  that starts with `-`, are its values.
  """
  out, files_flag, awaiting = [], None, False
  for arg in args:
    if arg.startswith('-'):
      name, equals, _ = arg.lstrip('-').partition('=')
      name = name.replace('_', '-')  # The alias is no MultiFlag itself.
      files_flag = name if _is_file_list(name) else None
      awaiting = files_flag is not None and not equals
    elif files_flag and not awaiting:
      out.append(f'--{files_flag}')  # A further value of the flag.
    else:
      awaiting = False
    out.append(arg)
  return out


def _is_file_list(name: str) -> bool:
  return (name.endswith('-files') and name in FLAGS and
          isinstance(FLAGS[name], flags.MultiFlag))


def _short_help(args: List[str]) -> List[str]:
  """`-h` as `--help`, as most command-line tools take it (absl: `-?`).

  Not where it is the separate value of the flag before it (`--name -h`).
  """
  return ['--help' if arg == '-h' and not _takes_next(args[i - 1]) else arg
          for i, arg in enumerate(args)]


def _takes_next(arg: str) -> bool:
  """Whether absl reads the argument after `arg` as its value."""
  name = arg.lstrip('-')
  return (arg.startswith('-') and '=' not in arg and name in FLAGS and
          not FLAGS[name].boolean)


def run(main: Callable[[List[str]], Optional[int]], prog: str, *,
        passthrough: bool = False, hint: str = '') -> None:
  """`absl.app.run(main)` under the rules above.

  Args:
    main: Gets [program, *args after `--`]; may raise UsageError or Failure.
    prog: The name messages start with.
    passthrough: Whether arguments after `--` are main's (else an error).
    hint: Ends usage messages, e.g. where other flags go.
  """

  # Python's last garbage collections at exit walk every object that
  # TensorFlow and the model made: seconds of CPU per process, more when a
  # cluster's or a sweep's processes exit together, which outlasted the
  # launcher's and the sweep's grace period after SIGTERM (then SIGKILL).
  # Frozen objects are skipped; files and checkpoints are closed by then.
  atexit.register(gc.freeze)

  def checked_main(argv):
    try:
      return main(argv)
    except UsageError as e:
      fail(prog, str(e), EXIT_USAGE)
    except Failure as e:
      fail(prog, str(e), e.exit_code)

  app.run(checked_main,
          flags_parser=lambda argv: parse(argv, prog, passthrough, hint))
