"""model_fns for tests/probes/probe.py."""

import numpy as np
import tensorflow as tf

from tests import sync_cluster_task as sct

tf1 = tf.compat.v1
TRAIN = tf.estimator.ModeKeys.TRAIN


def _net(features, mode):
  table = tf1.get_variable('embedding', [sct.VOCAB, 3],
                           initializer=tf1.random_normal_initializer())
  hidden = tf.concat([features['x'],
                      tf.nn.embedding_lookup(table, features['ids'])], 1)
  hidden = tf1.layers.dense(hidden, 5, activation=tf.nn.tanh)
  return tf1.layers.dense(hidden, 1)


def bert_clip(features, labels, mode):
  """tf.gradients, clip_by_global_norm, apply, manual global_step + 1."""
  loss = tf1.losses.mean_squared_error(labels, _net(features, mode))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  step = tf1.train.get_global_step()
  tvars = tf1.trainable_variables()
  grads = tf1.gradients(loss, tvars)
  grads, _ = tf.clip_by_global_norm(grads, clip_norm=0.5)
  opt = tf1.train.AdamOptimizer(0.05)
  apply = opt.apply_gradients(zip(grads, tvars))
  train_op = tf.group(apply, step.assign(step + 1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def two_optimizers(features, labels, mode):
  """DNNLinearCombined-like: two compute/apply pairs, one step increment."""
  loss = tf1.losses.mean_squared_error(labels, _net(features, mode))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  tvars = tf1.trainable_variables()
  emb = [v for v in tvars if 'embedding' in v.name]
  rest = [v for v in tvars if 'embedding' not in v.name]
  o1, o2 = tf1.train.AdagradOptimizer(0.1), tf1.train.AdamOptimizer(0.05)
  a1 = o1.apply_gradients(o1.compute_gradients(loss, emb))
  a2 = o2.apply_gradients(o2.compute_gradients(loss, rest))
  step = tf1.train.get_global_step()
  with tf.control_dependencies([a1, a2]):
    train_op = step.assign_add(1)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def ema_and_constants(features, labels, mode):
  """EMA after the update; a non-trainable variable assigned a constant."""
  loss = tf1.losses.mean_squared_error(labels, _net(features, mode))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  flag = tf1.get_variable('flag', [], tf.float32, tf1.zeros_initializer(),
                          trainable=False)
  opt = tf1.train.MomentumOptimizer(0.05, 0.9)
  update = opt.minimize(loss, tf1.train.get_global_step())
  ema = tf1.train.ExponentialMovingAverage(0.9)
  with tf.control_dependencies([update]):
    train_op = tf.group(ema.apply(tf1.trainable_variables()),
                        flag.assign(3.0))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def loss_scaled(features, labels, mode):
  """fp16-style dynamic loss scaling (tf.compat.v1 mixed precision)."""
  loss = tf1.losses.mean_squared_error(labels, _net(features, mode))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  opt = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
      tf1.train.AdamOptimizer(0.05), 'dynamic')
  train_op = opt.minimize(loss, tf1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _bad_row_batches(rows, steps):
  """global_batches with an inf in the LAST row (the worker's) of step 1."""
  rng = np.random.RandomState(7)
  x = rng.normal(size=(steps, rows, 4)).astype(np.float32)
  x[1, -1, 0] = np.inf
  ids = rng.randint(0, sct.VOCAB, size=(steps, rows)).astype(np.int64)
  y = rng.normal(size=(steps, rows, 1)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices(({'x': x, 'ids': ids}, y))


def _bad_row_task_input_fn(rows, steps):
  return sct.task_input_fn(rows, steps, _bad_row_batches)


def grad_summary(features, labels, mode):
  """A summary of a SECOND tf.gradients call (only the chief saves it)."""
  loss = tf1.losses.mean_squared_error(labels, _net(features, mode))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  grads = tf1.gradients(loss, tf1.trainable_variables())
  tf1.summary.scalar('grad_norm', tf.linalg.global_norm(grads))
  train_op = tf1.train.GradientDescentOptimizer(0.05).minimize(
      loss, tf1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def chief_hook_grad(features, labels, mode):
  """A chief-only LoggingTensorHook on a gradient norm not in train_op."""
  loss = tf1.losses.mean_squared_error(labels, _net(features, mode))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  opt = tf1.train.GradientDescentOptimizer(0.05)
  gv = opt.compute_gradients(loss)
  norm = tf.linalg.global_norm([g for g, _ in gv])
  train_op = opt.apply_gradients(gv, tf1.train.get_global_step())
  hook = tf1.train.LoggingTensorHook({'norm': norm}, every_n_iter=2)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    training_chief_hooks=[hook])


_COLUMNS_PARAMS = None


def canned_combined(features, labels, mode, config):
  ids = tf1.feature_column.categorical_column_with_identity('ids', sct.VOCAB)
  est = tf1.estimator.DNNLinearCombinedRegressor(
      linear_feature_columns=[tf1.feature_column.numeric_column('x', (4,))],
      dnn_feature_columns=[tf1.feature_column.embedding_column(ids, 3),
                           tf1.feature_column.numeric_column('x', (4,))],
      dnn_hidden_units=[4])
  return est.model_fn(features, labels, mode, config)


def accumulate(features, labels, mode):
  """Gradient accumulation: apply inside tf.cond every 2 steps."""
  loss = tf1.losses.mean_squared_error(labels, _net(features, mode))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  step = tf1.train.get_global_step()
  opt = tf1.train.GradientDescentOptimizer(0.05)
  gv = opt.compute_gradients(loss)
  accs = [tf1.get_variable(v.op.name + '/acc', v.shape, trainable=False,
                           initializer=tf1.zeros_initializer())
          for _, v in gv]
  adds = [a.assign_add(g) for a, (g, _) in zip(accs, gv)]
  with tf.control_dependencies(adds):
    def apply():
      op = opt.apply_gradients([(a.read_value(), v)
                                for a, (_, v) in zip(accs, gv)])
      with tf.control_dependencies([op]):
        return tf.group(*[a.assign(tf.zeros_like(a)) for a in accs])
    done = tf.cond(tf.equal(step % 2, 1), lambda: apply(), tf.no_op)
  with tf.control_dependencies([done]):
    train_op = step.assign_add(1)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


MODELS = {
    'bert_clip': {'fn': bert_clip},
    'two_optimizers': {'fn': two_optimizers},
    'ema_and_constants': {'fn': ema_and_constants},
    'loss_scaled': {'fn': loss_scaled,
                    'task_input_fn': _bad_row_task_input_fn,
                    'global_input_fn': _bad_row_batches},
    'grad_summary': {'fn': grad_summary},
    'chief_hook_grad': {'fn': chief_hook_grad},
    'canned_combined': {'fn': canned_combined},
    'accumulate': {'fn': accumulate},
}


def local_projection(features, labels, mode):
  """A fixed random projection kept in a LOCAL variable (not checkpointed)."""
  proj = tf1.get_local_variable('projection', [4, 4],
                                initializer=tf1.random_normal_initializer(),
                                trainable=False)
  feats = dict(features, x=tf.matmul(features['x'], proj))
  loss = tf1.losses.mean_squared_error(labels, _net(feats, mode))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  train_op = tf1.train.GradientDescentOptimizer(0.05).minimize(
      loss, tf1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def weighted(features, labels, mode):
  """Weights from the features: the worker's rows mostly weigh 0."""
  w = tf.expand_dims(tf.cast(tf.equal(features['ids'] % 3, 0), tf.float32), 1)
  loss = tf1.losses.mean_squared_error(labels, _net(features, mode),
                                       weights=w)
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  train_op = tf1.train.AdamOptimizer(0.05).minimize(
      loss, tf1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


class _ChiefEndRun(tf1.train.SessionRunHook):
  def __init__(self, tensor):
    self._tensor = tensor

  def end(self, session):
    print('CHIEF END LOSS', session.run(self._tensor), flush=True)


def chief_end_run(features, labels, mode):
  """A chief-only hook that runs the loss once more at the end."""
  spec = sct.model_fn(features, labels, mode)
  if mode != TRAIN:
    return spec
  return spec._replace(training_chief_hooks=[_ChiefEndRun(spec.loss)])


MODELS.update({
    'local_projection': {'fn': local_projection},
    'weighted': {'fn': weighted},
    'chief_end_run': {'fn': chief_end_run},
    'bn_model': {'fn': sct.model_fn},
})


def _repeating(rows, steps):
  return lambda config: sct.task_input_fn(rows, steps)(config).repeat()


MODELS['chief_end_run']['task_input_fn'] = _repeating
MODELS['chief_end_run']['global_input_fn'] = (
    lambda rows, steps: sct.global_batches(rows, steps).repeat())


def dropout_draws(features, labels, mode):
  """Dropout; the last tower's mask is kept in a local variable."""
  x = tf1.layers.dropout(features['x'], 0.5, training=mode == TRAIN)
  loss = tf1.losses.mean_squared_error(labels, _net(dict(features, x=x),
                                                    mode))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  seen = tf1.get_local_variable('mask', [4, 4], initializer=tf1.zeros_initializer())
  keep = seen.assign(tf.random.uniform([4, 4]))
  with tf.control_dependencies([keep]):
    train_op = tf1.train.GradientDescentOptimizer(0.05).minimize(
        loss, tf1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


MODELS['dropout_draws'] = {'fn': dropout_draws}


def _features_only(rows, steps):
  return sct.global_batches(rows, steps).map(lambda f, l: f)


def _features_only_task_input_fn(rows, steps):
  def input_fn(config):
    index = config.global_id_in_cluster
    begin, end = sum(rows[:index]), sum(rows[:index + 1])
    return _features_only(sum(rows), steps).map(
        lambda f: {k: v[begin:end] for k, v in f.items()})
  return input_fn


def label_less_sum(features, mode):
  """No labels; a summed loss (loss_reduction='sum')."""
  target = tf.reduce_sum(features['x'], 1, keepdims=True)
  loss = tf.reduce_sum(tf.square(_net(features, mode) - target))
  if mode != TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  train_op = tf1.train.AdamOptimizer(0.05).minimize(
      loss, tf1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


MODELS['label_less_sum'] = {
    'fn': label_less_sum, 'kwargs': {'loss_reduction': 'sum'},
    'label_less': True,
    'task_input_fn': _features_only_task_input_fn,
    'global_input_fn': _features_only}
