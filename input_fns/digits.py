"""The embedded default dataset: scikit-learn's 8x8 handwritten digits.

1797 images of the digits 0-9 ship inside scikit-learn, so nothing is
downloaded. A fixed permutation splits them into 1437 train and 360 eval
examples, the same on every machine.
"""

import numpy as np
import tensorflow as tf

from input_fns import arrays

NUM_TRAIN = 1437
NUM_EVAL = 360
N_CLASSES = 10
VIEWS = ('tabular', 'image')
_SPLIT_SEED = 0
_MAX_PIXEL = 16.0  # load_digits' pixels are ints in [0, 16].


def _load_digits():
  try:
    from sklearn import datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('digits() needs scikit-learn, which ships the data: '
                      'pip install scikit-learn.') from e
  return datasets.load_digits()


def digits(view: str = 'tabular') -> arrays.ArrayData:
  """scikit-learn's handwritten digits, split 1437 train / 360 eval.

  Args:
    view: 'tabular': features {'pixels': float32 [batch, 64]} with
      feature_columns [numeric_column('pixels', shape=[64])];
      'image': features {'image': float32 [batch, 8, 8, 1]}. Pixels are
      scaled to [0, 1] either way.

  Returns:
    The Data; its example_ids are the examples' indices in load_digits().

  Raises:
    ValueError: view is not 'tabular' or 'image'.
    ImportError: scikit-learn is not installed.
  """
  if view not in VIEWS:
    raise ValueError(f'view={view!r}; use one of {VIEWS}.')
  bunch = _load_digits()
  pixels = (bunch.data / _MAX_PIXEL).astype(np.float32)
  labels = bunch.target.astype(np.int32)
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
