"""The tf.data steps every source shares: file interleave, shuffle, batch.

Each source turns its files or arrays into a dataset of single examples; these
helpers read files in parallel, shuffle with a seed, batch and prefetch, the
same way for every source, so that the towers are never left waiting.
"""

from typing import Any, Callable, List, Sequence

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

AUTOTUNE = tf.data.AUTOTUNE
# Rows held for shuffling file-backed data; files are also shuffled, so this
# only has to mix rows of the files being read at the same time.
DEFAULT_SHUFFLE_BUFFER = 10_000
# Files read at once during training: enough to hide one slow file.
MAX_PARALLEL_FILES = 8


def check_batch_size(batch_size: Any) -> int:
  """Returns `batch_size` if it is an int >= 1.

  Raises:
    ValueError: batch_size is not an int >= 1.
  """
  if (isinstance(batch_size, bool) or
      not isinstance(batch_size, (int, np.integer)) or batch_size < 1):
    raise ValueError(f'batch_size={batch_size!r}; pass an int >= 1 (the '
                     'global batch, which the towers split).')
  return int(batch_size)


def check_seed(seed: Any) -> int:
  """Returns `seed` if it is an int >= 0.

  Raises:
    ValueError: seed is not an int >= 0.
  """
  if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or
      seed < 0):
    raise ValueError(f'seed={seed!r}; pass an int >= 0.')
  return int(seed)


def interleave_files(files: Sequence[str],
                     read_file: Callable[[tf.Tensor], tf.data.Dataset],
                     *, sequential: bool, shuffle: bool = False,
                     seed: int = 0) -> tf.data.Dataset:
  """Reads several files in parallel into one dataset.

  Args:
    files: File paths.
    read_file: Maps a scalar string Tensor (a path) to that file's dataset.
    sequential: Whether to yield the files one after the other, in order (for
      eval and predict, whose outputs must line up with `example_ids`). The
      next file is still opened ahead in the background. Otherwise up to
      MAX_PARALLEL_FILES files are read at once and their rows alternate.
    shuffle: Whether to shuffle the file order, anew each epoch.
    seed: The shuffle's op-level seed.

  Returns:
    A dataset of the files' elements.
  """
  names = tf.data.Dataset.from_tensor_slices(list(files))
  if shuffle:
    names = names.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
  cycle_length = 1 if sequential else min(len(files), MAX_PARALLEL_FILES)
  # deterministic=True keeps runs reproducible for a given seed; the parallel
  # readers still overlap their I/O.
  return names.interleave(read_file, cycle_length=cycle_length,
                          num_parallel_calls=AUTOTUNE, deterministic=True)


def parallel_map(dataset: tf.data.Dataset,
                 fn: Callable[..., Any]) -> tf.data.Dataset:
  """`dataset.map(fn)` on parallel threads, keeping the order."""
  return dataset.map(fn, num_parallel_calls=AUTOTUNE, deterministic=True)


def map_rows(fn: Callable[..., Any], rows: Any,
             signature: Any) -> Any:
  """`fn` on each row of a batch, the results stacked in order.

  For a parse that works on one row at a time, applied to a batch (e.g. a
  task's share of a global batch) of any number of rows, none included.

  Args:
    fn: Maps one row (the leaves of `rows` without their batch dimension,
      as positional arguments when `rows` is a tuple) to a nest of Tensors.
    rows: A Tensor, or a tuple of Tensors, with the rows as first dimension.
    signature: The nest of tf.TensorSpec `fn` returns; fully defined
      shapes, so that an empty batch still has them.

  Returns:
    fn's results with a batch dimension in front.
  """
  call = (lambda row: fn(*row)) if isinstance(rows, tuple) else fn
  return tf.map_fn(call, rows, fn_output_signature=signature)


def assert_no_bad_row(bad: tf.Tensor, messages: tf.Tensor) -> tf.Operation:
  """An assert that fails with the message of the first bad row.

  Args:
    bad: bool Tensor, a scalar (one row) or [rows].
    messages: string Tensor of the same shape: why each row would be bad
      (read only for the failing one).

  Returns:
    The assert op; make the row's values depend on it.
  """
  bad, messages = tf.reshape(bad, [-1]), tf.reshape(messages, [-1])
  # An empty string when no row is bad; the first bad row's message else.
  first = tf.strings.reduce_join(tf.boolean_mask(messages, bad)[:1])
  return tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [first])


def shuffle(dataset: tf.data.Dataset, buffer_size: int,
            seed: int) -> tf.data.Dataset:
  """Shuffles with a seed, in a new order each epoch."""
  return dataset.shuffle(max(1, int(buffer_size)), seed=seed,
                         reshuffle_each_iteration=True)


def batch_and_prefetch(dataset: tf.data.Dataset,
                       batch_size: int) -> tf.data.Dataset:
  """Batches, keeping a smaller last batch, and prefetches.

  The remainder is kept because the towers split uneven batches themselves;
  dropping it would lose eval and predict examples.
  """
  return dataset.batch(check_batch_size(batch_size)).prefetch(AUTOTUNE)


def collect(make_dataset: Callable[[], tf.data.Dataset],
            batch_size: int = 4096) -> List[Any]:
  """Runs a finite dataset to its end and returns its batches as numpy.

  Runs in a graph of its own, so it works whether the caller is eager or
  building a graph (e.g. the Estimator's).

  Args:
    make_dataset: Builds the dataset of single elements.
    batch_size: Elements fetched per session call.

  Returns:
    The batched elements, as numpy structures, in order.
  """
  with tf.Graph().as_default():
    dataset = make_dataset().batch(batch_size)
    next_batch = tf1.data.make_one_shot_iterator(dataset).get_next()
    batches = []
    with tf1.Session() as session:
      while True:
        try:
          batches.append(session.run(next_batch))
        except tf.errors.OutOfRangeError:
          return batches
