"""TF2 Estimators train with Keras optimizers; replicated, they equal one
device: the `tf.estimator` canned Estimators and heads given `optimizer=` or
`train_op_fn=`.
"""

import numpy as np
import pytest
import tensorflow as tf

import trainer
from helpers import (assert_same_variables, dataset_input_fn, make_estimator,
                     run_config, save_start_checkpoint, seeded,
                     variables_of)

pytestmark = pytest.mark.training

tf1 = tf.compat.v1
STEPS = 4
BATCH = 7
COLUMNS = [tf.feature_column.numeric_column('x', shape=(5,))]


def _pair(tmp_path, model_fn, towers, input_fn, params=None,
          **wrapper_kwargs):
  """(one-device, replicated) Estimators that start from one checkpoint.

  `model_fn` may be a list of three model_fns (start checkpoint, one
  device, replicated) when each must have its own optimizer instance.
  """
  fns = model_fn if isinstance(model_fn, list) else [model_fn] * 3
  dirs = [tmp_path / 'one', tmp_path / 'many']
  save_start_checkpoint(fns[0], input_fn, dirs, params)
  one = tf.estimator.Estimator(
      fns[1], params=params,
      config=run_config(dirs[0], 1))
  many = tf.estimator.Estimator(
      trainer.replicate_model_fn(fns[2], **wrapper_kwargs), params=params,
      config=run_config(dirs[1], towers))
  return one, many


def _train_and_compare(tmp_path, data, model_fn, towers, params=None,
                       float_labels=False, **wrapper_kwargs):
  x, y = data
  labels = y[:, None].astype(np.float32 if float_labels else np.int32)
  input_fn = dataset_input_fn({'x': x}, labels, BATCH)
  one, many = _pair(tmp_path, model_fn, towers, input_fn, params,
                    **wrapper_kwargs)
  one.train(input_fn, steps=STEPS)
  many.train(input_fn, steps=STEPS)
  assert _global_step(many) == STEPS
  assert_same_variables(variables_of(one), variables_of(many))
  return one, many


def _global_step(estimator):
  """global_step, also under its object-based checkpoint key."""
  names = [n for n in estimator.get_variable_names() if 'global_step' in n]
  assert len(names) == 1, names
  return estimator.get_variable_value(names[0])


@pytest.mark.parametrize('towers', [2, 3])
def test_tf2_canned_dnn_classifier_equals_one_device(tmp_path, data, towers):
  estimator = tf.estimator.DNNClassifier(hidden_units=[4],
                                         feature_columns=COLUMNS)
  one, many = _train_and_compare(tmp_path, data, estimator.model_fn, towers)
  # The Keras optimizer's slots, under their one-device names.
  assert any('Adagrad' in name for name in variables_of(many))


def test_tf2_canned_linear_regressor_with_adam_equals_one_device(tmp_path,
                                                                  data):
  estimator = tf.estimator.LinearRegressor(
      feature_columns=COLUMNS,
      optimizer=lambda: tf.keras.optimizers.legacy.Adam(0.05))
  _train_and_compare(tmp_path, data, estimator.model_fn, 3, float_labels=True)


def _canned_with_instance(kind, task):
  """A TF2 canned Estimator's model_fn, given fresh optimizer INSTANCES.

  Each instance serves one Estimator: Keras refuses to count a second
  graph's global_step, so even one device cannot reuse it.
  """
  legacy = tf.keras.optimizers.legacy
  dnn = dict(hidden_units=[4], feature_columns=COLUMNS,
             optimizer=legacy.Adagrad(0.3))
  linear = dict(feature_columns=COLUMNS, optimizer=legacy.Ftrl(0.2))
  combined = dict(linear_feature_columns=COLUMNS,
                  linear_optimizer=legacy.Ftrl(0.2),
                  dnn_feature_columns=COLUMNS, dnn_hidden_units=[4],
                  dnn_optimizer=legacy.Adam(0.05))
  baseline = dict(optimizer=legacy.Adam(0.05))
  kwargs = {'dnn': dnn, 'linear': linear, 'combined': combined,
            'baseline': baseline}[kind]
  name = {'dnn': 'DNN', 'linear': 'Linear', 'combined': 'DNNLinearCombined',
          'baseline': 'Baseline'}[kind] + task.capitalize()
  return getattr(tf.estimator, name)(**kwargs).model_fn


@pytest.mark.parametrize('kind,task,towers,aggregation', [
    ('dnn', 'classifier', 2, 'global_loss'),
    ('linear', 'regressor', 3, 'global_loss'),
    ('linear', 'classifier', 2, 'round_robin'),
    ('combined', 'classifier', 3, 'all_reduce'),
    ('baseline', 'regressor', 2, 'global_loss'),
])
def test_tf2_canned_with_an_optimizer_instance_equals_one_device(
    tmp_path, data, kind, task, towers, aggregation):
  # The canned model_fn sets `optimizer.iterations = global_step` on the
  # user's instance in every tower's call.
  fns = [_canned_with_instance(kind, task) for _ in range(3)]
  _train_and_compare(tmp_path, data, fns, towers,
                     float_labels=task == 'regressor',
                     aggregation=aggregation)


def head_model_fn(features, labels, mode, params):
  """A model_fn around a tf.estimator head, as the TF2 guides write them."""
  hidden = tf.keras.layers.Dense(4, tf.nn.tanh, kernel_initializer=seeded(6))
  logits = tf.keras.layers.Dense(1, kernel_initializer=seeded(7))(
      hidden(features['x']))
  head = tf.estimator.BinaryClassHead()
  step = tf1.train.get_or_create_global_step()
  if params['train'] == 'optimizer':
    optimizer = tf.keras.optimizers.legacy.Adam(0.05)
    optimizer.iterations = step  # As the canned Estimators do.
    return head.create_estimator_spec(
        features, mode, logits, labels, optimizer=optimizer,
        trainable_variables=tf1.trainable_variables())
  return head.create_estimator_spec(
      features, mode, logits, labels,
      train_op_fn=lambda loss: tf1.train.MomentumOptimizer(
          0.2, 0.9).minimize(loss, step))


@pytest.mark.parametrize('train', ['optimizer', 'train_op_fn'])
def test_head_equals_one_device(tmp_path, data, train):
  _train_and_compare(tmp_path, data, head_model_fn, 2, {'train': train})


def test_new_keras_optimizer_error_names_the_legacy_one(tmp_path, data):
  def model_fn(features, labels, mode):
    layer = tf.keras.layers.Dense(1)
    with tf.GradientTape() as tape:  # As a TF2 training loop writes it.
      loss = tf1.losses.sigmoid_cross_entropy(labels, layer(features['x']))
    optimizer = tf.keras.optimizers.SGD(0.1)  # Not legacy: no graph mode.
    grads = tape.gradient(loss, layer.trainable_variables)
    train_op = optimizer.apply_gradients(
        zip(grads, layer.trainable_variables))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  x, y = data
  estimator = tf.estimator.Estimator(
      trainer.replicate_model_fn(model_fn),
      config=run_config(tmp_path, 2))
  with pytest.raises(ValueError, match=r'never updates the weights.*'
                     r'tf\.keras\.optimizers\.legacy\.SGD or a '
                     r'tf\.compat\.v1\.train optimizer'):
    estimator.train(dataset_input_fn({'x': x}, y[:, None], BATCH), steps=1)


@pytest.mark.parametrize('gradients', ['tf.gradients', 'GradientTape'])
def test_a_new_keras_optimizer_does_not_train_in_graph_mode_on_one_device(
    gradients):
  # Why the refusal above is not a false one: unwrapped, in the graph mode
  # tf.estimator builds, the update runs and the weights stay as they were,
  # however the gradients are taken. Should a TensorFlow release change
  # that, towers must support it.
  with tf.Graph().as_default():
    x = tf.constant(np.arange(30, dtype=np.float32).reshape(10, 3) / 30)
    layer = tf.keras.layers.Dense(1, kernel_initializer='ones')
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(layer(x)[:, 0] - 2.0))
    if gradients == 'GradientTape':
      grads = tape.gradient(loss, layer.trainable_variables)
    else:
      grads = tf.gradients(loss, layer.trainable_variables)
    optimizer = tf.keras.optimizers.Adam(0.1)
    update = optimizer.apply_gradients(zip(grads, layer.trainable_variables))
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      losses = [session.run([loss, update])[0] for _ in range(3)]
      assert session.run(optimizer.iterations) == 3
      assert losses[0] == losses[-1] > 0
      np.testing.assert_array_equal(session.run(layer.kernel), 1.0)


def _keras_model():
  inputs = tf.keras.Input(shape=(5,), name='x')
  hidden = tf.keras.layers.Dense(4, tf.nn.tanh, kernel_initializer=seeded(8))(
      inputs)
  outputs = tf.keras.layers.Dense(1, tf.nn.sigmoid,
                                  kernel_initializer=seeded(9))(hidden)
  model = tf.keras.Model(inputs, outputs)
  model.compile(optimizer=tf.keras.optimizers.legacy.Adam(0.05),
                loss='binary_crossentropy')
  return model


@pytest.mark.parametrize('checkpoint_format, aggregation', [
    ('checkpoint', 'global_loss'), ('saver', 'global_loss'),
    # The Saver's restore ops are not the model_fn's writes (once refused).
    ('saver', 'all_reduce')])
def test_model_to_estimator_equals_one_device_and_resumes(
    tmp_path, data, checkpoint_format, aggregation):
  estimator = tf.keras.estimator.model_to_estimator(
      keras_model=_keras_model(), checkpoint_format=checkpoint_format,
      model_dir=str(tmp_path / 'keras'))
  one, many = _train_and_compare(tmp_path, data, estimator.model_fn, 2,
                                 float_labels=True, aggregation=aggregation)
  x, y = data
  input_fn = dataset_input_fn({'x': x}, y[:, None].astype(np.float32), BATCH)
  one.train(input_fn, steps=2)
  many.train(input_fn, steps=2)  # Resumes, optimizer slots included.
  assert _global_step(many) == STEPS + 2
  assert_same_variables(variables_of(one), variables_of(many))



def test_model_to_estimators_object_saver_is_refused_under_all_reduce(
    tmp_path, data):
  # Its Saver, built in the model_fn over the last tower's model, restores
  # that tower's copies: a restored run started from uninitialised
  # primaries (RuntimeError at session creation before this refusal).
  estimator = tf.keras.estimator.model_to_estimator(
      keras_model=_keras_model(), checkpoint_format='checkpoint',
      model_dir=str(tmp_path / 'keras'))
  x, y = data
  many = tf.estimator.Estimator(
      trainer.replicate_model_fn(estimator.model_fn, aggregation='all_reduce'),
      config=run_config(tmp_path / 'many', 2))
  with pytest.raises(ValueError, match=r"own Saver \(scaffold\.saver\) "
                     r"restores tower_1_replica/\S+, a tower's copy.*"
                     r"checkpoint_format='saver'"):
    many.train(dataset_input_fn({'x': x}, y[:, None].astype(np.float32),
                                BATCH), steps=1)


def recurrent_model_fn(features, labels, mode, params):
  """A masked Keras recurrent layer over the features as 2 steps."""
  sequence = tf.reshape(features['x'][:, :4], [-1, 2, 2])
  layer = {'lstm': tf.keras.layers.LSTM, 'simple': tf.keras.layers.SimpleRNN}
  mask = tf.sequence_mask(tf.ones_like(labels) + 1, 2)  # Every step.
  state = layer[params['layer']](3, kernel_initializer=seeded(5),
                                 recurrent_initializer=seeded(6))(sequence,
                                                                  mask=mask)
  logits = tf.compat.v1.layers.dense(state, 1, kernel_initializer=seeded(7))
  loss = tf.compat.v1.losses.sigmoid_cross_entropy(
      tf.cast(labels[:, None], tf.float32), logits)
  train_op = tf.compat.v1.train.AdamOptimizer(0.05).minimize(
      loss, tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('layer,towers,batch', [('lstm', 3, 10),
                                                ('simple', 2, 2)])
def test_a_masked_recurrent_layer_on_a_static_batch_equals_one_device(
    tmp_path, data, layer, towers, batch):
  # Keras' loop runs in a function body, where the towers record static
  # sizes folded from the shard (tower_effects reads them as the shard's).
  x, y = data
  def input_fn():
    return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(
        batch, drop_remainder=True).repeat()
  trained = []
  for name, count in (('one', 1), ('many', towers)):
    estimator = make_estimator(recurrent_model_fn, tmp_path / name, count,
                               {'layer': layer})
    estimator.train(input_fn, steps=3)
    trained.append(variables_of(estimator))
  assert_same_variables(*trained)
