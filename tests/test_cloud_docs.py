"""docs/cloud.md's commands name flags the task has and files that exist."""

import os
import re
import shlex

from cli_helpers import ROOT
from cli_helpers import is_task_flag
from trainer import options

options.define_flags()


def _commands():
  with open(os.path.join(ROOT, 'docs', 'cloud.md')) as f:
    text = f.read()
  for block in re.findall(r'```bash\n(.*?)```', text, re.S):
    for command in block.replace('\\\n', ' ').splitlines():
      command = command.split('#', 1)[0].strip()
      if command:
        yield shlex.split(command)


def _task_args(words):
  """The words the task gets from a documented command, or None."""
  if words[:3] == ['python', '-m', 'trainer.task']:
    return words[3:]
  if words[0] == 'gcloud' and '--' in words:
    return words[words.index('--') + 1:]
  return None


def test_walkthrough_covers_every_place_it_runs():
  firsts = {' '.join(words[:3]) for words in _commands()}
  for expected in ('python -m trainer.task', 'gcloud ai-platform local',
                   'gcloud ai-platform jobs', 'gcloud ai custom-jobs',
                   'kubectl apply -f', 'docker build -t',
                   'python setup.py sdist', 'python -m build'):
    assert expected in firsts, expected


def test_every_task_flag_in_the_commands_exists():
  checked = 0
  for words in _commands():
    args = _task_args(words)
    if args is None:
      continue
    for arg in args:
      if arg.startswith('--'):
        assert is_task_flag(arg), f'docs/cloud.md: unknown task flag {arg}'
        checked += 1
  assert checked >= 15


def test_every_named_file_exists():
  for words in _commands():
    for word in words:
      path = word.split('=', 1)[-1]
      if path.startswith(('deploy/', 'Dockerfile')):
        assert os.path.exists(os.path.join(ROOT, path)), path
