"""The sweep in TensorBoard's HParams dashboard.

`write_experiment` writes the experiment (every parameter with its domain,
and the metric) once into the job dir; `write_trial` writes one session per
finished trial into <job-dir>/<trial>/hparams: its parameter values, the
metric as a scalar under hyperparameterMetricTag, and how it ended.
`tensorboard --logdir <job-dir>` then shows the sweep under HPARAMS.
"""

import functools
import os
import threading
import types
from typing import Any, Mapping, Optional

from trainer.sweep import trials as sweep_trials
from trainer.sweep.config import ParamSpec
from trainer.sweep.config import SweepConfig

SESSION_DIR = 'hparams'


_LOAD_LOCK = threading.Lock()


def prepare() -> None:
  """Imports TensorFlow now (in the calling thread) rather than on first use.

  The sweep calls it from its main thread before any trial starts, so the
  import (which takes seconds) neither happens in a trial's thread nor
  delays a trial's results.
  """
  _tf()


def _tf() -> types.SimpleNamespace:
  """TensorFlow and the HParams API, imported on first use.

  TensorFlow takes seconds to import; a sweep with a bad config or job dir
  should fail before that. Several threads may get here at once: the first
  one loads, the others wait for it.
  """
  with _LOAD_LOCK:
    return _load()


@functools.lru_cache(maxsize=None)
def _load() -> types.SimpleNamespace:
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  from tensorboard.plugins.hparams import api as hp
  from tensorboard.plugins.hparams import api_pb2
  from tensorboard.plugins.hparams import summary as hparams_summary
  # The sweep only writes event files; GPU memory is for the trials.
  tf.config.set_visible_devices([], 'GPU')
  return types.SimpleNamespace(
      tf=tf, hp=hp, session_end_pb=hparams_summary.session_end_pb,
      # How a trial's end reads in the dashboard's Status column. The API
      # has no status for a trial stopped early on purpose: UNKNOWN (the
      # value shown is its last report).
      status={sweep_trials.COMPLETE: api_pb2.STATUS_SUCCESS,
              sweep_trials.FAILED: api_pb2.STATUS_FAILURE,
              sweep_trials.PRUNED: api_pb2.STATUS_UNKNOWN})


def _domain(spec: ParamSpec):
  hp = _tf().hp
  if spec.type == 'DOUBLE':
    return hp.RealInterval(float(spec.min_value), float(spec.max_value))
  if spec.type == 'INTEGER':
    return hp.IntInterval(int(spec.min_value), int(spec.max_value))
  if spec.type == 'CATEGORICAL':
    return hp.Discrete(list(spec.categorical_values))
  values = list(spec.discrete_values)
  # One dtype per domain: mixed ints and floats become floats.
  if any(isinstance(v, float) for v in values):
    values = [float(v) for v in values]
  return hp.Discrete(values)


def write_experiment(job_dir: str, config: SweepConfig) -> None:
  """Writes the HParams experiment (domains and metric) into the job dir."""
  tf, hp = _tf().tf, _tf().hp
  params = [hp.HParam(spec.name, _domain(spec)) for spec in config.params]
  goal = 'higher' if config.goal == 'MAXIMIZE' else 'lower'
  metric = hp.Metric(config.metric_tag, display_name=config.metric_tag,
                     description=f'The tuning objective ({goal} is better).')
  writer = tf.summary.create_file_writer(job_dir)
  with writer.as_default():
    hp.hparams_config(hparams=params, metrics=[metric])
  writer.close()


def write_trial(trial_dir: str, trial_id: str, values: Mapping[str, Any],
                metric_tag: str, value: Optional[float], step: Optional[int],
                status: str) -> None:
  """Writes one finished trial's HParams session.

  Args:
    trial_dir: <job-dir>/<trial id>; the session goes to its `hparams`
      subdirectory, so no training summary of the same tag mixes in.
    trial_id: The trial id (the session group's name).
    values: {parameterName: value}.
    metric_tag: hyperparameterMetricTag.
    value: The objective (last reported value), or None if none.
    step: The global step of that value.
    status: How the trial ended (sweep_trials.COMPLETE, FAILED, PRUNED).
  """
  lib = _tf()
  tf = lib.tf
  writer = tf.summary.create_file_writer(os.path.join(trial_dir, SESSION_DIR))
  with writer.as_default():
    lib.hp.hparams(dict(values), trial_id=trial_id)
    if value is not None:
      tf.summary.scalar(metric_tag, value, step=step or 0)
    end = lib.session_end_pb(lib.status[status])
    tf.summary.experimental.write_raw_pb(end.SerializeToString(), step=0)
  writer.close()
