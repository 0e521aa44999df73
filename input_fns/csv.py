"""CSV files with a schema: `csv_data(...)`.

Rows are read with tf.data.TextLineDataset, numbered by line, and parsed in
parallel map calls (see csv_rows); training parses batches of lines, after
a synchronous cluster's task has kept its share of them. A malformed row stops the input pipeline
with an InvalidArgumentError that names its file and line, or, with
`skip_malformed=True`, is left out; `CsvData.skipped_rows()` counts such
rows per file. A NaN or infinite number makes a row malformed unless
`allow_non_finite=True`: it would train a NaN model without any error.
"""

import csv as stdlib_csv
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from input_fns import columns as columns_lib
from input_fns import csv_rows
from input_fns import data as data_lib
from input_fns import files as files_lib
from input_fns import pipeline

_BOM = '\ufeff'


class _Head:
  """A file's header fields and whether a data row follows it."""

  def __init__(self, path: str, header: bool):
    self.fields: Optional[List[str]] = None
    self.has_rows = False
    with tf.io.gfile.GFile(path, 'r') as f:
      for number, line in enumerate(f):
        if number == 0 and header:
          line = line[1:] if line.startswith(_BOM) else line
          self.fields = [field.strip() for field in
                         next(stdlib_csv.reader([line]), [])]
        elif line.strip():
          self.has_rows = True
          return


def _location(path: tf.Tensor, line_number: tf.Tensor) -> tf.Tensor:
  return tf.strings.join([path, ':', tf.strings.as_string(line_number)])


class CsvData(data_lib.Data):
  """Tabular Data read from CSV files; see `csv_data`."""

  def __init__(self, schema: csv_rows.Schema, train_files: Sequence[str],
               eval_files: Sequence[str], *, header: bool,
               skip_malformed: bool, shuffle_buffer_size: int,
               allow_non_finite: bool = False):
    """Use `csv_data`, which checks the arguments.

    Args:
      schema: The files' columns.
      train_files: Training files (expanded globs).
      eval_files: Eval and predict files, in order.
      header: Whether each file's first line is a header.
      skip_malformed: Whether to leave out malformed rows.
      shuffle_buffer_size: Rows held for shuffling training data.
      allow_non_finite: Whether numeric fields may be NaN or infinite.
    """
    super().__init__(kind='tabular', n_classes=schema.n_classes,
                     feature_columns=csv_rows.feature_columns(schema),
                     image_shape=None)
    self.schema = schema
    self.skip_malformed = skip_malformed
    self.allow_non_finite = allow_non_finite
    self._files = {data_lib.TRAIN: list(train_files),
                   data_lib.EVAL: list(eval_files)}
    self._header = header
    self._shuffle_buffer_size = shuffle_buffer_size

  def _read_file(self, path: tf.Tensor) -> tf.data.Dataset:
    """(path, line number from 1, line) for the data lines of one file."""
    lines = tf.data.Dataset.zip((tf.data.TextLineDataset(path),
                                 tf.data.Dataset.counter(1)))
    if self._header:
      lines = lines.skip(1)
    # Blank lines (often one at the end) are not rows.
    lines = lines.filter(
        lambda line, number: tf.strings.length(tf.strings.strip(line)) > 0)
    return lines.map(lambda line, number: (path, number, line))

  def _rows(self, split: str, shuffle: bool = False, seed: int = 0
           ) -> tf.data.Dataset:
    """(path, line number, line) of every data row of `split`."""
    return pipeline.interleave_files(
        self._files[split], self._read_file, sequential=split != data_lib.TRAIN,
        shuffle=shuffle, seed=seed)

  def _parse(self, line: tf.Tensor):
    return csv_rows.parse_row(self.schema, line, self.allow_non_finite)

  def _problems(self, split: str) -> tf.data.Dataset:
    """(path, line number, problem) per row; problem is '' if well formed."""

    def parse(path, number, line):
      return path, number, self._parse(line)[2]

    return pipeline.parallel_map(self._rows(split), parse)

  def _shuffled_rows(self, split: str, shuffle: bool, seed: int
                    ) -> tf.data.Dataset:
    rows = self._rows(split, shuffle=shuffle, seed=seed)
    if shuffle:
      rows = pipeline.shuffle(rows, self._shuffle_buffer_size, seed)
    return rows

  def _parse_or_fail(self, path: tf.Tensor, number: tf.Tensor,
                     line: tf.Tensor):
    """(features, label) of one row or a batch; fails on a malformed row."""
    features, label, problem = self._parse(line)
    message = tf.strings.join([
        'Malformed CSV row ', _location(path, number), ': ', problem,
        '. Fix the row, or pass skip_malformed=True to skip such rows.'])
    check = pipeline.assert_no_bad_row(tf.not_equal(problem, ''), message)
    with tf.control_dependencies([check]):
      return tf.nest.map_structure(tf.identity, (features, label))

  def _unparsed(self, split, shuffle=False, seed=0):
    if self.skip_malformed:
      # Which rows make up a batch depends on which are malformed, which
      # only parsing tells.
      return None
    # The same seeded shuffle as _examples': the same order, of lines.
    return data_lib.Unparsed(self._shuffled_rows(split, shuffle, seed),
                             self._parse_or_fail)

  def _examples(self, split, shuffle=False, seed=0):
    if not self.skip_malformed:
      # Shuffling lines before parsing draws the same order as shuffling
      # their parses would (the order depends on the seed and the count).
      return pipeline.parallel_map(self._shuffled_rows(split, shuffle, seed),
                                   self._parse_or_fail)

    def parse(path, number, line):
      del path, number  # A skipped row needs no location.
      return self._parse(line)

    examples = pipeline.parallel_map(
        self._rows(split, shuffle=shuffle, seed=seed), parse)
    examples = examples.filter(
        lambda features, label, problem: tf.equal(problem, ''))
    examples = examples.map(lambda features, label, problem:
                            (features, label))
    if shuffle:
      examples = pipeline.shuffle(examples, self._shuffle_buffer_size, seed)
    return examples

  def _scan(self, split: str) -> Tuple[int, List[Tuple[str, int, str]]]:
    """Rows of `split`, and (file, line, problem) of each malformed one."""
    if split not in self._files:
      raise ValueError(f"split={split!r}; use 'train' or 'eval'.")
    rows, found = 0, []
    for paths, numbers, problems in pipeline.collect(
        lambda: self._problems(split)):
      rows += len(problems)
      for path, number, problem in zip(paths, numbers, problems):
        if problem:
          found.append((path.decode(), int(number), problem.decode()))
    return rows, found

  def row_counts(self, split: str = data_lib.TRAIN) -> Tuple[int, List[str]]:
    """Reads `split` once: its row count and its malformed rows.

    Args:
      split: 'train' or 'eval' (the eval files are also predict's).

    Returns:
      (rows, ['file:line: problem' for each malformed row, in file order]);
      with skip_malformed the input_fns yield rows - len(malformed) examples
      a pass.

    Raises:
      ValueError: split is neither 'train' nor 'eval'.
    """
    rows, found = self._scan(split)
    return rows, [f'{path}:{number}: {problem}'
                  for path, number, problem in found]

  def malformed_rows(self, split: str = data_lib.TRAIN) -> List[str]:
    """Reads `split` once and lists its malformed rows.

    Args:
      split: 'train' or 'eval' (the eval files are also predict's).

    Returns:
      'file:line: problem' for each malformed row, in file order.

    Raises:
      ValueError: split is neither 'train' nor 'eval'.
    """
    return self.row_counts(split)[1]

  def skipped_rows(self, split: str = data_lib.TRAIN) -> Dict[str, int]:
    """Reads `split` once and counts the rows skip_malformed leaves out.

    Every pass of the input_fns leaves out the same rows. With
    skip_malformed=False the pipeline stops at the first of them instead.

    Args:
      split: 'train' or 'eval' (the eval files are also predict's).

    Returns:
      File -> number of malformed rows, for every file of the split.

    Raises:
      ValueError: split is neither 'train' nor 'eval'.
    """
    _, found = self._scan(split)
    counts = {path: 0 for path in self._files[split]}
    for path, _, _ in found:
      counts[path] += 1
    return counts

  def example_ids(self) -> List[str]:
    """'file:line' (line from 1) for each row predict_input_fn yields.

    Raises:
      ValueError: an eval row is malformed and skip_malformed is False.
    """
    ids = []
    for paths, numbers, problems in pipeline.collect(
        lambda: self._problems(data_lib.EVAL)):
      for path, number, problem in zip(paths, numbers, problems):
        location = f'{path.decode()}:{number}'
        if not problem:
          ids.append(location)
        elif not self.skip_malformed:
          raise ValueError(f'Malformed CSV row {location}: {problem.decode()}'
                           '. Fix the row, or pass skip_malformed=True.')
    return ids

  def _serving_field_order(self) -> List[str]:
    return self.schema.feature_names

  def _serving_defaults(self) -> Mapping[str, Any]:
    return self.schema.defaults


def _check_columns(columns: Any) -> Tuple[str, ...]:
  if (not isinstance(columns, (list, tuple)) or
      not all(isinstance(name, str) for name in columns)):
    raise TypeError(f'columns={columns!r}; pass the column names in file '
                    'order, or None to read them from the header row.')
  if len(set(columns)) != len(columns):
    repeated = sorted({name for name in columns if columns.count(name) > 1})
    raise ValueError(f'columns repeat {repeated}; name each column once.')
  for name in columns:
    columns_lib.check_name(name, 'in columns')
  return tuple(columns)


def _resolve_columns(columns: Optional[Sequence[str]], header: bool,
                     heads: Mapping[str, _Head]) -> Tuple[str, ...]:
  """The columns, declared or from the headers, checked against every file."""
  # Empty files have no header; they add no rows either.
  heads = {path: head for path, head in heads.items()
           if head.fields is not None}
  paths = list(heads)
  if columns is None:
    if not header:
      raise ValueError('columns=None reads the names from a header row, but '
                       'header=False; pass columns=[...] in file order.')
    first = heads[paths[0]].fields
    for path in paths[1:]:
      if heads[path].fields != first:
        raise ValueError(
            f'The header of {path!r} ({heads[path].fields}) differs from '
            f'that of {paths[0]!r} ({first}); all files need the same '
            'columns.')
    for name in first:
      columns_lib.check_name(name, f'in the header of {paths[0]!r}; pass '
                             'columns=[...] to rename')
    return _check_columns(first)
  columns = _check_columns(columns)
  if header:
    for path, head in heads.items():
      if len(head.fields) != len(columns):
        raise ValueError(
            f'The header of {path!r} has {len(head.fields)} fields '
            f'({head.fields}) but columns names {len(columns)}; pass one name '
            'per field.')
  return columns


def _check_labels(label_vocabulary: Optional[Sequence[str]],
                  n_classes: Optional[int]
                 ) -> Tuple[Optional[Tuple[str, ...]], int]:
  if label_vocabulary is None:
    if (isinstance(n_classes, bool) or
        not isinstance(n_classes, (int, np.integer)) or n_classes < 2):
      raise ValueError(f'n_classes={n_classes!r}; with int labels (no '
                       'label_vocabulary) pass n_classes, an int >= 2.')
    return None, int(n_classes)
  if (not isinstance(label_vocabulary, (list, tuple)) or
      not all(isinstance(value, str) for value in label_vocabulary) or
      len(label_vocabulary) < 2 or
      len(set(label_vocabulary)) != len(label_vocabulary)):
    raise ValueError(f'label_vocabulary={label_vocabulary!r}; pass the >= 2 '
                     'distinct string labels, class id = position.')
  if n_classes is not None and n_classes != len(label_vocabulary):
    raise ValueError(f'n_classes={n_classes!r} but label_vocabulary has '
                     f'{len(label_vocabulary)} values; drop n_classes.')
  return tuple(label_vocabulary), len(label_vocabulary)


def csv_data(train_files: Sequence[str], eval_files: Sequence[str], *,
             label_column: str,
             columns: Optional[Sequence[str]] = None,
             header: bool = True,
             categorical_columns: Optional[Mapping[str, Any]] = None,
             defaults: Optional[Mapping[str, Any]] = None,
             label_vocabulary: Optional[Sequence[str]] = None,
             n_classes: Optional[int] = None,
             skip_malformed: bool = False,
             shuffle_buffer_size: int = pipeline.DEFAULT_SHUFFLE_BUFFER,
             allow_non_finite: bool = False) -> CsvData:
  """Tabular Data from CSV files.

  Features are {column: Tensor [batch]}: float32 for numeric columns, string
  for categorical ones (fields stripped of surrounding spaces). The serving
  'csv' format takes lines of the feature fields in file order, without the
  label.

  Args:
    train_files: Globs (tf.io.gfile.glob) of the training files.
    eval_files: Globs of the eval files, also read by predict_input_fn; their
      order (glob order, then sorted) is the eval and predict order.
    label_column: The column holding the label.
    columns: Column names in file order; None reads them from the first
      line of the files (then every file must have the same header).
    header: Whether each file's first line is a header to skip.
    categorical_columns: Column -> vocabulary list (an indicator column up
      to 16 values, else an embedding column) or int number of hash buckets
      (an embedding column of dimension max(2, round(buckets ** 0.25))).
      Every other non-label column is numeric.
    defaults: Column -> value for empty fields. An empty field of a column
      without a default makes its row malformed.
    label_vocabulary: String labels; class id = position. None: labels are
      int class ids in [0, n_classes).
    n_classes: Number of classes; required without label_vocabulary.
    skip_malformed: Whether to leave out malformed rows (wrong field count,
      bad quoting, a non-number in a numeric column, an empty field without
      default, an unknown label, a non-finite number without
      allow_non_finite) instead of failing with an error naming the file and
      line. `skipped_rows()` counts them.
    shuffle_buffer_size: Rows held for shuffling the training data.
    allow_non_finite: Whether numeric fields (and defaults) may be NaN or
      infinite, or overflow float32. By default such a row is malformed: it
      would make the loss NaN without any error.

  Returns:
    The Data; example_ids are 'file:line', lines counted from 1 with the
    header.

  Raises:
    ValueError: a glob matches no file or only files without rows; the
      columns, headers, label or defaults are inconsistent.
    TypeError: an argument has the wrong type.
  """
  heads = {}

  def has_rows(path):
    heads[path] = _Head(path, header)
    return heads[path].has_rows

  train = files_lib.expand(train_files, 'train_files', has_rows)
  evaluation = files_lib.expand(eval_files, 'eval_files', has_rows)
  all_columns = _resolve_columns(columns, header, heads)
  if label_column not in all_columns:
    raise ValueError(f'label_column={label_column!r} is not a column; columns '
                     f'are {list(all_columns)}.')
  if len(all_columns) < 2:
    raise ValueError(f'columns={list(all_columns)} has no feature besides the '
                     'label.')
  categorical = {}
  for name, spec in (categorical_columns or {}).items():
    if name not in all_columns or name == label_column:
      raise ValueError(f'categorical_columns[{name!r}]: not a feature column; '
                       f'feature columns are '
                       f'{[c for c in all_columns if c != label_column]}.')
    categorical[name] = columns_lib.check_categorical(name, spec)
  vocabulary, n_classes = _check_labels(label_vocabulary, n_classes)
  schema = csv_rows.Schema(
      columns=all_columns, label_column=label_column, categorical=categorical,
      defaults=csv_rows.check_defaults(defaults, all_columns, label_column,
                                       categorical, bool(allow_non_finite)),
      label_vocabulary=vocabulary, n_classes=n_classes)
  if (isinstance(shuffle_buffer_size, bool) or
      not isinstance(shuffle_buffer_size, int) or shuffle_buffer_size < 1):
    raise ValueError(f'shuffle_buffer_size={shuffle_buffer_size!r}; pass an '
                     'int >= 1.')
  return CsvData(schema, train, evaluation, header=bool(header),
                 skip_malformed=bool(skip_malformed),
                 shuffle_buffer_size=shuffle_buffer_size,
                 allow_non_finite=bool(allow_non_finite))
