"""The one table of known failures: one line and its exit code, or nothing.

Each case raises in a real process under `faults.handled`, as an entry
point's main does.
"""

import os
import subprocess
import sys

import pytest

from cli_helpers import ROOT

pytestmark = pytest.mark.cli

_RAISE = """
import tensorflow as tf
from trainer import faults, options, preemption
with faults.handled('prog', eval_files='--predict-files'):
  raise {error}
"""


def _raised(error):
  """(exit code, stderr lines) of a process whose work raises `error`."""
  result = subprocess.run(
      [sys.executable, '-c', _RAISE.format(error=error)], cwd=ROOT,
      env={**os.environ, 'PYTHONPATH': ROOT, 'TF_CPP_MIN_LOG_LEVEL': '3'},
      capture_output=True, text=True, timeout=120)
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
