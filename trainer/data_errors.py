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
                           r'|Feature .* of TFRecord .* is nan or inf')
# tf.debugging.Assert reports `assertion failed: [<message>]`, then the
# graph context on the following lines.
_ASSERTION = re.compile(r'assertion failed: \[(.*)\]\s*$', re.MULTILINE)
# input_fns argument -> the trainer.task flag that sets it, where a message
# names only the argument.
_FLAGS = (('skip_malformed=True', '--skip-malformed'),
          ('allow_non_finite=True', '--allow-non-finite'))
# The other input_fns arguments (csv_data, tfrecord_data) a message may name,
# as `name=value`, `name[key]` or `name: ...`, and their task flags.
_ARGUMENTS = {'train_files': '--train-files', 'eval_files': '--eval-files',
              'label_column': '--label-column', 'columns': '--columns',
              'categorical_columns': '--categorical-column',
              'defaults': '--column-default', 'n_classes': '--n-classes',
              'label_vocabulary': '--label-vocabulary'}
_ARGUMENT = re.compile(r'(?<![\w.-])(' + '|'.join(_ARGUMENTS) + r')(?=[=\[:])')
# csv_rows' empty field: the column's name, then the library's fix.
_NO_DEFAULT = re.compile(r'(column `([^`]+)` is empty and has no default) '
                         r'\(pass defaults=\{\.\.\.\}\)')
# How a message names both: keep the flag alone.
_BOTH = re.compile(r'(--[a-z-]+) / [a-z_]+=True|(--[a-z-]+) \([a-z_]+=True\)')


def in_flag_terms(message: str, **renamed: str) -> str:
  """An input_fns message with its arguments spelt as the task's flags.

  Args:
    message: E.g. "columns=['a'] has no feature besides the label."
    **renamed: Arguments whose flag differs in this command, e.g.
      eval_files='--predict-files' for trainer.predict.

  Returns:
    E.g. "--columns=['a'] has no feature besides the label."
  """
  for argument, flag in _FLAGS:
    message = message.replace(argument, flag)
  # The library's `defaults={...}` is a dict; the flag takes one column.
  message = _NO_DEFAULT.sub(r'\1 (pass --column-default=\2=VALUE)', message)
  flags = {**_ARGUMENTS, **renamed}
  return _ARGUMENT.sub(lambda m: flags[m.group(1)], message)


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
      return in_flag_terms(message)
  return None
