"""The "evaluating on the training files" warning only where it is true."""

import numpy as np
import tensorflow as tf

import pytest

import cli_helpers

pytestmark = pytest.mark.cli

_WARNING = 'evaluating on the training files'


def _image_folder(root, per_class=5):
  rng = np.random.RandomState(0)
  for name in ('cat', 'dog'):
    (root / name).mkdir(parents=True)
    for i in range(per_class):
      pixels = rng.randint(0, 255, (8, 8, 3)).astype(np.uint8)
      tf.io.write_file(str(root / name / f'{i}.png'), tf.io.encode_png(pixels))
  return str(root)


def test_image_folder_holds_out_a_fifth_so_no_warning(tmp_path):
  root = _image_folder(tmp_path / 'photos')
  result = cli_helpers.run_module(
      'trainer.task', f'--job-dir={tmp_path / "job"}', '--dry-run',
      '--input-format=image_folder', f'--train-files={root}',
      '--image-size=8,8', '--model=cifar_cnn')
  assert 'dry run' in result.stdout
  assert _WARNING not in result.stderr

