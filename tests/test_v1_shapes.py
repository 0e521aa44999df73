"""TF1 code that turns TensorShape dimensions into Dimension objects.

SimCLR and other TF1 codebases call `tf.compat.v1.disable_v2_tensorshape()`
(or `disable_v2_behavior()`): `shape[0]` is then a `Dimension`, unhashable,
and two unknown ones do not compare equal. The setting is global to the
process, so the towers are compared with one device in a process of their
own.
"""

import subprocess
import sys

import pytest

from cli_helpers import ROOT

pytestmark = pytest.mark.cli

_SCRIPT = '''
import sys
import numpy as np
import tensorflow as tf
tf.compat.v1.disable_v2_tensorshape()
sys.path.insert(0, 'tests')
import helpers

rng = np.random.RandomState(0)
x = rng.randn(30, 5).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
params = {'optimizer': helpers.OPTIMIZERS['sgd']}
for aggregation in ('global_loss', 'all_reduce'):
  runs = []
  for towers in (1, 2):
    estimator = helpers.make_estimator(
        helpers.classifier_model_fn, f'{sys.argv[1]}/{aggregation}{towers}',
        towers=towers, params=params, aggregation=aggregation)
    # Batches of 7: the last one of each pass is short.
    estimator.train(helpers.dataset_input_fn(x, y, batch_size=7), steps=5)
    runs.append(helpers.variables_of(estimator))
  helpers.assert_same_variables(*runs)
  print(aggregation, 'same as one device', flush=True)
'''


def test_v1_dimensions_train_as_one_device(tmp_path):
  result = subprocess.run([sys.executable, '-c', _SCRIPT, str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == [
      'global_loss same as one device', 'all_reduce same as one device']
