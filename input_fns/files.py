"""File globs, expanded and checked when a source is built.

A glob that matches nothing, or only files without data, is a mistake the
user should hear about before the first training step rather than as an
empty or stalled input pipeline.
"""

from typing import Callable, List, Sequence, Union

import tensorflow as tf

Globs = Union[str, Sequence[str]]


def _as_list(globs: Globs, name: str) -> List[str]:
  if isinstance(globs, str):
    return [globs]  # One glob is a common shorthand for a list of one.
  if (not isinstance(globs, (list, tuple)) or not globs or
      not all(isinstance(glob, str) and glob for glob in globs)):
    raise TypeError(f'{name}={globs!r}; pass a non-empty list of file globs '
                    "(strings such as 'data/train-*.csv').")
  return list(globs)


def expand(globs: Globs, name: str,
           has_data: Callable[[str], bool]) -> List[str]:
  """The files the globs match, in glob order then sorted, without repeats.

  Args:
    globs: A list of globs (tf.io.gfile.glob patterns), or one glob.
    name: The argument's name, for error messages (e.g. 'train_files').
    has_data: Whether a file holds at least one example; called once for
      every matched file.

  Returns:
    The matched files; the order fixes the eval and predict order.

  Raises:
    TypeError: globs is not a non-empty list of strings.
    ValueError: a glob matches no file, or only files without examples.
  """
  files, seen = [], set()
  for glob in _as_list(globs, name):
    matches = sorted(path for path in tf.io.gfile.glob(glob)
                     if not tf.io.gfile.isdir(path))
    if not matches:
      raise ValueError(f'{name}: the glob {glob!r} matches no file; check the '
                       'path (globs are expanded by tf.io.gfile.glob).')
    # Every file is looked at (no short cut): callers check them all.
    if not any([has_data(path) for path in matches]):
      raise ValueError(f'{name}: the glob {glob!r} matches only files without '
                       f'examples ({len(matches)} file(s), e.g. '
                       f'{matches[0]!r}).')
    for path in matches:
      if path not in seen:
        seen.add(path)
        files.append(path)
  return files


def is_nonempty(path: str) -> bool:
  """Whether the file has at least one byte."""
  return tf.io.gfile.stat(path).length > 0
