"""Towers' EstimatorSpecs merge into one, or fail naming the disagreement."""

import pytest
import tensorflow as tf

import trainer
from estimator_towers.merge import spec_merge
from helpers import build_replicated

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys


def _logits(features):
  return tf1.layers.dense(features['x'], 2)


def test_towers_disagreeing_on_prediction_keys():

  def model_fn(features, mode):
    key = f'logits_{trainer.tower_context().index}'
    return tf.estimator.EstimatorSpec(mode, predictions={key: _logits(features)})

  with pytest.raises(ValueError, match=r"predictions.*\['logits_0'\].*"
                     r"tower 1 has \['logits_1'\]"):
    build_replicated(model_fn, 2, mode=ModeKeys.PREDICT, with_labels=False)


def test_towers_disagreeing_on_metric_names():

  def model_fn(features, labels, mode):
    logits = _logits(features)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    name = 'acc' if trainer.tower_context().index == 0 else 'accuracy'
    metrics = {name: tf1.metrics.accuracy(labels, tf.argmax(logits, 1))}
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops=metrics)

  with pytest.raises(ValueError, match='Towers disagree on eval_metric_ops'):
    build_replicated(model_fn, 2, mode=ModeKeys.EVAL)


def test_scalar_prediction_has_no_batch_dimension():

  def model_fn(features, mode):
    return tf.estimator.EstimatorSpec(
        mode, predictions={'mean': tf.reduce_mean(_logits(features))})

  with pytest.raises(ValueError, match=r"predictions\['mean'\] is a scalar"):
    build_replicated(model_fn, 2, mode=ModeKeys.PREDICT, with_labels=False)


def test_train_spec_without_loss_is_refused():

  def model_fn(features, labels, mode):
    loss = tf.reduce_mean(_logits(features))
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, train_op=train_op)

  with pytest.raises(ValueError, match='[Ll]oss'):
    build_replicated(model_fn, 2)


def test_model_fn_returning_something_else_is_a_value_error():
  # As tf.estimator.Estimator's own check raises it (its tests expect it).

  def model_fn(features, labels, mode):
    return {'loss': tf.reduce_mean(_logits(features))}

  with pytest.raises(ValueError,
                     match='must return a tf.estimator.EstimatorSpec'):
    build_replicated(model_fn, 2, mode=ModeKeys.EVAL)


def test_export_outputs_of_each_kind_are_concatenated():
  export = tf.estimator.export

  def model_fn(features, mode):
    logits = _logits(features)
    vocabulary = tf.constant(['a', 'b', 'c', 'd', 'e'])
    outputs = {
        'serving_default': export.PredictOutput({'logits': logits,
                                                 'vocabulary': vocabulary}),
        'classify': export.ClassificationOutput(scores=tf.nn.softmax(logits)),
        'regress': export.RegressionOutput(logits[:, 0]),
    }
    return tf.estimator.EstimatorSpec(mode, predictions=logits,
                                      export_outputs=outputs)

  _, spec = build_replicated(model_fn, 3, mode=ModeKeys.PREDICT,
                             with_labels=False, replicate_serving=True)
  outputs = spec.export_outputs
  for merged in (spec.predictions, outputs['classify'].scores,
                 outputs['regress'].value):
    # The towers' rows concatenated, an idle tower's padding row dropped.
    assert merged.op.type == 'GatherV2', merged
    assert merged.op.inputs[0].op.type == 'ConcatV2', merged
  # An output that repeats a prediction is put in order once.
  assert outputs['serving_default'].outputs['logits'] is spec.predictions
  # One free of the examples is one device's, as such a prediction is (it
  # was concatenated, or failed the row check).
  vocabulary = outputs['serving_default'].outputs['vocabulary']
  assert vocabulary.op.type == 'Const', vocabulary


def test_the_row_check_shows_every_towers_rows():
  # Tower 3 of 4 short by one row: the message shows all four counts (the
  # default summary of 3 entries hid the fourth).
  with tf.Graph().as_default():
    rows = spec_merge.RowOrder(tf.constant([2, 2, 2, 2]))
    merged = rows.concat('predictions', [tf.zeros([n, 1]) for n in
                                         (2, 2, 2, 1)])
    with tf1.Session() as session:
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r'Rows per tower:\] \[2 2 2 1\] '
                         r'\[examples fed per tower:\] \[2 2 2 2\]'):
        session.run(merged)


@pytest.mark.parametrize('mode', [ModeKeys.TRAIN, ModeKeys.EVAL,
                                  ModeKeys.PREDICT])
def test_the_scaffold_is_the_last_towers_in_every_mode(mode):
  # A model_fn that keeps what it built (tf.estimator's own
  # test_scaffold_is_used keeps its mock Saver on `self`) keeps the last
  # call's: that scaffold must be the one that runs.
  built = []

  def model_fn(features, labels, mode):
    logits = _logits(features)
    built.append(tf1.train.Scaffold())
    loss = tf.reduce_mean(logits) if mode != ModeKeys.PREDICT else None
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step()) if (
            mode == ModeKeys.TRAIN) else None
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                      predictions={'logits': logits},
                                      scaffold=built[-1])

  _, spec = build_replicated(model_fn, 2, mode=mode)
  assert len(built) == 2 and spec.scaffold is built[-1]


def test_a_scalar_of_unknown_rank_fails_the_named_row_check():
  # A py_function's output has no static rank; a scalar at run time failed
  # at an anonymous strided slice ("slice index 0 of dimension 0 out of
  # bounds"), naming no prediction.
  with tf.Graph().as_default():
    rows = spec_merge.RowOrder(tf.constant([2, 2]))
    scalars = [tf.py_function(lambda: 1.0, [], tf.float32) for _ in (0, 1)]
    merged = rows.concat("predictions['total']", scalars)
    with tf1.Session() as session:
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r"total.*does not have one row per example"
                         r'.*Rows per tower:\] \[0 0\]'):
        session.run(merged)
