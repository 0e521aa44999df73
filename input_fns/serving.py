"""Serving inputs rebuilt from the training features' signature.

The signature (feature name -> unbatched tf.TensorSpec or tf.SparseTensorSpec)
is read off the training dataset itself, so whatever a client sends is turned
into features with exactly the keys, dtypes and shapes the model was trained
on.
"""

import re
from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

Signature = Mapping[str, tf.TypeSpec]
Features = Dict[str, Any]

# Names that graph ops accept; feature names (CSV headers) may be anything.
_INVALID_OP_NAME_CHARS = re.compile(r'[^A-Za-z0-9_.\-/]')


def _op_name(key: str) -> str:
  name = _INVALID_OP_NAME_CHARS.sub('_', key).lstrip('_-/') or 'feature'
  return name if name[0].isalnum() or name[0] == '.' else 'f' + name


def _stored_dtype(dtype: tf.DType) -> tf.DType:
  """The dtype tf.Example and decode_csv hold a feature of `dtype` as."""
  if dtype == tf.string:
    return tf.string
  if dtype.is_integer or dtype == tf.bool:
    return tf.int64
  return tf.float32


def placeholders(signature: Signature) -> Tuple[Features, Features]:
  """One placeholder per feature, batch dimension None: what JSON feeds.

  A variable-length (sparse) string feature is fed as a dense [batch, n]
  string matrix padded with '' and turned into a SparseTensor without the
  padding, as parsing a VarLenFeature gives in training.

  Args:
    signature: The training features' signature.

  Returns:
    (features, receiver_tensors).

  Raises:
    ValueError: a sparse feature that is not a string.
  """
  features, receivers = {}, {}
  for key, spec in signature.items():
    if isinstance(spec, tf.SparseTensorSpec):
      if spec.dtype != tf.string:
        raise ValueError(
            f'Feature {key!r} is a variable-length {spec.dtype.name} feature, '
            "which JSON cannot feed; use export_format='example'.")
      dense = tf1.placeholder(tf.string, [None, None], name=_op_name(key))
      receivers[key] = dense
      features[key] = tf.sparse.from_dense(dense)
    else:
      receivers[key] = tf1.placeholder(
          spec.dtype, [None] + spec.shape.as_list(), name=_op_name(key))
      features[key] = receivers[key]
  return features, receivers


def example_parse_spec(signature: Signature,
                       defaults: Mapping[str, Any]) -> Dict[str, Any]:
  """A tf.io.parse_example spec for the features of `signature`.

  Dense features are FixedLenFeatures of their shape (an image [H, W, C] is a
  float_list of H*W*C values in row-major order); sparse ones VarLenFeatures.

  Args:
    signature: The training features' signature.
    defaults: Feature name -> value used when an Example lacks the feature.

  Returns:
    Feature name -> tf.io.FixedLenFeature or tf.io.VarLenFeature.
  """
  spec = {}
  for key, type_spec in signature.items():
    stored = _stored_dtype(type_spec.dtype)
    if isinstance(type_spec, tf.SparseTensorSpec):
      spec[key] = tf.io.VarLenFeature(stored)
    else:
      spec[key] = tf.io.FixedLenFeature(type_spec.shape.as_list(), stored,
                                        default_value=defaults.get(key))
  return spec


def cast_to_signature(features: Features, signature: Signature) -> Features:
  """Casts parsed features to the dtypes of the training features."""
  cast = {}
  for key, type_spec in signature.items():
    value = features[key]
    if value.dtype != type_spec.dtype:
      if isinstance(value, tf.SparseTensor):
        value = tf.SparseTensor(value.indices,
                                tf.cast(value.values, type_spec.dtype),
                                value.dense_shape)
      else:
        value = tf.cast(value, type_spec.dtype)
    cast[key] = value
  return cast


def parse_examples(serialized: tf.Tensor, signature: Signature,
                   defaults: Mapping[str, Any]) -> Features:
  """Parses serialized tf.Examples into features matching `signature`."""
  parsed = tf.io.parse_example(serialized,
                               example_parse_spec(signature, defaults))
  return cast_to_signature(parsed, signature)


def decode_csv_lines(lines: tf.Tensor, signature: Signature,
                     order: Sequence[str],
                     defaults: Mapping[str, Any]) -> Features:
  """Decodes CSV lines (no label field) into features matching `signature`.

  Fields follow `order`; a feature of shape S takes prod(S) consecutive
  fields (row-major). Empty fields take `defaults`, and are an error for
  features without one.

  Args:
    lines: string Tensor [batch] of CSV lines.
    signature: The training features' signature.
    order: Feature names in field order.
    defaults: Feature name -> default for empty fields.

  Returns:
    Features matching `signature`.

  Raises:
    ValueError: a feature is variable-length, which a CSV line cannot hold.
  """
  record_defaults, sizes = [], []
  for key in order:
    spec = signature[key]
    if isinstance(spec, tf.SparseTensorSpec):
      raise ValueError(
          f'Feature {key!r} is variable-length, which CSV lines cannot hold; '
          "use export_format='json' or 'example'.")
    stored = _stored_dtype(spec.dtype)
    size = int(np.prod(spec.shape.as_list(), dtype=np.int64))
    if key in defaults:
      default = tf.constant([defaults[key]], stored)
    else:
      default = tf.constant([], stored)  # Empty: the field is required.
    record_defaults.extend([default] * size)
    sizes.append(size)
  columns = tf.io.decode_csv(lines, record_defaults)
  features, start = {}, 0
  for key, size in zip(order, sizes):
    shape = signature[key].shape.as_list()
    if shape:
      value = tf.stack(columns[start:start + size], axis=1)
      value = tf.reshape(value, [-1] + shape)
    else:
      value = columns[start]
    features[key] = value
    start += size
  return cast_to_signature(features, signature)
