"""PREDICT outputs whose rows are not one device's are refused.

The towers' predictions are merged by putting each tower's rows after the
previous tower's. A prediction that keeps, orders, pairs or numbers the
rows by their position does that to each tower's shard: the merged rows
were another batch's, silently (`tf.reverse(h, [0])` on 2 towers gave each
shard reversed; `h[:6]` of a batch of 8 kept each 4-row shard whole, 8 rows
where one device has 6). Each such form is refused while the graph is
built, in the predictions and in every export output; per-example forms
give one device's predictions, row for row.
"""

import numpy as np
import pytest
import tensorflow as tf

from helpers import seeded
import trainer

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys
_BATCH = 10


def _row_positions(h):
  return tf.range(tf.shape(h)[0])


# Each was merged silently on towers before it was refused.
_REFUSED = {
    'gather_by_positions': (lambda h: tf.gather(h, [0, 1, 2]),
                            'keeps some rows'),
    'reverse': (lambda h: tf.reverse(h, [0]), 'orders the rows'),
    'reversed_slice': (lambda h: h[::-1], 'keeps some rows'),
    'roll': (lambda h: tf.roll(h, 1, 0), 'orders the rows'),
    'sorted_rows': (lambda h: tf.sort(h, axis=0),
                    '(orders the rows|keeps some rows)'),
    'slices_swapped': (lambda h: tf.concat([h[3:], h[:3]], 0),
                       'keeps some rows'),
    'mask_of_positions': (lambda h: tf.boolean_mask(
        h, _row_positions(h) < 6), 'keeps some rows'),
    'where_of_positions': (lambda h: tf.where(
        (_row_positions(h) < 6)[:, None], h, 0.0), 'keeps some rows'),
    'weights_of_positions': (lambda h: h * tf.cast(
        _row_positions(h) < 6, tf.float32)[:, None], 'keeps some rows'),
    'pairs': (lambda h: tf.matmul(h, h, transpose_b=True),
              'pairs the examples'),
    'positions': (_row_positions, 'numbers the examples'),
    'positions_and_values': (lambda h: tf.cast(
        _row_positions(h), tf.float32) + h[:, 0], 'numbers the examples'),
    'batch_mean': (lambda h: h - tf.reduce_mean(h, 0),
                   'is computed from its batch as a whole'),
    # Adversary round 30: still silent after the rule above.
    'where_of_a_column_of_positions': (lambda h: tf.where(
        _row_positions(h)[:, None] < 6, h, 0.0), 'keeps some rows'),
    'mean_row': (lambda h: tf.reduce_mean(h, 0, keepdims=True),
                 'is computed from its batch as a whole'),
    'tiled_mean': (lambda h: tf.tile(tf.reduce_mean(
        h, 0, keepdims=True), [tf.shape(h)[0], 1]), 'is computed from its '
                   'batch as a whole: Mean .* repeats in each row'),
    'broadcast_max': (lambda h: tf.broadcast_to(tf.reduce_max(h, 0),
                                                tf.shape(h)),
                      'is computed from its batch as a whole'),
    'zeros_plus_mean': (lambda h: tf.zeros_like(h) + tf.reduce_mean(h, 0),
                        'is computed from its batch as a whole'),
}
# Refused when the batch's size is static: with a batch of unknown size
# the first rows by a written number run with a check (see below).
_REFUSED_STATIC = {
    'first_rows_of_a_shards_size': (lambda h: h[:5],
                                    'keeps the first 5 rows'),
    'first_rows_beyond_a_shard': (lambda h: h[:7], 'keeps the first 7 rows'),
    'tf_slice': (lambda h: tf.slice(h, [0, 0], [5, -1]),
                 'keeps the first 5 rows'),
    'first_rows_reversed': (lambda h: h[:6][::-1], 'keeps'),
    # At most 6 rows: each shard kept whole (adversary round 30).
    'at_most_first_rows': (lambda h: h[:tf.minimum(6, tf.shape(h)[0])],
                           'keeps the first 6 rows'),
}
# One device's predictions, row for row, on towers.
_PER_EXAMPLE = {
    'h': lambda h: h,
    'scaled': lambda h: 2.0 * h + 1.0,
    'a_column': lambda h: h[:, :1],
    'own_rows': lambda h: h[:tf.shape(h)[0]],
    'beyond_any_batch': lambda h: h[:1000],
    'sorted_within_examples': lambda h: tf.sort(h, axis=1),
    'reversed_within_examples': lambda h: tf.reverse(h, [1]),
    'picked_per_example': lambda h: tf.gather_nd(h, tf.stack(
        [_row_positions(h), tf.argmax(h, 1, output_type=tf.int32)], 1)),
    'a_mask_of_values': lambda h: tf.where(h > 0.0, h, 0.0),
    'softmax_over_columns': tf.nn.softmax,
}


def _model_fn(rows, export=False):

  def model_fn(features, mode):
    h = tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(1))
    p = rows(h)
    outputs = None
    if export:
      outputs = {'serving_default':
                 tf.estimator.export.PredictOutput({'p': p})}
    return tf.estimator.EstimatorSpec(
        mode, predictions={'h': h} if export else {'p': p},
        export_outputs=outputs)

  return model_fn


def _predict(model_fn, towers, static_batch=True, batch=_BATCH):
  """The predictions of a batch of `batch` distinct rows: `model_fn` itself
  (`towers=0`), or replicated on `towers` virtual CPUs."""
  graph = tf.Graph()
  with graph.as_default():
    x = np.arange(batch * 3, dtype=np.float32).reshape(batch, 3) % 7 - 3
    dataset = tf.data.Dataset.from_tensors({'x': x})
    if not static_batch:
      dataset = dataset.unbatch().batch(batch)
    features = tf1.data.make_one_shot_iterator(dataset).get_next()
    config = trainer.make_run_config(cpu_devices=max(towers, 1))
    if towers == 0:
      spec = model_fn(features=features, mode=ModeKeys.PREDICT)
    else:
      spec = trainer.replicate_model_fn(model_fn)(
          features=features, mode=ModeKeys.PREDICT, config=config)
    with tf1.Session(config=config.session_config) as session:
      session.run(tf1.global_variables_initializer())
      return session.run(spec.predictions)


@pytest.mark.parametrize('static_batch', [True, False],
                         ids=['static', 'unknown_size'])
@pytest.mark.parametrize('case', sorted(_REFUSED))
def test_predictions_by_position_are_refused(case, static_batch):
  rows, phrase = _REFUSED[case]
  with pytest.raises(ValueError, match=f"The prediction 'p' {phrase}"):
    _predict(_model_fn(rows), 2, static_batch)


@pytest.mark.parametrize('case', sorted(_REFUSED_STATIC))
def test_first_rows_of_a_static_batch_are_refused(case):
  rows, phrase = _REFUSED_STATIC[case]
  with pytest.raises(ValueError, match=f"The prediction 'p' {phrase}"):
    _predict(_model_fn(rows), 2)


def test_first_rows_of_a_shards_static_size_name_the_ambiguity():
  # h[:x.shape[0]] writes the shard's size on a tower (5 of a batch of 10)
  # and the batch's on one device: the graph holds a 5 either way.
  def model_fn(features, mode):
    x = features['x']
    h = tf1.layers.dense(x, 2, kernel_initializer=seeded(1))
    return tf.estimator.EstimatorSpec(mode, predictions={
        'p': h[:x.shape[0]]})

  with pytest.raises(ValueError, match=r'(?s)keeps the first 5 rows.*'
                     r'x\.shape\[0\]\) is the shard.*tf\.shape\(x\)\[0\]'):
    _predict(model_fn, 2)


@pytest.mark.parametrize('towers', [2, 3])
@pytest.mark.parametrize('static_batch', [True, False],
                         ids=['static', 'unknown_size'])
@pytest.mark.parametrize('case', sorted(_PER_EXAMPLE))
def test_per_example_predictions_are_one_devices(case, static_batch, towers):
  model_fn = _model_fn(_PER_EXAMPLE[case])
  one = _predict(model_fn, 0, static_batch)
  many = _predict(model_fn, towers, static_batch)
  assert len(np.unique(one['p'])) > 1  # Distinct rows: an order shows.
  np.testing.assert_allclose(many['p'], one['p'], rtol=1e-6)


@pytest.mark.parametrize('rows', [
    lambda h: h[:6], lambda h: tf.slice(h, [0, 0], [5, -1]),
    lambda h: h[:tf.minimum(6, tf.shape(h)[0])]],
                         ids=['strided', 'tf_slice', 'at_most'])
def test_first_rows_of_a_batch_of_unknown_size_fail_when_run(rows):
  # 5-row shards kept whole: 10 predictions where one device makes 5-6. The
  # graph cannot tell [:6] from [:1000] (every row): the step checks.
  # (TensorFlow's message escapes the quotes around the name.)
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?s)The "
                     r"prediction \W*p\W* keeps the first [56] rows of its "
                     r"batch.*\[10\] \[rows\. Slice the rows"):
    _predict(_model_fn(rows), 2, static_batch=False)


def test_first_rows_covering_a_batch_of_unknown_size_run():
  one = _predict(_model_fn(lambda h: h[:10]), 0, static_batch=False)
  many = _predict(_model_fn(lambda h: h[:10]), 2, static_batch=False)
  np.testing.assert_allclose(many['p'], one['p'], rtol=1e-6)


@pytest.mark.parametrize('case', ['reverse', 'mask_of_positions'])
def test_export_outputs_by_position_are_refused(case):
  # A SavedModel serves the export outputs: refused like the predictions.
  rows, phrase = _REFUSED[case]
  with pytest.raises(ValueError, match=r"The prediction "
                     r"\"export_outputs\['serving_default'\]\['p'\]\" "
                     f'{phrase}'):
    _predict(_model_fn(rows, export=True), 2, static_batch=False)


def test_export_outputs_of_first_rows_fail_when_run():
  # A serving graph with towers (replicate_serving=True) feeds a batch of
  # unknown size: 8 rows kept whole as two 4-row shards where one device
  # serves 6.
  model_fn = _model_fn(lambda h: h[:6], export=True)
  graph = tf.Graph()
  with graph.as_default():
    x = tf1.placeholder(tf.float32, [None, 3])
    config = trainer.make_run_config(cpu_devices=2)
    spec = trainer.replicate_model_fn(model_fn, replicate_serving=True)(
        features={'x': x}, mode=ModeKeys.PREDICT, config=config)
    served = spec.export_outputs['serving_default'].outputs['p']
    with tf1.Session(config=config.session_config) as session:
      session.run(tf1.global_variables_initializer())
      assert session.run(served, {x: np.ones([6, 3])}).shape == (6, 2)
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match='keeps the first 6 rows'):
        session.run(served, {x: np.ones([8, 3])})


def test_predictions_from_the_shards_batch_statistics_are_refused():
  # Batch norm with training=True normalised each shard with its own
  # moments in PREDICT: predictions 1.1-1.8 off one device's, silently.
  def model_fn(training):
    def fn(features, mode):
      normalised = tf1.layers.batch_normalization(features['x'],
                                                  training=training)
      return tf.estimator.EstimatorSpec(mode, predictions={
          'scores': tf1.layers.dense(normalised, 1,
                                     kernel_initializer=seeded(1))})
    return fn

  with pytest.raises(ValueError, match=r"(?s)The prediction 'scores' is "
                     'computed from its batch as a whole.*training=False'):
    _predict(model_fn(True), 2)
  one = _predict(model_fn(False), 0)
  np.testing.assert_allclose(_predict(model_fn(False), 2)['scores'],
                             one['scores'], rtol=1e-6)


def _run_merged(mode, rows, fetch):
  """Runs `fetch(spec)` of a replicated EVAL or TRAIN step on 2 towers
  whose predictions are {'h': h, 'p': rows(h)}."""
  def model_fn(features, labels, mode):
    h = tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(1))
    loss = tf.reduce_mean(tf.square(h - labels))
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=train_op,
        predictions={'h': h, 'p': rows(h)})

  graph = tf.Graph()
  with graph.as_default():
    x = np.arange(_BATCH * 3, dtype=np.float32).reshape(_BATCH, 3) % 7 - 3
    y = np.ones([_BATCH, 2], np.float32)
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensors(({'x': x}, y)).repeat()).get_next()
    config = trainer.make_run_config(cpu_devices=2)
    spec = trainer.replicate_model_fn(model_fn)(
        features=features, labels=labels, mode=mode, config=config)
    with tf1.Session(config=config.session_config) as session:
      session.run([tf1.global_variables_initializer(),
                   tf1.local_variables_initializer()])
      return session.run(fetch(spec))


@pytest.mark.parametrize('mode', [ModeKeys.EVAL, ModeKeys.TRAIN])
def test_eval_and_train_predictions_by_position_fail_when_read(mode):
  # tf.estimator.add_metrics and hooks read the merged predictions: each
  # shard reversed was read silently. A step that does not read them runs
  # as one device's.
  reverse = lambda h: tf.reverse(h, [0])
  assert np.isfinite(_run_merged(mode, reverse, lambda spec: spec.loss))
  assert _run_merged(mode, reverse,
                     lambda spec: spec.predictions['h']).shape == (10, 2)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r'(?s)prediction \W*p\W* orders the rows.*read '
                     'in EVAL or TRAIN'):
    _run_merged(mode, reverse, lambda spec: spec.predictions['p'])


def test_eval_predictions_of_a_batch_statistic_fail_when_read():
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='computed from its batch as a whole'):
    _run_merged(ModeKeys.EVAL, lambda h: h - tf.reduce_mean(h, 0),
                lambda spec: spec.predictions['p'])
