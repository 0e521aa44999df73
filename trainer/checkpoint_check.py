"""Resuming only from a checkpoint that can be read whole.

A checkpoint cut short (a full disk, a copy that stopped, a damaged file)
made the restore fail with `Read less bytes than requested` and a long
traceback naming no file. Before a run resumes, `resumable` reads the latest
checkpoint's every tensor; if that fails it names the damaged file and falls
back to the newest earlier checkpoint of the job dir's `checkpoint` list
that reads whole, saying so, and points that list at it.
"""

import os
from typing import List, Optional, Tuple

from absl import logging
import tensorflow as tf

tf1 = tf.compat.v1
# The reader's C++ statuses arrive as these: OUT_OF_RANGE ("Read less bytes
# than requested") as IndexError, most others translated to OpErrors.
_READ_ERRORS = (tf.errors.OpError, IndexError, RuntimeError, ValueError)


def damage(path: str) -> Optional[Tuple[str, str]]:
  """Why a checkpoint cannot be restored, or None when it reads whole.

  Args:
    path: A checkpoint prefix (`<dir>/model.ckpt-N`).

  Returns:
    (the damaged file, TensorFlow's message), or None.
  """
  try:
    reader = tf.train.load_checkpoint(path)
  except _READ_ERRORS as e:
    return f'{path}.index', _first_line(e)
  try:
    for name in reader.get_variable_to_shape_map():
      reader.get_tensor(name)
  except _READ_ERRORS as e:
    data = sorted(tf.io.gfile.glob(f'{path}.data-*'))
    return ', '.join(data) or f'{path}.data-*', _first_line(e)
  return None


def _first_line(error: Exception) -> str:
  message = getattr(error, 'message', None) or str(error)
  return message.strip().splitlines()[0] if message.strip() else repr(error)


def resumable(model_dir: str) -> Optional[str]:
  """The checkpoint a run in `model_dir` resumes from, checked whole.

  When the latest checkpoint is damaged, the newest earlier one that reads
  whole becomes the latest in `<model_dir>/checkpoint` (the damaged ones
  leave the list; their files stay, for inspection), with a warning naming
  both.

  Args:
    model_dir: The job dir (trial dir) of a local run or a chief.

  Returns:
    The checkpoint to resume from, or None when there is none.

  Raises:
    ValueError: checkpoints are listed but none reads whole.
  """
  state = tf.train.get_checkpoint_state(model_dir)
  if state is None or not state.model_checkpoint_path:
    return None
  listed = list(state.all_model_checkpoint_paths)
  latest = state.model_checkpoint_path
  candidates = [latest] + [p for p in reversed(listed) if p != latest]
  damaged: List[Tuple[str, str]] = []
  for path in candidates:
    problem = damage(path)
    if problem is None:
      break
    damaged.append(problem)
  else:
    files = '; '.join(f'{f} ({why})' for f, why in damaged)
    raise ValueError(
        f'{model_dir} cannot be resumed: no checkpoint listed in '
        f'{os.path.join(model_dir, "checkpoint")} reads whole: {files}. '
        'Move the damaged files away to start again from step 0, or use a '
        'new --job-dir.')
  if damaged:
    bad = {candidates[i] for i in range(len(damaged))}
    tf1.train.update_checkpoint_state(
        model_dir, path,
        all_model_checkpoint_paths=[p for p in listed if p not in bad])
    logging.warning(
        'The latest checkpoint %s is damaged: %s: %s. Resuming from the '
        'previous one that reads whole, %s (the steps after it are trained '
        'again); the damaged files are left in place and off the checkpoint '
        'list.', latest, damaged[0][0], damaged[0][1], path)
  return path
