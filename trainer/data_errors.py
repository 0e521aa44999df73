"""Bad-data errors of the input pipeline, as one line for the command line.

input_fns finds a malformed CSV row, a label out of range or a NaN/inf
feature inside the tf.data pipeline, so the error surfaces from
`Estimator.train/evaluate/predict` as a tf.errors.InvalidArgumentError whose
message wraps the useful line in TensorFlow's graph context. `cli_message`
takes that line back out and names the task flags instead of the
input_fns arguments, so that `trainer.task` can print one line and exit
non-zero instead of a traceback:

    except tf.errors.InvalidArgumentError as e:
      message = data_errors.cli_message(e)
      if message is None:
        raise
      sys.stderr.write(f'task: error: {message}\\n')
      sys.exit(1)
"""

import re
from typing import Optional

import tensorflow as tf

# The messages of input_fns' checks (csv.py, tfrecord.py).
_DATA_MESSAGE = re.compile(r'Malformed CSV row |Bad label .* in TFRecord '
                           r'|Non-finite value .* of TFRecord ')
# tf.debugging.Assert reports `assertion failed: [<message>]`, then the
# graph context on the following lines.
_ASSERTION = re.compile(r'assertion failed: \[(.*)\]\s*$', re.MULTILINE)
# input_fns argument -> the trainer.task flag that sets it, where a message
# names only the argument.
_FLAGS = (('skip_malformed=True', '--skip-malformed'),
          ('allow_non_finite=True', '--allow-non-finite'))
# How a message names both: keep the flag alone.
_BOTH = re.compile(r'(--[a-z-]+) / [a-z_]+=True|(--[a-z-]+) \([a-z_]+=True\)')


def cli_message(error: BaseException) -> Optional[str]:
  """The one-line message of an input_fns data check, with task flags.

  Args:
    error: An exception from running an input pipeline.

  Returns:
    E.g. 'Malformed CSV row data.csv:3: column `a`: `x` is not a number.
    Fix the row, or pass --skip-malformed to skip such rows.'; None when
    `error` is not a failed input_fns data check (re-raise it then).
  """
  if not isinstance(error, tf.errors.InvalidArgumentError):
    return None
  for match in _ASSERTION.finditer(error.message):
    message = match.group(1)
    if _DATA_MESSAGE.match(message):
      message = _BOTH.sub(lambda m: m.group(1) or m.group(2), message)
      for argument, flag in _FLAGS:
        message = message.replace(argument, flag)
      return message
  return None
