"""What a census-sample user types: space-separated files, its flags, and a
wide & deep model."""

import json
import os
import subprocess
import sys

import pytest

import cli_helpers

pytestmark = pytest.mark.cli


def test_wide_deep_trains_on_space_separated_csv_files(tmp_path):
  first = cli_helpers.write_tabular_csv(tmp_path / 'a.csv', rows=80)
  second = cli_helpers.write_tabular_csv(tmp_path / 'b.csv', rows=80, seed=1)
  result = cli_helpers.run_module(
      'trainer.task', f'--job-dir={tmp_path / "job"}',
      # As the census sample takes them: one flag, then each file.
      '--train-files', first, second, '--eval-files', second,
      '--label-column=label', '--categorical-column=colour=red|green|blue',
      '--n-classes=2', '--model=wide_deep', '--embedding-size=4',
      '--hidden-units=8', '--train-steps=3', '--train-batch-size=16',
      '--save-checkpoints-steps=3', '--cpu-towers=2')
  metrics = cli_helpers.eval_line(result)
  assert metrics['global_step'] == '3'
  assert os.path.isdir(result.stdout.split('export=')[-1].strip())
  with open(tmp_path / 'job' / 'trainer_config.json') as f:
    saved = json.load(f)
  assert saved['train_files'] == [first, second]
  assert saved['embedding_size'] == 4


def test_census_flags_that_do_nothing_here_point_to_what_does():
  """--eval-delay-secs and --min-eval-frequency parse, then are refused;
  --embedding-size too, but for --model=wide_deep."""
  commands = [['--eval-delay-secs=10'], ['--min-eval-frequency', '100'],
              ['--embedding-size=8'],
              ['--embedding-size=8', '--model=wide_deep']]
  result = subprocess.run(
      [sys.executable, os.path.join('tests', 'docs_flag_check.py'),
       'trainer.task'], input=json.dumps(commands), cwd=cli_helpers.ROOT,
      capture_output=True, text=True, timeout=120,
      env={**os.environ, 'PYTHONPATH': cli_helpers.ROOT,
           'TF_CPP_MIN_LOG_LEVEL': '3'})
  assert result.returncode == 0, result.stderr[-2000:]
  errors = json.loads(result.stdout.strip().splitlines()[-1])
  for command, error in zip(commands[:2], errors):
    assert error and '\n' not in error, (command, error)
    assert command[0].split('=')[0] in error
    assert '--save-checkpoints-steps' in error
  # --embedding-size only where a model reads it.
  assert '--model=dnn would ignore it' in errors[2]
  assert errors[3] is None
