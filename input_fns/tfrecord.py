"""TFRecord files of tf.Example: `tfrecord_data(...)`.

Records are numbered per file and parsed in parallel map calls (training
parses batches, after a synchronous cluster's task has kept its share of
them); a label outside [0, n_classes), or unless allowed a NaN or infinite
float feature, stops the pipeline with an error naming the file and record. The serving
'example' format takes Examples like the training records (the label may be
left out): encoded images stay encoded.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from input_fns import columns as columns_lib
from input_fns import data as data_lib
from input_fns import files as files_lib
from input_fns import images
from input_fns import pipeline

_FEATURE_TYPES = (tf.io.FixedLenFeature, tf.io.VarLenFeature)


def _check_spec(feature_spec: Any) -> Dict[str, Any]:
  if not isinstance(feature_spec, Mapping) or not feature_spec:
    raise TypeError(f'feature_spec={feature_spec!r}; pass a dict feature '
                    'name -> tf.io.FixedLenFeature or tf.io.VarLenFeature.')
  for key, spec in feature_spec.items():
    if not isinstance(spec, _FEATURE_TYPES):
      raise TypeError(f'feature_spec[{key!r}]={spec!r}; pass a '
                      'tf.io.FixedLenFeature or tf.io.VarLenFeature.')
  return dict(feature_spec)


def _check_label(feature_spec: Mapping[str, Any], label_key: str) -> None:
  spec = feature_spec.get(label_key)
  if spec is None:
    raise ValueError(f'label_key={label_key!r} is not in feature_spec '
                     f'(keys: {sorted(feature_spec)}).')
  if (not isinstance(spec, tf.io.FixedLenFeature) or spec.dtype != tf.int64 or
      tuple(spec.shape) not in ((), (1,))):
    raise ValueError(f'feature_spec[{label_key!r}]={spec!r}; the label must '
                     'be tf.io.FixedLenFeature([], tf.int64), an int class '
                     'id.')


def _image_encoding(feature_spec: Mapping[str, Any], image_key: str,
                    image_shape: Tuple[int, int, int]) -> str:
  """'encoded' (PNG/JPEG bytes) or 'raw' (H*W*C floats) for the image."""
  spec = feature_spec.get(image_key)
  if spec is None:
    raise ValueError(f'image_key={image_key!r} is not in feature_spec '
                     f'(keys: {sorted(feature_spec)}).')
  if isinstance(spec, tf.io.FixedLenFeature):
    if spec.dtype == tf.string and tuple(spec.shape) in ((), (1,)):
      return 'encoded'
    size = int(np.prod(spec.shape, dtype=np.int64))
    if spec.dtype == tf.float32 and size == int(np.prod(image_shape)):
      return 'raw'
  raise ValueError(
      f'feature_spec[{image_key!r}]={spec!r}; an image must be '
      'FixedLenFeature([], tf.string) of PNG/JPEG bytes, or '
      f'FixedLenFeature([{int(np.prod(image_shape))}], tf.float32) of H*W*C '
      f'floats in [0, 1] for image_shape={image_shape}.')


def _tabular_columns(feature_spec: Mapping[str, Any], label_key: str,
                     categorical_columns: Mapping[str, Any]) -> list:
  """Feature columns for the non-label features; checks their types."""
  categorical = {}
  for key, spec in (categorical_columns or {}).items():
    feature = feature_spec.get(key)
    if key == label_key or feature is None or feature.dtype != tf.string:
      raise ValueError(f'categorical_columns[{key!r}]: not a string feature '
                       'of feature_spec.')
    categorical[key] = columns_lib.check_categorical(key, spec)
  names, shapes = [], {}
  for key, spec in feature_spec.items():
    if key == label_key:
      continue
    columns_lib.check_name(key, 'a feature_spec key')
    if spec.dtype == tf.string and key not in categorical:
      raise ValueError(
          f'feature_spec[{key!r}] is a string feature; declare it in '
          'categorical_columns as a vocabulary list or a hash-bucket count.')
    if isinstance(spec, tf.io.VarLenFeature) and spec.dtype != tf.string:
      raise ValueError(
          f'feature_spec[{key!r}] is a numeric VarLenFeature, which numeric '
          'feature columns cannot take; use tf.io.FixedLenFeature(shape, '
          f'{spec.dtype.name}, default_value=...).')
    if isinstance(spec, tf.io.FixedLenFeature):
      shapes[key] = tuple(spec.shape)
    names.append(key)
  return columns_lib.tabular_columns(names, categorical, shapes)


def _non_finite_rows(value: Any, batched: bool) -> tf.Tensor:
  """Whether each record (or the one record) has a NaN or inf in `value`."""
  if isinstance(value, tf.SparseTensor):
    bad = tf.cast(tf.logical_not(tf.math.is_finite(value.values)), tf.int32)
    if not batched:
      return tf.reduce_any(bad > 0)
    rows = tf.cast(value.dense_shape[0], tf.int32)
    return tf.math.unsorted_segment_max(bad, value.indices[:, 0], rows) > 0
  finite = tf.math.is_finite(value)
  if not batched:
    return tf.logical_not(tf.reduce_all(finite))
  return tf.logical_not(tf.reduce_all(finite,
                                      axis=list(range(1, finite.shape.rank))))


class TFRecordData(data_lib.Data):
  """Data read from TFRecord files of tf.Example; see `tfrecord_data`."""

  def __init__(self, *, train_files: Sequence[str],
               eval_files: Sequence[str], feature_spec: Mapping[str, Any],
               label_key: str, n_classes: int, feature_columns: list,
               image_key: Optional[str],
               image_shape: Optional[Tuple[int, int, int]],
               image_encoding: Optional[str], shuffle_buffer_size: int,
               allow_non_finite: bool = False):
    """Use `tfrecord_data`, which checks the arguments.

    Args:
      train_files: Training files (expanded globs).
      eval_files: Eval and predict files, in order.
      feature_spec: Feature name -> FixedLenFeature or VarLenFeature.
      label_key: The label's feature.
      n_classes: Number of classes.
      feature_columns: Columns of tabular data; [] for images.
      image_key: The image's feature, or None for tabular data.
      image_shape: (H, W, C) of images, else None.
      image_encoding: 'encoded' or 'raw' for images, else None.
      shuffle_buffer_size: Records held for shuffling training data.
      allow_non_finite: Whether float features may be NaN or infinite.
    """
    super().__init__(kind='tabular' if image_key is None else 'image',
                     n_classes=n_classes, feature_columns=feature_columns,
                     image_shape=image_shape)
    self._files = {data_lib.TRAIN: list(train_files),
                   data_lib.EVAL: list(eval_files)}
    self._label_key = label_key
    self._image_key = image_key
    self._image_encoding = image_encoding
    self._shuffle_buffer_size = shuffle_buffer_size
    self.allow_non_finite = allow_non_finite
    # Image data parse only the image: other features are not served.
    keys = list(feature_spec) if image_key is None else [image_key, label_key]
    self._feature_spec = {key: feature_spec[key] for key in keys}

  def _to_features(self, parsed: Dict[str, Any],
                   batched: bool) -> Dict[str, Any]:
    """Parsed Example values -> features, per record or per batch."""
    if self._image_key is not None:
      stored = parsed[self._image_key]
      if self._image_encoding == 'encoded':
        stored = tf.reshape(stored, [-1] if batched else [])

        def decode(contents):
          return images.decode(contents, self.image_shape)

        # A full signature: an empty batch (a task's empty share) still
        # has the image shape.
        image = (tf.map_fn(decode, stored, fn_output_signature=tf.TensorSpec(
            self.image_shape, tf.float32)) if batched else decode(stored))
      else:
        shape = list(self.image_shape)
        image = tf.reshape(stored, [-1] + shape if batched else shape)
      return {'image': image}
    features = {}
    for key, value in parsed.items():
      if key == self._label_key:
        continue
      if value.dtype == tf.int64:  # Numeric features are float32.
        value = tf.cast(value, tf.float32)
      features[key] = value
    return features

  def _read_file(self, path: tf.Tensor) -> tf.data.Dataset:
    """(path, record number from 0, serialized Example) of one file."""
    return tf.data.Dataset.zip(
        (tf.data.TFRecordDataset(path), tf.data.Dataset.counter(0))).map(
            lambda record, number: (path, number, record))

  def _records(self, split: str, shuffle: bool = False,
               seed: int = 0) -> tf.data.Dataset:
    return pipeline.interleave_files(
        self._files[split], self._read_file,
        sequential=split != data_lib.TRAIN, shuffle=shuffle, seed=seed)

  def _finite_checks(self, parsed: Dict[str, Any], location: tf.Tensor,
                     batched: bool) -> List[tf.Operation]:
    """Asserts that the records' float features hold no NaN or inf."""
    checks = []
    if self.allow_non_finite:
      return checks
    for key, value in sorted(parsed.items()):
      if not value.dtype.is_floating:
        continue
      message = tf.strings.join([
          f'Feature {key} of TFRecord ', location, ' is nan or inf; pass '
          '--allow-non-finite (allow_non_finite=True) to keep such values.'])
      checks.append(pipeline.assert_no_bad_row(
          _non_finite_rows(value, batched), message))
    return checks

  def _parse(self, path: tf.Tensor, number: tf.Tensor, record: tf.Tensor,
             batched: bool):
    """(features, label) of one record, or of a batch of records."""
    n_classes = self.n_classes
    parse = tf.io.parse_example if batched else tf.io.parse_single_example
    parsed = parse(record, self._feature_spec)
    label = tf.reshape(parsed[self._label_key], [-1] if batched else [])
    location = tf.strings.join([path, ':', tf.strings.as_string(number)])
    message = tf.strings.join([
        'Bad label ', tf.strings.as_string(label), ' in TFRecord ', location,
        f': class ids must be in [0, {n_classes}).'])
    checks = [pipeline.assert_no_bad_row((label < 0) | (label >= n_classes),
                                         message)]
    checks += self._finite_checks(parsed, location, batched)
    with tf.control_dependencies(checks):
      label = tf.cast(label, tf.int32)
    return self._to_features(parsed, batched=batched), label

  def _shuffled_records(self, split: str, shuffle: bool,
                        seed: int) -> tf.data.Dataset:
    records = self._records(split, shuffle=shuffle, seed=seed)
    if shuffle:
      # Serialized records, not their parses: a smaller buffer, and the
      # same order (it depends on the seed and the count only).
      records = pipeline.shuffle(records, self._shuffle_buffer_size, seed)
    return records

  def _examples(self, split, shuffle=False, seed=0):
    return pipeline.parallel_map(
        self._shuffled_records(split, shuffle, seed),
        lambda *record: self._parse(*record, batched=False))

  def _unparsed(self, split, shuffle=False, seed=0):
    return data_lib.Unparsed(
        self._shuffled_records(split, shuffle, seed),
        lambda *records: self._parse(*records, batched=True))

  def example_ids(self) -> List[str]:
    """'file:record' (record counted from 0) per predicted example."""
    ids = []
    for paths, numbers in pipeline.collect(
        lambda: self._records(data_lib.EVAL).map(
            lambda path, number, record: (path, number))):
      ids.extend(f'{path.decode()}:{number}'
                 for path, number in zip(paths, numbers))
    return ids

  def _serving_field_order(self) -> List[str]:
    return [key for key in self._feature_spec if key != self._label_key]

  def _parse_serving_examples(self, serialized):
    """Examples as in the training files; the label may be absent."""
    spec = {key: value for key, value in self._feature_spec.items()
            if key != self._label_key}
    return self._to_features(tf.io.parse_example(serialized, spec),
                             batched=True)


def tfrecord_data(train_files: Sequence[str], eval_files: Sequence[str], *,
                  feature_spec: Mapping[str, Any], label_key: str,
                  n_classes: int, image_key: Optional[str] = None,
                  image_shape: Optional[Tuple[int, int, int]] = None,
                  categorical_columns: Optional[Mapping[str, Any]] = None,
                  shuffle_buffer_size: int = pipeline.DEFAULT_SHUFFLE_BUFFER,
                  allow_non_finite: bool = False) -> TFRecordData:
  """Data from TFRecord files of tf.Example.

  Tabular (image_key None): every non-label feature of feature_spec is a
  feature. FixedLen float32/int64 features are numeric (float32 Tensors
  [batch, *shape]); string features must be declared in categorical_columns
  (VarLen string features arrive as SparseTensors, multivalent categories).

  Image (image_key given): features {'image': float32 [batch, H, W, C]},
  from FixedLenFeature([], tf.string) PNG/JPEG/GIF/BMP bytes (decoded,
  resized to image_shape, scaled to [0, 1]) or FixedLenFeature([H*W*C],
  tf.float32) raw floats, used as stored (they should be in [0, 1]). Other
  features are ignored.

  Args:
    train_files: Globs (tf.io.gfile.glob) of the training files.
    eval_files: Globs of the eval files, also read by predict_input_fn; their
      order (glob order, then sorted) is the eval and predict order.
    feature_spec: Feature name -> tf.io.FixedLenFeature or VarLenFeature, as
      for tf.io.parse_example; includes the label.
    label_key: The label's feature: FixedLenFeature([], tf.int64) class ids.
    n_classes: Number of classes.
    image_key: The image's feature, or None for tabular data.
    image_shape: (H, W, C) of the images; required with image_key.
    categorical_columns: For tabular data, string feature -> vocabulary list
      or int hash-bucket count (see csv_data).
    shuffle_buffer_size: Records held for shuffling the training data.
    allow_non_finite: Whether float32 features (raw images included) may be
      NaN or infinite. By default such a record stops the input pipeline with
      an error naming its file and record: it would make the loss NaN without
      any error.

  Returns:
    The Data; example_ids are 'file:record', records counted from 0.

  Raises:
    ValueError: a glob matches no file or only empty files; the spec, label,
      image or columns are inconsistent.
    TypeError: feature_spec is not a dict of FixedLen/VarLen features.
  """
  feature_spec = _check_spec(feature_spec)
  _check_label(feature_spec, label_key)
  image_encoding, columns = None, []
  if image_key is None:
    if image_shape is not None:
      raise ValueError(f'image_shape={image_shape!r} without image_key; pass '
                       'image_key for image data, or neither.')
    columns = _tabular_columns(feature_spec, label_key, categorical_columns)
    if not columns:
      raise ValueError('feature_spec has no feature besides the label.')
  else:
    if image_shape is None:
      raise ValueError(f'image_key={image_key!r} needs image_shape=(H, W, C).')
    image_shape = images.check_image_shape(image_shape)
    if image_key == label_key:
      raise ValueError(f'image_key and label_key are both {image_key!r}.')
    image_encoding = _image_encoding(feature_spec, image_key, image_shape)
  if (isinstance(shuffle_buffer_size, bool) or
      not isinstance(shuffle_buffer_size, int) or shuffle_buffer_size < 1):
    raise ValueError(f'shuffle_buffer_size={shuffle_buffer_size!r}; pass an '
                     'int >= 1.')
  return TFRecordData(
      train_files=files_lib.expand(train_files, 'train_files',
                                   files_lib.is_nonempty),
      eval_files=files_lib.expand(eval_files, 'eval_files',
                                  files_lib.is_nonempty),
      feature_spec=feature_spec, label_key=label_key, n_classes=n_classes,
      feature_columns=columns, image_key=image_key, image_shape=image_shape,
      image_encoding=image_encoding, shuffle_buffer_size=shuffle_buffer_size,
      allow_non_finite=bool(allow_non_finite))
