"""random_ops='one_device': towers draw the random numbers one device draws.

With the same `tf_random_seed`, a model with random initial weights and
dropout (BERT's tf.nn.dropout with keep_prob, TF2's rate,
tf.compat.v1.layers and tf.keras Dropout, per-example Gaussian,
truncated-normal and stateless noise) computes on towers what one device
computes: predictions with dropout on over several runs (fast), and the
weights after a few training steps (training). The same checks fail with
random_ops='per_tower' (each tower draws its own numbers), which the fast
test asserts. Draws that cannot be made one device's are refused. The
synchronous cluster's case is in test_task_sync.
"""

import numpy as np
import pytest
import tensorflow as tf

import trainer
from helpers import (assert_same_variables, bert_model_fn, build_replicated,
                     dataset_input_fn, make_estimator, seeded, variables_of)

tf1 = tf.compat.v1

# Which draws each tower's random ops make: in the graph the product runs,
# Grappler's rewrites on (tests/README.md, "Where the time goes").
pytestmark = pytest.mark.graph_rewrites
ModeKeys = tf.estimator.ModeKeys

VOCAB, SEQ, HIDDEN = 11, 3, 8
DROPOUT = 0.3  # Large, so that a wrong mask shows in a few values.
SEED = 7


def keras_model_fn(features, labels, mode, params):
  """tf.keras and tf.compat.v1.layers dropout in a graph-mode model_fn.

  Keras initializers without a seed draw a new one in Python on each
  build (not from tf_random_seed), so one device would not repeat itself:
  the Dense layers get seeds."""
  x = tf.cast(features['ids'], tf.float32)
  hidden = tf.keras.layers.Dense(
      HIDDEN, activation='tanh',
      kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))(x)
  hidden = tf.keras.layers.Dropout(params['dropout'])(hidden, training=True)
  hidden = tf1.layers.dropout(hidden, params['dropout'], training=True)
  logits = tf.keras.layers.Dense(
      2, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(
          hidden)
  return _spec(mode, logits, labels, params)


def noise_model_fn(features, labels, mode, params):
  """Per-example Gaussian, truncated-normal and stateless noise, noise of
  a fixed shape (one value for every example), and tf.nn.dropout's rate."""
  del params
  x = tf.cast(features['ids'], tf.float32)
  x += 0.3 * tf.random.normal(tf.shape(x))
  x += 0.3 * tf.random.truncated_normal(tf.shape(x))
  x += 0.3 * tf.random.stateless_normal(tf.shape(x), seed=[1, 2])
  x *= tf.random.uniform([SEQ], 0.5, 1.5)
  x = tf.nn.dropout(x, rate=0.2)  # TF2's rate, beside BERT's keep_prob
  # tf.compat.v1.layers' default initializer is Keras's, seeded in Python.
  logits = tf1.layers.dense(x, 2, name='logits', kernel_initializer=seeded(3))
  return _spec(mode, logits, labels, {})


def _spec(mode, logits, labels, params):
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf1.train.GradientDescentOptimizer(params.get('rate', 0.5))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=(
      optimizer.minimize(loss, tf1.train.get_or_create_global_step())))


def tiny_bert_model_fn(features, labels, mode, params):
  """helpers.bert_model_fn, one layer of hidden size 8."""
  return bert_model_fn(features, labels, mode, {
      **params, 'vocab': VOCAB, 'seq': SEQ, 'hidden': HIDDEN, 'heads': 2,
      'layers': 1, 'learning_rate': 0.5})


MODEL_FNS = {'bert': tiny_bert_model_fn, 'keras': keras_model_fn,
             'noise': noise_model_fn}


def _data(rows):
  ids = np.random.RandomState(0).randint(0, VOCAB, (rows, SEQ))
  return ids.astype(np.int32), (ids[:, 0] % 2).astype(np.int32)


def _predictions(model_fn, towers, rows, runs=3, **wrapper_kwargs):
  """Logits of `runs` PREDICT runs of one graph seeded with SEED (dropout
  on), initial weights included, on `towers` (1: the model_fn itself)."""
  config = trainer.make_run_config(cpu_devices=max(towers, 1))
  fn = (trainer.replicate_model_fn(model_fn, **wrapper_kwargs)
        if towers > 1 else model_fn)
  with tf.Graph().as_default() as graph:
    graph.seed = SEED
    ids, _ = _data(rows)
    features = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensors({'ids': ids}).repeat()).get_next()
    kwargs = {'config': config} if towers > 1 else {}
    spec = fn(features=features, labels=None, mode=ModeKeys.PREDICT,
              params={'dropout': DROPOUT}, **kwargs)
    with tf1.Session(config=config.session_config) as session:
      session.run(tf1.global_variables_initializer())
      return np.stack([session.run(spec.predictions['logits'])
                       for _ in range(runs)])


@pytest.mark.fast
@pytest.mark.parametrize('kind,towers,rows', [
    ('bert', 2, 6), ('bert', 3, 7), ('bert', 3, 2),  # 3, 2, 2; one idle
    ('keras', 3, 7), ('noise', 2, 7)])
def test_predictions_with_dropout_are_one_devices(kind, towers, rows):
  expected = _predictions(MODEL_FNS[kind], 1, rows)
  actual = _predictions(MODEL_FNS[kind], towers, rows,
                        random_ops='one_device')
  np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-6)
  # Proof that the comparison can fail: each tower drawing its own.
  per_tower = _predictions(MODEL_FNS[kind], towers, rows)
  assert not np.allclose(per_tower, expected, rtol=1e-4, atol=1e-6)


STEPS = 3


@pytest.fixture(scope='module')
def one_device(tmp_path_factory):
  """`one_device(kind, batch_size)`: variables after STEPS steps on one
  device, from tf_random_seed's initial weights (computed once each)."""
  runs = {}

  def get(kind, batch_size):
    if (kind, batch_size) not in runs:
      runs[kind, batch_size] = _train(
          tmp_path_factory.mktemp('one_device'), kind, 1, batch_size)
    return runs[kind, batch_size]

  return get


def _train(model_dir, kind, towers, batch_size, **wrapper_kwargs):
  ids, labels = _data(4 * batch_size)
  estimator = make_estimator(MODEL_FNS[kind], model_dir, towers,
                             {'dropout': DROPOUT}, **wrapper_kwargs)
  estimator.train(dataset_input_fn({'ids': ids}, labels, batch_size),
                  steps=STEPS)
  return variables_of(estimator)


@pytest.mark.training
@pytest.mark.parametrize('kind,towers,batch_size,aggregation', [
    ('bert', 3, 7, 'all_reduce'),   # shards of 3, 2, 2
    ('bert', 3, 2, 'global_loss'),  # an idle tower (a padding copy)
    ('noise', 2, 7, 'all_reduce'),
])
def test_training_with_dropout_is_one_devices(tmp_path, one_device, kind,
                                              towers, batch_size,
                                              aggregation):
  actual = _train(tmp_path, kind, towers, batch_size,
                  random_ops='one_device', aggregation=aggregation)
  assert_same_variables(one_device(kind, batch_size), actual, rtol=1e-4)


def _noisy(draw):
  """A classifier whose features get the noise `draw(x)` adds."""

  def model_fn(features, labels, mode, params):
    del params
    x = features['x']
    logits = tf1.layers.dense(x + draw(x), 2, kernel_initializer=seeded(1))
    return _spec(mode, logits, labels, {})

  return model_fn


@pytest.mark.fast
@pytest.mark.parametrize('value', ['one_devices', None, 1])
def test_an_unknown_choice_is_refused_naming_it(value):
  with pytest.raises(ValueError, match=f'random_ops={value!r}'):
    trainer.replicate_model_fn(noise_model_fn, random_ops=value)


@pytest.mark.fast
@pytest.mark.parametrize('draw,refusal', [
    # Noise on tower 0 only: towers draw differently from one another.
    (lambda x: (tf.random.normal(tf.shape(x)) if
                trainer.tower_context().index == 0 else 0.0),
     'tower 1 creates 0 random ops, tower 0 \(one device\) 1'),
    # Sampling from the shard's logits: no global draw to cut rows from.
    (lambda x: tf.cast(tf.random.categorical(x, 1), tf.float32),
     "takes the tower's shard as an input other than its shape"),
    # Inside a conditional (a function in TF2 graphs): out of reach. (Not
    # on a statistic of the shard, which each tower computes on its own:
    # that is refused, shard_statistics.)
    (lambda x: tf.cond(tf1.placeholder_with_default(True, []),
                       lambda: tf.random.normal(tf.shape(x)),
                       lambda: tf.zeros_like(x)),
     'inside its function'),
    # Candidates drawn by a sampler (nce_loss, sampled softmax), and a
    # tf.random.Generator's draw: each tower drew its own, silently.
    (lambda x: x + tf.cast(tf.random.log_uniform_candidate_sampler(
        tf.zeros([1, 1], tf.int64), 1, 1, True, 5)[0][0], tf.float32),
     'LogUniformCandidateSampler .* draws random numbers \\(a candidate '
     'sampler'),
    (lambda x: tf.random.Generator.from_seed(1).normal(tf.shape(x)),
     'RngReadAndSkip .* draws random numbers'),
])
def test_draws_it_cannot_match_are_refused(draw, refusal):
  with pytest.raises(ValueError, match=refusal) as raised:
    build_replicated(_noisy(draw), 2, random_ops='one_device')
  assert "random_ops='per_tower'" in str(raised.value)
  build_replicated(_noisy(draw), 2)  # Each tower on its own: built.


@pytest.mark.fast
def test_a_first_dimension_other_than_the_rows_fails_the_step():
  # [2 * rows + 1, features]: not a multiple of the shard's rows.
  model_fn = _noisy(lambda x: tf.random.normal(
      tf.shape(tf.concat([x, x, x[:1]], 0)))[:tf.shape(x)[0]])
  graph, spec = build_replicated(model_fn, 2, batch_size=4,
                                 random_ops='one_device')
  with graph.as_default(), tf1.Session(config=trainer.make_run_config(
      cpu_devices=2).session_config) as session:
    session.run(tf1.global_variables_initializer())
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match='not a multiple of the tower.*per_tower'):
      session.run(spec.train_op)
