"""The classification head every model_fn here shares: logits to EstimatorSpec.

Written for ONE device. Under `trainer.replicate_model_fn` each tower calls
it on its share of the batch; that is why the loss is a mean over the
tower's batch, metrics are per-example `tf.compat.v1.metrics` (their state is
shared by the towers, so they merge exactly), and batch-norm updates are
taken from UPDATE_OPS (each tower sees only its own there).
"""

from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import tensorflow as tf

from model_fns import hparams

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys

_OPTIMIZERS: Dict[str, Callable[[float], tf1.train.Optimizer]] = {
    'sgd': tf1.train.GradientDescentOptimizer,
    'momentum': lambda lr: tf1.train.MomentumOptimizer(lr, momentum=0.9),
    'adam': tf1.train.AdamOptimizer,
    'adagrad': tf1.train.AdagradOptimizer,
    'rmsprop': tf1.train.RMSPropOptimizer,
}
OPTIMIZER_NAMES = tuple(sorted(_OPTIMIZERS))


def make_optimizer(name: str, learning_rate: float) -> tf1.train.Optimizer:
  """A tf.compat.v1.train optimizer by name.

  Args:
    name: One of OPTIMIZER_NAMES ('momentum' uses momentum 0.9).
    learning_rate: The learning rate.

  Returns:
    A new optimizer.

  Raises:
    ValueError: the name is not one of the known optimizers.
  """
  if name not in _OPTIMIZERS:
    raise ValueError(f"optimizer={name!r}; set params['optimizer'] to one of "
                     f'{list(OPTIMIZER_NAMES)}.')
  return _OPTIMIZERS[name](learning_rate)


def l2_penalty(weights: Sequence[tf.Variable], coefficient: float
              ) -> Optional[tf.Tensor]:
  """coefficient * sum of squares of `weights` (Keras' l2 convention).

  Computed in every tower from the variables the tower uses rather than read
  from the REGULARIZATION_LOSSES collection: that collection is not per
  tower, so a later tower would count earlier towers' terms again.

  Returns:
    The scalar penalty, or None when there is nothing to decay.
  """
  if not coefficient or not weights:
    return None
  with tf.name_scope('l2_penalty'):
    squares = [tf.reduce_sum(tf.square(tf.cast(w, tf.float32)))
               for w in weights]
    return tf.multiply(coefficient, tf.add_n(squares), name='value')


def _class_ids(labels: Optional[tf.Tensor], mode: str) -> tf.Tensor:
  if labels is None:
    raise ValueError(f'{mode} needs labels, but the input_fn gave none; return '
                     '(features, labels) with int class ids as labels.')
  if isinstance(labels, Mapping) or not labels.dtype.is_integer:
    raise ValueError(f'labels must be int class ids in [0, n_classes), got '
                     f'{labels!r}; map label strings to ids in the input_fn.')
  return tf.reshape(tf.cast(labels, tf.int32), [-1])


def _predict_spec(logits, class_ids, probabilities,
                  vocabulary: Optional[Sequence[str]] = None
                 ) -> tf.estimator.EstimatorSpec:
  predictions = {'class_ids': class_ids, 'probabilities': probabilities,
                 'logits': logits}
  classes = None
  if vocabulary:
    # As canned heads give them: the label names, and for TF Serving's
    # Classify API every row's names beside its scores.
    names = tf.constant(list(vocabulary))
    predictions['classes'] = tf.gather(names, class_ids)
    classes = tf.tile(names[None, :], [tf.shape(class_ids)[0], 1])
  export = tf.estimator.export
  export_outputs = {
      'serving_default': export.PredictOutput(predictions),
      'classification': export.ClassificationOutput(scores=probabilities,
                                                    classes=classes),
  }
  return tf.estimator.EstimatorSpec(ModeKeys.PREDICT, predictions=predictions,
                                    export_outputs=export_outputs)


def _metrics(labels, class_ids, probabilities, n_classes):
  metrics = {'accuracy': tf1.metrics.accuracy(labels, class_ids)}
  if n_classes == 2:
    # Thresholded confusion counts: sums over examples, so exact over towers.
    metrics['auc'] = tf1.metrics.auc(labels, probabilities[:, 1])
  return metrics


def _train_op(loss: tf.Tensor, params: Mapping[str, Any]) -> tf.Operation:
  rate = hparams.learning_rate(params)
  optimizer = make_optimizer(params.get('optimizer'), rate)
  tf1.summary.scalar('learning_rate', tf.constant(rate, tf.float32))
  # Batch-norm moving averages are updated only if the train op runs them.
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    return optimizer.minimize(
        loss, global_step=tf1.train.get_or_create_global_step())


def classifier_spec(mode: str, logits: tf.Tensor, labels: Optional[tf.Tensor],
                    params: Mapping[str, Any],
                    decayed_weights: Sequence[tf.Variable] = ()
                   ) -> tf.estimator.EstimatorSpec:
  """The EstimatorSpec of a softmax classifier.

  Args:
    mode: A tf.estimator.ModeKeys value.
    logits: float [batch, n_classes].
    labels: int class ids [batch] (or [batch, 1]); None when predicting.
    params: Reads 'n_classes'; in TRAIN and EVAL 'weight_decay' (default 0);
      in TRAIN 'learning_rate' and 'optimizer'; in PREDICT
      'label_vocabulary' (optional: the class names, in class id order).
    decayed_weights: Variables the L2 penalty applies to (kernels, not biases
      or batch-norm parameters).

  Returns:
    PREDICT: predictions {'class_ids', 'probabilities', 'logits'} (and
    'classes', the names, with a label_vocabulary) and export outputs
    'serving_default' (all predictions) and 'classification' (scores, and
    the names as classes).
    EVAL: the mean cross entropy (plus the L2 penalty) as loss and metrics
    'accuracy' (and 'auc' when n_classes == 2). TRAIN: the same loss and a
    train op that also runs UPDATE_OPS and advances the global step.

  Raises:
    ValueError: a param is invalid, or labels are missing or not int ids.
  """
  n_classes = hparams.n_classes(params)
  if logits.shape[-1] != n_classes:
    raise ValueError(f'The model made {logits.shape[-1]} logits but '
                     f"params['n_classes']={n_classes}.")
  class_ids = tf.argmax(logits, axis=-1, output_type=tf.int32)
  probabilities = tf.nn.softmax(logits)
  if mode == ModeKeys.PREDICT:
    return _predict_spec(logits, class_ids, probabilities,
                         params.get('label_vocabulary'))
  labels = _class_ids(labels, mode)
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  penalty = l2_penalty(decayed_weights, hparams.weight_decay(params))
  if penalty is not None:
    loss += penalty
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(
        mode, loss=loss,
        eval_metric_ops=_metrics(labels, class_ids, probabilities, n_classes))
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=_train_op(loss, params))
