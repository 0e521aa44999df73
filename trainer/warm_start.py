"""`--warm-start-from`: a run's first weights from another checkpoint.

The Estimator reads the warm-start checkpoint only when the job dir has none
of its own; otherwise it resumes and silently ignores the warm start. So a
job dir with checkpoints is accepted only when they are this job's (its
trainer_config.json names the same --warm-start-from: a restarted run
resumes), and refused otherwise.
"""

import json
import os
import re
from typing import Optional

from absl import logging
import tensorflow as tf

FLAG = 'warm-start-from'


def checkpoint_of(path: str) -> str:
  """The checkpoint `path` names: itself, or the newest in a directory.

  Raises:
    ValueError: no checkpoint there.
  """
  if tf.io.gfile.isdir(path):
    latest = tf.train.latest_checkpoint(path)
    if latest is None:
      raise ValueError(f'--{FLAG}={path}: the directory holds no checkpoint. '
                       'Give a job dir that was trained, or a checkpoint '
                       'path such as <job dir>/model.ckpt-1000.')
    return latest
  if not tf.io.gfile.exists(path + '.index'):
    raise ValueError(f'--{FLAG}={path}: no such checkpoint (no directory, no '
                     f'{os.path.basename(path)}.index). Give a trained job '
                     'dir or a checkpoint path such as '
                     '<job dir>/model.ckpt-1000.')
  return path


def settings(path: Optional[str]
             ) -> Optional[tf.estimator.WarmStartSettings]:
  """The Estimator's warm start from `path` (None: none); checked.

  Only the trainable variables are read: the optimizer's slots and the
  global step start afresh.

  Raises:
    ValueError: `path` holds no checkpoint.
  """
  if path is None:
    return None
  return tf.estimator.WarmStartSettings(ckpt_to_initialize_from=
                                        checkpoint_of(path))


def check_job_dir(model_dir: str, config_file: str,
                  path: Optional[str]) -> None:
  """Refuses a warm start the Estimator would ignore.

  Args:
    model_dir: The job dir the run trains in.
    config_file: The name of the saved options there.
    path: --warm-start-from, or None.

  Raises:
    ValueError: the job dir has checkpoints of another run, from which the
      run would resume instead of warm-starting.
  """
  latest = tf.train.latest_checkpoint(model_dir)
  if path is None or latest is None:
    return
  saved = os.path.join(model_dir, config_file)
  if tf.io.gfile.exists(saved):
    with tf.io.gfile.GFile(saved) as f:
      if json.load(f).get('warm_start_from') == path:
        logging.info('Resuming from %s; it was warm-started from %s.', latest,
                     path)
        return
  raise ValueError(
      f'--{FLAG}={path}: {model_dir} already has checkpoints ({latest}), '
      'which the run would resume from, ignoring the warm start. Add '
      '--clean to start the job dir afresh, or choose a new --job-dir.')


# What the Estimator's warm start raises when a variable of the model is
# missing from the checkpoint, or has another shape there.
_MISFIT = re.compile(r'is not found in .* checkpoint|from checkpoint reader')


def is_misfit(error: ValueError) -> bool:
  """Whether `error` is the warm start's: the checkpoint does not fit."""
  return bool(_MISFIT.search(str(error)))


def phrased(error: ValueError, path: str) -> ValueError:
  """The Estimator's error on a checkpoint that does not fit, with the flag.

  E.g. a variable of the model the checkpoint lacks, or of another shape.
  """
  # The Estimator's message may list every tensor of the checkpoint.
  reason = re.sub(r' checkpoint \{.*\}', ' checkpoint',
                  ' '.join(str(error).split()))
  return ValueError(f'--{FLAG}={path}: the checkpoint does not fit the model '
                    f'({reason}). Warm-start from a model of the same '
                    'architecture.')
