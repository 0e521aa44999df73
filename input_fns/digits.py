"""The embedded default dataset: scikit-learn's 8x8 handwritten digits.

The 1797 images of the digits 0-9 ship inside this package (digits.npz, 45
KB, written from scikit-learn's copy by make_digits.py), so nothing is
downloaded and scikit-learn is not needed. A fixed permutation splits them
into 1437 train and 360 eval examples, the same on every machine.
"""

import os

import numpy as np
import tensorflow as tf

from input_fns import arrays

NUM_TRAIN = 1437
NUM_EVAL = 360
N_CLASSES = 10
VIEWS = ('tabular', 'image')
_SPLIT_SEED = 0
_MAX_PIXEL = 16.0  # load_digits' pixels are ints in [0, 16].


_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                     'digits.npz')


def _load_digits():
  """(pixels as load_digits gives them, labels), in load_digits' order."""
  with np.load(_FILE) as arrays_file:
    return arrays_file['pixels'], arrays_file['labels']


def digits(view: str = 'tabular') -> arrays.ArrayData:
  """scikit-learn's handwritten digits, split 1437 train / 360 eval.

  Args:
    view: 'tabular': features {'pixels': float32 [batch, 64]} with
      feature_columns [numeric_column('pixels', shape=[64])];
      'image': features {'image': float32 [batch, 8, 8, 1]}. Pixels are
      scaled to [0, 1] either way.

  Returns:
    The Data; its example_ids are the examples' indices in
    sklearn.datasets.load_digits().

  Raises:
    ValueError: view is not 'tabular' or 'image'.
  """
  if view not in VIEWS:
    raise ValueError(f'view={view!r}; use one of {VIEWS}.')
  raw_pixels, raw_labels = _load_digits()
  pixels = (raw_pixels / _MAX_PIXEL).astype(np.float32)
  labels = raw_labels.astype(np.int32)
  order = np.random.RandomState(_SPLIT_SEED).permutation(len(labels))
  train_idx, eval_idx = order[:NUM_TRAIN], order[NUM_TRAIN:]
  if view == 'tabular':
    def features(idx):
      return {'pixels': pixels[idx]}
    columns = [tf.compat.v1.feature_column.numeric_column('pixels',
                                                          shape=[64])]
    image_shape = None
  else:
    def features(idx):
      return {'image': pixels[idx].reshape(-1, 8, 8, 1)}
    columns, image_shape = [], (8, 8, 1)
  return arrays.ArrayData(
      kind=view, n_classes=N_CLASSES, feature_columns=columns,
      image_shape=image_shape,
      train=(features(train_idx), labels[train_idx]),
      eval=(features(eval_idx), labels[eval_idx]),
      eval_ids=[str(i) for i in eval_idx])
