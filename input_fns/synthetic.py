"""Embedded synthetic classification problems: no download, same every run.

`gaussian_blobs` and `arrays_input_fn` serve plain arrays (trainer/demo.py);
`synthetic_tabular` and `synthetic_images` wrap such problems as `Data` for
benchmarks and tests. Both are learnable: each class has its own mean.
"""

from typing import Callable, List, Tuple

import numpy as np
import tensorflow as tf

from input_fns import arrays
from input_fns import data as data_lib
from input_fns import pipeline

EVAL_FRACTION = 0.2
# How far an image strays from its class's pattern: visible noise that still
# leaves the classes easy to tell apart.
_IMAGE_NOISE = 0.15


def gaussian_blobs(num_examples: int = 2048, num_features: int = 16,
                   num_classes: int = 4, seed: int = 0
                  ) -> Tuple[np.ndarray, np.ndarray]:
  """Classes drawn around random centres, overlapping a little.

  Returns:
    (x float32 [num_examples, num_features], y int32 [num_examples]).
  """
  rng = np.random.RandomState(seed)
  centres = rng.randn(num_classes, num_features) * 0.5
  y = rng.randint(0, num_classes, num_examples).astype(np.int32)
  x = centres[y] + rng.randn(num_examples, num_features)
  return x.astype(np.float32), y


def arrays_input_fn(x: np.ndarray, y: np.ndarray, batch_size: int,
                    shuffle: bool = False, repeat: bool = False,
                    seed: int = 0) -> Callable[[], tf.data.Dataset]:
  """An input_fn serving ({'x': x}, y) in batches of `batch_size`."""

  def input_fn():
    ds = tf.data.Dataset.from_tensor_slices(({'x': x}, y))
    if shuffle:
      ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    if repeat:
      ds = ds.repeat()
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)

  return input_fn


def _check_int(name: str, value, minimum: int) -> int:
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or
      value < minimum):
    raise ValueError(f'{name}={value!r}; pass an int >= {minimum}.')
  return int(value)


def _num_eval(num_examples: int) -> int:
  return max(1, int(num_examples * EVAL_FRACTION))


def synthetic_tabular(num_features: int = 16, n_classes: int = 4,
                      num_examples: int = 2048,
                      seed: int = 0) -> arrays.ArrayData:
  """Gaussian blobs as tabular Data: features {'x': float32 [batch, F]}.

  Args:
    num_features: F, the length of 'x'.
    n_classes: Number of classes (>= 2), each around its own centre.
    num_examples: Train plus eval examples; the last 20% are eval.
    seed: Fixes the data.

  Returns:
    The Data; feature_columns [numeric_column('x', shape=[F])], example_ids
    the eval examples' indices in the generated data.

  Raises:
    ValueError: an argument is not an int in range.
  """
  num_features = _check_int('num_features', num_features, 1)
  n_classes = _check_int('n_classes', n_classes, 2)
  num_examples = _check_int('num_examples', num_examples, 2)
  x, y = gaussian_blobs(num_examples, num_features, n_classes,
                        pipeline.check_seed(seed))
  num_train = num_examples - _num_eval(num_examples)
  column = tf.compat.v1.feature_column.numeric_column('x',
                                                      shape=[num_features])
  return arrays.ArrayData(
      kind='tabular', n_classes=n_classes, feature_columns=[column],
      image_shape=None, train=({'x': x[:num_train]}, y[:num_train]),
      eval=({'x': x[num_train:]}, y[num_train:]),
      eval_ids=[str(i) for i in range(num_train, num_examples)])


class SyntheticImageData(data_lib.Data):
  """Images generated inside the input graph, one pattern per class.

  Example i is a function of (seed, i) only (stateless random ops), so the
  data are the same every run without being stored: the graph holds just the
  class patterns, and the images are made by parallel map calls.
  """

  def __init__(self, image_shape: Tuple[int, int, int], n_classes: int,
               num_examples: int, seed: int):
    """Use `synthetic_images`, which checks the arguments.

    Args:
      image_shape: (H, W, C).
      n_classes: Number of classes.
      num_examples: Train plus eval examples.
      seed: Fixes the patterns and images.
    """
    super().__init__(kind='image', n_classes=n_classes, feature_columns=[],
                     image_shape=image_shape)
    self._seed = seed
    self._num_eval = _num_eval(num_examples)
    self._num_train = num_examples - self._num_eval
    rng = np.random.RandomState(seed)
    # Patterns in [0.2, 0.8] leave room for the noise inside [0, 1].
    self._patterns = (0.2 + 0.6 * rng.rand(n_classes, *self.image_shape)
                     ).astype(np.float32)

  def _example(self, index: tf.Tensor):
    index = tf.cast(index, tf.int64)
    seed = tf.constant(self._seed, tf.int64)
    label = tf.random.stateless_uniform(
        [], tf.stack([seed, 2 * index]), minval=0, maxval=self.n_classes,
        dtype=tf.int32)
    noise = tf.random.stateless_normal(
        self.image_shape, tf.stack([seed, 2 * index + 1]),
        stddev=_IMAGE_NOISE)
    image = tf.gather(tf.constant(self._patterns), label) + noise
    return {'image': tf.clip_by_value(image, 0.0, 1.0)}, label

  def _indices(self, split: str, shuffle: bool,
               seed: int) -> tf.data.Dataset:
    if split == data_lib.TRAIN:
      indices = tf.data.Dataset.range(self._num_train)
    else:
      indices = tf.data.Dataset.range(self._num_train,
                                      self._num_train + self._num_eval)
    if shuffle:
      # Shuffling indices before generating keeps the buffer tiny.
      indices = pipeline.shuffle(indices, self._num_train, seed)
    return indices

  def _examples(self, split, shuffle=False, seed=0):
    return pipeline.parallel_map(self._indices(split, shuffle, seed),
                                 self._example)

  def _unparsed(self, split, shuffle=False, seed=0):
    # The indices are the records: a task makes only its own rows' images.
    signature = ({'image': tf.TensorSpec(self.image_shape, tf.float32)},
                 tf.TensorSpec([], tf.int32))
    return data_lib.Unparsed(
        self._indices(split, shuffle, seed),
        lambda indices: pipeline.map_rows(self._example, indices, signature))

  def example_ids(self) -> List[str]:
    return [str(i) for i in range(self._num_train,
                                  self._num_train + self._num_eval)]


def synthetic_images(image_shape: Tuple[int, int, int] = (32, 32, 3),
                     n_classes: int = 10, num_examples: int = 1280,
                     seed: int = 0) -> SyntheticImageData:
  """Image Data: each class a random pattern plus per-image noise.

  Args:
    image_shape: (H, W, C) of features['image'], float32 in [0, 1].
    n_classes: Number of classes (>= 2).
    num_examples: Train plus eval examples; the last 20% are eval.
    seed: Fixes the patterns and images.

  Returns:
    The Data; example_ids are the eval examples' indices.

  Raises:
    ValueError: an argument is not an int (or shape of ints) in range.
  """
  if (not isinstance(image_shape, (tuple, list)) or len(image_shape) != 3):
    raise ValueError(f'image_shape={image_shape!r}; pass (height, width, '
                     'channels).')
  image_shape = tuple(_check_int('image_shape[]', d, 1) for d in image_shape)
  return SyntheticImageData(
      image_shape, _check_int('n_classes', n_classes, 2),
      _check_int('num_examples', num_examples, 2), pipeline.check_seed(seed))
