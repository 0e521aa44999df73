"""The deploy/ examples run trainer.task with flags it actually has."""

import os

import pytest
import yaml

from cli_helpers import ROOT
from cli_helpers import is_task_flag
from trainer import options

pytestmark = pytest.mark.fast

options.define_flags()
DEPLOY = os.path.join(ROOT, 'deploy')


def _arg_lists(node):
  """Every `args:` list in a parsed YAML document."""
  if isinstance(node, dict):
    for key, value in node.items():
      if key == 'args' and isinstance(value, list):
        yield value
      else:
        yield from _arg_lists(value)
  elif isinstance(node, list):
    for item in node:
      yield from _arg_lists(item)


@pytest.mark.parametrize('name', ['vertex_custom_job.yaml',
                                  'kubeflow_tfjob.yaml'])
def test_every_flag_is_a_task_flag(name):
  with open(os.path.join(DEPLOY, name)) as f:
    document = yaml.safe_load(f)
  arg_lists = list(_arg_lists(document))
  assert arg_lists
  for args in arg_lists:
    for arg in args:
      assert is_task_flag(arg), f'{name}: unknown flag {arg}'


def test_ai_platform_config_has_every_role():
  with open(os.path.join(DEPLOY, 'ai_platform_config.yaml')) as f:
    training = yaml.safe_load(f)['trainingInput']
  assert training['scaleTier'] == 'CUSTOM'
  for key in ('masterType', 'workerCount', 'parameterServerCount',
              'evaluatorCount'):
    assert training[key]
