"""What a person sees: a start line, progress, evaluations, a final line."""

import os
import subprocess
import sys

import pytest

from cli_helpers import ROOT

pytestmark = pytest.mark.cli


def _task(tmp_path, *args):
  env = {k: v for k, v in os.environ.items()
         if k not in ('TF_CPP_MIN_LOG_LEVEL', 'TF_CONFIG')}
  env['PYTHONPATH'] = ROOT
  result = subprocess.run(
      [sys.executable, '-m', 'trainer.task', f'--job-dir={tmp_path / "job"}',
       '--train-steps=200', '--save-checkpoints-steps=200', *args],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
      stdin=subprocess.DEVNULL)
  assert result.returncode == 0, result.stderr[-3000:]
  return [line for line in (result.stderr + result.stdout).splitlines()
          if line.strip()]


def test_default_output_is_a_few_readable_lines(tmp_path):
  lines = _task(tmp_path)
  text = '\n'.join(lines)
  assert len(lines) <= 12, text
  for noise in ('deprecat', 'Using config', 'Unable to register', 'cuda',
                'Calling model_fn'):
    assert noise.lower() not in text.lower(), text
  assert 'Training dnn on 1 tower(s) (CPU)' in lines[0] or any(
      'Training dnn on' in line for line in lines[:3]), text
  assert any('step 100: loss=' in line and 'ETA' in line for line in lines)
  assert any('evaluated step 200: accuracy=' in line for line in lines)
  assert lines[-1].startswith('eval: ')


@pytest.mark.parametrize('verbosity', ['INFO', '0'])
def test_verbosity_names_and_numbers_bring_tensorflow_logs_back(tmp_path,
                                                                verbosity):
  lines = _task(tmp_path, f'--verbosity={verbosity}')
  assert any('Calling model_fn' in line for line in lines)


def test_verbosity_error_leaves_only_the_final_line(tmp_path):
  lines = _task(tmp_path, '--verbosity=ERROR')
  assert len(lines) == 1 and lines[0].startswith('eval: '), lines
