"""A fully connected classifier model_fn for dense features, for one device."""

from typing import Any, Dict

import tensorflow as tf

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys

_OPTIMIZERS = {
    'sgd': tf1.train.GradientDescentOptimizer,
    'momentum': lambda lr: tf1.train.MomentumOptimizer(lr, momentum=0.9),
    'adam': tf1.train.AdamOptimizer,
    'adagrad': tf1.train.AdagradOptimizer,
    'rmsprop': tf1.train.RMSPropOptimizer,
}


def make_optimizer(name: str, learning_rate: float) -> tf1.train.Optimizer:
  """A tf.compat.v1.train optimizer by name.

  Raises:
    ValueError: the name is not one of the known optimizers.
  """
  if name not in _OPTIMIZERS:
    raise ValueError(f'optimizer={name!r}; use one of {sorted(_OPTIMIZERS)}.')
  return _OPTIMIZERS[name](learning_rate)


def dnn_model_fn(features: Dict[str, tf.Tensor], labels: tf.Tensor,
                 mode: str, params: Dict[str, Any]) -> tf.estimator.EstimatorSpec:
  """Classifies `features['x']` with ReLU hidden layers and softmax.

  Args:
    features: {'x': float32 [batch, num_features]}.
    labels: int32 class ids [batch], or None when predicting.
    mode: A tf.estimator.ModeKeys value.
    params: 'n_classes', 'hidden_units' (list of ints), 'learning_rate',
      'optimizer' (see make_optimizer).

  Returns:
    The EstimatorSpec for `mode`.
  """
  net = features['x']
  for units in params['hidden_units']:
    net = tf.keras.layers.Dense(units, activation='relu')(net)
  logits = tf.keras.layers.Dense(params['n_classes'])(net)
  classes = tf.argmax(logits, axis=1, output_type=tf.int32)
  if mode == ModeKeys.PREDICT:
    predictions = {'class_ids': classes, 'probabilities': tf.nn.softmax(logits)}
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == ModeKeys.EVAL:
    metrics = {'accuracy': tf1.metrics.accuracy(labels, classes)}
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops=metrics)
  optimizer = make_optimizer(params['optimizer'], params['learning_rate'])
  train_op = optimizer.minimize(loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
