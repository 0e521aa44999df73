"""Cheap fingerprints of the training files, for the tasks to compare.

Two machines can hold different data at the same path: an interrupted copy
of an image folder, a file regenerated with other rows but the same length,
another working directory with a file of the same name. A synchronous
cluster would train on both without an error, so every task states what it
found and the tasks compare (cluster_agreement).

What is stated, per file matched by a `--train-files` pattern (a directory
counts with every file below it): its name, and for a sample of at most
`SAMPLED_FILES` files spread evenly over the sorted list, their size and a
digest of their bytes -- the whole file up to `WHOLE_BYTES`, beyond that
`BLOCKS` blocks of `BLOCK_BYTES` spread from its first byte to its last.
So a start-up reads at most SAMPLED_FILES x WHOLE_BYTES, whatever the data
set's size. What this misses: an edit between the blocks of a large file,
and a file outside the sample that changed but kept its name.
"""

import hashlib
import os
from typing import Iterator, List

import tensorflow as tf

SAMPLED_FILES = 64
WHOLE_BYTES = 1 << 20
BLOCK_BYTES = 64 << 10
BLOCKS = 16


def of_patterns(patterns: List[str]) -> List[List[object]]:
  """What every task must find at `patterns`, as JSON-ready lists.

  Args:
    patterns: File names, glob patterns or directories.

  Returns:
    Per file, in sorted order: [name], or [name, bytes, digest] for the
    sampled files.
  """
  names = sorted(set(_files(patterns)))
  sampled = set(_spread(len(names), SAMPLED_FILES))
  return [[name, *(_fingerprint(name) if i in sampled else ())]
          for i, name in enumerate(names)]


def _files(patterns: List[str]) -> Iterator[str]:
  for pattern in patterns or []:
    for match in tf.io.gfile.glob(pattern):
      if not tf.io.gfile.isdir(match):
        yield match
        continue
      # An image folder: a class folder copied halfway has fewer files.
      for folder, _, files in tf.io.gfile.walk(match):
        for name in files:
          yield os.path.join(folder, name)


def _spread(count: int, most: int) -> List[int]:
  """`most` indexes of [0, count) spread evenly, first and last included."""
  if count <= most:
    return list(range(count))
  return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})


def _fingerprint(name: str) -> List[object]:
  size = tf.io.gfile.stat(name).length
  digest = hashlib.sha256()
  with tf.io.gfile.GFile(name, 'rb') as f:
    if size <= WHOLE_BYTES:
      digest.update(f.read())
    else:
      for offset in _spread(size - BLOCK_BYTES + 1, BLOCKS):
        f.seek(offset)
        digest.update(f.read(BLOCK_BYTES))
  return [size, digest.hexdigest()[:16]]
