"""A SavedModelEstimator on towers: one device's metrics and predictions."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_estimator.python.estimator.canned import saved_model_estimator as sme_lib  # pylint: disable=g-direct-tensorflow-import

import trainer
from helpers import (NUM_FEATURES, classifier_model_fn, dataset_input_fn,
                     make_estimator)
from estimator_towers.merge import saved_model_estimator

pytestmark = pytest.mark.training

tf1 = tf.compat.v1
# 11 rows in batches of 5: shards of 3 and 2 (2 towers), a last batch of
# one row that leaves towers idle.
_ROWS, _BATCH = 11, 5


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  """A SavedModel with TRAIN, EVAL and PREDICT graphs, and its data."""
  tmp = tmp_path_factory.mktemp('exported')
  rng = np.random.RandomState(5)
  x = rng.randn(_ROWS, NUM_FEATURES).astype(np.float32)
  y = rng.randint(0, 2, size=_ROWS).astype(np.int32)
  source = make_estimator(classifier_model_fn, tmp / 'source', params={
      'optimizer': lambda: tf1.train.GradientDescentOptimizer(0.5)})
  source.train(dataset_input_fn({'x': x}, y, _BATCH), steps=3)
  with tf.Graph().as_default():  # The receivers copy these placeholders.
    features = {'x': tf1.placeholder(tf.float32, [None, NUM_FEATURES])}
    supervised = (
        tf.estimator.experimental.build_raw_supervised_input_receiver_fn(
            features, tf1.placeholder(tf.int32, [None])))
    serving = tf.estimator.export.build_raw_serving_input_receiver_fn(
        features)
  modes = tf.estimator.ModeKeys
  export_dir = source.experimental_export_all_saved_models(
      str(tmp / 'export'), {modes.TRAIN: supervised, modes.EVAL: supervised,
                            modes.PREDICT: serving})
  return export_dir.decode(), x, y


def _towers(export_dir, model_dir, towers):
  config = trainer.make_run_config(str(model_dir), cpu_devices=towers)
  return saved_model_estimator.TowersSavedModelEstimator(export_dir,
                                                      config=config)


def _assert_same_metrics(expected, actual):
  assert sorted(expected) == sorted(actual)
  for name in expected:
    np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize('towers', [2, 3])
def test_towers_evaluate_and_predict_as_one_device(exported, tmp_path,
                                                   towers):
  export_dir, x, y = exported
  one = sme_lib.SavedModelEstimator(export_dir, str(tmp_path / 'one'))
  replicated = _towers(export_dir, tmp_path / 'towers', towers)
  eval_input = dataset_input_fn({'x': x}, y, _BATCH, repeat=False)
  _assert_same_metrics(one.evaluate(eval_input), replicated.evaluate(eval_input))
  predict_input = dataset_input_fn({'x': x}, None, _BATCH, repeat=False)
  expected = list(one.predict(predict_input))
  actual = list(replicated.predict(predict_input))
  assert len(actual) == _ROWS
  for want, got in zip(expected, actual):
    np.testing.assert_allclose(got['logits'], want['logits'], rtol=1e-5)
    assert got['classes'] == want['classes']


def test_towers_read_what_one_device_trained(exported, tmp_path):
  # SavedModelEstimator trains on one device into model_dir; the towers then
  # read that checkpoint, not the SavedModel's variables.
  export_dir, x, y = exported
  model_dir = tmp_path / 'model'
  one = sme_lib.SavedModelEstimator(export_dir, str(model_dir))
  one.train(dataset_input_fn({'x': x}, y, _BATCH), steps=2)
  eval_input = dataset_input_fn({'x': x}, y, _BATCH, repeat=False)
  expected = one.evaluate(eval_input)
  assert expected['global_step'] == 5  # The SavedModel's 3, then 2 more.
  _assert_same_metrics(expected,
                       _towers(export_dir, model_dir, 2).evaluate(eval_input))


def test_training_on_towers_is_refused(exported, tmp_path):
  export_dir, x, y = exported
  replicated = _towers(export_dir, tmp_path, 2)
  with pytest.raises(ValueError, match=r"cannot train a SavedModelEstimator "
                     r"on 2 towers.*SavedModelEstimator\.train on one device"):
    replicated.train(dataset_input_fn({'x': x}, y, _BATCH), steps=1)


def test_a_plain_estimator_is_pointed_to_towers_saved_model_estimator(
    exported, tmp_path):
  # tf.estimator.Estimator makes a global_step before the model_fn imports
  # the SavedModel's: SavedModelEstimator's own RuntimeError said only that
  # the input_fn must not make one.
  export_dir, x, y = exported
  one = sme_lib.SavedModelEstimator(export_dir, str(tmp_path / 'one'))
  plain = tf.estimator.Estimator(
      trainer.replicate_model_fn(one.model_fn),
      config=trainer.make_run_config(str(tmp_path / 'towers'),
                                     cpu_devices=2))
  with pytest.raises(ValueError, match=r'made one before calling it.*'
                     r'TowersSavedModelEstimator\(saved_model_dir'):
    plain.evaluate(dataset_input_fn({'x': x}, y, _BATCH, repeat=False))
