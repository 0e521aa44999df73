"""The command-line toolkit: flag spellings, -- passthrough, exit codes."""

import dataclasses

from absl import flags
import pytest

from cli_helpers import run_module
from trainer import cli
from trainer import options

options.define_flags()
FLAGS = flags.FLAGS


@pytest.fixture
def parsed():
  """Parses a task command line into the global flags, then resets them."""
  def parse(*args, passthrough=False):
    return cli.parse(['task', *args], 'task', passthrough=passthrough)
  yield parse
  FLAGS.unparse_flags()


@pytest.mark.fast
def test_underscore_spellings_are_aliases(parsed):
  parsed('--job_dir=/j', '--train_files', 'a.csv', '--noallow_growth',
         '--verbosity=1')
  assert FLAGS['job-dir'].value == '/j'
  assert FLAGS['train-files'].value == ['a.csv']
  assert FLAGS['allow-growth'].value is False


@pytest.mark.fast
def test_no_dash_negates_boolean_flags(parsed):
  parsed('--no-allow-growth', '--no-skip_malformed', '--export-best')
  assert FLAGS['allow-growth'].value is False
  assert FLAGS['skip-malformed'].value is False
  assert FLAGS['export-best'].value is True


@pytest.mark.fast
def test_no_dash_of_a_non_boolean_is_unknown(parsed):
  with pytest.raises(SystemExit) as stopped:
    parsed('--no-train-steps')
  assert stopped.value.code == 2


@pytest.mark.fast
@pytest.mark.parametrize('fraction', ['0', '1.5'])
def test_validators_refuse_values_the_bounds_cannot_say(parsed, fraction,
                                                        capsys):
  with pytest.raises(SystemExit) as stopped:
    parsed(f'--gpu-memory-fraction={fraction}')
  assert stopped.value.code == 2
  assert 'must be in (0, 1]' in capsys.readouterr().err


@pytest.mark.fast
def test_micro_batches_flag_is_a_positive_int(parsed, capsys):
  parsed('--micro-batches=4')
  assert options.from_flags().micro_batches == 4
  FLAGS.unparse_flags()
  with pytest.raises(SystemExit) as stopped:
    parsed('--micro-batches=0')
  assert stopped.value.code == 2
  assert 'micro-batches' in capsys.readouterr().err


@pytest.mark.fast
def test_args_after_double_dash_are_passed_through_or_refused(parsed):
  assert parsed('--job-dir=/j', '--', '--job_dir=kept', passthrough=True) == [
      'task', '--job_dir=kept']
  with pytest.raises(SystemExit) as stopped:
    parsed('--', '--x')
  assert stopped.value.code == 2


@pytest.mark.fast
def test_split_multi_accepts_repeats_commas_and_spaces():
  assert cli.split_multi(['a.csv,b.csv', 'c.csv d.csv', '']) == [
      'a.csv', 'b.csv', 'c.csv', 'd.csv']


@pytest.mark.fast
def test_a_file_name_with_a_space_stays_one_name(tmp_path):
  # It was split at the space into two globs that match nothing.
  spaced = tmp_path / 'my data.csv'
  spaced.write_text('x,label\n1,0\n')
  other = str(tmp_path / 'other.csv')
  assert cli.split_multi([str(spaced)]) == [str(spaced)]
  assert cli.split_multi([f'{spaced},{other}']) == [str(spaced), other]
  assert cli.split_multi([f'{spaced}, {other}']) == [str(spaced), other]
  assert cli.split_multi([str(spaced), other]) == [str(spaced), other]
  assert cli.split_multi([str(tmp_path / 'my d*.csv')]) == [
      str(tmp_path / 'my d*.csv')]
  # Names without commas that match nothing as a whole: the census style.
  assert cli.split_multi([f'{tmp_path}/a.csv {other}']) == [
      f'{tmp_path}/a.csv', other]


@pytest.mark.fast
def test_every_option_has_exactly_one_flag_with_its_default(parsed):
  parsed()
  defaults = options.from_flags()
  assert defaults == options.TaskOptions()
  for field in dataclasses.fields(options.TaskOptions):
    assert options.flag_name(field) in FLAGS, field.name


@pytest.mark.fast
def test_flags_become_options(parsed):
  parsed('--categorical-column=colour=red|blue', '--image-size=8,16',
         '--hidden-units=4,2', '--export-format=CSV', '--gpu-ids=0,2',
         '--random-ops=one_device')
  got = options.from_flags()
  assert got.random_ops == 'one_device'
  assert got.categorical_columns == {'colour': ['red', 'blue']}
  assert got.image_size == (8, 16)
  assert got.hidden_units == [4, 2]
  assert got.export_format == 'csv'
  assert got.gpu_ids == [0, 2]
  assert options.model_params(got)['hidden_units'] == [4, 2]


@pytest.mark.cli
@pytest.mark.parametrize('module', ['trainer.task', 'trainer.predict',
                                    'trainer.cluster'])
def test_every_entry_point_exits_2_on_a_bad_flag(module):
  result = run_module(module, '--job-dir=/tmp/x', '--no-such-flag',
                      check=False, timeout=120)
  assert result.returncode == 2
  name = module.split('.')[1]
  assert result.stderr.strip().splitlines()[-2].startswith(f'{name}: error: ')


@pytest.mark.cli
def test_every_entry_point_exits_0_after_help():
  for module in ('trainer.task', 'trainer.predict', 'trainer.cluster'):
    assert run_module(module, '--help', check=False,
                      timeout=120).returncode == 0, module


@pytest.mark.fast
@pytest.mark.parametrize('flag', ['--categorical-column=c=x|y',
                                  '--categorical-column=c=hash:4'])
def test_a_column_given_twice_is_refused_not_overwritten(parsed, flag):
  parsed('--categorical-column=c=a|b', flag)
  with pytest.raises(cli.UsageError, match='c=.*given twice'):
    options.from_flags()


@pytest.mark.fast
def test_a_column_default_given_twice_is_refused(parsed):
  parsed('--column-default=c=0', '--column_default=c=1')
  with pytest.raises(cli.UsageError, match='c=.*given twice'):
    options.from_flags()


@pytest.mark.fast
@pytest.mark.parametrize('replaced', ['--first-layer-size=8',
                                      '--num_layers=3', '--scale-factor=1'])
def test_hidden_units_refuses_the_layer_flags_it_replaces(parsed, replaced):
  parsed('--hidden_units=4,2', replaced)
  name = replaced[2:].partition('=')[0].replace('_', '-')
  with pytest.raises(cli.UsageError, match=f'--hidden-units.*--{name}'):
    options.from_flags()


@pytest.mark.fast
def test_hidden_units_or_the_layer_flags_alone_are_used(parsed):
  parsed('--first-layer-size=8', '--num-layers=3')
  got = options.model_params(options.from_flags())
  assert (got['first_layer_size'], got['num_layers']) == (8, 3)
  assert 'hidden_units' not in got


@pytest.mark.cli
def test_dash_h_asks_for_help_unless_it_is_a_value(parsed):
  result = run_module('trainer.task', '--allow-growth', '-h', check=False,
                      timeout=120)
  assert result.returncode == 0
  assert '--train-steps' in result.stdout
  parsed('--label-column', '-h')
  assert FLAGS['label-column'].value == '-h'


@pytest.mark.fast
def test_model_errors_name_the_flag_not_the_params_key():
  assert options.in_flag_terms(
      "params['resnet_depth']=21; use 20. params['learning_rate'] too.") == (
          '--resnet-depth=21; use 20. --learning-rate too.')
  # Not an option of the task: left as the model_fn spelt it.
  assert options.in_flag_terms("params['mine']=1") == "params['mine']=1"
