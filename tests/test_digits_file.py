"""The embedded digits ship in the package: no scikit-learn needed."""

import configparser
import os
import subprocess
import sys

import pytest

from cli_helpers import ROOT

pytestmark = pytest.mark.cli

# Imports of sklearn fail in this process, as where it is not installed.
_WITHOUT_SKLEARN = '''
import sys
sys.modules['sklearn'] = None
import input_fns
for view in ('tabular', 'image'):
  data = input_fns.digits(view=view)
  dataset = data.train_input_fn(1437, shuffle=False)()
  features, labels = next(iter(dataset))
  (values,) = features.values()
  print(view, tuple(values.shape), float(values.numpy().min()),
        float(values.numpy().max()), sorted(set(labels.numpy().tolist())))
'''


def test_digits_load_without_scikit_learn():
  result = subprocess.run(
      [sys.executable, '-c', _WITHOUT_SKLEARN], cwd=ROOT, capture_output=True,
      text=True, timeout=120,
      env={**os.environ, 'PYTHONPATH': ROOT, 'TF_CPP_MIN_LOG_LEVEL': '3'})
  assert result.returncode == 0, result.stderr[-2000:]
  tabular, image = result.stdout.strip().splitlines()
  classes = str(list(range(10)))
  assert tabular == f'tabular (1437, 64) 0.0 1.0 {classes}'
  assert image == f'image (1437, 8, 8, 1) 0.0 1.0 {classes}'


def test_scikit_learn_is_no_install_requirement():
  config = configparser.ConfigParser()
  config.read(os.path.join(ROOT, 'setup.cfg'))
  required = config['options']['install_requires'].lower()
  assert 'scikit-learn' not in required and 'sklearn' not in required
