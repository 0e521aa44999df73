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
    ValueError: a glob matches no file, or only files without examples, or
      a remote glob's bucket cannot be reached.
  """
  files, seen = [], set()
  for glob in _as_list(globs, name):
    try:
      matches = sorted(path for path in tf.io.gfile.glob(glob)
                       if not tf.io.gfile.isdir(path))
    except tf.errors.OpError as e:
      if '://' not in glob:
        raise
      raise ValueError(f'{name}: {unreachable(glob, e)}') from e
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


def unreachable(path: str, error: Exception) -> str:
  """Why a remote path (gs://...) could not be read, and what to check.

  Args:
    path: The path or glob, e.g. 'gs://bucket/data/*.csv'.
    error: TensorFlow's error (e.g. a FailedPreconditionError from libcurl).

  Returns:
    One sentence naming the path, the bucket and TensorFlow's reason.
  """
  scheme, _, rest = path.partition('://')
  bucket = f'{scheme}://{rest.split("/", 1)[0]}'
  reason = (getattr(error, 'message', None) or str(error)).strip()
  reason = reason.splitlines()[0] if reason else type(error).__name__
  return (f'cannot read {path}: the bucket {bucket} is unreachable from this '
          f'machine ({reason}). Check the network and the credentials '
          '(GOOGLE_APPLICATION_CREDENTIALS, or gcloud auth '
          'application-default login).')
