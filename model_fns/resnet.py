"""The CIFAR ResNet of He et al. 2015 (section 4.2), for one device.

depth = 6n + 2 weighted layers: a 3x3 convolution with 16 filters, three
stages of n residual blocks (two 3x3 convolutions each) with 16, 32 and 64
filters, the second and third stage halving the height and width in their
first block, then global average pooling and the logits. Shortcuts are
identities; where the shape changes they subsample and zero-pad the channels
(the paper's option A, which adds no parameters). Batch norm follows every
convolution, through tf.compat.v1.layers.batch_normalization, whose moving
average updates go to UPDATE_OPS and run with the train op.
"""

from typing import Any, Dict, List, Optional
import warnings

import tensorflow as tf

from model_fns import hparams
from model_fns.head import classifier_spec

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys

DEFAULT_DEPTH = 20
PAPER_DEPTHS = (20, 32, 56, 110, 1202)
_STAGE_FILTERS = (16, 32, 64)
# The paper's batch-norm settings (Keras' 0.99 would lag on short runs).
_BN_MOMENTUM = 0.9
_BN_EPSILON = 1e-5


def blocks_per_stage(depth: Any) -> int:
  """n for depth = 6n + 2.

  Raises:
    ValueError: depth is not 6n + 2 for some n >= 1.
  """
  if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (
      (depth - 2) % 6):
    raise ValueError(
        f"params['resnet_depth']={depth!r}; a CIFAR ResNet has 6n+2 layers: "
        f'use one of the paper\'s {PAPER_DEPTHS[:4]} (or 8, 14, 26, ...).')
  return (depth - 2) // 6


class _Builder:
  """Builds the network, recording the kernels weight decay applies to."""

  def __init__(self, training: bool):
    self.training = training
    self.kernels: List[tf.Variable] = []

  def conv(self, net: tf.Tensor, filters: int, stride: int, name: str):
    # No bias: the batch norm after it has its own offset.
    layer = tf1.layers.Conv2D(
        filters, 3, strides=stride, padding='same', use_bias=False,
        kernel_initializer=tf1.variance_scaling_initializer(scale=2.0),
        name=name)
    net = layer(net)
    self.kernels.append(layer.kernel)
    return net

  def batch_norm(self, net: tf.Tensor, name: str) -> tf.Tensor:
    # Deprecated, but unlike Keras' layer in graph mode it puts its updates
    # in UPDATE_OPS, where the head and the towers find them; so silence the
    # warning that says so on every layer.
    with warnings.catch_warnings():
      warnings.filterwarnings(
          'ignore', message='`tf.layers.batch_normalization` is deprecated',
          category=UserWarning)
      return tf1.layers.batch_normalization(
          net, momentum=_BN_MOMENTUM, epsilon=_BN_EPSILON,
          training=self.training, name=name)

  def block(self, net: tf.Tensor, filters: int, stride: int) -> tf.Tensor:
    shortcut = _shortcut(net, filters, stride)
    net = tf.nn.relu(self.batch_norm(self.conv(net, filters, stride, 'conv1'),
                                     'bn1'))
    net = self.batch_norm(self.conv(net, filters, 1, 'conv2'), 'bn2')
    return tf.nn.relu(net + shortcut)


def _shortcut(net: tf.Tensor, filters: int, stride: int) -> tf.Tensor:
  """Identity; subsampled and zero-padded where the block changes shape."""
  if stride > 1:
    net = net[:, ::stride, ::stride, :]
  extra = filters - net.shape[-1]
  if extra:
    channels = [extra // 2, extra - extra // 2]
    net = tf.pad(net, [[0, 0], [0, 0], [0, 0], channels])
  return net


def _logits(images: tf.Tensor, n: int, builder: _Builder, n_classes: int):
  net = builder.conv(images, _STAGE_FILTERS[0], 1, 'initial_conv')
  net = tf.nn.relu(builder.batch_norm(net, 'initial_bn'))
  for stage, filters in enumerate(_STAGE_FILTERS):
    for block in range(n):
      stride = 2 if stage and not block else 1
      with tf1.variable_scope(f'stage{stage + 1}'), tf1.variable_scope(
          f'block{block + 1}'):
        net = builder.block(net, filters, stride)
  net = tf.reduce_mean(net, axis=[1, 2], name='global_average_pool')
  layer = tf1.layers.Dense(n_classes, name='logits')
  logits = layer(net)
  builder.kernels.append(layer.kernel)
  return logits


def resnet_model_fn(features: Dict[str, tf.Tensor],
                    labels: Optional[tf.Tensor], mode: str,
                    params: Dict[str, Any]) -> tf.estimator.EstimatorSpec:
  """Classifies images with a CIFAR ResNet of depth 6n+2.

  Args:
    features: {'image': float32 [batch, H, W, C] in [0, 1]} (or flattened).
    labels: int class ids [batch], or None when predicting.
    mode: A tf.estimator.ModeKeys value.
    params: 'n_classes'; 'image_shape' (H, W, C), any size (32x32 in the
      paper); 'resnet_depth' (default 20; 20/32/56/110 in the paper);
      'weight_decay' (default 0, the paper used 1e-4; L2 on all kernels);
      for TRAIN 'learning_rate' and 'optimizer' (the paper: 'momentum', 0.1).

  Returns:
    The EstimatorSpec for `mode` (see head.classifier_spec). Batch norm uses
    batch statistics in TRAIN and the moving averages otherwise.

  Raises:
    ValueError: a param is missing or invalid (e.g. a depth not 6n+2), or
      there is no image feature.
  """
  depth = params.get('resnet_depth')
  n = blocks_per_stage(DEFAULT_DEPTH if depth is None else depth)
  images = hparams.image_input(features, params)
  builder = _Builder(training=mode == ModeKeys.TRAIN)
  logits = _logits(images, n, builder, hparams.n_classes(params))
  return classifier_spec(mode, logits, labels, params, builder.kernels)
