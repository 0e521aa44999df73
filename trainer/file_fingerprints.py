"""Cheap fingerprints of the training files, for the tasks to compare.

Two machines can hold different data at the same path: an interrupted copy
of an image folder, a file regenerated with other rows but the same length,
another working directory with a file of the same name. A synchronous
cluster would train on both without an error, so every task states what it
found and the tasks compare (cluster_agreement).

What is stated, per file matched by a `--train-files` pattern (a directory
is an image folder: its class folders and the images the image reader
lists in them): its name, and for a sample of at most
`SAMPLED_FILES` files spread evenly over the sorted list, their size and a
digest of their bytes -- the whole file up to `WHOLE_BYTES`, beyond that
`BLOCKS` blocks of `BLOCK_BYTES` spread from its first byte to its last.
So a start-up reads at most SAMPLED_FILES x WHOLE_BYTES, whatever the data
set's size. What this misses: an edit between the blocks of a large file,
and a file outside the sample that changed but kept its name.
"""

import hashlib
import os
from typing import List

import tensorflow as tf

from input_fns import image_folder

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
  files, folders = set(), set()
  for pattern in patterns or []:
    for match in tf.io.gfile.glob(pattern):
      if tf.io.gfile.isdir(match):
        _image_folder(match, files, folders)
      else:
        files.add(match)
  names = sorted(files)
  sampled = set(_spread(len(names), SAMPLED_FILES))
  # An empty class folder is a class too.
  return [[name, *(_fingerprint(name) if i in sampled else ())]
          for i, name in enumerate(names)] + [
              [os.path.join(folder, '')] for folder in sorted(folders)]


def _image_folder(root: str, files: set, folders: set) -> None:
  """The class folders below `root` and their images, as the image reader
  lists them: a copy interrupted halfway has fewer; a .DS_Store beside
  them is not read, so it does not count."""
  for name, paths in image_folder.list_classes(root, '--train-files').items():
    folders.add(os.path.join(root, name))
    files.update(paths)


def _spread(count: int, most: int) -> List[int]:
  """`most` indexes of [0, count) spread evenly, first and last included."""
  if count <= most:
    return list(range(count))
  return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})


def _fingerprint(name: str) -> List[object]:
  try:
    size = tf.io.gfile.stat(name).length
  except tf.errors.NotFoundError:  # A broken link: the input fails on it.
    return ['unreadable']
  digest = hashlib.sha256()
  with tf.io.gfile.GFile(name, 'rb') as f:
    if size <= WHOLE_BYTES:
      digest.update(f.read())
    else:
      for offset in _spread(size - BLOCK_BYTES + 1, BLOCKS):
        f.seek(offset)
        digest.update(f.read(BLOCK_BYTES))
  return [size, digest.hexdigest()[:16]]
