"""Shared test helpers: small seeded models, an Estimator runner, checks.

Tests import these from here (`from helpers import ...`); conftest.py keeps
only the fixtures. Every multi-device test runs on virtual CPU devices
(`make_run_config(cpu_devices=N)`), the way the package is tested without
GPUs. Initializers carry op-level seeds so the one-device and the towered
graph start from the same weights although their graphs differ.
"""

import inspect
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position

import trainer  # pylint: disable=wrong-import-position

tf1 = tf.compat.v1
tf.get_logger().setLevel('ERROR')

NUM_EXAMPLES = 48
NUM_FEATURES = 5


def dataset_input_fn(features, labels=None, batch_size=12, repeat=True):
  """An input_fn yielding the arrays in order, in batches of batch_size."""

  def input_fn():
    items = features if labels is None else (features, labels)
    ds = tf.data.Dataset.from_tensor_slices(items).batch(batch_size)
    return ds.repeat() if repeat else ds

  return input_fn


# Whether `run_config` keeps Grappler's graph rewrites on, as the product
# does. tests/conftest.py sets it for each test file marked
# `graph_rewrites` (files whose subject is what runs, and how often).
graph_rewrites = False


def run_config(model_dir, towers, **kwargs):
  """`make_run_config` on `towers` virtual CPUs, for Estimators in tests.

  The checkpoint hook writes no graph.pbtxt, .meta files or graph event: a
  big graph (MobileNet's: tens of MB) makes them seconds of a test's time,
  and no test reads them. Grappler's graph rewrites are off but under
  `mixed_precision` (a rewrite itself) and in files marked
  `graph_rewrites`: see `_without_graph_rewrites`.

  Args:
    model_dir: The Estimator's directory.
    towers: How many virtual CPU devices the session gets.
    **kwargs: More arguments of `make_run_config` / `RunConfig`.

  Returns:
    The `RunConfig`.
  """
  config = trainer.make_run_config(str(model_dir), cpu_devices=towers,
                                   checkpoint_save_graph_def=False, **kwargs)
  if graph_rewrites or kwargs.get('mixed_precision'):
    return config
  return _without_graph_rewrites(config)


def _without_graph_rewrites(config):
  """`config` with Grappler's graph rewrites off.

  They run each time a session starts (an Estimator starts one per train,
  evaluate and predict call): 31% of the CPU time of test_aggregation.py's
  and test_gradient_routing.py's training tests (116 -> 80 s), and 14 of the
  49 CPU seconds of MobileNet's 2-tower train call. The graphs the product
  runs, rewrites on, are still tested: in files marked `graph_rewrites`
  (what runs once per step, in which tower, with which draws), wherever a
  test builds its RunConfig with make_run_config itself (the write-order
  race, loss scaling, the equivalence check, `build_replicated`,
  `train_in_session`) and in every process the cli and cluster tiers
  start.
  """
  session_config = tf1.ConfigProto()
  session_config.CopyFrom(config.session_config)
  session_config.graph_options.rewrite_options.disable_meta_optimizer = True
  return config.replace(session_config=session_config)


def make_estimator(model_fn, model_dir, towers=1, params=None, replicate=None,
                   **wrapper_kwargs):
  """An Estimator on `towers` virtual CPUs; replicated when towers > 1."""
  config = run_config(model_dir, towers, tf_random_seed=7,
                      save_checkpoints_steps=10_000,
                      log_step_count_steps=10_000)
  if replicate is None:
    replicate = towers > 1
  fn = trainer.replicate_model_fn(model_fn, **wrapper_kwargs) if replicate \
      else model_fn
  return tf.estimator.Estimator(fn, config=config, params=params)


def variables_of(estimator):
  """Every checkpointed variable of the estimator, by name.

  The object graph that object-based checkpoints add is not a variable.
  """
  return {name: estimator.get_variable_value(name)
          for name in estimator.get_variable_names()
          if name != '_CHECKPOINTABLE_OBJECT_GRAPH'}


def checkpoint_variables(model_dir):
  """Every variable of the latest checkpoint in `model_dir`, by name."""
  reader = tf.train.load_checkpoint(str(model_dir))
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()}


def largest_difference(expected: dict, actual: dict) -> float:
  """The largest absolute difference between two variable dicts, inf when
  either holds a NaN or inf (Python's max() skips a NaN it meets after a
  number, which would let a diverged run pass a `< tol` check)."""
  largest = 0.0
  for name, value in expected.items():
    value, other = np.asarray(value), np.asarray(actual[name])
    if not (np.all(np.isfinite(value)) and np.all(np.isfinite(other))):
      return float('inf')
    largest = max(largest, float(np.max(np.abs(other - value), initial=0.0)))
  return largest


def assert_same_variables(expected, actual, rtol=1e-5, atol=1e-6):
  """Same names, same values within float32 tolerance."""
  assert sorted(expected) == sorted(actual)
  for name in expected:
    np.testing.assert_allclose(actual[name], expected[name], rtol=rtol,
                               atol=atol, err_msg=name)


def seeded(seed):
  return tf1.glorot_uniform_initializer(seed=seed)


def loss_model_fn(loss_of, metrics_of=None, learning_rate=0.5):
  """A seeded 2-layer classifier of features['x'] into 3 classes, trained
  by SGD on `loss_of(x, labels, logits, hidden)`; EVAL metrics
  `metrics_of(x, labels, logits, hidden)`. For tests of how the towers
  read and weigh a loss."""

  def model_fn(features, labels, mode):
    x = features['x']
    hidden = tf1.layers.dense(x, 4, kernel_initializer=seeded(1))
    logits = tf1.layers.dense(hidden, 3, kernel_initializer=seeded(2))
    loss = loss_of(x, labels, logits, hidden)
    if mode == tf.estimator.ModeKeys.EVAL:
      ops = metrics_of(x, labels, logits, hidden) if metrics_of else {}
      return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops=ops)
    train_op = tf1.train.GradientDescentOptimizer(learning_rate).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def half_weighted_data():
  """48 examples of 5 features and 3 classes; column 4 > 0 marks the
  present (weighted) ones: none in the first half of every 12 (tower 0's
  shard of a batch of 12 on 2 towers), all in the second."""
  rng = np.random.RandomState(0)
  x = rng.randn(48, 5).astype(np.float32)
  y = rng.randint(0, 3, 48).astype(np.int32)
  x[:, 4] = np.abs(x[:, 4]) + 0.1
  x[np.arange(48) % 12 < 6, 4] = -1.0
  return x, y


def classifier_model_fn(features, labels, mode, params):
  """Dense net mixing tf.compat.v1.layers and an unnamed tf.keras layer.

  params: 'optimizer' (callable returning a tf.compat.v1.train.Optimizer),
  optional 'clip_norm' to go through compute/clip/apply.
  """
  x = features['x'] if isinstance(features, dict) else features
  hidden = tf1.layers.dense(
      x, 8, activation=tf.nn.tanh, kernel_initializer=seeded(1),
      kernel_regularizer=tf.keras.regularizers.l2(0.01))
  logits = tf.keras.layers.Dense(2, kernel_initializer=seeded(2))(hidden)
  classes = tf.argmax(logits, 1, output_type=tf.int32)
  probabilities = tf.nn.softmax(logits)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(
        mode, predictions={'logits': logits, 'classes': classes})
  tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  loss = tf1.losses.get_total_loss()  # Cross entropy plus the L2 term.
  if mode == tf.estimator.ModeKeys.EVAL:
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    metrics = {
        'accuracy': tf1.metrics.accuracy(labels, classes),
        'mean_xent': tf1.metrics.mean(per_example),
        'auc': tf1.metrics.auc(labels, probabilities[:, 1]),
    }
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      eval_metric_ops=metrics)
  optimizer = params['optimizer']()
  step = tf1.train.get_or_create_global_step()
  if 'clip_norm' in params:
    grads_and_vars = optimizer.compute_gradients(loss)
    grads, variables = zip(*grads_and_vars)
    grads, _ = tf.clip_by_global_norm(grads, params['clip_norm'])
    train_op = optimizer.apply_gradients(zip(grads, variables), step)
  else:
    train_op = optimizer.minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def bert_model_fn(features, labels, mode, params):
  """A BERT classifier as google-research/bert builds it, made small.

  Embeddings, `params['layers']` transformer layers (self-attention,
  feed-forward, each with a residual and a layer norm), the pooler and the
  classifier, with dropout where modeling.py and run_classifier.py put it:
  tf.nn.dropout with keep_prob on the embeddings ([batch, seq, hidden]),
  the attention probabilities ([batch, heads, seq, seq]), each sublayer's
  output on the flattened [batch * seq, hidden] matrix, and the pooled
  output (keep_prob 0.9). Initializers are truncated normals without an
  op seed (BERT's create_initializer): their values follow tf_random_seed.

  params: 'vocab', 'seq', 'hidden', 'heads', 'layers', 'dropout',
  'learning_rate' (SGD); features['ids']: int32 [batch, seq].
  """
  seq, hidden, heads = params['seq'], params['hidden'], params['heads']
  prob = params['dropout']

  def dropout(x, keep_prob=1.0 - prob):
    return tf1.nn.dropout(x, keep_prob)  # BERT's, through compat.v1

  def dense(x, units, name, activation=None):
    return tf1.layers.dense(
        x, units, activation=activation, name=name,
        kernel_initializer=tf1.truncated_normal_initializer(stddev=0.5))

  def layer_norm(x, name):
    with tf1.variable_scope(name):
      gamma = tf1.get_variable('gamma', [hidden],
                               initializer=tf1.ones_initializer())
      mean, variance = tf.nn.moments(x, [-1], keepdims=True)
      return (x - mean) * tf.math.rsqrt(variance + 1e-6) * gamma

  def split_heads(x):
    x = tf.reshape(x, [-1, seq, heads, hidden // heads])
    return tf.transpose(x, [0, 2, 1, 3])

  table = tf1.get_variable('word_embeddings', [params['vocab'], hidden],
                           initializer=tf1.truncated_normal_initializer())
  positions = tf1.get_variable('position_embeddings', [seq, hidden],
                               initializer=tf1.truncated_normal_initializer())
  embedded = tf.gather(table, features['ids']) + positions
  embedded = dropout(layer_norm(embedded, 'embeddings'))
  layer_input = tf.reshape(embedded, [-1, hidden])  # reshape_to_matrix
  for layer in range(params['layers']):
    with tf1.variable_scope(f'layer_{layer}'):
      query, key, value = (split_heads(dense(layer_input, hidden, name))
                           for name in ('query', 'key', 'value'))
      scores = tf.matmul(query, key, transpose_b=True) * (
          (hidden // heads) ** -0.5)
      probs = dropout(tf.nn.softmax(scores))
      context = tf.reshape(tf.transpose(tf.matmul(probs, value),
                                        [0, 2, 1, 3]), [-1, hidden])
      attended = dropout(dense(context, hidden, 'attention_output'))
      attended = layer_norm(attended + layer_input, 'attention_norm')
      inner = dense(attended, 4 * hidden, 'intermediate', tf.nn.gelu)
      output = dropout(dense(inner, hidden, 'output'))
      layer_input = layer_norm(output + attended, 'output_norm')
  first = tf.reshape(layer_input, [-1, seq, hidden])[:, 0]
  pooled = dropout(dense(first, hidden, 'pooler', tf.tanh), keep_prob=0.9)
  logits = dense(pooled, 2, 'classifier')
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  step = tf1.train.get_or_create_global_step()
  train_op = tf1.train.GradientDescentOptimizer(
      params['learning_rate']).minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


OPTIMIZERS = {
    'sgd': lambda: tf1.train.GradientDescentOptimizer(0.5),
    'momentum': lambda: tf1.train.MomentumOptimizer(0.2, momentum=0.9),
    'adam': lambda: tf1.train.AdamOptimizer(0.05),
    'adagrad': lambda: tf1.train.AdagradOptimizer(0.3),
}


def normalising_model_fn(normalise):
  """A model_fn: `normalise(features['x'])`, a dense layer, cross entropy,
  SGD after the UPDATE_OPS (batch norm's moving statistics)."""

  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(normalise(features['x']), 2)
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
      train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
          loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


class FinalValues(tf1.train.SessionRunHook):
  """The global variables' values when training ends.

  A skipped step leaves global_step where it was, so the Estimator writes
  no new checkpoint: the values are read from the session instead.
  """

  def __init__(self):
    self.values = {}

  def end(self, session):
    variables = tf1.global_variables()
    self.values = dict(zip([v.op.name for v in variables],
                           session.run(variables)))


def build_replicated(model_fn, towers, mode=tf.estimator.ModeKeys.TRAIN,
                     batch_size=10, params=None, with_labels=True,
                     num_features=NUM_FEATURES, static_batch=True,
                     **wrapper_kwargs):
  """Calls the replicated model_fn once in a fresh graph, as Estimator would.

  `static_batch=False` gives the batch an unknown size, as an input_fn
  batching without `drop_remainder` does.

  Returns:
    (graph, spec) for inspecting placement, names and errors without
    training.
  """
  graph = tf.Graph()
  with graph.as_default():
    x = np.zeros((batch_size, num_features), np.float32)
    y = np.zeros((batch_size,), np.int32)
    items = ({'x': x}, y) if with_labels else {'x': x}
    dataset = tf.data.Dataset.from_tensors(items)
    if not static_batch:
      dataset = dataset.unbatch().batch(batch_size)
    next_item = tf1.data.make_one_shot_iterator(
        dataset.repeat()).get_next()
    features, labels = next_item if with_labels else (next_item, None)
    config = trainer.make_run_config(cpu_devices=towers)
    spec = trainer.replicate_model_fn(model_fn, **wrapper_kwargs)(
        features, labels, mode,
        params if params is not None else {'optimizer': OPTIMIZERS['sgd']},
        config)
  return graph, spec


def save_start_checkpoint(model_fn, input_fn, model_dirs, params=None):
  """Writes one step-0 checkpoint of `model_fn` into each of `model_dirs`.

  Layer initializers of canned and Keras models are not reproduced by
  `tf_random_seed` across different graphs, so the one-device and the
  replicated Estimator both resume from these weights instead.
  """
  with tf.Graph().as_default():
    features, labels = tf1.data.make_one_shot_iterator(input_fn()).get_next()
    tf1.train.get_or_create_global_step()
    kwargs = {'labels': labels, 'mode': tf.estimator.ModeKeys.TRAIN,
              'params': params, 'config': tf.estimator.RunConfig()}
    accepted = inspect.signature(model_fn).parameters
    spec = model_fn(features=features,
                    **{k: v for k, v in kwargs.items() if k in accepted})
    # The model_fn's own Saver if it has one (e.g. object-based checkpoints).
    saver = spec.scaffold.saver or tf1.train.Saver()
    with tf1.Session() as session:
      session.run([tf1.global_variables_initializer(),
                   tf1.tables_initializer()])
      for model_dir in model_dirs:
        os.makedirs(str(model_dir), exist_ok=True)
        saver.save(session, os.path.join(str(model_dir), 'model.ckpt'),
                   global_step=0)


def train_in_session(model_fn, x, y, towers, batch, steps, start=None,
                     static_batch=False, graph_seed=None, **wrapper_kwargs):
  """Trains `steps` batches in a Session from the `start` variable values.

  The features are {'x': x} (or `x` itself, a dict) batched in order, of a
  static size with `static_batch` (drop_remainder); `towers` > 1 wraps
  `model_fn` in replicate_model_fn(**wrapper_kwargs) on that many virtual
  CPUs; `graph_seed` seeds the graph (unseeded initializers draw a new
  start in every process otherwise).

  Returns:
    (start, end): every global variable's value before and after.
  """
  with tf.Graph().as_default():
    if graph_seed is not None:
      tf1.set_random_seed(graph_seed)
    features = x if isinstance(x, dict) else {'x': x}
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices((features, y)).repeat()
        .batch(batch, drop_remainder=static_batch)).get_next()
    config = trainer.make_run_config(cpu_devices=towers)
    if towers > 1:
      spec = trainer.replicate_model_fn(model_fn, **wrapper_kwargs)(
          features, labels, tf.estimator.ModeKeys.TRAIN, None, config)
    else:
      spec = model_fn(features=features, labels=labels,
                      mode=tf.estimator.ModeKeys.TRAIN)
    scaffold = spec.scaffold  # all_reduce's copies start in local_init_op.
    scaffold.finalize()
    variables = {v.op.name: v for v in tf1.global_variables()}
    with tf1.Session(config=config.session_config) as session:
      session.run(scaffold.init_op)
      for name, value in (start or {}).items():
        variables[name].load(value, session)
      session.run(scaffold.local_init_op)
      first = session.run(variables)
      for _ in range(steps):
        session.run(spec.train_op)
      return first, session.run(variables)
