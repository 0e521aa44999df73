"""Feature columns for tabular sources, from a declared column type.

A categorical column is declared as a vocabulary list (its values) or an int
(a hash-bucket count); everything else is numeric.
"""

import re
from typing import Any, Mapping, Sequence, Union

import numpy as np
import tensorflow as tf

fc = tf.compat.v1.feature_column

# Up to this many values a one-hot indicator is exact and cheap; beyond it an
# embedding keeps the input layer small.
MAX_INDICATOR_VOCABULARY = 16
# Feature columns open variable scopes named after the feature.
_VALID_NAME = re.compile(r'[A-Za-z0-9.][A-Za-z0-9_.\-]*')

Categorical = Union[Sequence[str], int]


def check_name(name: Any, where: str) -> str:
  """Returns `name` if a feature column can be named so.

  Raises:
    ValueError: name is not a string usable as a variable scope.
  """
  if not isinstance(name, str) or not _VALID_NAME.fullmatch(name):
    raise ValueError(
        f'Column name {name!r} ({where}) cannot name a feature column: use '
        'letters, digits, "_", "." and "-", starting with a letter or digit.')
  return name


def embedding_dimension(num_values: int) -> int:
  """The usual fourth-root rule of thumb, at least 2."""
  return max(2, int(round(num_values ** 0.25)))


def check_categorical(name: str, spec: Any) -> Categorical:
  """Validates a categorical declaration: vocabulary list or bucket count.

  Raises:
    TypeError: spec is neither a list of strings nor an int.
    ValueError: an empty or repetitive vocabulary, or a count < 1.
  """
  if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
    if spec < 1:
      raise ValueError(f'categorical_columns[{name!r}]={spec!r}: a hash '
                       'bucket count must be >= 1.')
    return int(spec)
  if (isinstance(spec, (list, tuple)) and
      all(isinstance(value, str) for value in spec)):
    if not spec or len(set(spec)) != len(spec):
      raise ValueError(f'categorical_columns[{name!r}]={spec!r}: pass a '
                       'non-empty vocabulary without repeated values.')
    return list(spec)
  raise TypeError(f'categorical_columns[{name!r}]={spec!r}; pass a list of '
                  'string values or an int number of hash buckets.')


def categorical_column(name: str, spec: Categorical):
  """An indicator or embedding column over a vocabulary or hash buckets.

  Values outside a vocabulary map to no category (an all-zero input).
  """
  if isinstance(spec, int):
    return fc.embedding_column(
        fc.categorical_column_with_hash_bucket(name, spec),
        embedding_dimension(spec))
  categorical = fc.categorical_column_with_vocabulary_list(name, spec)
  if len(spec) <= MAX_INDICATOR_VOCABULARY:
    return fc.indicator_column(categorical)
  return fc.embedding_column(categorical, embedding_dimension(len(spec)))


def tabular_columns(names: Sequence[str],
                    categorical: Mapping[str, Categorical],
                    shapes: Mapping[str, Sequence[int]] = None) -> list:
  """One feature column per name: categorical if declared, else numeric.

  Args:
    names: Feature names, in the order of the columns.
    categorical: Name -> vocabulary list or hash-bucket count.
    shapes: Name -> shape of a numeric feature (default scalar).

  Returns:
    tf.compat.v1.feature_column columns.
  """
  shapes = shapes or {}
  columns = []
  for name in names:
    if name in categorical:
      columns.append(categorical_column(name, categorical[name]))
    else:
      shape = tuple(shapes.get(name, ())) or (1,)
      columns.append(fc.numeric_column(name, shape=shape))
  return columns
