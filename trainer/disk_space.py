"""A save that finds the disk full: one line, no half-written checkpoint.

TensorFlow reports a full disk while saving as a `ResourceExhaustedError`
whose long message ends in a hint about out-of-memory tensors, and leaves the
checkpoint it was writing as a `model.ckpt-N_temp` directory. `no_space_failure`
removes such directories and says where space ran out and how much is left.
"""

import os
import shutil
import threading
from typing import List, Optional

from absl import logging
import tensorflow as tf

NO_SPACE = 'No space left on device'


def summary_writer_failures_in_one_line() -> None:
  """Makes a summary writer thread that finds the disk full say so in one
  log line instead of a traceback.

  TensorFlow's event writer flushes from a thread of its own; on a full disk
  that thread dies with a traceback on stderr, beside the step's own failure,
  which `no_space_failure` already phrases. Other threads' failures keep
  the default report.
  """
  previous = threading.excepthook

  def hook(args):
    if NO_SPACE in str(args.exc_value) and args.thread is not None and (
        args.thread.name == 'EventLoggerThread'):
      logging.error('Summaries not written: %s', args.exc_value)
      return
    previous(args)

  threading.excepthook = hook


def no_space_failure(message: str, model_dir: str) -> Optional[str]:
  """Explains a full disk in one line, after removing partial checkpoints.

  Args:
    message: The TensorFlow error's message.
    model_dir: The job dir (trial dir) the task writes.

  Returns:
    The explanation, or None when the message is about something else.
  """
  if NO_SPACE not in message:
    return None
  removed = remove_partial_checkpoints(model_dir)
  latest = tf.train.latest_checkpoint(model_dir)
  return (f'no space left on the device of --job-dir {model_dir} '
          f'({_free(model_dir)} free) while writing there'
          + (f'; removed the partial {", ".join(removed)}' if removed else '')
          + f'. The last complete checkpoint is {latest or "none"}. Free '
          'space there (or choose another --job-dir) and re-run to resume.')


def remove_partial_checkpoints(model_dir: str) -> List[str]:
  """Removes the `*_temp` directories of checkpoints cut short.

  Returns:
    The names of the directories removed.
  """
  pattern = os.path.join(model_dir, '*.ckpt-*_temp*')
  removed = []
  for path in sorted(tf.io.gfile.glob(pattern)):
    if tf.io.gfile.isdir(path):
      tf.io.gfile.rmtree(path)
      removed.append(os.path.basename(path.rstrip('/')))
  return removed


def _free(model_dir: str) -> str:
  if '://' in model_dir:
    return 'unknown space'
  try:
    free = shutil.disk_usage(model_dir).free
  except OSError:
    return 'unknown space'
  return f'{free / 2**20:.1f} MiB'
