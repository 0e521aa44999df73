"""EVAL metrics of one number per batch, and predictions beside metrics.

Each tower adds into one shared metric state. A metric of a per-example sum
was always exact; these are the ones that were not: a mean over batches of a
per-batch value (canned KMeans's `score` came out divided by the tower
count), and metrics that `tf.estimator.add_metrics` computes from the
spec's predictions (tower 0's shard only). Every test evaluates one
checkpoint on one device and on 2 and 3 towers, with a last batch smaller
than the tower count.
"""

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers
from estimator_towers.graph import op_ledger
from helpers import build_replicated

tf1 = tf.compat.v1
pytestmark = pytest.mark.training
_ROWS, _BATCH = 26, 8  # Batches of 8, 8, 8, 2: 3 towers leave one idle.


def _data():
  rng = np.random.RandomState(0)
  x = rng.randn(_ROWS, 3).astype(np.float32)
  y = (x[:, 0] + 0.5 * rng.randn(_ROWS) > 0).astype(np.int64)
  return x, y


def _input_fn(drop_remainder=False):
  x, y = _data()
  return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(
      _BATCH, drop_remainder=drop_remainder)


def _classifier(features, labels, mode, params):
  """A dense classifier whose EVAL metrics are per-batch values."""
  logits = tf1.layers.dense(
      features['x'], 2,
      kernel_initializer=tf1.constant_initializer([[1., -1.], [.2, .1],
                                                   [0., .3]]))
  predictions = {'probabilities': tf.nn.softmax(logits),
                 'class_ids': tf.argmax(logits, 1)}
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits)
  loss = tf.reduce_mean(per_example)
  metrics = params.get('metrics', lambda _: {})(per_example)
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, predictions=predictions,
                                    eval_metric_ops=metrics,
                                    train_op=train_op)


def _per_batch_metrics(per_example):
  return {
      # A sum per batch, counted once per call: KMeans's `score` pattern.
      'batch_sum': tf1.metrics.mean(tf.reduce_sum(per_example)),
      # A mean per batch: the whole batch's, not the towers' shards'.
      'batch_mean': tf1.metrics.mean(tf.reduce_mean(per_example)),
      # A per-example metric, exact before too.
      'example_mean': tf1.metrics.mean(per_example),
  }


def _evaluate(model_fn, model_dir, towers, params=None, wrap=lambda e: e,
              input_fn=_input_fn):
  config = estimator_towers.make_run_config(str(model_dir),
                                            cpu_devices=towers)
  if towers > 1:
    model_fn = estimator_towers.replicate_model_fn(model_fn)
  estimator = wrap(tf.estimator.Estimator(model_fn, config=config,
                                          params=params or {}))
  return estimator.evaluate(input_fn, name=f'towers{towers}')


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """A model_dir holding one trained step of `_classifier`."""
  model_dir = tmp_path_factory.mktemp('metrics')
  estimator = tf.estimator.Estimator(
      _classifier, config=estimator_towers.make_run_config(str(model_dir)))
  estimator.train(_input_fn, steps=1)
  return model_dir


@pytest.mark.parametrize('towers', [2, 3])
def test_per_batch_values_average_as_on_one_device(checkpoint, towers):
  params = {'metrics': _per_batch_metrics}
  expected = _evaluate(_classifier, checkpoint, 1, params)
  actual = _evaluate(_classifier, checkpoint, towers, params)
  assert set(actual) == set(expected)
  for name in ('batch_sum', 'batch_mean', 'example_mean', 'loss'):
    np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize('towers', [2, 3])
def test_a_static_batch_size_counts_every_towers_examples(checkpoint, towers):
  # drop_remainder=True gives the shards static sizes, and TF folds a
  # metric's count of examples (tf.size of the values) into a constant,
  # which looked like a count per call: only tower 0's examples were
  # counted (accuracy 1.375 on 2 towers). The per-call count of
  # `batch_sum` must still count once per step.
  def metrics(per_example):
    return {**_per_batch_metrics(per_example),
            'keras_mean': _keras_mean(per_example)}

  def input_fn():
    return _input_fn(drop_remainder=True)

  params = {'metrics': metrics}
  expected = _evaluate(_classifier, checkpoint, 1, params, input_fn=input_fn)
  actual = _evaluate(_classifier, checkpoint, towers, params,
                     input_fn=input_fn)
  for name in ('batch_sum', 'batch_mean', 'example_mean', 'keras_mean',
               'loss'):
    np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5,
                               err_msg=name)


_WEIGHTED_MEAN = lambda e, w: tf.reduce_sum(w * e) / tf.reduce_sum(w)  # pylint: disable=unnecessary-lambda-assignment
_HALF = [1, 1, 1, 1, 0, 0, 0, 0]  # On 2 towers the second shard weighs 0.
_MIDDLE_BATCH_ZERO = [1] * 8 + [0] * 8 + [1] * 8


@pytest.mark.parametrize('value_of,pattern,finite', [
    # A shard's weighted mean was 0 / 0 = NaN, which its zero weight kept.
    (_WEIGHTED_MEAN, _HALF, True),
    # RetinaNet's normaliser: every loss over the batch's positives. A shard
    # without positives still adds its losses on one device (0.7644); when
    # its add was weighed by its count it was NaN, then dropped (0.3771).
    (lambda e, w: tf.reduce_sum(e) / tf.reduce_sum(w), _HALF, True),
    # A batch weighing 0 is NaN on one device (0 / 0), 0 with divide_no_nan:
    # the towers divide as the metric does (they added 0.2690 for both).
    (_WEIGHTED_MEAN, _MIDDLE_BATCH_ZERO, False),
    (lambda e, w: tf.math.divide_no_nan(tf.reduce_sum(w * e),
                                        tf.reduce_sum(w)),
     _MIDDLE_BATCH_ZERO, True),
], ids=['shard_weighing_0', 'sum_per_positive', 'batch_weighing_0_nan',
        'batch_weighing_0_no_nan'])
@pytest.mark.parametrize('towers', [2, 3])
def test_a_mean_over_a_count_that_may_be_0_equals_one_device(
    checkpoint, towers, value_of, pattern, finite):
  expected, actual = _one_device_and_towers(
      checkpoint, towers, pattern,
      lambda e, features: tf1.metrics.mean(value_of(e, features['w'])))
  assert np.isfinite(expected) == finite
  np.testing.assert_allclose(actual, expected, rtol=1e-5)


def _one_device_and_towers(checkpoint_dir, towers, pattern, metric):
  """Metric 'm' (`metric(per_example, features)`) of one device and of
  `towers`, over batches with weights `w` repeating `pattern`."""
  def input_fn():
    x, y = _data()
    w = np.resize(np.float32(pattern), _ROWS)
    return tf.data.Dataset.from_tensor_slices(({'x': x, 'w': w}, y)).batch(
        _BATCH)

  model_fn = _weighted_metric(metric)
  return [_evaluate(model_fn, checkpoint_dir, count, input_fn=input_fn)['m']
          for count in (1, towers)]


def _weighted_metric(metric):
  def model_fn(features, labels, mode, params):
    del params
    return _classifier(features, labels, mode, {'metrics': lambda e: {
        'm': metric(e, features)}})
  return model_fn


@pytest.mark.parametrize('pattern,finite,divide', [
    (_HALF, True, tf.math.divide),
    # One device: 0 / 0 * 0 = NaN for the middle batch; divide_no_nan: 0.
    (_MIDDLE_BATCH_ZERO, False, tf.math.divide),
    (_MIDDLE_BATCH_ZERO, True, tf.math.divide_no_nan),
], ids=['shard_weighing_0', 'batch_weighing_0_nan', 'batch_weighing_0_no_nan'])
@pytest.mark.parametrize('one_weight_tensor', [True, False],
                         ids=['weight_reused', 'weight_written_twice'])
@pytest.mark.parametrize('towers', [2, 3])
def test_a_batch_mean_weighted_by_its_weight_equals_one_device(
    checkpoint, towers, pattern, finite, divide, one_weight_tensor):
  # Each batch's weighted mean, weighing the batch's weight: the weighted
  # mean of every example. Was refused as "neither a sum nor a mean".
  def metric(e, features):
    w = features['w']
    weight = tf.reduce_sum(w)
    mean = divide(tf.reduce_sum(w * e), weight)
    if not one_weight_tensor:
      weight = tf.reduce_sum(w)
    return tf1.metrics.mean(mean, weights=weight)

  expected, actual = _one_device_and_towers(checkpoint, towers, pattern,
                                            metric)
  assert np.isfinite(expected) == finite
  np.testing.assert_allclose(actual, expected, rtol=1e-5)


# Weights with fractions (a cast to an integer loses them); on 2 towers the
# second shard of each full batch weighs 0.
_FRACTIONS = [0.5, 1.5, 1.0, 0.25, 0, 0, 0, 0]


def _weighted_input_fn():
  """Batches with float32 weights `w` and float64 weights `tiny`, whose
  second batch weighs ~1e-50 (0 once cast to float32)."""
  x, y = _data()
  w = np.resize(np.float32(_FRACTIONS), _ROWS)
  tiny = w.astype(np.float64)
  tiny[8:16] *= 1e-50
  return tf.data.Dataset.from_tensor_slices(
      ({'x': x, 'w': w, 'tiny': tiny}, y)).batch(_BATCH)


def _ratio_and_weight(e, w):
  weight = tf.reduce_sum(w)
  return tf.reduce_sum(w * tf.cast(e, w.dtype)) / weight, weight


def _keras_weighted_mean(value, weight, dtype='float32'):
  metric = tf.keras.metrics.Mean(dtype=dtype)
  metric.update_state(value, sample_weight=weight)
  return metric


# A cast to an integer or bool truncates: one device adds int(N / D) * D,
# N / D * int(D) or N / int(D) * D, not N (the towers added N, silently).
_TRUNCATED = {
    'ratio_to_int': lambda r, d: tf1.metrics.mean(tf.cast(r, tf.int32),
                                                  weights=d),
    'weight_to_int': lambda r, d: tf1.metrics.mean(
        r, weights=tf.cast(d, tf.int32)),
    'weight_to_bool': lambda r, d: tf1.metrics.mean(
        r, weights=tf.cast(tf.cast(d, tf.bool), tf.float32)),
    'keras_ratio_to_int': lambda r, d: _keras_weighted_mean(
        tf.cast(r, tf.int32), d),
}


@pytest.mark.parametrize('name', sorted(_TRUNCATED))
def test_a_ratio_or_weight_cast_to_an_integer_is_refused(name):
  def metric(e, features):
    return _TRUNCATED[name](*_ratio_and_weight(e, features['w']))

  with tf.Graph().as_default():
    features, labels = tf1.data.make_one_shot_iterator(
        _weighted_input_fn()).get_next()
    with pytest.raises(ValueError, match="'m'.*neither a sum nor a mean"):
      estimator_towers.replicate_model_fn(_weighted_metric(metric))(
          features, labels, tf.estimator.ModeKeys.EVAL, {},
          estimator_towers.make_run_config(cpu_devices=2))


# float64 weights beyond float32's range: the towers' total weight summed
# in float32 was 0 (or inf), 0 / 0 = NaN where one device is finite.
_FLOAT64 = {
    'keras_tiny': lambda e, f: _keras_weighted_mean(
        *_ratio_and_weight(e, f['tiny']), dtype='float64'),
    'keras_huge': lambda e, f: _keras_weighted_mean(
        *_ratio_and_weight(e, tf.cast(f['w'], tf.float64) * 1e300),
        dtype='float64'),
    # tf.compat.v1.metrics.mean casts to float32: the tiny batch adds 0.
    'tf1_tiny': lambda e, f: tf1.metrics.mean(
        *_ratio_and_weight(e, f['tiny'])),
}


@pytest.mark.parametrize('name', sorted(_FLOAT64))
@pytest.mark.parametrize('towers', [2, 3])
def test_float64_weights_add_up_as_on_one_device(checkpoint, towers, name):
  model_fn = _weighted_metric(_FLOAT64[name])
  expected = _evaluate(model_fn, checkpoint, 1,
                       input_fn=_weighted_input_fn)['m']
  actual = _evaluate(model_fn, checkpoint, towers,
                     input_fn=_weighted_input_fn)['m']
  assert np.isfinite(expected)
  np.testing.assert_allclose(actual, expected, rtol=1e-5)


def _per_class_weighted_means(e, f):
  """mean_tensor of per-class weighted means, each weighing its class's
  weight: two columns of sums over the rows."""
  w = tf.stack([f['w'], 1.0 - 0.5 * f['w']], 1)
  values = tf.stack([e, e * e], 1)
  weight = tf.reduce_sum(w, axis=0)
  return tf1.metrics.mean_tensor(
      tf.reduce_sum(w * values, axis=0) / weight, weights=weight)


@pytest.mark.parametrize('towers', [2, 3])
def test_per_class_means_weighing_their_weight_equal_one_device(
    checkpoint, towers):
  # A shard whose class weighs 0 added 0 / 0: [NaN, 4.6731] where one
  # device gives [1.9426, 4.6731].
  model_fn = _weighted_metric(_per_class_weighted_means)
  expected = _evaluate(model_fn, checkpoint, 1,
                       input_fn=_weighted_input_fn)['m']
  actual = _evaluate(model_fn, checkpoint, towers,
                     input_fn=_weighted_input_fn)['m']
  assert expected.shape == (2,) and np.all(np.isfinite(expected))
  np.testing.assert_allclose(actual, expected, rtol=1e-5)


def test_a_batch_value_spread_over_the_examples_is_refused():
  # The batch's weighted mean broadcast to every example and weighed per
  # example: each tower spread its shard's mean (NaN for a shard weighing
  # 0; one device 1.9426).
  def metric(e, features):
    ratio, _ = _ratio_and_weight(e, features['w'])
    return tf1.metrics.mean(ratio * tf.ones_like(features['w']),
                            weights=features['w'])

  with tf.Graph().as_default():
    features, labels = tf1.data.make_one_shot_iterator(
        _weighted_input_fn()).get_next()
    with pytest.raises(ValueError, match=(
        r"metric 'm' adds values that combine the examples of their batch: "
        r"Mul .* combines the rows with Sum .* a statistic of the shard")):
      estimator_towers.replicate_model_fn(_weighted_metric(metric))(
          features, labels, tf.estimator.ModeKeys.EVAL, {},
          estimator_towers.make_run_config(cpu_devices=2))


@pytest.mark.parametrize('towers', [2, 3])
def test_per_class_counts_added_at_indices_equal_one_device(checkpoint,
                                                            towers):
  # mean_per_class_accuracy scatter-adds per-class counts: refused as a
  # write the last tower wins. The last batch (2 rows) leaves a tower of 3
  # idle: its padding copy must add nothing.
  def model_fn(features, labels, mode, params):
    del params
    return _classifier(features, labels, mode, {'metrics': lambda e: {
        'm': tf1.metrics.mean_per_class_accuracy(
            labels, tf.cast(e < 0.5, tf.int64), 2, weights=features['w'])}})

  expected = _evaluate(model_fn, checkpoint, 1,
                       input_fn=_weighted_input_fn)['m']
  actual = _evaluate(model_fn, checkpoint, towers,
                     input_fn=_weighted_input_fn)['m']
  assert 0 < expected < 1
  np.testing.assert_allclose(actual, expected, rtol=1e-6)


def _keras_mean(values):
  """A Keras Mean with a scalar sample weight, as the v2 heads make it."""
  metric = tf.keras.metrics.Mean()
  metric.update_state(values, sample_weight=1.0)
  return metric  # EstimatorSpec initializes a Keras metric's variables.


@pytest.mark.parametrize('towers', [2, 3])
def test_add_metrics_sees_the_whole_batch_predictions(checkpoint, towers):
  def metric_fn(labels, predictions):
    return {'mean_p1': tf1.metrics.mean(predictions['probabilities'][:, 1]),
            'accuracy': tf1.metrics.accuracy(labels,
                                             predictions['class_ids'])}

  def wrap(estimator):
    return tf.estimator.add_metrics(estimator, metric_fn)

  expected = _evaluate(_classifier, checkpoint, 1, wrap=wrap)
  actual = _evaluate(_classifier, checkpoint, towers, wrap=wrap)
  for name in ('mean_p1', 'accuracy'):
    np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5,
                               err_msg=name)


def _tensor_predictions(features, labels, mode, params):
  """The classifier with its predictions as one Tensor, not a dict."""
  spec = _classifier(features, labels, mode, params)
  return spec._replace(predictions=spec.predictions['probabilities'])


@pytest.mark.parametrize('model_fn,read', [
    (_classifier, lambda predictions: predictions['probabilities']),
    # A Tensor's truth value is undefined in a graph: the merge once asked
    # it (tensorflow/estimator's own test_complete_flow_... crashed).
    (_tensor_predictions, lambda predictions: predictions)])
def test_training_predictions_cover_the_whole_batch(model_fn, read):
  x, _ = _data()
  outputs = []
  for towers in (1, 3):
    with tf.Graph().as_default():
      features, labels = tf1.data.make_one_shot_iterator(
          _input_fn()).get_next()
      config = estimator_towers.make_run_config(cpu_devices=towers)
      spec = estimator_towers.replicate_model_fn(model_fn)(
          features, labels, tf.estimator.ModeKeys.TRAIN, {}, config)
      with tf1.Session(config=config.session_config) as session:
        session.run(tf1.global_variables_initializer())
        outputs.append(session.run(read(spec.predictions)))
  assert outputs[1].shape == (_BATCH, 2) and len(x) > _BATCH
  np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-6)


def test_kmeans_score_equals_one_device(tmp_path):
  rng = np.random.RandomState(0)
  points = np.concatenate([rng.randn(13, 2) + 3,
                           rng.randn(13, 2) - 3]).astype(np.float32)
  kmeans = tf1.estimator.experimental.KMeans(
      num_clusters=2, model_dir=str(tmp_path), use_mini_batch=False, seed=3)
  kmeans.train(lambda: tf.data.Dataset.from_tensors(points).repeat(),
               steps=2)

  def input_fn():  # Batches of 9, 9, 8: KMeans's kernel needs points.
    return tf.data.Dataset.from_tensor_slices(points).batch(9)

  expected = kmeans.evaluate(input_fn)
  for towers in (2, 3):
    estimator = tf.estimator.Estimator(
        estimator_towers.replicate_model_fn(kmeans.model_fn),
        config=estimator_towers.make_run_config(
            str(tmp_path), cpu_devices=towers))
    actual = estimator.evaluate(input_fn, name=f'towers{towers}')
    np.testing.assert_allclose(actual['score'], expected['score'], rtol=1e-5,
                               err_msg=f'{towers} towers')


def test_a_sum_plus_a_constant_per_call_is_refused():
  def metric(per_example):
    total = tf1.get_local_variable('total', [], initializer=tf1.zeros_initializer(),
                                   collections=[tf1.GraphKeys.METRIC_VARIABLES,
                                                tf1.GraphKeys.LOCAL_VARIABLES])
    update = total.assign_add(tf.reduce_sum(per_example) + 1.0)
    return {'padded_sum': (total.read_value(), update)}

  with tf.Graph().as_default():
    features, labels = tf1.data.make_one_shot_iterator(_input_fn()).get_next()
    with pytest.raises(ValueError, match="'padded_sum'.*once per tower"):
      estimator_towers.replicate_model_fn(_classifier)(
          features, labels, tf.estimator.ModeKeys.EVAL, {'metrics': metric},
          estimator_towers.make_run_config(cpu_devices=2))


def _running_max(per_example):
  peak = tf1.get_local_variable('peak', [], initializer=tf1.zeros_initializer(),
                                collections=[tf1.GraphKeys.METRIC_VARIABLES,
                                             tf1.GraphKeys.LOCAL_VARIABLES])
  return peak.read_value(), peak.assign(tf.maximum(peak,
                                                   tf.reduce_max(per_example)))


@pytest.mark.parametrize('name,metric,says', [
    # One value per batch that is no sum or mean of the examples: each
    # tower added its shard's (5.66 for 3.38; -inf from an idle tower).
    ('batch_max', lambda e: tf1.metrics.mean(tf.reduce_max(e)),
     'neither a sum nor a mean'),
    ('squared_mean', lambda e: tf1.metrics.mean(tf.square(tf.reduce_mean(e))),
     'neither a sum nor a mean'),
    # A ratio weighed by another sum than its divisor: no tower's part is
    # its numerator (a ratio times its own divisor is, above).
    ('ratio_times_other_sum', lambda e: tf1.metrics.mean(
        tf.reduce_sum(e * e) / tf.reduce_sum(e), weights=tf.reduce_sum(e)
        + tf.reduce_sum(e * e)), 'neither a sum nor a mean'),
    # State written from the shard by an assign: the last tower wins.
    ('running_max', _running_max, 'the last write wins'),
])
def test_a_per_batch_value_the_towers_cannot_combine_is_refused(name, metric,
                                                                says):
  with tf.Graph().as_default():
    features, labels = tf1.data.make_one_shot_iterator(_input_fn()).get_next()
    with pytest.raises(ValueError, match=f"'{name}'.*{says}"):
      estimator_towers.replicate_model_fn(_classifier)(
          features, labels, tf.estimator.ModeKeys.EVAL,
          {'metrics': lambda e: {name: metric(e)}},
          estimator_towers.make_run_config(cpu_devices=2))


def _conv_classifier(features, labels, mode, params):
  """A small CNN: TF 2.15's oneDNN Conv2D mishandled an empty shard."""
  del params
  images = tf.reshape(features['x'], [-1, 8, 8, 1])
  hidden = tf.keras.layers.Conv2D(
      4, 3, activation='relu', kernel_initializer='ones')(images)
  hidden = tf.keras.layers.MaxPooling2D()(hidden)
  hidden = tf.keras.layers.Conv2D(
      2, 3, padding='same', kernel_initializer='ones')(hidden)
  logits = tf1.layers.dense(
      tf1.layers.flatten(hidden), 2,
      kernel_initializer=tf1.constant_initializer(0.01))
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  probability = tf.nn.softmax(logits)[:, 1]
  metrics = {
      'accuracy': tf1.metrics.accuracy(labels, tf.argmax(logits, 1)),
      # Per-threshold count vectors: adds count_once leaves as they are.
      'auc': tf1.metrics.auc(labels, probability),
      'mean_p1': tf1.metrics.mean(probability),
  }
  train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    eval_metric_ops=metrics)


def test_a_batch_smaller_than_the_tower_count_evaluates_as_one_device(
    tmp_path):
  # Idle towers evaluate a padding copy that adds nothing: an empty shard
  # crashed oneDNN's convolution (on by default here), and a copy that
  # counted would move every metric.
  rng = np.random.RandomState(1)
  x = rng.rand(7, 64).astype(np.float32)
  y = np.array([0, 1, 1, 0, 1, 0, 1])

  def input_fn():  # Batches of 3, 3, 1: the last leaves 1 or 2 towers idle.
    return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(3)

  results = {}
  for towers in (1, 2, 3):
    fn = (estimator_towers.replicate_model_fn(_conv_classifier)
          if towers > 1 else _conv_classifier)
    estimator = tf.estimator.Estimator(fn, config=estimator_towers.
                                       make_run_config(str(tmp_path),
                                                       cpu_devices=towers))
    if towers == 1:
      estimator.train(input_fn, steps=2)
    results[towers] = estimator.evaluate(input_fn, name=f'towers{towers}')
  for towers in (2, 3):
    for name in ('accuracy', 'auc', 'mean_p1', 'loss'):
      np.testing.assert_allclose(results[towers][name], results[1][name],
                                 rtol=1e-5, err_msg=f'{name}, {towers}')


@pytest.mark.parametrize('towers', [2, 3])
def test_a_per_column_mean_of_each_batch_equals_one_device(checkpoint,
                                                           towers):
  # tf.compat.v1.metrics.mean_tensor of tf.reduce_mean(values, 0) (each
  # batch's column means) was doubled on 2 towers, then refused as "neither
  # a sum nor a mean over the examples". Each tower's column means now weigh
  # by its share of the rows; the uneven last batch tells the shares from
  # equal weights.
  def column_means(per_example):
    columns = tf.stack([per_example, tf.square(per_example)], 1)
    return {'m': tf1.metrics.mean_tensor(tf.reduce_mean(columns, 0))}

  params = {'metrics': column_means}
  expected = _evaluate(_classifier, checkpoint, 1, params)['m']
  actual = _evaluate(_classifier, checkpoint, towers, params)['m']
  assert expected.shape == (2,)
  np.testing.assert_allclose(actual, expected, rtol=1e-5)


def _columns(per_example):
  """Per-example rows of 2 columns, as probabilities are."""
  likelihood = tf.exp(-per_example)
  return tf.stack([likelihood, 1.0 - likelihood], 1)


# Functions of each batch's column means that are no weighted sum of the
# towers' column means: each tower added its own into the metric's total
# while the count took the batch once (2 towers: 0.25-0.65 off, 3 towers:
# 0.50-1.13, silently).
_OF_COLUMN_MEANS = {
    'square': lambda e: tf.square(tf.reduce_mean(_columns(e), 0)),
    'maximum': lambda e: tf.maximum(tf.reduce_mean(_columns(e), 0), 0.5),
    'guarded': lambda e: tf.where(tf.reduce_sum(e) > 3.0,
                                  tf.reduce_mean(_columns(e), 0),
                                  tf.zeros([2])),
    'over_a_mean': lambda e: (tf.reduce_mean(_columns(e), 0) /
                              tf.reduce_mean(e)),
}


@pytest.mark.parametrize('name', sorted(_OF_COLUMN_MEANS))
def test_a_function_of_column_means_is_refused(name):
  with tf.Graph().as_default():
    features, labels = tf1.data.make_one_shot_iterator(_input_fn()).get_next()
    with pytest.raises(ValueError, match="'m' adds one value per batch"):
      estimator_towers.replicate_model_fn(_classifier)(
          features, labels, tf.estimator.ModeKeys.EVAL,
          {'metrics': lambda e: {'m': tf1.metrics.mean_tensor(
              _OF_COLUMN_MEANS[name](e))}},
          estimator_towers.make_run_config(cpu_devices=2))


@pytest.mark.parametrize('towers', [2, 3])
def test_column_means_keepdims_3d_and_plus_a_constant_equal_one_device(
    checkpoint, towers):
  # `+ 1.0` failed inside the rewrite (TensorFlow's "Shapes must be equal
  # rank" from an add_n of the weighted constant and the vector).
  def metrics(e):
    columns = _columns(e)
    return {
        'plus_one': tf1.metrics.mean_tensor(
            tf.reduce_mean(columns, 0) + 1.0),
        'keepdims': tf1.metrics.mean_tensor(
            tf.reduce_mean(columns, 0, keepdims=True)),
        'three_d': tf1.metrics.mean_tensor(
            tf.reduce_mean(tf.stack([columns, 2 * columns], 1), 0)),
    }

  params = {'metrics': metrics}
  expected = _evaluate(_classifier, checkpoint, 1, params)
  actual = _evaluate(_classifier, checkpoint, towers, params)
  for name in ('plus_one', 'keepdims', 'three_d'):
    np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5,
                               err_msg=name)


def test_towers_add_into_a_metric_in_tower_order():
  # In any order, float adds round differently: evaluations of one
  # checkpoint differed in their last bits (tf.estimator's own
  # InMemoryEvaluatorHook test compares two of them exactly).

  def model_fn(features, labels, mode):
    loss = tf.reduce_mean(tf1.layers.dense(features['x'], 1))
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        'mean_x': tf1.metrics.mean(features['x'])})

  graph, spec = build_replicated(model_fn, 3, mode=tf.estimator.ModeKeys.EVAL)
  update = spec.eval_metric_ops['mean_x'][1]
  with graph.as_default():
    adds = [op for op in op_ledger.ancestors([update.op if hasattr(
        update, 'op') else update]) if op.type == 'AssignAddVariableOp']
  by_variable = {}
  for add in adds:
    by_variable.setdefault(add.inputs[0].op.name, []).append(add)
  assert sorted(len(v) for v in by_variable.values()) == [3, 3]
  for writes in by_variable.values():
    writes.sort(key=lambda op: op.name)  # mean/..., tower_1/..., tower_2/...
    for earlier, later in zip(writes, writes[1:]):
      assert earlier in op_ledger.ancestors([later]), (earlier.name,
                                                       later.name)
