"""Flag spellings of the trainer's command line."""

from trainer import cli

cli.define_task_flags()


def test_underscore_spellings_become_hyphenated():
  argv = ['task', '--job_dir=/j', '--train_files', 'a.csv', '--nosave',
          '--noallow_growth', '--verbosity=1', '--', '--job_dir=kept']
  assert cli.normalize_argv(argv) == [
      'task', '--job-dir=/j', '--train-files', 'a.csv', '--nosave',
      '--noallow-growth', '--verbosity=1', '--', '--job_dir=kept']


def test_split_multi_accepts_repeats_and_commas():
  assert cli.split_multi(['a.csv,b.csv', 'c.csv', '']) == [
      'a.csv', 'b.csv', 'c.csv']


def test_no_dash_negates_boolean_flags_only():
  argv = ['task', '--no-allow-growth', '--no-skip_malformed', '--no-such']
  assert cli.normalize_argv(argv) == [
      'task', '--noallow-growth', '--noskip-malformed', '--no-such']
