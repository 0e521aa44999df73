"""Training losses the graph walk cannot follow are checked before step 1.

Past an op `batch_mixing` does not know (a py_function of the batch, a
tf.scan over its rows, a tf.function body) a loss that reverses, pairs or
accumulates its batch's rows trained each tower on its own shard silently:
the weights were 0.25-0.51 off one device's after 2 steps. The model_fn now
also runs once on the whole batch, its optimizer calls discarded, and
estimator.train fails before the first update when the losses differ.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

from helpers import seeded
from estimator_towers.update import first_step_check
import trainer

tf1 = tf.compat.v1

_X = (np.arange(48, dtype=np.float32).reshape(16, 3) % 7) - 3
_Y = np.arange(16, dtype=np.float32) % 5


def _numpy(fn):
  return lambda h: tf.reshape(tf.numpy_function(fn, [h], tf.float32),
                              [-1, 2])


def _sum_in_a_loop(h):
  """The rows' running sum, written row by row in a tf.while_loop."""
  rows = tf.TensorArray(tf.float32, size=tf.shape(h)[0])
  _, _, rows = tf.while_loop(
      lambda i, *_: i < tf.shape(h)[0],
      lambda i, total, rows: (i + 1, total + h[i], rows.write(i, total + h[i])),
      [0, tf.zeros([2]), rows])
  return rows.stack()


# Targets that mix the batch's rows, past ops the walk does not follow.
_DIFFER = {
    'numpy_function_reverse': _numpy(lambda a: a[::-1].copy()),
    'cumulative_sum_over_rows': lambda h: tf.scan(lambda a, r: a + r, h),
    'while_loop_running_sum': _sum_in_a_loop,
    'tf_function_batch_mean': lambda h: tf.function(
        lambda a: a - tf.reduce_mean(a, 0))(h),
}
# Per example through the same ops: one device's loss.
_SAME = {
    'numpy_function_scaled': _numpy(lambda a: 2.0 * a),
    'map_fn': lambda h: tf.map_fn(lambda row: tf.reverse(row, [0]), h),
    'scan_within_rows': lambda h: tf.transpose(tf.scan(
        lambda a, column: a + column, tf.transpose(h))),
}


def _clipped_update(loss, step):
  """compute_gradients, clip by global norm, apply_gradients."""
  optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
  gradients, variables = zip(*optimizer.compute_gradients(loss))
  clipped, _ = tf.clip_by_global_norm(gradients, 1.0)
  return optimizer.apply_gradients(zip(clipped, variables), step)


def _bert_style_update(loss, step):
  """tf.gradients, clipped, applied without the step, which is then
  advanced by hand (BERT's optimization.py)."""
  variables = tf1.trainable_variables()
  gradients, _ = tf.clip_by_global_norm(tf.gradients(loss, variables), 1.0)
  update = tf1.train.MomentumOptimizer(0.1, 0.9).apply_gradients(
      zip(gradients, variables))
  return tf.group(update, step.assign(step + 1))


_UPDATES = {
    'minimize': lambda loss, step: tf1.train.MomentumOptimizer(
        0.1, 0.9).minimize(loss, step),
    'clipped': _clipped_update,
    'bert_style': _bert_style_update,
}


def _model_fn(target_of, batch_norm=False, keras=False, record=None,
              update='minimize', penalty=None, warm_start=None):
  """A 2-layer regressor whose loss pulls its output towards
  `target_of(output)` (held fixed) and its first unit towards the label;
  momentum (`update`: how it is applied), kernel and activity
  regularizers, batch norm if asked, `penalty()` added to the loss, and
  the first layer warm-started from the checkpoint `warm_start`."""

  def model_fn(features, labels, mode):
    training = mode == tf.estimator.ModeKeys.TRAIN
    h = tf1.layers.dense(
        features['x'], 4, kernel_initializer=seeded(1),
        kernel_regularizer=lambda w: 0.01 * tf.reduce_sum(tf.square(w)),
        activity_regularizer=lambda a: 0.01 * tf.reduce_sum(tf.square(a)))
    if batch_norm:
      h = tf1.layers.batch_normalization(h, training=training)
    if keras:
      h = tf.keras.layers.Dense(2, kernel_initializer=seeded(2))(h)
    else:
      h = tf1.layers.dense(h, 2, kernel_initializer=seeded(2))
    if record is not None:
      h = tf.numpy_function(record, [h], tf.float32)
      h.set_shape([None, 2])
    if warm_start:
      tf1.train.init_from_checkpoint(warm_start, {'dense/': 'dense/'})
    target = tf.stop_gradient(target_of(h))
    loss = (tf.reduce_mean(tf.square(h - target)) +
            tf.reduce_mean(tf.square(h[:, 0] - labels)) +
            tf1.losses.get_regularization_loss())
    if penalty is not None:
      loss += penalty()
    with tf1.control_dependencies(
        tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
      train_op = _UPDATES[update](loss,
                                  tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _train(tmp_path, model_fn, towers, steps=3, name='', **kwargs):
  """The Estimator after `steps` steps on _X in batches of 6 (the last of
  4): `model_fn` itself (`towers=0`) or on `towers` virtual CPUs
  (`kwargs` for replicate_model_fn)."""
  config = trainer.make_run_config(str(tmp_path / f'{name}{towers}'),
                                   cpu_devices=max(towers, 1))
  if towers:
    model_fn = trainer.replicate_model_fn(model_fn, **kwargs)

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(({'x': _X}, _Y)).batch(6)

  estimator = tf.estimator.Estimator(model_fn, config=config)
  return estimator.train(input_fn, steps=steps)


def _weights(estimator):
  return {name: estimator.get_variable_value(name)
          for name in estimator.get_variable_names()}


@pytest.mark.training
@pytest.mark.parametrize('case', sorted(_DIFFER))
def test_a_training_loss_past_the_walk_that_differs_fails_before_a_step(
    tmp_path, case):
  config_dir = tmp_path / '2'
  with pytest.raises(ValueError, match=(
      r"(?s)The training loss is not one device's: on the first batch the "
      r'towers give [-\d.e]+ and one device [-\d.e]+\. It is computed '
      r'through .*cannot follow.*before any update.*in training too')):
    _train(tmp_path, _model_fn(_DIFFER[case]), 2, loss_reduction='mean')
  # No update ran: the only checkpoint is the one made before step 1.
  assert tf.train.latest_checkpoint(str(config_dir)).endswith('ckpt-0')


@pytest.mark.training
@pytest.mark.parametrize('towers,aggregation,batch_norm,keras', [
    (2, 'global_loss', False, False),
    (3, 'global_loss', True, False),
    (2, 'all_reduce', True, True),
], ids=['2_towers', '3_towers_batch_norm', 'all_reduce_batch_norm_keras'])
@pytest.mark.parametrize('case', sorted(_SAME))
def test_a_per_example_training_loss_past_the_walk_trains_as_one_device(
    tmp_path, caplog, case, towers, aggregation, batch_norm, keras):
  model_fn = _model_fn(_SAME[case], batch_norm, keras)
  one = _weights(_train(tmp_path, model_fn, 0))
  # The first step trains on the batch the check read and fed back; the
  # moving statistics are updated once by it, not again by the check.
  for run in range(2):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger='absl'):
      many = _weights(_train(tmp_path, model_fn, towers, name=f'run{run}_',
                             aggregation=aggregation))
    # Checked (batch norm's updates are not waited for by the loss).
    assert "the towers' loss equal one device's" in caplog.text
    assert sorted(many) == sorted(one)  # The copy made no variable.
    for name, value in one.items():
      np.testing.assert_allclose(many[name], value, rtol=2e-5, atol=1e-6,
                                 err_msg=name)


@pytest.mark.training
def test_the_copy_runs_before_the_first_step_only(tmp_path):
  seen = []

  def record(h):
    seen.append(len(h))
    return h

  _train(tmp_path, _model_fn(_SAME['numpy_function_scaled'], record=record),
         2, steps=2)
  # Before step 1: the towers' 3 + 3 and the copy's 6; then each step's
  # 3 + 3. (A tower's order of running is free.)
  assert sorted(seen) == sorted([3, 3, 6, 3, 3, 3, 3])


@pytest.mark.training
def test_turned_off_a_loss_past_the_walk_trains_each_shard_on_its_own(
    tmp_path):
  model_fn = _model_fn(_DIFFER['numpy_function_reverse'])
  one = _weights(_train(tmp_path, model_fn, 0, steps=2))
  many = _weights(_train(tmp_path, model_fn, 2, steps=2,
                         check_first_batch=False))
  assert np.abs(many['dense/kernel'] - one['dense/kernel']).max() > 1e-3


def _graph_with_input():
  """A fresh graph's features and labels from a dataset's iterator."""
  data = tf.data.Dataset.from_tensor_slices(({'x': _X}, _Y)).batch(4)
  return tf1.data.make_one_shot_iterator(data).get_next()


@pytest.mark.fast
def test_the_check_says_why_it_cannot_run():
  with tf.Graph().as_default():
    features, labels = _graph_with_input()
    inputs = [features['x'], labels]
    loss = tf.reduce_mean(features['x'])
    assert first_step_check.refusal([loss, *inputs], [loss], inputs) is None
    counter = tf1.Variable(0.0)
    with tf1.control_dependencies([counter.assign_add(1.0)]):
      counted = tf.identity(loss)
    assert 'would write a variable (AssignAddVariableOp' in (
        first_step_check.refusal([counted, *inputs], [counted], inputs))
    noisy = loss + tf.random.uniform([])
    assert 'would draw random numbers again' in (
        first_step_check.refusal([noisy, *inputs], [noisy], inputs))
    more, _ = _graph_with_input()  # A second iterator, read by the step.
    step = loss + tf.reduce_mean(more['x'])
    assert 'reads the input pipeline (IteratorGetNext' in (
        first_step_check.refusal([loss, *inputs], [step], inputs))
    assert 'no features or labels' in first_step_check.refusal(
        [loss], [loss], [])
    # A draw inside a function: the check's run would advance its state.
    drawn = loss + tf.function(lambda: tf.random.uniform([], seed=1))()
    assert 'would draw random numbers again (StatefulPartitionedCall' in (
        first_step_check.refusal([drawn, *inputs], [drawn], inputs))
    # Features a hook may feed (a FeedFnHook): the check would feed them too.
    fed = tf1.placeholder_with_default(features['x'], [None, 3])
    assert 'which another hook may feed' in first_step_check.refusal(
        [tf.reduce_mean(fed), fed], [fed], [fed])


@pytest.mark.fast
def test_the_copy_leaves_no_variable_or_collection_entry():
  with tf.Graph().as_default() as graph:
    features, labels = _graph_with_input()
    model_fn = _model_fn(_DIFFER['numpy_function_reverse'], batch_norm=True)
    spec = trainer.replicate_model_fn(model_fn)(
        features=features, labels=labels, mode=tf.estimator.ModeKeys.TRAIN,
        config=trainer.make_run_config(cpu_devices=2))
    assert any(isinstance(hook, first_step_check.FirstStepCheck)
               for hook in spec.training_hooks)
    for key in (tf1.GraphKeys.GLOBAL_VARIABLES, tf1.GraphKeys.UPDATE_OPS,
                tf1.GraphKeys.LOSSES, tf1.GraphKeys.SUMMARIES,
                tf1.GraphKeys.REGULARIZATION_LOSSES):
      copied = [item.name for item in graph.get_collection(key)
                if 'one_device_check' in item.name]
      assert not copied, key


@pytest.mark.training
@pytest.mark.parametrize('kwargs,why', [
    ({'micro_batches': 2}, 'with micro_batches > 1'),
    ({'batch_norm': 'per_tower'}, "with batch_norm='per_tower'"),
])
def test_a_loss_that_goes_unchecked_is_named_in_the_log(tmp_path, caplog,
                                                        kwargs, why):
  with caplog.at_level(logging.WARNING, logger='absl'):
    _train(tmp_path, _model_fn(_DIFFER['numpy_function_reverse']), 2,
           steps=1, **kwargs)
  assert ('cannot check the training loss against one device on the first '
          f'batch: {why}') in caplog.text


def _global_variables_penalty():
  """Weight decay over every global variable, as some model_fns write it:
  one device has no optimizer slot yet when it reads the collection."""
  return 1e-3 * tf.add_n([tf.reduce_sum(tf.square(v))
                          for v in tf1.global_variables()
                          if v.dtype.base_dtype == tf.float32])


@pytest.mark.training
@pytest.mark.parametrize('update', ['clipped', 'bert_style'])
def test_a_checked_loss_applied_by_hand_trains_as_one_device(
    tmp_path, caplog, update):
  model_fn = _model_fn(_SAME['numpy_function_scaled'], update=update)
  one = _weights(_train(tmp_path, model_fn, 0))
  with caplog.at_level(logging.INFO, logger='absl'):
    many = _weights(_train(tmp_path, model_fn, 2))
  assert "the towers' loss equal one device's" in caplog.text
  assert many['global_step'] == one['global_step'] == 3
  for name, value in one.items():
    np.testing.assert_allclose(many[name], value, rtol=2e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.training
def test_the_copy_sees_no_optimizer_slot_in_scopes_or_collections(tmp_path):
  # Momentum slots under 'dense/' in the checkpoint: a warm start by scope
  # after the one update made its slots would start them from there, and a
  # penalty over global_variables() would count them.
  source = _train(tmp_path, _model_fn(lambda h: h), 0, name='source')
  model_fn = _model_fn(_SAME['numpy_function_scaled'],
                       penalty=_global_variables_penalty,
                       warm_start=source.latest_checkpoint())
  one = _weights(_train(tmp_path, model_fn, 0))
  many = _weights(_train(tmp_path, model_fn, 2))
  assert np.abs(one['dense/kernel/Momentum']).max() > 1e-3
  for name, value in one.items():
    np.testing.assert_allclose(many[name], value, rtol=2e-5, atol=1e-6,
                               err_msg=name)


def _lstm_dropout_loss(h):
  steps = tf.reshape(tf.tile(h, [1, 3]), [-1, 3, 2])
  return tf.keras.layers.LSTM(2, dropout=0.3)(steps, training=True)


# Losses drawn where a plain random op is not: one device's copy would
# draw other numbers, so they are not compared (nor refused).
_DRAWN_INSIDE = {
    'dropout_in_a_tf_function': lambda h: tf.function(
        lambda a: tf.nn.dropout(a, 0.5))(h),
    'keras_lstm_dropout': _lstm_dropout_loss,
    'generator_noise': lambda h: h + tf.random.Generator.from_seed(1).normal(
        tf.shape(h)),
}


@pytest.mark.fast
@pytest.mark.parametrize('case', sorted(_DRAWN_INSIDE))
def test_a_loss_drawn_inside_a_function_or_generator_is_not_compared(case):
  with tf.Graph().as_default():
    features, labels = _graph_with_input()
    target_of = lambda h: _DIFFER['numpy_function_reverse'](  # pylint: disable=g-long-lambda
        _DRAWN_INSIDE[case](h))
    spec = trainer.replicate_model_fn(_model_fn(target_of))(
        features=features, labels=labels, mode=tf.estimator.ModeKeys.TRAIN,
        config=trainer.make_run_config(cpu_devices=2))
    assert not any(isinstance(hook, first_step_check.FirstStepCheck)
                   for hook in spec.training_hooks)
