"""An embedded synthetic classification problem: no download, same every run."""

from typing import Callable, Tuple

import numpy as np
import tensorflow as tf


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
