"""One task of a synchronous loopback cluster, for tests/test_task_sync.py.

    python tests/sync_cluster_task.py task MODEL_DIR STEPS ROWS...

is one task; TF_CONFIG names the cluster and the task (tests/sync_cluster_pair.py
starts a chief and a worker of them). Each step's global batch is
`sum(ROWS)` rows of `global_batches`; task k (chief first, then workers by
index, as `global_id_in_cluster` counts them) trains on rows
[sum(ROWS[:k]), sum(ROWS[:k+1])) of it, on 2 virtual CPU towers, through
`tf.estimator.train_and_evaluate`.

    python tests/sync_cluster_task.py dropout-task MODEL_DIR STEPS ROWS...

trains `dropout_model_fn` with random_ops='one_device' and tf_random_seed 7.

    python tests/sync_cluster_task.py sliced-task MODEL_DIR BATCH TOTAL

trains the model with momentum (which updates only the embedding rows a
sparse gradient names) on one pass over TOTAL rows in global batches of
BATCH, keeping its part with `estimator_towers.task_slice`. A last batch
of fewer rows than tasks leaves the worker nothing. `micro-task` and
`masked-task` train `micro_batch_model_fn` (micro_batches=2) and
`masked_model_fn` as `task` trains its model.
"""

import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import estimator_towers  # pylint: disable=g-import-not-at-top
from model_fns import head  # pylint: disable=g-import-not-at-top

tf1 = tf.compat.v1
VOCAB = 7


def model_fn(features, labels, mode, optimizer=None, projection=None,
             manual_step=False, dropout=0.0, batch_norm=True, guarded=False,
             masked=False):
  """Embedding (sparse gradients), dense layer, batch norm and Adam.

  With `projection` (an initializer), the features first go through a
  fixed 4x4 matrix kept in a local variable: not checkpointed, so every
  task initialises it, and a random one must still be the chief's. With
  `manual_step`, BERT's way: Adam's rate is read from global_step, which
  the model_fn advances by hand beside the update. With `dropout`, BERT's
  tf.nn.dropout (keep_prob) after the batch norm. Without `batch_norm`,
  no batch norm (micro-batches refuse it in training). With `guarded`, the
  loss is a weighted mean inside tf.where(present > 0, ...) (the
  `_safe_div` of tf.contrib.losses), whose condition must be the global
  batch's on every task. With `masked`, a Keras masked mean is added: the
  ids (0 is padding) predicted back from Embedding(mask_zero=True), whose
  divisor is the batch's valid ids (each task holds another number).
  """
  x = features['x']
  if projection is not None:
    x = tf.matmul(x, tf1.get_local_variable(
        'projection', [4, 4], initializer=projection))
  table = tf1.get_variable('embedding', [VOCAB, 3],
                           initializer=tf1.random_normal_initializer())
  hidden = tf.concat([x,
                      tf.nn.embedding_lookup(table, features['ids'])], 1)
  hidden = tf1.layers.dense(hidden, 5, activation=tf.nn.tanh)
  if batch_norm:
    hidden = tf1.layers.batch_normalization(
        hidden, training=mode == tf.estimator.ModeKeys.TRAIN, momentum=0.5)
  if dropout and mode == tf.estimator.ModeKeys.TRAIN:
    hidden = tf1.nn.dropout(hidden, 1.0 - dropout)
  predictions = tf1.layers.dense(hidden, 1)
  loss = tf1.losses.mean_squared_error(labels, predictions)
  if guarded:
    weights = tf.cast(features['x'][:, :1] > 0, tf.float32)
    present = tf.reduce_sum(weights)
    loss = tf.where(present > 0, tf.reduce_sum(
        tf.square(labels - predictions) * weights) / tf.where(
            present > 0, present, 1.0), 0.0)
  if masked:
    embedded = tf.keras.layers.Embedding(
        VOCAB, 3, mask_zero=True,
        embeddings_initializer=tf1.random_normal_initializer())(
            features['ids'])
    logits = tf.keras.layers.Dense(VOCAB)(embedded)
    loss += tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        features['ids'], logits)
  if mode != tf.estimator.ModeKeys.TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  step = tf1.train.get_global_step()
  if manual_step:
    optimizer = tf1.train.AdamOptimizer(0.02 * tf.cast(step + 1, tf.float32))
  optimizer = optimizer or tf1.train.AdamOptimizer(0.05)
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, None if manual_step else step)
  if manual_step:
    train_op = tf.group(train_op, step.assign(step + 1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def global_batches(rows: int, steps: int):
  """`steps` global batches of `rows` rows, the same in every process."""
  rng = np.random.RandomState(7)
  x = rng.normal(size=(steps, rows, 4)).astype(np.float32)
  ids = rng.randint(0, VOCAB, size=(steps, rows)).astype(np.int64)
  y = (x.sum(-1, keepdims=True) + rng.normal(size=(steps, rows, 1))
       ).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices(({'x': x, 'ids': ids}, y))


def task_input_fn(rows, steps, batches=None):
  """The input_fn of the task the config names: its slice of each batch
  of `batches(rows, steps)` (`global_batches` by default)."""
  def input_fn(config):
    index = config.global_id_in_cluster
    begin, end = sum(rows[:index]), sum(rows[:index + 1])
    return (batches or global_batches)(sum(rows), steps).map(
        lambda f, l: ({k: v[begin:end] for k, v in f.items()},
                      l[begin:end]))
  return input_fn


def projected_model_fn(features, labels, mode):
  """model_fn through a random projection of its features (no seed), its
  step advanced by hand."""
  return model_fn(features, labels, mode,
                  projection=tf1.random_normal_initializer(), manual_step=True)


def momentum_model_fn(features, labels, mode):
  """model_fn with momentum, whose sparse update touches only named rows,
  and a guarded loss."""
  return model_fn(features, labels, mode,
                  tf1.train.MomentumOptimizer(0.05, 0.9), guarded=True)


def dropout_model_fn(features, labels, mode):
  """model_fn with dropout 0.5, for random_ops='one_device'."""
  return model_fn(features, labels, mode, dropout=0.5)


def masked_model_fn(features, labels, mode):
  """model_fn plus a Keras masked mean over the ids."""
  return model_fn(features, labels, mode, masked=True)


def micro_batch_model_fn(features, labels, mode):
  """model_fn without batch norm, for micro_batches=2."""
  return model_fn(features, labels, mode, batch_norm=False)


def batch_norm_classifier(features, labels, mode, params):
  """`--model=tests.sync_cluster_task:batch_norm_classifier` of the trainer.

  Dense, batch norm, softmax, through the trainer's head. The moving
  variance's n / (n - 1) and the towers' shards depend on the global batch,
  so a cluster whose tasks read the whole batch each (a global batch of
  every row twice) would not train as one process does, although a mean
  loss of twice the rows is the same loss.
  """
  inputs = tf1.feature_column.input_layer(features, params['feature_columns'])
  hidden = tf1.layers.dense(inputs, 8, activation=tf.nn.relu)
  hidden = tf1.layers.batch_normalization(
      hidden, training=mode == tf.estimator.ModeKeys.TRAIN, momentum=0.5)
  return head.classifier_spec(
      mode, tf1.layers.dense(hidden, params['n_classes']), labels, params)


def sliced_batches(batch, total):
  """One pass over `total` rows of `global_batches`, in batches of `batch`."""
  return global_batches(total, 1).unbatch().batch(batch)


def sliced_input_fn(batch, total):
  """Every task's part of `sliced_batches`, as task_slice cuts it."""
  def input_fn(config):
    return estimator_towers.task_slice(sliced_batches(batch, total), config)
  return input_fn


class _SaveFinalVariables(tf1.train.SessionRunHook):
  """Writes this task's variables to MODEL_DIR/final-<task>.npz at the end.

  Local ones too, but not the towers' copies of the trainable ones.
  """

  def __init__(self, path):
    self._path = path

  def end(self, session):
    variables = tf1.global_variables() + [
        v for v in tf1.local_variables() if '_replica/' not in v.op.name]
    values = session.run(variables)
    np.savez(self._path, **{v.op.name: x for v, x in zip(variables, values)})


def run_task(argv, sliced=False, dropout=False, micro=False, masked=False):
  model_dir, steps, rows = argv[0], int(argv[1]), [int(r) for r in argv[2:]]
  # Dropout: one device's masks need the graph seed (the one of
  # helpers.make_estimator).
  config = estimator_towers.make_run_config(
      model_dir=model_dir, cpu_devices=2,
      tf_random_seed=7 if dropout else None)
  model = (momentum_model_fn if sliced else dropout_model_fn if dropout
           else micro_batch_model_fn if micro else masked_model_fn if masked
           else projected_model_fn)
  estimator = tf.estimator.Estimator(
      estimator_towers.replicate_model_fn(
          model, aggregation='all_reduce', sync_timeout_secs=60,
          random_ops='one_device' if dropout else 'per_tower',
          micro_batches=2 if micro else 1),
      config=config)
  if sliced:  # STEPS is the global batch, ROWS the total; the input ends.
    input_fn, steps = sliced_input_fn(steps, rows[0]), 1000
  else:
    input_fn = task_input_fn(rows, steps)
  task = f'{config.task_type}-{config.task_id}'
  tf.estimator.train_and_evaluate(
      estimator, tf.estimator.TrainSpec(
          input_fn, max_steps=steps,
          hooks=[_SaveFinalVariables(os.path.join(model_dir,
                                                  f'final-{task}.npz'))]),
      tf.estimator.EvalSpec(input_fn, steps=1))
  print('TASK DONE', flush=True)


def exit_without_teardown(run) -> None:
  """Calls `run()`, then ends this task's process at once with its code.

  Python's teardown of a process with TensorFlow and a gRPC server loaded
  takes seconds (5-7 s each on a busy 2-core machine), and every test of a
  pair waits for it. What the tests read is on disk by then (checkpoints,
  .npz files; the summary writers are closed here) and the logs are
  flushed. An exception other than SystemExit ends the process as usual,
  with its traceback.

  Args:
    run: The task, a callable; its sys.exit code becomes the exit code.
  """
  try:
    run()
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    if isinstance(e.code, str):
      sys.stderr.write(e.code + '\n')
  tf1.summary.FileWriterCache.clear()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


if __name__ == '__main__':
  exit_without_teardown(lambda: run_task(
      sys.argv[2:], sliced=sys.argv[1] == 'sliced-task',
      dropout=sys.argv[1] == 'dropout-task',
      micro=sys.argv[1] == 'micro-task',
      masked=sys.argv[1] == 'masked-task'))
