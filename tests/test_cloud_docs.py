"""docs/cloud.md's commands name flags the task has and files that exist;
every documented command and deploy/ file agrees on the package and jobs."""

import configparser
import glob
import os
import re
import shlex

import pytest
import yaml

from cli_helpers import ROOT
from cli_helpers import is_task_flag
from trainer import options

pytestmark = pytest.mark.fast

options.define_flags()
_DOCS = ('docs/cloud.md', 'docs/cluster.md')
_DEPLOY = sorted(glob.glob(os.path.join(ROOT, 'deploy', '*.yaml')))


def _read(path):
  with open(os.path.join(ROOT, path)) as f:
    return f.read()


def _split(lines, start=''):
  """Shell words of each command in `lines` (backslash continuations) that
  starts with `start`."""
  for command in lines.replace('\\\n', ' ').splitlines():
    command = command.split('#', 1)[0].strip()
    if command and command.startswith(start):
      yield shlex.split(command)


def _commands(path='docs/cloud.md'):
  for block in re.findall(r'```bash\n(.*?)```', _read(path), re.S):
    yield from _split(block)


def _gcloud_commands():
  """(where, words) of every gcloud command in the docs and deploy/ files.

  From the docs' bash blocks and inline code, and from the usage comments
  at the top of each deploy/ file.
  """
  for path in _DOCS:
    spans = re.findall(r'`(gcloud [^`]+)`', _read(path))
    for words in [*_commands(path), *_split('\n'.join(
        ' '.join(span.split()) for span in spans))]:
      if words[0] == 'gcloud':
        yield path, words
  for path in _DEPLOY:
    comments = '\n'.join(line.lstrip('#') for line in _read(path).splitlines()
                         if line.startswith('#'))
    for words in _split(comments.replace('&&', '\n'), 'gcloud '):
      yield path, words


def _option(words, name):
  """The value of `--name X` or `--name=X` in words, or None."""
  for i, word in enumerate(words):
    if word == name and i + 1 < len(words):
      return words[i + 1]
    if word.startswith(name + '='):
      return word.split('=', 1)[1]
  return None


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


def _sdist_file():
  """setup.cfg's name and the file name of the sdist current tools write."""
  parser = configparser.ConfigParser()
  parser.read(os.path.join(ROOT, 'setup.cfg'))
  name, version = parser['metadata']['name'], parser['metadata']['version']
  # setuptools >= 69.3 (PEP 625) normalizes the file name; older ones (and
  # gcloud's `python setup.py sdist`) keep the name as written.
  return name, f'{re.sub(r"[-_.]+", "_", name).lower()}-{version}.tar.gz'


def test_every_package_file_name_is_the_one_the_build_writes():
  name, expected = _sdist_file()
  assert expected.startswith(name + '-'), (
      f'setup.cfg name {name!r}: old and new setuptools would name the sdist '
      'differently')
  named = 0
  for path in [*_DOCS, *_DEPLOY]:
    for file_name in re.findall(r'[\w.-]+\.tar\.gz', _read(path)):
      assert file_name == expected, f'{path} names {file_name}'
      named += 1
  assert named >= 4  # cloud.md's gsutil cp, the Vertex job's packageUris...


def test_custom_container_jobs_are_not_given_a_package():
  checked = 0
  for where, words in _gcloud_commands():
    config = _option(words, '--config')
    if config is None or not config.startswith('deploy/'):
      continue
    document = yaml.safe_load(_read(config))
    if 'imageUri' not in repr(document):
      continue
    # gcloud refuses --package-path / --module-name with custom containers.
    packaged = [w for w in words if w.split('=')[0] in
                ('--package-path', '--module-name', '--packages')]
    assert not packaged, f'{where}: {" ".join(words)}'
    checked += 1
  assert checked >= 2  # docs/cluster.md and the config's own usage comment
