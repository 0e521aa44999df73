"""TensorFlow environment defaults for the command-line entry points.

These variables are read when TensorFlow is imported, so an entry point calls
`configure(sys.argv)` before importing anything that imports TensorFlow.
Values already in the environment win.
"""

import os
from typing import List, MutableMapping, Optional, Sequence


def _flag_value(argv: Sequence[str], name: str) -> Optional[str]:
  """The value of --name (either spelling) in argv, without parsing flags."""
  spellings = {f'--{name}', f'--{name.replace("-", "_")}'}
  for i, arg in enumerate(argv):
    key, sep, value = arg.partition('=')
    if key in spellings:
      if sep:
        return value
      return argv[i + 1] if i + 1 < len(argv) else None
  return None


def _with_flagfiles(argv: List[str]) -> List[str]:
  """A copy of argv with every --flagfile expanded, as absl will read it."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  try:
    return argv[:1] + flags.FlagValues().read_flags_from_files(argv[1:])
  except flags.Error:
    # An unreadable flagfile: absl stops with its message when it parses
    # the command line moments later; until then, the flags on it count.
    return list(argv)


# --verbosity as the census sample spells it -> absl's number.
VERBOSITY_NAMES = {'DEBUG': 1, 'INFO': 0, 'WARN': -1, 'WARNING': -1,
                   'ERROR': -2, 'FATAL': -3}
# absl level -> TF_CPP_MIN_LOG_LEVEL (0 all, 1 no INFO, 2 no WARNING, 3 no
# ERROR). ERROR maps to 3 too: the C++ runtime's "errors" on a CPU machine
# are CUDA plugin registration notices; real failures reach Python.
_CPP_LEVEL = {1: '0', 0: '0', -1: '1', -2: '3', -3: '3'}


def _verbosity(argv: List[str]) -> Optional[int]:
  """The --verbosity level in argv as absl's number; names are rewritten.

  absl's --verbosity takes numbers only; the census sample's trainers take
  DEBUG, INFO, WARN, ERROR and FATAL, so those become absl's numbers here,
  before absl parses the command line.
  """
  for i, arg in enumerate(argv):
    key, sep, value = arg.partition('=')
    if key not in ('--verbosity', '-v'):
      continue
    if not sep and i + 1 < len(argv):
      value, i = argv[i + 1], i + 1
    number = VERBOSITY_NAMES.get(value.upper())
    if number is not None:
      argv[i] = f'{key}={number}' if sep else str(number)
      return number
    try:
      return max(-3, min(1, int(value)))
    except ValueError:
      return None  # absl reports the bad value.
  return None


def configure(argv: List[str],
              environ: MutableMapping[str, str] = os.environ) -> None:
  """Sets TensorFlow's log level and, for CPU towers, turns oneDNN off.

  `--verbosity` (a census name or absl's number) sets the C++ log level; by
  default the C++ runtime logs only what reaches Python as an error anyway.
  `argv` is edited in place: a verbosity name becomes absl's number.

  With several virtual CPU towers, a batch smaller than the tower count
  leaves some towers an empty shard in evaluation; TF 2.15's oneDNN
  convolution returns a wrongly shaped result for an empty batch (the
  default Eigen kernel does not), so CPU-tower runs use the default kernels;
  except with `--mixed-precision=bfloat16`, oneDNN's rewrite, which turns
  oneDNN on (by default it is on only on CPUs with AVX-512).

  Args:
    argv: The command line, program name first.
    environ: Where to set the variables: the process's environment, or a
      copy for a process about to be started.
  """
  # 3 hides the C++ runtime's import-time noise (e.g. CUDA plugin
  # registration errors on machines without GPUs); real failures still
  # reach Python as exceptions with their message.
  level = _verbosity(argv)
  expanded = _with_flagfiles(argv)
  if level is None:
    level = _verbosity(expanded)
  environ.setdefault('TF_CPP_MIN_LOG_LEVEL',
                     '3' if level is None else _CPP_LEVEL[level])
  towers = _flag_value(expanded, 'cpu-towers')
  bfloat16 = _flag_value(expanded, 'mixed-precision') == 'bfloat16'
  if bfloat16:
    # oneDNN is on by default only on CPUs with AVX-512; its bfloat16
    # kernels run on the others too.
    environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '1')
  elif towers and towers.isdigit() and int(towers) > 1:
    environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')


def quiet_python_logs(verbosity_given: bool, level: int) -> None:
  """TensorFlow's Python logs: warnings and errors only, unless asked.

  By default the Estimator's INFO chatter (config dumps, "Calling model_fn")
  and TensorFlow's deprecation notices are left out, so that the console
  shows the task's own lines. `--verbosity` lets them through again.

  Args:
    verbosity_given: Whether --verbosity was on the command line.
    level: absl's verbosity (1 DEBUG ... -3 FATAL).
  """
  # pylint: disable=g-import-not-at-top
  import logging as py_logging
  import tensorflow as tf
  logger = tf.get_logger()
  logger.handlers = []  # One log format: through absl's handler.
  if verbosity_given:
    logger.setLevel({1: py_logging.DEBUG, 0: py_logging.INFO,
                     -1: py_logging.WARNING, -2: py_logging.ERROR}.get(
                         level, py_logging.CRITICAL))
    return
  _quiet_python()


def _quiet_python() -> None:
  """TensorFlow's Python logger at WARNING, its deprecation notices off."""
  # pylint: disable=g-import-not-at-top
  import logging as py_logging
  import warnings
  import tensorflow as tf
  from tensorflow.python.util import deprecation
  tf.get_logger().setLevel(py_logging.WARNING)
  # Private, but the only switch for TensorFlow's deprecation notices.
  deprecation._PRINT_DEPRECATION_WARNINGS = False  # pylint: disable=protected-access
  warnings.filterwarnings('ignore', category=UserWarning,
                          module=r'(keras|tensorflow)\.')
  warnings.filterwarnings('ignore', category=DeprecationWarning)


def quiet_tensorflow() -> None:
  """Quiets TensorFlow in a script as the command-line tools do.

  Call it before importing TensorFlow: the C++ runtime reads its log level
  once, then. It hides the runtime's import-time notices, the Estimator's
  INFO chatter and TensorFlow's deprecation notices; warnings and errors
  still print. A TF_CPP_MIN_LOG_LEVEL already set wins.

      import trainer
      trainer.quiet_tensorflow()
      import tensorflow as tf
  """
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  _quiet_python()
