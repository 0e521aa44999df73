"""Fully connected (DNN) classifier model_fns, for one device.

Two entry points share one network: `tabular_dnn_model_fn` reads columns
through `params['feature_columns']`, `dnn_model_fn` reads a dense
`features['x']`.
"""

from typing import Any, Dict, List, Mapping, Optional, Tuple

import tensorflow as tf

from model_fns import hparams
from model_fns.head import classifier_spec
from model_fns.head import make_optimizer  # Re-exported: dnn.make_optimizer.

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys

__all__ = ['dnn_model_fn', 'tabular_dnn_model_fn', 'make_optimizer']


def dnn_logits(inputs: tf.Tensor, mode: str, params: Mapping[str, Any]
               ) -> Tuple[tf.Tensor, List[tf.Variable]]:
  """ReLU hidden layers, dropout while training, then linear logits.

  Returns:
    (logits [batch, n_classes], the kernels weight decay applies to).
  """
  units = hparams.hidden_units(params)
  rate = hparams.dropout(params)
  n_classes = hparams.n_classes(params)
  training = mode == ModeKeys.TRAIN
  net, kernels = inputs, []
  for i, size in enumerate(units):
    layer = tf.keras.layers.Dense(size, activation='relu', name=f'hidden_{i}')
    net = layer(net)
    kernels.append(layer.kernel)
    if rate:
      net = tf.keras.layers.Dropout(rate, name=f'dropout_{i}')(
          net, training=training)
  layer = tf.keras.layers.Dense(n_classes, name='logits')
  logits = layer(net)
  return logits, kernels + [layer.kernel]


def tabular_dnn_model_fn(features: Dict[str, tf.Tensor],
                         labels: Optional[tf.Tensor], mode: str,
                         params: Dict[str, Any]) -> tf.estimator.EstimatorSpec:
  """Classifies tabular features with ReLU hidden layers and softmax.

  Args:
    features: Column name -> Tensor, as `params['feature_columns']` expect.
    labels: int class ids [batch], or None when predicting.
    mode: A tf.estimator.ModeKeys value.
    params: 'n_classes'; 'feature_columns' (dense columns: numeric,
      embedding_column or indicator_column of categoricals); 'hidden_units'
      (list of ints) or 'first_layer_size' + 'num_layers' (+ 'scale_factor',
      default 0.5); 'dropout' (default 0, TRAIN only); 'weight_decay'
      (default 0, L2 on kernels); for TRAIN 'learning_rate' and 'optimizer'
      (see make_optimizer).

  Returns:
    The EstimatorSpec for `mode` (see head.classifier_spec).

  Raises:
    ValueError: a param is missing or invalid.
  """
  columns = hparams.feature_columns(params)
  inputs = tf1.feature_column.input_layer(features, columns)
  logits, kernels = dnn_logits(inputs, mode, params)
  return classifier_spec(mode, logits, labels, params, kernels)


def dnn_model_fn(features: Dict[str, tf.Tensor], labels: Optional[tf.Tensor],
                 mode: str, params: Dict[str, Any]
                ) -> tf.estimator.EstimatorSpec:
  """Classifies `features['x']` with ReLU hidden layers and softmax.

  Args:
    features: {'x': float32 [batch, num_features]}.
    labels: int class ids [batch], or None when predicting.
    mode: A tf.estimator.ModeKeys value.
    params: As tabular_dnn_model_fn, without 'feature_columns': 'n_classes',
      'hidden_units' (or 'first_layer_size' + 'num_layers'), 'learning_rate',
      'optimizer', optional 'dropout' and 'weight_decay'.

  Returns:
    The EstimatorSpec for `mode` (see head.classifier_spec).

  Raises:
    ValueError: a param is missing or invalid, or features has no 'x'.
  """
  if not isinstance(features, Mapping) or 'x' not in features:
    raise ValueError(f"dnn_model_fn reads features['x'], got {features!r}; "
                     'use tabular_dnn_model_fn for feature columns.')
  inputs = tf.cast(features['x'], tf.float32)
  logits, kernels = dnn_logits(inputs, mode, params)
  return classifier_spec(mode, logits, labels, params, kernels)
