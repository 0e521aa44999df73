"""Vertex AI's output locations: AIP_CHECKPOINT_DIR, AIP_MODEL_DIR and
AIP_TENSORBOARD_LOG_DIR.

Vertex AI tells a custom job where to write through environment variables
(set when the job has a base output directory). Precedence, as in
docs/cloud.md: `--job-dir` wins for everything; without it, checkpoints,
evaluation and exports go to AIP_CHECKPOINT_DIR; the final SavedModel is
also copied to AIP_MODEL_DIR (the folder Vertex imports a model from) and
summaries are also written to AIP_TENSORBOARD_LOG_DIR.
"""

import os
from typing import Dict, Optional

from absl import logging
import tensorflow as tf

tf1 = tf.compat.v1


def job_dir(flag_value: Optional[str], environ=None) -> Optional[str]:
  """--job-dir if given, else AIP_CHECKPOINT_DIR, else None."""
  environ = os.environ if environ is None else environ
  return flag_value or environ.get('AIP_CHECKPOINT_DIR') or None


def check_outputs(environ=None) -> None:
  """Creates AIP_MODEL_DIR and AIP_TENSORBOARD_LOG_DIR, or says why not.

  Called before training, so that a location the task cannot write to stops
  it at once rather than after hours of training.

  Raises:
    ValueError: one of them cannot be created.
  """
  environ = os.environ if environ is None else environ
  for name in ('AIP_MODEL_DIR', 'AIP_TENSORBOARD_LOG_DIR'):
    path = environ.get(name)
    if not path:
      continue
    try:
      tf.io.gfile.makedirs(path)
    except (tf.errors.OpError, OSError) as e:
      raise ValueError(f'{name}={path} is not a directory this task can '
                       f'write to ({getattr(e, "message", None) or e}); set '
                       f'{name} to a writable location or unset it.') from e


# What marks a folder as a SavedModel: written last, so that a copy cut short
# leaves nothing a loader would take for a whole model.
_MODEL_FILE = 'saved_model.pb'
# The SavedModel parts an earlier model may have left in AIP_MODEL_DIR.
_MODEL_PARTS = (_MODEL_FILE, 'fingerprint.pb', 'keras_metadata.pb',
                'variables', 'assets', 'assets.extra')


def copy_model(export_dir: Optional[str], environ=None) -> Optional[str]:
  """Copies the final SavedModel into AIP_MODEL_DIR; returns where, or None.

  Vertex imports a model from the SavedModel at the root of AIP_MODEL_DIR,
  not from a timestamped folder under it. An earlier model's parts there are
  removed first (its extra variable shards or assets would otherwise be
  served with the new graph), and `saved_model.pb` is copied last.

  Raises:
    tf.errors.OpError: a file could not be copied; AIP_MODEL_DIR then holds
      no saved_model.pb.
  """
  environ = os.environ if environ is None else environ
  target = environ.get('AIP_MODEL_DIR')
  if not target or not export_dir:
    return None
  target = target.rstrip('/')
  _remove_model_parts(target)
  for root, _, files in tf.io.gfile.walk(export_dir):
    relative = os.path.relpath(root, export_dir)
    destination = target if relative == '.' else os.path.join(target,
                                                              relative)
    tf.io.gfile.makedirs(destination)
    for name in files:
      if relative != '.' or name != _MODEL_FILE:
        tf.io.gfile.copy(os.path.join(root, name),
                         os.path.join(destination, name), overwrite=True)
  tf.io.gfile.copy(os.path.join(export_dir, _MODEL_FILE),
                   os.path.join(target, _MODEL_FILE), overwrite=True)
  logging.info('Copied the SavedModel %s to AIP_MODEL_DIR %s.', export_dir,
               target)
  return target


def _remove_model_parts(target: str) -> None:
  for name in _MODEL_PARTS:  # saved_model.pb first.
    path = os.path.join(target, name)
    if tf.io.gfile.isdir(path):
      tf.io.gfile.rmtree(path)
    elif tf.io.gfile.exists(path):
      tf.io.gfile.remove(path)


def tensorboard_dir(environ=None) -> Optional[str]:
  environ = os.environ if environ is None else environ
  return environ.get('AIP_TENSORBOARD_LOG_DIR') or None


class TrainSummaries(tf1.train.SummarySaverHook):
  """Writes the training summaries to AIP_TENSORBOARD_LOG_DIR too."""

  def __init__(self, output_dir: str, save_steps: int):
    super().__init__(save_steps=save_steps, output_dir=output_dir,
                     summary_op=[])  # The graph's summaries: begin().

  def begin(self):
    self._summary_op = tf1.summary.merge_all()
    if self._summary_op is None:
      self._summary_op = []  # Nothing to write; the hook stays quiet.
    super().begin()


class EvalSummaries(tf.estimator.Exporter):
  """Writes every scalar evaluation result to AIP_TENSORBOARD_LOG_DIR/eval."""

  def __init__(self, output_dir: str):
    self._dir = os.path.join(output_dir, 'eval')

  @property
  def name(self) -> str:
    return 'vertex_tensorboard'

  def export(self, estimator, export_path, checkpoint_path,
             eval_result: Dict, is_the_final_export: bool):
    del estimator, export_path, checkpoint_path, is_the_final_export
    step = int(eval_result.get('global_step', 0))
    with tf.Graph().as_default():
      writer = tf1.summary.FileWriterCache.get(self._dir)
      values = [tf1.Summary.Value(tag=key, simple_value=float(value))
                for key, value in sorted(eval_result.items())
                if key != 'global_step' and getattr(value, 'size', 1) == 1]
      writer.add_summary(tf1.Summary(value=values), step)
      writer.flush()
    return None
