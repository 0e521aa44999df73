"""The one table of known failures: one line and its exit code, or nothing.

Each case raises in a real process under `faults.handled`, as an entry
point's main does.
"""

import json
import os
import subprocess
import sys

import pytest

from cli_helpers import ROOT, run_module

pytestmark = pytest.mark.cli


def _raised(error, tf_config=None):
  """(exit code, stderr lines) of a process whose work raises `error`."""
  env = {'TF_CONFIG': json.dumps(tf_config)} if tf_config else None
  result = run_module('tests.raise_handled', error, env=env, check=False,
                      timeout=120)
  return result.returncode, result.stderr.strip().splitlines()


@pytest.mark.parametrize('error, code, line', [
    ("options.OptionError('--x is bad.')", 2, 'prog: error: --x is bad.'),
    ("ValueError('eval_files=[] is empty.')", 1,
     'prog: error: --predict-files=[] is empty.'),
    ("preemption.Preempted('Saved step 3.', 15)", 143,
     'prog: stopped: Saved step 3. Re-run the same command to resume.'),
    ("tf.compat.v1.train.NanLossDuringTrainingError()", 1,
     'prog: error: the loss became nan during training; nothing more was '
     'saved or exported. Look for nan/inf in the data (allowed only with '
     '--allow-non-finite) or lower --learning-rate.'),
])
def test_a_known_failure_is_one_line_and_its_exit_code(error, code, line):
  exit_code, lines = _raised(error)
  assert (exit_code, lines[-1]) == (code, line)
  assert not any('Traceback' in l for l in lines)


@pytest.mark.parametrize('error', [
    "RuntimeError('not in the table')",
    # In the table, but no data check: TensorFlow's own error.
    "tf.errors.InvalidArgumentError(None, None, 'not in the table')",
])
def test_any_other_failure_keeps_its_traceback(error):
  code, lines = _raised(error)
  assert code == 1
  assert lines[0] == 'Traceback (most recent call last):'
  assert lines[-1].endswith('not in the table')


def test_a_stopped_synchronous_task_says_to_restart_every_task():
  # Re-running one task cannot resume: its peers' collectives broke off.
  tf_config = {'cluster': {'chief': ['127.0.0.1:1'],
                           'worker': ['127.0.0.1:2']},
               'task': {'type': 'worker', 'index': 0}}
  code, lines = _raised("preemption.Preempted('Saved step 3.', 15)",
                        tf_config)
  assert (code, lines[-1]) == (
      143, "prog: stopped: Saved step 3. This task trained in a synchronous "
      "cluster: restart every task; they resume from the chief's last "
      'checkpoint.')



def test_a_synchronous_cluster_counted_apart_is_one_line():
  # The group leader's InternalError had no row: the line sync_errors
  # builds for it never reached the command line (a ~180-line traceback).
  tf_config = {'cluster': {'chief': ['127.0.0.1:1'],
                           'worker': ['127.0.0.1:2']},
               'task': {'type': 'worker', 'index': 0}}
  result = subprocess.run(
      [sys.executable, '-m', 'tests.raise_handled',
       "tf.errors.InternalError(None, None, 'Device /job:worker/replica:0/"
       "task:0/device:CPU:0 is joining a group with size2, but that group "
       "has size 3 (group_key=1)')"], cwd=ROOT, capture_output=True,
      text=True, timeout=120, check=False,
      env={**os.environ, 'PYTHONPATH': ROOT,
           'TF_CONFIG': json.dumps(tf_config)})
  code, lines = result.returncode, result.stderr.strip().splitlines()
  assert code == 1
  assert lines[-1].startswith('prog: error: worker:0: the tasks of the '
                              'synchronous cluster count themselves apart')
  assert not any('Traceback' in l for l in lines)
