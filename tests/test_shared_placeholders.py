"""A placeholder the model_fn makes, fed by a hook, reaches every tower.

A later tower made its own copy (`tower_1/lr`), which the hook feeding
'lr:0' did not feed: every step failed (shared_placeholders).
"""

import numpy as np
import pytest
import tensorflow as tf

import helpers
from helpers import seeded

tf1 = tf.compat.v1

_X = (np.arange(72, dtype=np.float32).reshape(24, 3) % 7) - 3
_Y = np.arange(24, dtype=np.float32) % 5


def _model_fn_with(make_rate):
  """A regression whose Momentum learning rate is `make_rate()`."""

  def model_fn(features, labels, mode):
    net = tf1.layers.dense(features['x'], 4, kernel_initializer=seeded(1))
    out = tf1.layers.dense(net, 1, kernel_initializer=seeded(2))[:, 0]
    loss = tf.reduce_mean(tf.square(out - labels))
    train_op = tf1.train.MomentumOptimizer(make_rate(), 0.9).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


_model_fn = _model_fn_with(
    lambda: tf1.placeholder(tf.float32, [], name='lr'))
_MODEL_FNS = {
    'placeholder': _model_fn,
    'placeholder_with_default': _model_fn_with(
        lambda: tf1.placeholder_with_default(0.2, [], name='lr')),
}


class _FeedLearningRate(tf1.train.SessionRunHook):
  """Feeds 'lr:0' by name, a smaller rate every step."""

  def __init__(self):
    self._step = 0

  def before_run(self, run_context):
    del run_context
    self._step += 1
    rate = tf1.get_default_graph().get_tensor_by_name('lr:0')
    return tf1.train.SessionRunArgs(None, feed_dict={rate: 0.1 / self._step})


def _input_fn():
  return tf.data.Dataset.from_tensor_slices(({'x': _X}, _Y)).batch(9)


@pytest.mark.training
@pytest.mark.parametrize('name,towers,kwargs', [
    ('placeholder', 2, {}), ('placeholder', 3, {}),
    ('placeholder', 2, {'aggregation': 'all_reduce'}),
    ('placeholder', 2, {'micro_batches': 2}),
    ('placeholder_with_default', 2, {}),
    ('placeholder_with_default', 3, {'aggregation': 'all_reduce'})])
def test_a_placeholder_fed_by_a_hook_trains_as_one_device(tmp_path, name,
                                                          towers, kwargs):
  model_fn = _MODEL_FNS[name]
  one = helpers.make_estimator(model_fn, tmp_path / 'one', 1)
  one.train(_input_fn, steps=3, hooks=[_FeedLearningRate()])
  expected = helpers.variables_of(one)
  for run in range(2):
    replicated = helpers.make_estimator(model_fn, tmp_path / str(run),
                                        towers, **kwargs)
    replicated.train(_input_fn, steps=3, hooks=[_FeedLearningRate()])
    helpers.assert_same_variables(expected,
                                  helpers.variables_of(replicated), rtol=2e-5)


@pytest.mark.training
def test_an_unfed_placeholder_fails_naming_the_one_devices(tmp_path):
  replicated = helpers.make_estimator(_model_fn, tmp_path, 2)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"placeholder tensor 'lr'"):
    replicated.train(_input_fn, steps=1)


@pytest.mark.training
def test_a_default_from_the_shard_stays_the_towers(tmp_path):
  """A placeholder_with_default of the features is each tower's own rows."""

  def model_fn(features, labels, mode):
    x = tf1.placeholder_with_default(features['x'], [None, 3], name='x_in')
    return _model_fn_with(lambda: tf.constant(0.1))({'x': x}, labels, mode)

  one = helpers.make_estimator(model_fn, tmp_path / 'one', 1)
  one.train(_input_fn, steps=3)
  replicated = helpers.make_estimator(model_fn, tmp_path / 'two', 2)
  replicated.train(_input_fn, steps=3)
  helpers.assert_same_variables(helpers.variables_of(one),
                                helpers.variables_of(replicated), rtol=2e-5)
