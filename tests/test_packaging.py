"""Every documented packaging route gives a package that trains on its own.

Each route builds the package from a copy of the checkout, installs it into
an empty directory, and runs `python -m trainer.task` from outside the
checkout with that directory first on the path (the dependencies come from
the test environment).
"""

import os
import shutil
import subprocess
import sys

import pytest

from cli_helpers import ROOT, eval_line

pytestmark = pytest.mark.cli

_ROUTES = {
    # What gcloud runs when setup.py is beside trainer/, and what
    # deploy/vertex_custom_job.yaml tells users to run.
    'setup.py sdist': [sys.executable, 'setup.py', '--quiet', 'sdist',
                       '--dist-dir', '{dist}'],
    'python -m build': [sys.executable, '-m', 'build', '--sdist',
                        '--no-isolation', '--outdir', '{dist}'],
}


def _checkout_copy(destination):
  files = subprocess.run(['git', 'ls-files'], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
  for name in files:
    if os.path.exists(os.path.join(ROOT, name)):
      target = os.path.join(destination, name)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.copy2(os.path.join(ROOT, name), target)
  return destination


def _run(command, cwd, env=None):
  result = subprocess.run(command, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
  assert result.returncode == 0, (command, result.stderr[-3000:])
  return result


@pytest.mark.parametrize('route', sorted(_ROUTES))
def test_built_package_trains_from_an_isolated_install(tmp_path, route):
  source = _checkout_copy(tmp_path / 'source')
  dist, site, elsewhere = (tmp_path / 'dist', tmp_path / 'site',
                           tmp_path / 'elsewhere')
  elsewhere.mkdir()
  _run([part.format(dist=dist) for part in _ROUTES[route]], cwd=source)
  (sdist,) = dist.glob('estimator*towers-*.tar.gz')
  _run([sys.executable, '-m', 'pip', 'install', '--quiet', '--no-deps',
        '--no-build-isolation', '--target', str(site), str(sdist)],
       cwd=elsewhere)
  env = {**os.environ, 'PYTHONPATH': str(site), 'TF_CPP_MIN_LOG_LEVEL': '3'}
  env.pop('TF_CONFIG', None)
  where = _run([sys.executable, '-c', 'import trainer, input_fns, '
                'model_fns, estimator_towers as e; print(e.__file__)'],
               cwd=elsewhere, env=env)
  assert where.stdout.startswith(str(site)), where.stdout
  trained = _run([sys.executable, '-m', 'trainer.task',
                  f'--job-dir={elsewhere / "job"}', '--train-steps=20',
                  '--cpu-towers=2'], cwd=elsewhere, env=env)
  assert int(eval_line(trained)['global_step']) == 20


def _dockerfile():
  with open(os.path.join(ROOT, 'Dockerfile')) as f:
    lines = [line.strip() for line in f if line.strip()
             and not line.lstrip().startswith('#')]
  return lines


def _docker_daemon_runs():
  # A docker client without a reachable daemon is no builder.
  if not shutil.which('docker'):
    return False
  return subprocess.run(['docker', 'info'], capture_output=True,
                        stdin=subprocess.DEVNULL, timeout=60).returncode == 0


def test_dockerfile_installs_the_package_and_runs_the_task():
  # No image builder here: the Dockerfile's parts are checked instead, and
  # its entry point is run from the package installed by the test above.
  lines = _dockerfile()
  assert lines[0] == 'FROM python:3.11-slim'
  copied = [line.split()[1].rstrip('/') for line in lines
            if line.startswith('COPY')]
  packages = {'estimator_towers', 'trainer', 'model_fns', 'input_fns'}
  assert packages <= set(copied)
  for path in copied:
    assert os.path.exists(os.path.join(ROOT, path)), path
  assert any(line.startswith('RUN python -m pip install') and ' . ' in
             line + ' ' for line in lines)
  entry = [line for line in lines if line.startswith('ENTRYPOINT')]
  assert entry == ['ENTRYPOINT ["python", "-m", "trainer.task"]']
  if _docker_daemon_runs():
    _run(['docker', 'build', '-q', '-t', 'estimator-towers:test', '.'],
         cwd=ROOT)
