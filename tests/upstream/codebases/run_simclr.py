"""google-research/simclr's TF1 model_fn, unchanged, on one device and towers.

The model_fn is model.py's `build_model_fn(model, num_classes,
num_train_examples)` (the repository's top level is its TF1 code; tf2/ is
the other one) around resnet.py's `resnet_v1`, in pretraining mode: the
NT-Xent loss, whose negatives are every other example of the batch. It
reads run.py's absl flags, so this script imports run.py (for its flag
definitions only) and parses a tiny configuration:

  SIMCLR_DIR=/tmp/h8code/simclr PYTHONPATH=tests/upstream/codebases:. \
      .venv/bin/python tests/upstream/codebases/run_simclr.py

run.py imports tensorflow_datasets and tensorflow_hub for its main(), which
this script does not call: both are empty stand-in modules here. The
features are two fixed 'views' of each image stacked on the channel axis,
as SimCLR's input pipeline gives them; no augmentation runs.

Switched off: the TPU (params has no 'context', so the loss takes no
cross-replica concat), the random Gaussian blur the model_fn applies to the
batch (--use_blur=false) and the tf.summary writer (--train_summary_steps=0:
it writes into --model_dir, one per run here). Everything else is SimCLR's
default (LARS, global batch norm flag, 3-layer projection head, hidden
norm, temperature 0.1), at ResNet-18 width 1 on 16x16 images.
"""

import os
import sys
import types

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.environ.get('SIMCLR_DIR', '/tmp/h8code/simclr'))
for _unused in ('tensorflow_datasets', 'tensorflow_hub'):
  sys.modules.setdefault(_unused, types.ModuleType(_unused))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
import run as simclr_run  # pylint: disable=unused-import  (defines the flags)
import model as simclr_model
import resnet as simclr_resnet
import harness
from estimator_towers.merge import tpu_spec

BATCH = 12
IMAGE = 16
CLASSES = 5
EXAMPLES = 36
FLAGS_USED = [
    '--use_tpu=false', '--train_mode=pretrain', f'--image_size={IMAGE}',
    '--resnet_depth=18', '--width_multiplier=1', '--use_blur=false',
    '--train_summary_steps=0', f'--train_batch_size={BATCH}',
    f'--eval_batch_size={BATCH}', '--warmup_epochs=1', '--learning_rate=1.0']
PARAMS = {'batch_size': BATCH}


def _data():
  rng = np.random.RandomState(0)
  images = rng.uniform(0, 1, size=(EXAMPLES, IMAGE, IMAGE, 3))
  second = np.clip(images + rng.normal(0, .1, images.shape), 0, 1)
  views = np.concatenate([images, second], -1).astype(np.float32)
  labels = {'labels': np.eye(CLASSES, dtype=np.float32)[
      rng.randint(0, CLASSES, EXAMPLES)],
            'mask': np.ones(EXAMPLES, np.float32)}
  return views, labels


def train_input_fn():
  # As SimCLR's data.py batches for training: drop_remainder, a static batch.
  return tf.data.Dataset.from_tensor_slices(_data()).repeat().batch(
      BATCH, drop_remainder=True)


def eval_input_fn():
  return tf.data.Dataset.from_tensor_slices(_data()).batch(BATCH)


def main():
  flags.FLAGS(['run_simclr'] + FLAGS_USED)
  model = simclr_resnet.resnet_v1(resnet_depth=18, width_multiplier=1,
                                  cifar_stem=True)
  simclr_fn = simclr_model.build_model_fn(model, CLASSES, EXAMPLES)

  def one_device_fn(features, labels, mode, params):
    """What TPUEstimator(use_tpu=False) does with the TPUEstimatorSpec."""
    return tpu_spec.as_estimator_spec(
        simclr_fn(features, labels, mode, params))

  # SimCLR's model_fn has no PREDICT mode (it builds labels-based metrics).
  harness.run_all('simclr', one_device_fn, train_input_fn, eval_input_fn,
                  None, params=PARAMS, steps=3, eval_steps=3,
                  tower_model_fn=simclr_fn)


if __name__ == '__main__':
  main()
