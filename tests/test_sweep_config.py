"""Parsing and checking hptuning_config.yaml (trainer.sweep.config)."""

import copy
import os
import textwrap

import pytest

from trainer.sweep import config as sweep_config

pytestmark = pytest.mark.fast


def _block(**overrides):
  """A valid hyperparameters block with some fields replaced or removed."""
  block = {
      'goal': 'MAXIMIZE',
      'hyperparameterMetricTag': 'accuracy',
      'maxTrials': 8,
      'maxParallelTrials': 2,
      'params': [
          {'parameterName': 'learning-rate', 'type': 'DOUBLE',
           'minValue': 0.0001, 'maxValue': 0.1, 'scaleType': 'UNIT_LOG_SCALE'},
          {'parameterName': 'num-layers', 'type': 'INTEGER', 'minValue': 1,
           'maxValue': 3},
      ],
  }
  for key, value in overrides.items():
    if value is None:
      block.pop(key, None)
    else:
      block[key] = value
  return block


def _with_param(index, **fields):
  block = _block()
  param = copy.deepcopy(block['params'][index])
  for key, value in fields.items():
    if value is None:
      param.pop(key, None)
    else:
      param[key] = value
  block['params'][index] = param
  return block


def test_full_file_and_bare_block_read_the_same(tmp_path):
  body = textwrap.dedent("""\
      goal: MINIMIZE
      hyperparameterMetricTag: loss
      maxTrials: 6
      params:
        - parameterName: optimizer
          type: CATEGORICAL
          categoricalValues: [sgd, adam]
        - parameterName: batch
          type: DISCRETE
          discreteValues: [16, 32, 64]
        - parameterName: learning-rate
          type: DOUBLE
          minValue: 1e-4
          maxValue: 0.5
          scaleType: UNIT_REVERSE_LOG_SCALE
      """)
  full = tmp_path / 'full.yaml'
  full.write_text('trainingInput:\n  hyperparameters:\n' +
                  textwrap.indent(body, '    '))
  bare = tmp_path / 'bare.yaml'
  bare.write_text('hyperparameters:\n' + textwrap.indent(body, '  '))
  config = sweep_config.load(str(full))
  assert config == sweep_config.load(str(bare))
  assert config.goal == 'MINIMIZE' and config.metric_tag == 'loss'
  # Cloud's defaults.
  assert config.max_parallel_trials == 1
  assert config.algorithm == 'ALGORITHM_UNSPECIFIED'
  assert config.early_stopping is False
  assert config.failure_limit == 1  # max(1, 6 // 4)
  batch = config.params[1]
  assert batch.discrete_values == (16, 32, 64)
  assert all(isinstance(v, int) for v in batch.discrete_values)
  # YAML reads 1e-4 as a string; it is still a number.
  assert config.params[2].min_value == pytest.approx(1e-4)


def test_explicit_max_failed_trials_and_grid_budget():
  config = sweep_config.parse(_block(
      algorithm='GRID_SEARCH', maxTrials=20, maxFailedTrials=3,
      params=[{'parameterName': 'lr', 'type': 'DISCRETE',
               'discreteValues': [0.1, 0.2]},
              {'parameterName': 'layers', 'type': 'INTEGER',
               'minValue': 1, 'maxValue': 3}]))
  assert config.failure_limit == 3
  assert config.grid_size == 6
  assert config.trial_budget == 6  # The grid is exhausted before maxTrials.
  assert config.params[1].grid_values() == [1, 2, 3]


def test_config_round_trips_through_to_dict():
  config = sweep_config.parse(_block())
  assert sweep_config.parse(config.to_dict()) == config


@pytest.mark.parametrize('block,message', [
    (_block(resumePreviousJobId='x'),
     r"hyperparameters: unknown field\(s\) \['resumePreviousJobId'\]"),
    (_block(goal=None), r'goal: missing'),
    (_block(goal='BIGGER'), r"goal: unknown value 'BIGGER'"),
    (_block(hyperparameterMetricTag=None), r'hyperparameterMetricTag: missing'),
    (_block(hyperparameterMetricTag=''), r'hyperparameterMetricTag: missing'),
    (_block(maxTrials=0), r'maxTrials: must be at least 1, got 0'),
    (_block(maxTrials=2.5), r'maxTrials: must be a whole number'),
    (_block(maxTrials=True), r'maxTrials: must be a number'),
    (_block(maxParallelTrials=9), r'maxParallelTrials: 9 > maxTrials 8'),
    (_block(maxFailedTrials=-1), r'maxFailedTrials: must be at least 0'),
    (_block(enableTrialEarlyStopping='yes'),
     r'enableTrialEarlyStopping: must be true or false'),
    (_block(algorithm='BAYES'), r"algorithm: unknown value 'BAYES'"),
    (_block(params=[]), r'params: missing or empty'),
    (_block(params=None), r'params: missing or empty'),
    (_with_param(0, type='FLOAT'),
     r"params\[0\] \(learning-rate\): type: unknown value 'FLOAT'"),
    (_with_param(1, stepSize=1),
     r"params\[1\] \(num-layers\): field\(s\) \['stepSize'\] do not apply"),
    (_with_param(0, discreteValues=[1, 2]),
     r"params\[0\] \(learning-rate\): field\(s\) \['discreteValues'\]"),
    (_with_param(0, minValue=0.5, maxValue=0.1),
     r'params\[0\] \(learning-rate\): minValue 0.5 > maxValue 0.1'),
    (_with_param(0, maxValue=None),
     r'params\[0\] \(learning-rate\): maxValue missing'),
    (_with_param(0, minValue='small'),
     r"params\[0\] \(learning-rate\): minValue: must be a number, got 'small'"),
    (_with_param(1, minValue=1.5),
     r'params\[1\] \(num-layers\): minValue: must be a whole number, got 1.5'),
    (_with_param(1, maxValue=1e29),
     r'params\[1\] \(num-layers\): maxValue 1e\+29 is outside the int32 '
     r'range \[-2147483648, 2147483647\]'),
    (_with_param(1, maxValue='1e29'), r"maxValue '1e29' is outside the int32"),
    (_with_param(1, minValue=-2**31 - 1), r'minValue -2147483649 is outside'),
    (_with_param(0, minValue=0.0),
     r'params\[0\] \(learning-rate\): UNIT_LOG_SCALE needs minValue > 0'),
    (_with_param(0, minValue=-1.0, scaleType='UNIT_REVERSE_LOG_SCALE'),
     r'UNIT_REVERSE_LOG_SCALE needs minValue > 0'),
    (_with_param(0, scaleType='UNIT_SQUARE_SCALE'),
     r"params\[0\] \(learning-rate\): scaleType: unknown value"),
    (_with_param(1, parameterName='learning_rate'),
     r'params\[1\] \(learning_rate\): duplicate parameterName; params\[0\]'),
    (_with_param(1, parameterName='bad name'),
     r"params\[1\]: parameterName must be a flag name"),
    (_with_param(1, parameterName='job_dir'),
     r'params\[1\] \(job_dir\): parameterName .* is set by the sweep'),
    (_with_param(1, parameterName='status'),
     r'params\[1\] \(status\): parameterName .* sweep_results.csv'),
    (_block(params=[{'parameterName': 'batch', 'type': 'DISCRETE',
                     'discreteValues': [32, 16]}]),
     r'params\[0\] \(batch\): discreteValues must be strictly increasing: '
     r'\[0\] 32 then \[1\] 16'),
    (_block(params=[{'parameterName': 'batch', 'type': 'DISCRETE',
                     'discreteValues': [16, 16]}]),
     r'discreteValues must be strictly increasing'),
    (_block(params=[{'parameterName': 'batch', 'type': 'DISCRETE',
                     'discreteValues': []}]),
     r'params\[0\] \(batch\): discreteValues must be a non-empty list'),
    (_block(params=[{'parameterName': 'opt', 'type': 'CATEGORICAL',
                     'categoricalValues': []}]),
     r'params\[0\] \(opt\): categoricalValues must be a non-empty list'),
    (_block(params=[{'parameterName': 'opt', 'type': 'CATEGORICAL',
                     'categoricalValues': ['sgd', 3]}]),
     r'params\[0\] \(opt\): categoricalValues\[1\] must be a string, got 3'),
    (_block(params=[{'parameterName': 'opt', 'type': 'CATEGORICAL',
                     'categoricalValues': ['sgd'],
                     'scaleType': 'UNIT_LINEAR_SCALE'}]),
     r"params\[0\] \(opt\): field\(s\) \['scaleType'\] do not apply"),
    (_block(algorithm='GRID_SEARCH'),
     r'params\[0\] \(learning-rate\): GRID_SEARCH needs every parameter '
     r'discrete'),
    (_block(algorithm='GRID_SEARCH', maxParallelTrials=1,
            params=[{'parameterName': 'steps', 'type': 'INTEGER',
                     'minValue': 1, 'maxValue': 10**7}]),
     r'algorithm: GRID_SEARCH over 10000000 points'),
])
def test_invalid_config_names_the_field(block, message):
  with pytest.raises(ValueError, match=message):
    sweep_config.parse(block)


@pytest.mark.parametrize('text,message', [
    ('just a string', r'must be a mapping'),
    ('trainingInput:\n  scaleTier: BASIC\n',
     r'trainingInput has no hyperparameters block'),
    ('trainingInput:\n  hyperparameters: {}\nextra: 1\n',
     r"unknown top-level field\(s\) \['extra'\]"),
    ('goal: MAXIMIZE\n', r'neither trainingInput.hyperparameters nor'),
    ('hyperparameters: [1, 2]\n', r'hyperparameters must be a mapping'),
    ('hyperparameters: {goal: [unclosed\n', r'is not valid YAML'),
    # PyYAML would keep the last of repeated keys without a word.
    ('hyperparameters:\n  maxTrials: 4\n  goal: MAXIMIZE\n  maxTrials: 40\n',
     r"not valid YAML: line 4, column 3: 'maxTrials' is set twice \(also on "
     r'line 2\); write each field once$'),
    ('hyperparameters:\n  params:\n    - parameterName: x\n'
     '      minValue: 1\n      minValue: 2\n',
     r"line 5, column 7: 'minValue' is set twice"),
])
def test_invalid_file_structure(tmp_path, text, message):
  path = tmp_path / 'hptuning_config.yaml'
  path.write_text(text)
  with pytest.raises(ValueError, match=message):
    sweep_config.load(str(path))


def test_missing_file_is_named(tmp_path):
  with pytest.raises(ValueError, match=r'cannot read --config .*nope.yaml'):
    sweep_config.load(str(tmp_path / 'nope.yaml'))


def test_the_documented_example_config_is_valid():
  from cli_helpers import ROOT  # pylint: disable=g-import-not-at-top
  config = sweep_config.load(
      os.path.join(ROOT, 'docs', 'example_hptuning_config.yaml'))
  assert [p.name for p in config.params] == ['learning-rate', 'optimizer']
