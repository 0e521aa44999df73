"""The classic TensorFlow CIFAR-10 tutorial CNN, for one device.

conv 5x5x64 - max pool 3x3/2 - local response norm - conv 5x5x64 - local
response norm - max pool 3x3/2 - fully connected 384 - fully connected 192 -
linear logits, with the tutorial's initializers. 'same' padding and pooling
make it work for any image size (8x8x1 as well as 32x32x3): each pooling
halves the height and width, rounding up.
"""

from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

from model_fns import hparams
from model_fns.head import classifier_spec

tf1 = tf.compat.v1
layers = tf.keras.layers
ModeKeys = tf.estimator.ModeKeys

_CONV_FILTERS = 64
_FC_UNITS = (384, 192)


def _local_response_norm(net: tf.Tensor, name: str) -> tf.Tensor:
  # The tutorial's settings, named as in tf.nn.local_response_normalization.
  return tf.nn.local_response_normalization(
      net, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name=name)


def _conv(net: tf.Tensor, bias: float, name: str) -> tf.Tensor:
  return layers.Conv2D(
      _CONV_FILTERS, 5, padding='same', activation='relu', name=name,
      kernel_initializer=tf.keras.initializers.TruncatedNormal(stddev=5e-2),
      bias_initializer=tf.keras.initializers.Constant(bias))(net)


def _pool(net: tf.Tensor, name: str) -> tf.Tensor:
  return layers.MaxPool2D(3, strides=2, padding='same', name=name)(net)


def _features(images: tf.Tensor) -> tf.Tensor:
  net = _conv(images, 0.0, 'conv1')
  net = _local_response_norm(_pool(net, 'pool1'), 'norm1')
  net = _local_response_norm(_conv(net, 0.1, 'conv2'), 'norm2')
  return layers.Flatten(name='flatten')(_pool(net, 'pool2'))


def _classifier(net: tf.Tensor, mode: str, params: Dict[str, Any]
               ) -> Tuple[tf.Tensor, List[tf.Variable]]:
  """The fully connected layers; returns (logits, their hidden kernels)."""
  rate = hparams.dropout(params)
  kernels = []
  for i, units in enumerate(_FC_UNITS):
    layer = layers.Dense(
        units, activation='relu', name=f'local{i + 3}',
        kernel_initializer=tf.keras.initializers.TruncatedNormal(stddev=0.04),
        bias_initializer=tf.keras.initializers.Constant(0.1))
    net = layer(net)
    kernels.append(layer.kernel)
    if rate:
      net = layers.Dropout(rate, name=f'dropout{i + 3}')(
          net, training=mode == ModeKeys.TRAIN)
  logits = layers.Dense(
      hparams.n_classes(params), name='softmax_linear',
      kernel_initializer=tf.keras.initializers.TruncatedNormal(
          stddev=1 / _FC_UNITS[-1]))(net)
  return logits, kernels


def cifar_cnn_model_fn(features: Dict[str, tf.Tensor],
                       labels: Optional[tf.Tensor], mode: str,
                       params: Dict[str, Any]) -> tf.estimator.EstimatorSpec:
  """Classifies images with the CIFAR-10 tutorial CNN.

  Args:
    features: {'image': float32 [batch, H, W, C] in [0, 1]} (or flattened).
    labels: int class ids [batch], or None when predicting.
    mode: A tf.estimator.ModeKeys value.
    params: 'n_classes'; 'image_shape' (H, W, C), any size; 'dropout'
      (default 0, after each fully connected layer, TRAIN only);
      'weight_decay' (default 0; as in the tutorial, L2 on the two fully
      connected hidden layers, whose value there was 0.004); for TRAIN
      'learning_rate' and 'optimizer'.

  Returns:
    The EstimatorSpec for `mode` (see head.classifier_spec).

  Raises:
    ValueError: a param is missing or invalid, or there is no image feature.
  """
  images = hparams.image_input(features, params)
  logits, kernels = _classifier(_features(images), mode, params)
  return classifier_spec(mode, logits, labels, params, kernels)
