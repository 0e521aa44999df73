"""Reports the tuning metric after every evaluation (see trainer.hptuning).

An Estimator exporter, so it needs TensorFlow; the conventions it follows
(trial ids, the tag, the metric file) are hptuning's, which loads none.
"""

import os
from typing import Any, Dict, Optional

from absl import logging
import tensorflow as tf

from trainer import hptuning


class HypertuneReporter(tf.estimator.Exporter):
  """Reports the tuning metric after every evaluation; exports nothing.

  Estimator calls exporters with each evaluation's results, so this is the
  one place that sees every evaluation, local or in a cluster's evaluator.

  Args:
    metric: Eval metric name to report (a key of the evaluation results).
    summary_tag: Summary tag; CLOUD_ML_HP_METRIC_TAG overrides it.
    report_file: Also write the cloudml-hypertune metric file. By default,
      only when running as a trial or when CLOUD_ML_HP_METRIC_FILE is set,
      so that plain local runs leave no file behind in /tmp.
  """

  def __init__(self, metric: str,
               summary_tag: str = hptuning.DEFAULT_SUMMARY_TAG,
               report_file: Optional[bool] = None):
    self._metric = metric
    self._tag = hptuning.metric_tag(summary_tag)
    trial = hptuning.trial_id()
    if report_file is None:
      report_file = bool(trial or os.environ.get('CLOUD_ML_HP_METRIC_FILE'))
    self._hypertune = None
    if report_file:
      import hypertune  # pylint: disable=g-import-not-at-top
      self._hypertune = hypertune.HyperTune()
      # The library reads only CLOUD_ML_TRIAL_ID; TF_CONFIG's trial counts too.
      self._hypertune.trial_id = trial or 0

  @property
  def name(self) -> str:
    return 'hypertune'

  def export(self, estimator, export_path, checkpoint_path,
             eval_result: Dict[str, Any], is_the_final_export: bool):
    del export_path, is_the_final_export  # Nothing is exported.
    if self._metric not in eval_result:
      raise ValueError(
          f'The tuning metric {self._metric!r} is not among the evaluation '
          f'results {sorted(eval_result)}; set --hypertune-metric to one of '
          'them.')
    value = float(eval_result[self._metric])
    step = int(eval_result.get('global_step', 0))
    _write_summary(estimator.eval_dir(), self._tag, value, step)
    if self._hypertune is not None:
      self._hypertune.report_hyperparameter_tuning_metric(
          hyperparameter_metric_tag=self._tag, metric_value=value,
          global_step=step, checkpoint_path=checkpoint_path or '')
    scalars = ' '.join(
        f'{k}={float(v):.4g}' for k, v in sorted(eval_result.items())
        if k != 'global_step' and getattr(v, 'size', 1) == 1)
    logging.info('evaluated step %d: %s (tuning metric %s, tag %s)', step,
                 scalars, self._metric, self._tag)
    return None


def _write_summary(directory: str, tag: str, value: float, step: int) -> None:
  # The v1 writer (the one Estimator's eval summaries use) needs a graph.
  with tf.Graph().as_default():
    writer = tf.compat.v1.summary.FileWriterCache.get(directory)
    summary = tf.compat.v1.Summary(
        value=[tf.compat.v1.Summary.Value(tag=tag, simple_value=value)])
    writer.add_summary(summary, step)
    writer.flush()
