"""Reading and checking the `params` the model_fns share.

Every reader raises ValueError naming the bad value and how to fix it, so a
typo in a flag fails when the graph is built, not deep inside TensorFlow.
A key whose value is None counts as absent: the trainer passes one params
dict to every model, with None for what the data do not define.
"""

from typing import Any, List, Mapping, Sequence, Tuple

import tensorflow as tf

tf1 = tf.compat.v1

DEFAULT_SCALE_FACTOR = 0.5
# A layer sized by first_layer_size * scale_factor**i never drops below this.
MIN_LAYER_SIZE = 2


def _get(params: Mapping[str, Any], key: str, default: Any = None) -> Any:
  value = params.get(key)
  return default if value is None else value


def _is_int(value: Any) -> bool:
  # bool is an int subclass, but True layers or classes are surely a mistake.
  return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(params: Mapping[str, Any], key: str, hint: str) -> int:
  value = params.get(key)
  if not _is_int(value) or value < 1:
    raise ValueError(f'params[{key!r}]={value!r}; set it to a positive int '
                     f'({hint}).')
  return value


def n_classes(params: Mapping[str, Any]) -> int:
  """The number of classes, at least 2.

  Raises:
    ValueError: it is missing, not an int or below 2.
  """
  value = params.get('n_classes')
  if not _is_int(value) or value < 2:
    raise ValueError(f"params['n_classes']={value!r}; set it to the number of "
                     'classes, an int >= 2 (labels are ids in [0, n_classes)).')
  return value


def learning_rate(params: Mapping[str, Any]) -> float:
  """The optimizer's learning rate, a positive number.

  Raises:
    ValueError: it is missing or not a positive number.
  """
  value = params.get('learning_rate')
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (
      value <= 0):
    raise ValueError(f"params['learning_rate']={value!r}; set it to a positive "
                     'float such as 0.01.')
  return float(value)


def dropout(params: Mapping[str, Any]) -> float:
  """The dropout rate in [0, 1); 0 (no dropout) by default.

  Raises:
    ValueError: it is not a number in [0, 1).
  """
  value = _get(params, 'dropout', 0.0)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      0 <= value < 1):
    raise ValueError(f"params['dropout']={value!r}; set it to the fraction of "
                     'units dropped while training, a float in [0, 1).')
  return float(value)


def weight_decay(params: Mapping[str, Any]) -> float:
  """The L2 coefficient, >= 0; 0 (no decay) by default.

  Raises:
    ValueError: it is not a non-negative number.
  """
  value = _get(params, 'weight_decay', 0.0)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (
      value < 0):
    raise ValueError(f"params['weight_decay']={value!r}; set it to a float "
                     '>= 0 such as 1e-4, or 0 for no L2 penalty.')
  return float(value)


def hidden_units(params: Mapping[str, Any]) -> List[int]:
  """The hidden layer sizes of a DNN.

  `hidden_units` wins when present; otherwise `first_layer_size` and
  `num_layers` give layer i max(2, int(first_layer_size * scale_factor**i))
  units (scale_factor 0.5 by default), as in the Cloud ML census sample.

  Raises:
    ValueError: neither form is given, or a value is not a valid size.
  """
  units = params.get('hidden_units')
  if units is not None:
    if isinstance(units, (str, bytes)) or not isinstance(units, Sequence) or (
        not units) or not all(_is_int(u) and u > 0 for u in units):
      raise ValueError(f"params['hidden_units']={units!r}; set it to a "
                       'non-empty list of positive ints such as [64, 32].')
    return list(units)
  if params.get('first_layer_size') is None or params.get('num_layers') is None:
    raise ValueError(
        "params need 'hidden_units' (e.g. [64, 32]) or both "
        "'first_layer_size' and 'num_layers' (optionally 'scale_factor'); "
        f"got hidden_units=None, first_layer_size="
        f"{params.get('first_layer_size')!r}, "
        f"num_layers={params.get('num_layers')!r}.")
  first = _positive_int(params, 'first_layer_size', 'units of the first '
                        'hidden layer')
  layers = _positive_int(params, 'num_layers', 'number of hidden layers')
  scale = _get(params, 'scale_factor', DEFAULT_SCALE_FACTOR)
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or (
      scale <= 0):
    raise ValueError(f"params['scale_factor']={scale!r}; set it to a positive "
                     'float such as 0.5 (each layer is that fraction of the '
                     'previous one).')
  return [max(MIN_LAYER_SIZE, int(first * scale**i)) for i in range(layers)]


def feature_columns(params: Mapping[str, Any]) -> List[Any]:
  """The tf.compat.v1.feature_column columns of a tabular model.

  Raises:
    ValueError: they are missing or empty.
  """
  columns = params.get('feature_columns')
  if isinstance(columns, (str, bytes)) or not isinstance(
      columns, (list, tuple)) or not columns:
    raise ValueError(
        f"params['feature_columns']={columns!r}; tabular models need a "
        'non-empty list of tf.compat.v1.feature_column columns (use an image '
        'model for image data).')
  return list(columns)


def image_shape(params: Mapping[str, Any]) -> Tuple[int, int, int]:
  """The (height, width, channels) of the model's images.

  Raises:
    ValueError: it is missing or not three positive ints.
  """
  shape = params.get('image_shape')
  if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or (
      len(shape) != 3) or not all(_is_int(d) and d > 0 for d in shape):
    raise ValueError(f"params['image_shape']={shape!r}; image models need "
                     '(height, width, channels), e.g. (32, 32, 3).')
  return tuple(shape)


def image_input(features: Any, params: Mapping[str, Any]) -> tf.Tensor:
  """`features['image']` as float32 [batch, height, width, channels].

  Flattened images of the right size are reshaped, so every layer sees a
  static image shape.

  Raises:
    ValueError: there is no 'image' feature, or its size is not image_shape's.
  """
  shape = image_shape(params)
  if not isinstance(features, Mapping) or 'image' not in features:
    keys = sorted(features) if isinstance(features, Mapping) else features
    raise ValueError(f"Image models read features['image'], but the features "
                     f'are {keys!r}; give the input_fn an image view.')
  images = tf.cast(features['image'], tf.float32)
  per_example = images.shape[1:]
  size = shape[0] * shape[1] * shape[2]
  if per_example.is_fully_defined() and per_example.num_elements() != size:
    raise ValueError(f"features['image'] has shape {images.shape}, which "
                     f"does not hold params['image_shape']={shape}; make the "
                     'two agree.')
  return tf.reshape(images, [-1, *shape])

