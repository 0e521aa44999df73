"""Every shell block of README.md and docs/*.md runs as copied.

Each ```bash block runs in a real bash, with the programs it calls
(python, gcloud, ./run.sh, docker, ...) replaced by shell functions that
record their arguments; a command bash would not find (`Male` after an
unquoted `sex=Female|Male`) fails the block. Then every recorded trainer
command line is parsed by its entry point's flags: one process per entry
point (tests/docs_flag_check.py), so the test costs a few seconds.
"""

import collections
import glob
import json
import os
import re
import subprocess
import sys

import pytest

import cli_helpers

pytestmark = pytest.mark.cli

ROOT = cli_helpers.ROOT
_DOCS = ['README.md'] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs',
                                                             '*.md')))
_BLOCK = re.compile(r'^```(?:bash|sh|shell)\n(.*?)^```', re.M | re.S)
# Stand-ins for what a block calls; each records its argv, one per file,
# NUL-separated. `./run.sh` is not a valid function name in every bash.
_PRELUDE = r'''
set -e -o pipefail
_record() { printf '%s\0' "$@" > "$(mktemp "$RECORD/cmd.XXXXXX")"; }
python() { _record python "$@"; }
gcloud() { _record gcloud "$@"; }
run_sh() { _record run.sh "$@"; }
for _tool in tensorboard docker gsutil kubectl pip; do
  eval "$_tool() { :; }"
done
command_not_found_handle() { echo "not a command: $1" >&2; return 127; }
'''


def _blocks():
  """(file, block number, text) of each shell block of the docs."""
  for doc in _DOCS:
    with open(os.path.join(ROOT, doc)) as f:
      for i, match in enumerate(_BLOCK.finditer(f.read())):
        yield doc, i, match.group(1)


def _run_block(text, record_dir):
  """Runs one block under the stand-ins; returns (result, recorded argvs)."""
  os.makedirs(record_dir)
  script = _PRELUDE + text.replace('./run.sh', 'run_sh').replace(
      '.venv/bin/python', 'python')  # The checkout's venv is python too.
  # Not in the checkout: a block's mkdir or rm must not touch it.
  result = subprocess.run(['bash', '-c', script], capture_output=True,
                          text=True, timeout=30, cwd=record_dir,
                          env={**os.environ, 'RECORD': record_dir})
  argvs = []
  for name in sorted(n for n in os.listdir(record_dir)
                     if n.startswith('cmd.')):
    with open(os.path.join(record_dir, name)) as f:
      argvs.append(f.read().split('\0')[:-1])
  return result, argvs


def _after_dashes(args):
  return args[args.index('--') + 1:] if '--' in args else []


def _trainer_commands(argv):
  """(entry point, its arguments) of each trainer command an argv runs.

  The sweep's and the cluster launcher's arguments after `--` are
  trainer.task's, as are those after `--` of a gcloud job (the image's
  entry point and --module-name are trainer.task).
  """
  program, args = argv[0], argv[1:]
  if program == 'python' and args[:1] == ['-m'] and args[1].startswith(
      'trainer.'):
    module, args = args[1], args[2:]
    yield module, args
    if module in ('trainer.sweep', 'trainer.cluster'):
      yield 'trainer.task', _after_dashes(args)
  elif program == 'run.sh' and args[:1] == ['main']:
    yield 'trainer.task', args[1:]
  elif program == 'gcloud' and ('local' in args or 'submit' in args):
    yield 'trainer.task', _after_dashes(args)


def _main_module(module):
  """The module whose import defines an entry point's flags."""
  return {'trainer.sweep': 'trainer.sweep.main',
          'trainer.cluster': 'trainer.cluster.main'}.get(module, module)


def _flag_errors(commands_by_module):
  """{module: [error or None per command]}, one process per module.

  The processes run side by side: each mostly waits for its imports.
  """
  env = {**os.environ, 'PYTHONPATH': ROOT, 'TF_CPP_MIN_LOG_LEVEL': '3'}
  checks = {
      module: subprocess.Popen(
          [sys.executable, os.path.join('tests', 'docs_flag_check.py'),
           _main_module(module)], stdin=subprocess.PIPE,
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
          text=True) for module in commands_by_module}
  errors = {}
  for module, check in checks.items():
    stdout, stderr = check.communicate(
        json.dumps([args for _, args in commands_by_module[module]]),
        timeout=120)
    assert check.returncode == 0, stderr[-3000:]
    errors[module] = json.loads(stdout.strip().splitlines()[-1])
  return errors


@pytest.fixture(scope='module')
def recorded(tmp_path_factory):
  """Runs every block once: {(file, block): (result, argvs)}."""
  out = {}
  root = tmp_path_factory.mktemp('blocks')
  for doc, i, text in _blocks():
    out[doc, i] = _run_block(text, str(root / f'{doc.replace("/", "_")}{i}'))
  return out


def test_every_shell_block_runs_in_bash(recorded):
  failed = {f'{doc} block {i}': result.stderr.strip()
            for (doc, i), (result, _) in recorded.items()
            if result.returncode != 0}
  assert not failed, failed
  assert len(recorded) >= 10  # README's and docs/' blocks were all found.


def test_every_trainer_command_of_the_docs_takes_its_flags(recorded):
  by_module = collections.defaultdict(list)
  for (doc, i), (_, argvs) in recorded.items():
    for argv in argvs:
      for module, args in _trainer_commands(argv):
        by_module[module].append((f'{doc} block {i}', args))
  # README shows each of the five entry points.
  assert set(by_module) == {'trainer.task', 'trainer.predict',
                            'trainer.sweep', 'trainer.cluster',
                            'trainer.check'}
  bad = {}
  for module, errors in _flag_errors(by_module).items():
    bad.update({f'{where}: {module} {" ".join(args)}': error
                for (where, args), error in zip(by_module[module], errors)
                if error})
  assert not bad, json.dumps(bad, indent=1)
