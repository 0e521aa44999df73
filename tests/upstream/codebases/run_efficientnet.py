"""tensorflow/tpu's EfficientNet model_fn, unchanged, on one device and towers.

The model_fn is models/official/efficientnet/main.py's `model_fn` (a
TPUEstimatorSpec; EMA over the trainable variables and batch norm's moving
statistics, chained after the update). It reads absl flags, so this script
parses main.py's flags with a tiny configuration and runs it under a plain
`tf.estimator.Estimator` (replicate_model_fn turns the TPUEstimatorSpec into
an EstimatorSpec; unwrapped, `tpu_spec.as_estimator_spec` does the same):

  EFFICIENTNET_DIR=/tmp/h8code/tpu/models/official/efficientnet \
  PYTHONPATH=tests/upstream/codebases:. \
      .venv/bin/python tests/upstream/codebases/run_efficientnet.py

Switched off: the TPU (--use_tpu=false, no CrossShardOptimizer), the host
call (--skip_host_call: its summaries need a TPU host loop), dropout
(--dropout_rate=0) and drop-connect (--survival_prob=1.0: its random
uniform still runs but floor(1 + U[0,1)) is always 1). bfloat16 off.
"""

import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.environ.get(
    'EFFICIENTNET_DIR', '/tmp/h8code/tpu/models/official/efficientnet'))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
import main as efficientnet_main  # tensorflow/tpu's main.py
import harness
from estimator_towers.merge import tpu_spec

BATCH = 12
IMAGE = 32
CLASSES = 10
FLAGS_USED = [
    '--use_tpu=false', '--model_name=efficientnet-b0',
    f'--input_image_size={IMAGE}', f'--num_label_classes={CLASSES}',
    '--width_coefficient=0.1', '--depth_coefficient=0.1',
    '--dropout_rate=0', '--survival_prob=1.0', '--skip_host_call',
    '--moving_average_decay=0.9', f'--train_batch_size={BATCH}',
    f'--eval_batch_size={BATCH}', '--base_learning_rate=2.0',
    '--lr_warmup_epochs=1', '--data_format=channels_last',
    '--transpose_input=false', '--train_steps=4']
PARAMS = {'batch_size': BATCH, 'use_bfloat16': False, 'steps_per_epoch': 2}


def _data():
  rng = np.random.RandomState(0)
  images = rng.uniform(0, 255, size=(36, IMAGE, IMAGE, 3)).astype(np.float32)
  labels = np.eye(CLASSES, dtype=np.float32)[rng.randint(0, CLASSES, 36)]
  return images, labels


def train_input_fn():
  images, labels = _data()
  return tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(
      BATCH)


def eval_input_fn():
  images, labels = _data()
  return tf.data.Dataset.from_tensor_slices((images, labels)).batch(BATCH)


def predict_input_fn():
  images, _ = _data()
  return tf.data.Dataset.from_tensor_slices(images).batch(BATCH)


def model_fn(features, labels, mode, params):
  """main.model_fn as TPUEstimator(use_tpu=False) would call it, unwrapped.

  Only the one-device run needs this: it turns the TPUEstimatorSpec into
  an EstimatorSpec as TPUEstimator does off TPU. The towers wrap
  main.model_fn itself.
  """
  return tpu_spec.as_estimator_spec(
      efficientnet_main.model_fn(features, labels, mode, params))


def main():
  flags.FLAGS(['run_efficientnet'] + FLAGS_USED)
  harness.run_all('efficientnet', model_fn, train_input_fn, eval_input_fn,
                  predict_input_fn, params=PARAMS, steps=4, eval_steps=3,
                  tower_model_fn=efficientnet_main.model_fn)


if __name__ == '__main__':
  main()
