"""A linear classifier on feature columns, for one device.

logits = dense inputs @ W + sum over categorical ids of their weights + b.

Categorical columns (hashed, vocabulary, crossed, ...) may be given as they
are: each id looks up one weight per class. That lookup is an
`embedding_column` of width n_classes with the 'sum' combiner, read through
`tf.compat.v1.feature_column.input_layer`, rather than
`tf.compat.v1.feature_column.linear_model`: the latter fails on a batch of
zero examples, which a tower gets when the last batch of an evaluation or
prediction is smaller than the number of towers.
"""

from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

from model_fns import hparams
from model_fns.head import classifier_spec

tf1 = tf.compat.v1


def _is_dense(column: Any) -> bool:
  # Dense columns (numeric, bucketized, embedding, indicator) have a shape.
  return hasattr(column, 'variable_shape') or hasattr(column, '_variable_shape')


def _dense_part(features, columns, n_classes: int, weights: List[tf.Variable]):
  inputs = tf1.feature_column.input_layer(features, columns)
  layer = tf.keras.layers.Dense(n_classes, use_bias=False,
                                kernel_initializer='zeros',
                                name='dense_weights')
  logits = layer(inputs)
  weights.append(layer.kernel)
  return logits


def _categorical_part(features, columns, n_classes: int,
                      weights: List[tf.Variable]):
  per_class = [tf1.feature_column.embedding_column(
      column, n_classes, combiner='sum',
      initializer=tf1.zeros_initializer()) for column in columns]
  cols_to_vars = {}
  looked_up = tf1.feature_column.input_layer(features, per_class,
                                             cols_to_vars=cols_to_vars)
  for variables in cols_to_vars.values():
    weights.extend(variables)
  # input_layer concatenates the columns; a linear model adds them up.
  by_column = tf.reshape(looked_up, [-1, len(per_class), n_classes])
  return tf.reduce_sum(by_column, axis=1)


def linear_model_fn(features: Dict[str, tf.Tensor],
                    labels: Optional[tf.Tensor], mode: str,
                    params: Dict[str, Any]) -> tf.estimator.EstimatorSpec:
  """Classifies tabular features with one weighted sum per class.

  Args:
    features: Column name -> Tensor, as `params['feature_columns']` expect.
    labels: int class ids [batch], or None when predicting.
    mode: A tf.estimator.ModeKeys value.
    params: 'n_classes'; 'feature_columns' (numeric, bucketized, embedding or
      indicator columns, and categorical columns as they are); 'weight_decay'
      (default 0, L2 on the weights, not the bias); for TRAIN
      'learning_rate' and 'optimizer'.

  Returns:
    The EstimatorSpec for `mode` (see head.classifier_spec). Weights start
    at zero, as in tf.compat.v1.feature_column.linear_model.

  Raises:
    ValueError: a param is missing or invalid.
  """
  logits, weights = linear_logits(features, hparams.feature_columns(params),
                                  hparams.n_classes(params))
  return classifier_spec(mode, logits, labels, params, weights)


def linear_logits(features: Dict[str, tf.Tensor], columns: List[Any],
                  n_classes: int) -> Tuple[tf.Tensor, List[tf.Variable]]:
  """The linear model's logits, in variable scope 'linear'.

  Args:
    features: Column name -> Tensor.
    columns: Dense and categorical feature columns (see linear_model_fn).
    n_classes: Logits per example.

  Returns:
    (logits [batch, n_classes], the weights weight decay applies to).
  """
  dense = [c for c in columns if _is_dense(c)]
  categorical = [c for c in columns if not _is_dense(c)]
  weights, parts = [], []
  with tf1.variable_scope('linear'):
    if dense:
      parts.append(_dense_part(features, dense, n_classes, weights))
    if categorical:
      parts.append(_categorical_part(features, categorical, n_classes,
                                     weights))
    bias = tf1.get_variable('bias', [n_classes],
                            initializer=tf1.zeros_initializer())
  return tf.nn.bias_add(tf.add_n(parts), bias), weights
