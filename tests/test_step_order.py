"""The step counter's false "global step has not been increased" warning."""

import logging

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.platform import tf_logging
from tensorflow.python.training import training_util

from trainer import train

tf1 = tf.compat.v1
_WARNING = 'It seems that global step (tf.train.get_global_step) has not been'


def _step_writes(graph):
  handle = tf1.train.get_global_step(graph).handle
  init = tf1.train.get_global_step(graph).initializer
  return [op for op in graph.get_operations()
          if op.inputs and op.inputs[0] is handle and op is not init and
          op.type.startswith('Assign')]


@pytest.mark.fast
@pytest.mark.parametrize('aggregation', ['global_loss', 'round_robin',
                                         'all_reduce'])
def test_the_increment_waits_for_the_step_counters_read(tmp_path,
                                                        aggregation):
  # Unordered, the read of one run could see its own increment and the next
  # run's read could not: the same value twice, and the warning.
  run = train._Run(  # pylint: disable=protected-access
      train.TaskOptions(train_steps=5, cpu_towers=2, hidden_units=[4],
                        aggregation=aggregation), str(tmp_path), {})
  with tf.Graph().as_default() as graph:
    tf1.train.get_or_create_global_step()
    read = training_util._get_or_create_global_step_read(graph)  # pylint: disable=protected-access
    features, labels = tf1.data.make_one_shot_iterator(
        run.train_spec.input_fn()).get_next()
    run.estimator.model_fn(features, labels, tf.estimator.ModeKeys.TRAIN,
                           run.estimator.config)
    writes = _step_writes(graph)
    assert writes
    for op in writes:
      assert read.op in op.control_inputs, op.name


def _stalled_model_fn(features, labels, mode, params, config):
  del labels, params, config  # A train op that never advances the step.
  weight = tf1.get_variable('w', [], initializer=tf1.zeros_initializer())
  loss = tf.reduce_mean(features['x']) * weight
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=tf1.assign_add(weight, 0.0))


class _Records(logging.Handler):

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _stall_warnings(model_dir):
  """The warnings TensorFlow logs while the stalled model_fn trains."""

  def input_fn():
    return tf.data.Dataset.from_tensors(
        ({'x': np.ones([2], np.float32)}, np.zeros([2], np.int32))).repeat(6)

  config = tf.estimator.RunConfig(str(model_dir), log_step_count_steps=1)
  estimator = tf.estimator.Estimator(
      train._with_step_logging(_stalled_model_fn, 2, 1, 6),  # pylint: disable=protected-access
      config=config)
  records, logger = _Records(), tf.get_logger()
  level = logger.level  # helpers.py keeps TensorFlow's warnings quiet.
  logger.addHandler(records)
  logger.setLevel(logging.WARNING)
  try:
    estimator.train(input_fn)
  finally:
    logger.removeHandler(records)
    logger.setLevel(level)
  return records.messages


@pytest.mark.training
def test_a_real_stall_is_still_reported(tmp_path, monkeypatch):
  # TensorFlow logs this warning only the first 5 times in a process
  # (log_first_n, counted per source line): a stall in an earlier test of
  # the same pytest process, as in this earlier training, would silence it
  # here. Counted afresh, it shows whether the trainer hides a stall.
  _stall_warnings(tmp_path / 'earlier')
  # Private, but the only record of those counts; monkeypatch restores it.
  monkeypatch.setattr(tf_logging, '_log_counter_per_token', {})
  messages = _stall_warnings(tmp_path / 'checked')
  assert any(_WARNING in m for m in messages), messages
