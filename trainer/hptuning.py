"""Hyperparameter-tuning conventions of Cloud trainer packages.

A trial learns its id from `TF_CONFIG['task']['trial']` (what AI Platform
sets) or `CLOUD_ML_TRIAL_ID`, writes under `<job-dir>/<trial-id>`, and after
every evaluation reports the tuning metric twice: as a summary (what
TensorBoard and the HParams dashboard read) and through the cloudml-hypertune
library's metric file (what the tuning service reads;
`CLOUD_ML_HP_METRIC_FILE` says where, `CLOUD_ML_HP_METRIC_TAG` what tag).
The reports are hypertune_reporter's; this module loads no TensorFlow, so
that trainer.options can take its default tag before a command line loads
TensorFlow.
"""

import os
import re
from typing import Optional, Sequence

from trainer import cluster_config

DEFAULT_SUMMARY_TAG = 'training/hptuning/metric'
_UNSAFE = re.compile(r'[^A-Za-z0-9_.-]+')


def trial_id(environ=None) -> Optional[str]:
  """The trial id of this process, sanitised, or None outside a sweep.

  Raises:
    ValueError: TF_CONFIG is set but is not a JSON object.
  """
  environ = os.environ if environ is None else environ
  tf_config = cluster_config.load_tf_config(environ) or {}
  raw = (tf_config.get('task') or {}).get('trial')
  if raw in (None, '') and environ.get('CLOUD_ML_TRIAL_ID'):
    raw = environ['CLOUD_ML_TRIAL_ID']
  if raw in (None, ''):
    return None
  return sanitize_trial_id(str(raw))


def sanitize_trial_id(raw: str) -> str:
  """A trial id safe as one directory name: it cannot climb out of job-dir.

  Anything but letters, digits, '.', '_' and '-' becomes '_'; leading dots
  are dropped (so '..' cannot name a parent), and the result is at most 64
  characters.
  """
  cleaned = _UNSAFE.sub('_', raw).lstrip('.')[:64]
  return cleaned or 'trial'


def trial_dir(job_dir: str, trial: Optional[str]) -> str:
  """Where a trial writes: job_dir itself outside a sweep."""
  return os.path.join(job_dir, trial) if trial else job_dir


def metric_tag(summary_tag: str = DEFAULT_SUMMARY_TAG) -> str:
  """The tag to report under: CLOUD_ML_HP_METRIC_TAG wins when set."""
  return os.environ.get('CLOUD_ML_HP_METRIC_TAG') or summary_tag


def tuning_metric(flag: Optional[str], reported: Sequence[str],
                  model: str) -> str:
  """The evaluation result a run reports for tuning.

  `--hypertune-metric` when given. Otherwise the metric CLOUD_ML_HP_METRIC_TAG
  names: a tuner told to minimise `loss` must get the loss, not the accuracy
  under the tag `loss`. With no tag set (or the trainer's own summary tag),
  accuracy.

  Args:
    flag: --hypertune-metric, or None.
    reported: The evaluation results of the model.
    model: --model, for the message.

  Returns:
    One of `reported`.

  Raises:
    ValueError: the flag, or the tag without the flag, names no result of
      the model.
  """
  listed = ', '.join(sorted(reported))
  if flag:
    if flag not in reported:
      raise ValueError(f'--hypertune-metric={flag} is not an evaluation '
                       f'result of --model={model}; it reports {listed}.')
    return flag
  tag = os.environ.get('CLOUD_ML_HP_METRIC_TAG')
  if not tag or tag == DEFAULT_SUMMARY_TAG:
    metric = 'accuracy'
  elif tag in reported:
    return tag
  else:
    raise ValueError(
        f'CLOUD_ML_HP_METRIC_TAG={tag} (hyperparameterMetricTag) is not an '
        f'evaluation result of --model={model}, which reports {listed}; set '
        'the tag to one of them, or pass --hypertune-metric=<one of them> to '
        f'report it under the tag {tag}.')
  if metric not in reported:
    raise ValueError(f'--model={model} does not report {metric}, the default '
                     f'tuning metric; pass --hypertune-metric (it reports '
                     f'{listed}).')
  return metric


def goal_for(metric: str) -> str:
  """MINIMIZE for losses and errors, MAXIMIZE otherwise."""
  return 'MINIMIZE' if re.search(r'loss|error', metric) else 'MAXIMIZE'


def check_metric_file() -> None:
  """Fails early when CLOUD_ML_HP_METRIC_FILE cannot be written.

  The file is written after the first evaluation; finding out then would
  throw away the training before it.

  Raises:
    ValueError: its directory cannot be created or the file opened.
  """
  path = os.environ.get('CLOUD_ML_HP_METRIC_FILE')
  if not path:
    return
  existed = os.path.exists(path)
  try:
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    with open(path, 'a', encoding='utf-8'):
      pass
  except OSError as e:
    raise ValueError(
        f'CLOUD_ML_HP_METRIC_FILE={path} cannot be written ({e.strerror}); '
        'point it at a writable file or unset it.') from e
  if not existed:
    os.remove(path)
