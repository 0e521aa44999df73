"""`--column-default` for numeric, integer and string CSV columns, end to end.

docs/quickstart.md §2 passes `--column-default=age=0`; a flag's value is
text, so the trainer converts it by the column's type.
"""

import csv

import pytest

import cli_helpers

pytestmark = pytest.mark.cli


def _census_like(path):
  """Rows with empty cells in a float, an integer and a string column."""
  with open(path, 'w', newline='') as f:
    out = csv.writer(f)
    out.writerow(['hours', 'age', 'sex', 'label'])
    for i in range(48):
      empty = i % 4  # One row in four has one empty cell, in turn.
      hours = '' if empty == 1 else f'{(i % 7) * 0.5:.1f}'
      age = '' if empty == 2 else str(20 + i % 30)
      sex = '' if empty == 3 else ('Female', 'Male')[i % 2]
      out.writerow([hours, age, sex, i % 2])
  return str(path)


_FLAGS = ('--categorical-column=sex=Female|Male', '--label-column=label',
          '--n-classes=2', '--model=linear', '--train-steps=2',
          '--train-batch-size=16', '--eval-batch-size=48',
          '--save-checkpoints-steps=2')


def test_numeric_int_and_string_defaults_train_every_row(tmp_path):
  data = _census_like(tmp_path / 'census.csv')
  result = cli_helpers.run_module(
      'trainer.task', f'--job-dir={tmp_path / "job"}', f'--train-files={data}',
      '--column-default=hours=1.5', '--column-default=age=0',
      '--column-default=sex=Female', *_FLAGS)
  # Every row was read: none was skipped, none failed.
  assert 'skipped' not in result.stdout
  assert cli_helpers.eval_line(result)['global_step'] == '2'


def test_a_numeric_column_default_that_is_no_number_is_one_line(tmp_path):
  data = _census_like(tmp_path / 'census.csv')
  result = cli_helpers.run_module(
      'trainer.task', f'--job-dir={tmp_path / "job"}', f'--train-files={data}',
      '--column-default=age=young', '--dry-run', *_FLAGS, check=False)
  assert result.returncode == 2
  assert 'Traceback' not in result.stderr, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert '--column-default=age=young' in last and 'number' in last, last


def test_an_empty_cell_without_default_names_the_flag_to_pass(tmp_path):
  data = _census_like(tmp_path / 'census.csv')
  result = cli_helpers.run_module(
      'trainer.task', f'--job-dir={tmp_path / "job"}', f'--train-files={data}',
      '--column-default=sex=Female', '--column-default=age=0', *_FLAGS,
      check=False)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert '`hours` is empty' in last and '--column-default=hours=VALUE' in last
