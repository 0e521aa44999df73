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


def copy_model(export_dir: Optional[str], environ=None) -> Optional[str]:
  """Copies the final SavedModel into AIP_MODEL_DIR; returns where, or None.

  Vertex imports a model from the SavedModel at the root of AIP_MODEL_DIR,
  not from a timestamped folder under it.
  """
  environ = os.environ if environ is None else environ
  target = environ.get('AIP_MODEL_DIR')
  if not target or not export_dir:
    return None
  target = target.rstrip('/')
  for root, _, files in tf.io.gfile.walk(export_dir):
    relative = os.path.relpath(root, export_dir)
    destination = target if relative == '.' else os.path.join(target,
                                                              relative)
    tf.io.gfile.makedirs(destination)
    for name in files:
      tf.io.gfile.copy(os.path.join(root, name),
                       os.path.join(destination, name), overwrite=True)
  logging.info('Copied the SavedModel %s to AIP_MODEL_DIR %s.', export_dir,
               target)
  return target


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
