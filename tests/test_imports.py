"""Importing the trainer changes nothing in the importing process.

Each check runs in a fresh interpreter: this test process has long imported
TensorFlow.
"""

import json
import os
import subprocess
import sys

import pytest

from cli_helpers import ROOT

# Prints what an import might change: argv, the TensorFlow variables and
# whether TensorFlow got loaded.
_PROBE = """
import os, sys, json
import {module}
print(json.dumps({{
    'argv': sys.argv[1:],
    'env': {{k: os.environ.get(k) for k in
            ('TF_ENABLE_ONEDNN_OPTS', 'TF_CPP_MIN_LOG_LEVEL')}},
    'tensorflow': 'tensorflow' in sys.modules}}))
"""


def _imported(module):
  """What importing `module` did, in a fresh interpreter."""
  env = {k: v for k, v in os.environ.items()
         if k not in ('TF_ENABLE_ONEDNN_OPTS', 'TF_CPP_MIN_LOG_LEVEL')}
  env['PYTHONPATH'] = ROOT
  result = subprocess.run(
      [sys.executable, '-c', _PROBE.format(module=module),
       '--verbosity=error', '--cpu-towers=4'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
      check=True)
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.cli
@pytest.mark.parametrize('module', ['trainer', 'trainer.sweep',
                                    'trainer.cluster', 'trainer.sweep.main',
                                    'trainer.cluster.main'])
def test_an_import_changes_nothing_and_loads_no_tensorflow(module):
  assert _imported(module) == {
      'argv': ['--verbosity=error', '--cpu-towers=4'],
      'env': {'TF_ENABLE_ONEDNN_OPTS': None, 'TF_CPP_MIN_LOG_LEVEL': None},
      'tensorflow': False}


@pytest.mark.cli
def test_the_public_names_load_the_library_on_first_use():
  result = subprocess.run(
      [sys.executable, '-c',
       'import trainer, estimator_towers; '
       'assert trainer.replicate_model_fn is '
       'estimator_towers.replicate_model_fn; '
       'assert trainer.make_run_config is estimator_towers.make_run_config; '
       'assert trainer.TowerContext is estimator_towers.TowerContext; '
       'assert trainer.whole_batch is estimator_towers.whole_batch; '
       'assert callable(trainer.task_slice) and '
       'callable(trainer.tower_context); print("same")'],
      cwd=ROOT, env={**os.environ, 'PYTHONPATH': ROOT,
                     'TF_CPP_MIN_LOG_LEVEL': '3'},
      capture_output=True, text=True, timeout=120, check=True)
  assert result.stdout.strip().splitlines()[-1] == 'same'


@pytest.mark.fast
def test_an_unknown_name_is_an_attribute_error():
  import trainer  # pylint: disable=g-import-not-at-top
  with pytest.raises(AttributeError, match='no_such_name'):
    trainer.no_such_name  # pylint: disable=pointless-statement


@pytest.mark.cli
def test_a_bad_task_flag_is_refused_before_tensorflow_loads():
  # -X importtime lists every module the process imported, on stderr.
  result = subprocess.run(
      [sys.executable, '-X', 'importtime', '-m', 'trainer.task',
       '--train-steps=0'],
      cwd=ROOT, env={**os.environ, 'PYTHONPATH': ROOT}, capture_output=True,
      text=True, timeout=120, check=False)
  assert result.returncode == 2
  assert 'task: error: flag --train-steps=0' in result.stderr
  imported = [line.rpartition('|')[2].strip()
              for line in result.stderr.splitlines()
              if line.startswith('import time:')]
  assert 'trainer.options' in imported  # The listing is there...
  assert 'tensorflow' not in imported  # ...without TensorFlow.
