"""A user's `--model=module:function` on the digits: which features it gets."""

import os

import pytest

import cli_helpers

pytestmark = pytest.mark.cli

# What a newcomer writes for images: it reads features['image'].
_USER_MODEL = '''
import tensorflow as tf
from model_fns.head import classifier_spec


def image_model_fn(features, labels, mode, params):
  flat = tf.reshape(features['image'], [-1, 64])
  layer = tf.keras.layers.Dense(params['n_classes'])
  return classifier_spec(mode, layer(flat), labels, params, [layer.kernel])
'''
_FLAGS = ('--model=user_image_model:image_model_fn', '--train-steps=2',
          '--train-batch-size=32', '--save-checkpoints-steps=2')


def _run(tmp_path, *args, check=True):
  with open(tmp_path / 'user_image_model.py', 'w') as f:
    f.write(_USER_MODEL)
  path = os.pathsep.join([cli_helpers.ROOT, str(tmp_path)])
  return cli_helpers.run_module(
      'trainer.task', f'--job-dir={tmp_path / "job"}', *_FLAGS, *args,
      env={'PYTHONPATH': path}, check=check)


def test_a_missing_feature_key_names_the_keys_and_the_view_flag(tmp_path):
  result = _run(tmp_path, '--dry-run', check=False)
  assert result.returncode == 1, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert "KeyError: 'image'" in last and "['pixels']" in last, last
  assert '--data-view=image' in last, last


def test_the_image_view_trains_an_image_model_on_the_digits(tmp_path):
  result = _run(tmp_path, '--data-view=image')
  assert cli_helpers.eval_line(result)['global_step'] == '2'
