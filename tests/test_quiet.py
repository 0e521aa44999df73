"""The library in a script: no doubled log lines, one call to quiet it.

Real interpreters, run as a user's script would be; the lines they print are
counted.
"""

import os
import subprocess
import sys

import pytest

from cli_helpers import ROOT

pytestmark = pytest.mark.cli

# The README's "Use" snippet, trained for 3 steps on 2 virtual CPU towers.
_README_SCRIPT = """
import sys
import trainer
if sys.argv[1] == 'quiet':
  trainer.quiet_tensorflow()
import numpy as np
import tensorflow as tf

def model_fn(features, labels, mode, params):
  logits = tf.keras.layers.Dense(10)(features['x'])
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(
      loss, tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

def input_fn():
  features = {'x': np.zeros((8, 3), np.float32)}
  return tf.data.Dataset.from_tensor_slices(
      (features, np.zeros(8, np.int32))).repeat().batch(4)

config = trainer.make_run_config(sys.argv[2], cpu_devices=2)
estimator = tf.estimator.Estimator(trainer.replicate_model_fn(model_fn),
                                   config=config, params={})
estimator.train(input_fn, steps=3)
print('trained')
"""

# A TensorFlow INFO line before and after the library's first warning (no
# GPU to fall back from).
_WARNING_SCRIPT = """
import tensorflow as tf
import trainer
tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
tf.compat.v1.logging.info('line before')
trainer.make_run_config(None, num_gpus=1, fallback_to_available_gpus=True)
tf.compat.v1.logging.info('line after')
"""


def _script_output(tmp_path, source, *args):
  """stdout and stderr of `python script.py args`, run outside the repo."""
  script = tmp_path / 'script.py'
  script.write_text(source)
  env = {k: v for k, v in os.environ.items() if not k.startswith('TF_')}
  env['PYTHONPATH'] = ROOT
  result = subprocess.run([sys.executable, str(script), *map(str, args)],
                          cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=True)
  return result.stdout + result.stderr


def test_tensorflow_lines_print_once_after_a_library_warning(tmp_path):
  lines = _script_output(tmp_path, _WARNING_SCRIPT).splitlines()
  assert sum('line before' in l for l in lines) == 1
  assert sum('line after' in l for l in lines) == 1
  assert sum('num_gpus=1 but this machine has' in l for l in lines) == 1


def test_quiet_tensorflow_leaves_the_scripts_own_lines(tmp_path):
  loud = _script_output(tmp_path, _README_SCRIPT, 'loud', tmp_path / 'a')
  quiet = _script_output(tmp_path, _README_SCRIPT, 'quiet', tmp_path / 'b')
  assert len(loud.splitlines()) > 20  # TensorFlow's import and INFO noise.
  assert quiet.splitlines() == ['trained']
