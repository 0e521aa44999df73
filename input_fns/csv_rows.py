"""Parsing CSV rows in the graph, with a reason when it is malformed.

`parse_row` never fails: a malformed row (wrong field count, bad quoting, a
non-number in a numeric column, an empty field without a default, an unknown
label, and unless allowed a NaN or infinite number) is parsed from harmless
stand-in values and comes with a non-empty `problem` string. The caller then either asserts that `problem` is empty,
naming the file and line, or filters the row out; tf.io.decode_csv and
tf.strings.to_number alone would fail with a message naming neither.
"""

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from input_fns import columns as columns_lib

# A field is either quoted (quotes inside doubled) or has no quote or comma;
# the same grammar tf.io.decode_csv accepts.
_QUOTED = r'"(?:[^"]|"")*"'
_FIELD = rf'(?:{_QUOTED}|[^",]*)'
_ROW = rf'{_FIELD}(?:,{_FIELD})*'
# What tf.strings.to_number parses as a float.
_NUMBER = (r'(?i)[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?'
           r'|[-+]?(?:inf|infinity|nan)')
# tf.strings.to_number reads 'inf' but not 'infinity'.
_INFINITY = r'(?i)inf(?:inity)?$'
# Up to 9 digits always fits int32.
_CLASS_ID = r'[-+]?\d{1,9}'


@dataclasses.dataclass(frozen=True)
class Schema:
  """What the columns of a CSV file hold.

  Attributes:
    columns: All column names, in file order.
    label_column: The label's column.
    categorical: Categorical column -> vocabulary list or hash-bucket count;
      other feature columns are numeric.
    defaults: Column -> value for empty fields.
    label_vocabulary: The labels' string values (id = position), or None
      for int class ids.
    n_classes: Number of classes.
  """
  columns: Tuple[str, ...]
  label_column: str
  categorical: Mapping[str, Any]
  defaults: Mapping[str, Any]
  label_vocabulary: Optional[Tuple[str, ...]]
  n_classes: int

  @property
  def feature_names(self) -> List[str]:
    return [name for name in self.columns if name != self.label_column]


def _quote(value: tf.Tensor) -> tf.Tensor:
  # Backticks: tf.debugging.Assert escapes quotes in its message.
  return tf.strings.join(['`', value, '`'])


class _Problems:
  """The first problem found in a row, built up check by check."""

  def __init__(self):
    self._checks = []

  def add(self, failed: tf.Tensor, *message_parts) -> None:
    self._checks.append((failed, tf.strings.join(list(message_parts))))

  def first(self) -> tf.Tensor:
    problem = tf.constant('')
    for failed, message in reversed(self._checks):
      problem = tf.where(failed, message, problem)
    return problem


def _field_count(line: tf.Tensor) -> tf.Tensor:
  # Quoted fields may hold commas: replace them before counting commas.
  unquoted = tf.strings.regex_replace(line, _QUOTED, 'q')
  commas = (tf.strings.length(unquoted) -
            tf.strings.length(tf.strings.regex_replace(unquoted, ',', '')))
  return commas + 1


def _numeric(name: str, field: tf.Tensor, default: Any,
             allow_non_finite: bool, problems: _Problems) -> tf.Tensor:
  empty = tf.equal(field, '')
  is_number = tf.strings.regex_full_match(field, _NUMBER)
  problems.add(tf.logical_not(empty | is_number),
               f'column `{name}`: ', _quote(field), ' is not a number')
  number = tf.strings.regex_replace(field, _INFINITY, 'inf')
  value = tf.strings.to_number(tf.where(is_number, number, '0'), tf.float32)
  if not allow_non_finite:
    # A NaN or inf feature trains a NaN model without any error; so does a
    # number beyond float32's range, which parses as inf.
    problems.add(is_number & tf.logical_not(tf.math.is_finite(value)),
                 f'column `{name}`: ', _quote(field), ' is not a finite '
                 'float32 (pass --allow-non-finite / allow_non_finite=True '
                 'to keep such values)')
  if default is None:
    problems.add(empty, f'column `{name}` is empty and has no default '
                 '(pass defaults={...})')
    return value
  return tf.where(empty, tf.constant(float(default), tf.float32), value)


def _categorical(name: str, field: tf.Tensor, default: Any,
                 problems: _Problems) -> tf.Tensor:
  empty = tf.equal(field, '')
  if default is None:
    problems.add(empty, f'column `{name}` is empty and has no default '
                 '(pass defaults={...})')
    return field
  return tf.where(empty, tf.constant(str(default)), field)


def _label(schema: Schema, field: tf.Tensor,
           problems: _Problems) -> tf.Tensor:
  name = schema.label_column
  empty = tf.equal(field, '')
  problems.add(empty, f'label column `{name}` is empty')
  if schema.label_vocabulary is not None:
    # Each field (one, or one per row of a batch) against every value.
    matches = tf.equal(tf.constant(schema.label_vocabulary),
                       field[..., tf.newaxis])
    problems.add(tf.logical_not(empty | tf.reduce_any(matches, axis=-1)),
                 'label ', _quote(field), ' is not in label_vocabulary')
    return tf.argmax(tf.cast(matches, tf.int32), axis=-1,
                     output_type=tf.int32)
  is_int = tf.strings.regex_full_match(field, _CLASS_ID)
  label = tf.strings.to_number(tf.where(is_int, field, '-1'), tf.int32)
  in_range = is_int & (label >= 0) & (label < schema.n_classes)
  problems.add(tf.logical_not(empty | in_range), 'label ', _quote(field),
               f' is not a class id in [0, {schema.n_classes})')
  return tf.maximum(label, 0)


def parse_row(schema: Schema, line: tf.Tensor, allow_non_finite: bool = False
             ) -> Tuple[Dict[str, tf.Tensor], tf.Tensor, tf.Tensor]:
  """Parses one CSV line, or a batch of them.

  Fields are stripped of surrounding spaces; an empty field takes its
  column's default. Every op works row by row, so a batch parses to the
  rows' parses, stacked.

  Args:
    schema: The file's columns.
    line: A string Tensor: one line without its newline (a scalar), or a
      batch of them ([rows], none included).
    allow_non_finite: Whether a numeric field may be NaN or infinite (or
      overflow float32); otherwise such a row is malformed.

  Returns:
    (features: name -> float32 or string Tensor, label: int32, problem:
    string, '' when the row is well formed), each of `line`'s shape. The
    features and label of a malformed row are meaningless.
  """
  problems = _Problems()
  num_columns = len(schema.columns)
  syntax_ok = tf.strings.regex_full_match(line, _ROW)
  problems.add(tf.logical_not(syntax_ok),
               'malformed quoting (a quoted field must be all of the field, '
               'with quotes inside doubled)')
  count = _field_count(line)
  count_ok = tf.equal(count, num_columns)
  problems.add(syntax_ok & tf.logical_not(count_ok),
               f'expected {num_columns} fields, found ',
               tf.strings.as_string(count))
  # decode_csv fails on a malformed line; a blank row of the right width
  # parses, and `problem` already says what was wrong.
  safe_line = tf.where(syntax_ok & count_ok, line, ',' * (num_columns - 1))
  fields = tf.io.decode_csv(safe_line, [['']] * num_columns)
  features, label = {}, None
  for name, field in zip(schema.columns, fields):
    field = tf.strings.strip(field)
    default = schema.defaults.get(name)
    if name == schema.label_column:
      label = _label(schema, field, problems)
    elif name in schema.categorical:
      features[name] = _categorical(name, field, default, problems)
    else:
      features[name] = _numeric(name, field, default, allow_non_finite,
                                problems)
  return features, label, problems.first()


def _fits_float32(value: float) -> bool:
  """Whether value is finite as the float32 the column holds."""
  with np.errstate(over='ignore'):
    return math.isfinite(np.float32(value))


def check_defaults(defaults: Mapping[str, Any], schema_columns: Sequence[str],
                   label_column: str, categorical: Mapping[str, Any],
                   allow_non_finite: bool = False) -> Dict[str, Any]:
  """Validates `defaults`: known columns, numbers for numeric, strings else.

  Raises:
    ValueError: an unknown column, a default for the label, or a NaN or
      infinite numeric default without allow_non_finite.
    TypeError: a default of the wrong type.
  """
  checked = {}
  for name, value in (defaults or {}).items():
    if name not in schema_columns:
      raise ValueError(f'defaults[{name!r}]: no such column; columns are '
                       f'{list(schema_columns)}.')
    if name == label_column:
      raise ValueError(f'defaults[{name!r}]: the label column cannot have a '
                       'default; a row without a label is malformed.')
    if name in categorical:
      if not isinstance(value, str):
        raise TypeError(f'defaults[{name!r}]={value!r}; a categorical '
                        'column needs a string default.')
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
      raise TypeError(f'defaults[{name!r}]={value!r}; a numeric column '
                      'needs a number default.')
    elif not allow_non_finite and not _fits_float32(value):
      raise ValueError(f'defaults[{name!r}]={value!r} is not a finite '
                       'float32; pass a finite default, or '
                       'allow_non_finite=True.')
    checked[name] = value
  return checked


def feature_columns(schema: Schema) -> list:
  """Feature columns for the schema's features, in file order."""
  return columns_lib.tabular_columns(schema.feature_names, schema.categorical)
