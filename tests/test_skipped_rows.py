"""--skip-malformed: a split left without rows is refused; skips are counted."""

import pytest

import input_fns
from cli_helpers import write_tabular_csv
from trainer import skipped_rows
from trainer import train

pytestmark = pytest.mark.fast

_BAD_ROWS = ['1,x,red,0', '2,y,blue,1']


def _bad_csv(path):
  path.write_text('x1,x2,colour,label\n' + '\n'.join(_BAD_ROWS) + '\n')
  return str(path)


def _options(train_files, eval_files=()):
  return train.TaskOptions(
      train_files=[train_files], eval_files=list(eval_files),
      label_column='label', n_classes=2, skip_malformed=True,
      categorical_columns={'colour': ['red', 'green', 'blue']},
      hidden_units=[4], train_steps=5)


def test_skipping_every_training_row_is_refused_before_training(tmp_path):
  # It trained zero steps, evaluated zero examples and exported, exit 0.
  bad = _bad_csv(tmp_path / 'bad.csv')
  with pytest.raises(ValueError) as caught:
    train.check(_options(bad))
  assert str(caught.value) == (
      '--skip-malformed skipped all 2 rows of --train-files, leaving nothing '
      f'to train on (the first: {bad}:2: column `x2`: `x` is not a number). '
      'Fix the rows, or check --columns, --categorical-column and '
      '--label-column against the files.')


def test_skipping_every_eval_row_is_refused(tmp_path):
  good = write_tabular_csv(tmp_path / 'good.csv', 10)
  bad = _bad_csv(tmp_path / 'bad.csv')
  with pytest.raises(ValueError, match='skipped all 2 rows of --eval-files, '
                     'leaving nothing to evaluate'):
    train.check(_options(good, [bad]))


def test_the_skipped_rows_are_counted_with_the_first_one(tmp_path):
  path = write_tabular_csv(tmp_path / 'some.csv', 10, extra_lines=_BAD_ROWS)
  data = input_fns.csv_data([path], [path], label_column='label',
                            n_classes=2, skip_malformed=True,
                            categorical_columns={'colour': ['red', 'green',
                                                            'blue']})
  assert skipped_rows.check(data, same_files=True) == (
      'skipped malformed rows: 2 of 12 rows of --train-files (the first: '
      f'{path}:12: column `x2`: `x` is not a number)')
  clean = input_fns.csv_data([path], [path], label_column='label',
                             n_classes=2, skip_malformed=False)
  assert skipped_rows.check(clean, same_files=True) is None
