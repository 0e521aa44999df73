"""`--dry-run` reads a sample of the data; a run that failed before its
first step does not block the fixed rerun."""

import os

import pytest

import cli_helpers

pytestmark = pytest.mark.cli

_FLAGS = ('--n-classes=2', '--model=linear', '--train-steps=2',
          '--train-batch-size=8', '--eval-batch-size=20',
          '--save-checkpoints-steps=2')
_COLOUR = '--categorical-column=colour=red|green|blue'


def _last_line(result):
  return result.stderr.strip().splitlines()[-1]


def test_dry_run_parses_the_training_and_the_eval_files(tmp_path):
  good = cli_helpers.write_tabular_csv(tmp_path / 'good.csv', rows=40)
  bad = cli_helpers.write_tabular_csv(tmp_path / 'bad.csv', rows=40,
                                      extra_lines=['0.1,0.2,red,yes'])
  job = f'--job-dir={tmp_path / "job"}'
  # `colour` not declared categorical: its first value is no number.
  undeclared = cli_helpers.run_module(
      'trainer.task', job, f'--train-files={good}', '--dry-run', *_FLAGS,
      check=False)
  assert undeclared.returncode == 1, undeclared.stderr[-2000:]
  assert 'good.csv:2: column `colour`' in _last_line(undeclared)
  # No --eval-files: CSV evaluation reads the training rows, and says so.
  assert 'evaluating on the training files' in undeclared.stderr
  # The eval files are read too: a bad label on their last row.
  bad_eval = cli_helpers.run_module(
      'trainer.task', job, f'--train-files={good}', f'--eval-files={bad}',
      _COLOUR, '--dry-run', *_FLAGS, check=False)
  assert bad_eval.returncode == 1, bad_eval.stderr[-2000:]
  assert 'bad.csv:42' in _last_line(bad_eval)
  assert not os.path.exists(tmp_path / 'job')  # A dry run writes nothing.


def test_a_run_that_failed_before_its_first_step_does_not_block_the_rerun(
    tmp_path):
  data = cli_helpers.write_tabular_csv(tmp_path / 'data.csv', rows=40)
  job = f'--job-dir={tmp_path / "job"}'
  failed = cli_helpers.run_module('trainer.task', job, f'--train-files={data}',
                                  *_FLAGS, check=False)
  assert failed.returncode == 1 and 'colour' in _last_line(failed)
  # The fix changes the model's inputs (an architecture option).
  fixed = cli_helpers.run_module('trainer.task', job, f'--train-files={data}',
                                 _COLOUR, *_FLAGS)
  assert cli_helpers.eval_line(fixed)['global_step'] == '2'
