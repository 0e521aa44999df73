"""run.sh refuses an unsupported Python with a message that says why."""

import os
import shutil
import stat
import subprocess

import pytest

from cli_helpers import ROOT

_FAKE_PYTHON = '''#!/bin/sh
# Plays a Python 3.12: fails the version check run.sh makes.
case "$1" in
  --version) echo "Python 3.12.1" ;;
  *) exit 1 ;;
esac
'''


@pytest.mark.cli
def test_unsupported_python_stops_with_a_clear_message(tmp_path):
  project = tmp_path / 'project'
  project.mkdir()
  shutil.copy(os.path.join(ROOT, 'run.sh'), project / 'run.sh')
  fake_bin = tmp_path / 'bin'
  fake_bin.mkdir()
  for name in ('python3', 'python3.12'):
    path = fake_bin / name
    path.write_text(_FAKE_PYTHON)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
  result = subprocess.run(
      ['/bin/bash', str(project / 'run.sh'), 'test'], cwd=project,
      env={'PATH': str(fake_bin), 'HOME': str(tmp_path)},
      capture_output=True, text=True, timeout=60)
  assert result.returncode == 1
  assert 'needs Python 3.9, 3.10 or 3.11' in result.stderr
  assert 'Python 3.12.1' in result.stderr
  assert not (project / '.venv').exists()


@pytest.mark.fast
def test_setup_cfg_pins_python_and_the_estimator_stack():
  with open(os.path.join(ROOT, 'setup.cfg')) as f:
    text = f.read()
  assert 'python_requires = >=3.9,<3.12' in text
  assert 'tensorflow==2.15.*' in text and 'tensorflow-estimator==2.15.*' in text
