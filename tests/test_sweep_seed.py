"""`trainer.sweep --seed` draws the same parameters with parallel trials.

Optuna reseeds its sampler in each worker thread when trials run in
parallel, so the seed alone did not fix the draws. The stand-in trainer
below reports at once after a random pause, so the trials finish (and the
threads ask for new ones) in a different order each run.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import optuna

from cli_helpers import ROOT
from trainer.sweep import study as sweep_study

pytestmark = pytest.mark.cli

_TRAINER = '''\
import json, os, random, sys, time
import hypertune
args = dict(a[2:].split('=', 1) for a in sys.argv[1:] if '=' in a)
time.sleep(random.random() * 0.3)  # Unseeded: the finishing order varies.
hypertune.HyperTune().report_hyperparameter_tuning_metric(
    hyperparameter_metric_tag=os.environ['CLOUD_ML_HP_METRIC_TAG'],
    metric_value=float(args['x']), global_step=1)
'''


_PARAMS = {
    'RANDOM_SEARCH': """
          - parameterName: x
            type: DOUBLE
            minValue: 1
            maxValue: 2
          - parameterName: units
            type: INTEGER
            minValue: 1
            maxValue: 1000
            scaleType: UNIT_LOG_SCALE""",
}


def _drawn(tmp_path, name, algorithm):
  """{trial number: params} of a seeded sweep of 6 trials, 2 at a time."""
  config = tmp_path / f'{name}.yaml'
  config.write_text(textwrap.dedent(f'''\
      hyperparameters:
        goal: MINIMIZE
        hyperparameterMetricTag: score
        maxTrials: 6
        maxParallelTrials: 2
        algorithm: {algorithm}
        params:''') + _PARAMS[algorithm] + '\n')
  job_dir = tmp_path / name
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([ROOT, str(tmp_path)])}
  env.pop('TF_CONFIG', None)
  result = subprocess.run(
      [sys.executable, '-m', 'trainer.sweep', f'--config={config}',
       f'--job-dir={job_dir}', '--module-name=seed_trainer', '--seed=11',
       '--poll-secs=0.1'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=120, stdin=subprocess.DEVNULL)
  assert result.returncode == 0, result.stderr[-3000:]
  storage = optuna.storages.RDBStorage(sweep_study.storage_url(str(job_dir)),
                                       skip_table_creation=True)
  trials = optuna.load_study(study_name='sweep', storage=storage).get_trials()
  return {t.number: t.params for t in trials}


def test_a_seeded_random_sweep_with_parallel_trials_draws_the_same_values(
    tmp_path):
  (tmp_path / 'seed_trainer.py').write_text(_TRAINER)
  first = _drawn(tmp_path, 'first', 'RANDOM_SEARCH')
  second = _drawn(tmp_path, 'second', 'RANDOM_SEARCH')
  assert len(first) == 6
  assert first == second
