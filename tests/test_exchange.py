"""One tower's tensor downstream of an exchange can be fetched on its own.

Towers exchange values through collective all-sums (batch norm's global
moments, `whole_batch`'s rows, and their gradients): one collective op per
tower. A fetch that needs one tower's result alone (a hook's `end()`
reading tower 0's logits, `session.run(tower_tensor)`) made TensorFlow
prune the other towers' members, and the one left waited forever: the
process hung. Now every member joins the others, so the fetch returns, with
the value the same tensor has when fetched with the train op. The fetches
run with a 60 s session deadline, a guard against the hang (the old code
fails with DeadlineExceededError), not a timing bound. Through an
Estimator, a `LoggingTensorHook(at_end=True)` on tower 0's logits returns
one device's logits of those rows.
"""

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers
import trainer
from helpers import dataset_input_fn, make_estimator, seeded

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys
BATCH = 7  # Uneven: 4+3 on 2 towers, 3+2+2 on 3.
# A guard against the hang, generous on a loaded machine: not a timing bound.
_HANG_GUARD = tf1.RunOptions(timeout_in_ms=60_000)


def _spec(mode, logits, labels):
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
        loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _batch_norm(features, labels, mode):
  """Dense, global batch norm, dense: two exchanges per tower (forward and
  backward)."""
  net = tf1.layers.dense(features['x'], 6, kernel_initializer=seeded(1))
  net = tf1.layers.batch_normalization(net, momentum=0.5, training=True)
  logits = tf.identity(tf1.layers.dense(
      tf.nn.tanh(net), 2, kernel_initializer=seeded(2)), name='logits')
  return _spec(mode, logits, labels)


def _whole_batch(features, labels, mode):
  """Logits against every tower's rows (in-batch negatives)."""
  z = tf1.layers.dense(features['x'], 4, kernel_initializer=seeded(3))
  rows, _ = estimator_towers.whole_batch(z)
  logits = tf.identity(tf.matmul(z, rows, transpose_b=True)[:, :2],
                       name='logits')
  return _spec(mode, logits, labels)


def _build(model_fn, towers):
  """The replicated train graph on one repeated batch, and its spec."""
  graph = tf.Graph()
  with graph.as_default():
    rng = np.random.RandomState(0)
    x = rng.randn(BATCH, 5).astype(np.float32)
    y = (rng.rand(BATCH) > 0.5).astype(np.int32)
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensors(({'x': x}, y)).repeat()).get_next()
    config = trainer.make_run_config(cpu_devices=towers)
    spec = trainer.replicate_model_fn(model_fn)(
        features, labels, ModeKeys.TRAIN, None, config)
  return graph, spec, config.session_config


def _alone_then_with_train_op(graph, spec, session_config, tensor):
  """`tensor` fetched on its own, then beside the train op (same batch,
  same variables: the step's reads come before its writes)."""
  with graph.as_default(), tf1.Session(config=session_config) as session:
    session.run(tf1.global_variables_initializer())
    alone = session.run(tensor, options=_HANG_GUARD)
    beside, _ = session.run([tensor, spec.train_op], options=_HANG_GUARD)
  return alone, beside


@pytest.mark.fast
@pytest.mark.parametrize('model_fn', [_batch_norm, _whole_batch],
                         ids=['batch_norm', 'whole_batch'])
@pytest.mark.parametrize('towers', [2, 3])
def test_one_towers_logits_alone(model_fn, towers):
  graph, spec, session_config = _build(model_fn, towers)
  for name in ('logits:0', f'tower_{towers - 1}/logits:0'):
    alone, beside = _alone_then_with_train_op(
        graph, spec, session_config, graph.get_tensor_by_name(name))
    np.testing.assert_array_equal(alone, beside, err_msg=name)


def _backward_part(graph, device):
  """The gradient w.r.t. the exchanged part of the tower on `device`: what
  the backward all-sum's result gives that tower (past its join)."""
  collective, = [op for op in graph.get_operations()
                 if op.type == 'CollectiveReduce' and op.device == device
                 and op.name.startswith('gradients/')]
  consumer, = collective.outputs[0].consumers()
  if consumer.type == 'Identity':  # The join.
    consumer, = consumer.outputs[0].consumers()
  return consumer.outputs[0]


@pytest.mark.fast
def test_one_towers_backward_exchange_alone():
  graph, spec, session_config = _build(_batch_norm, 2)
  alone, beside = _alone_then_with_train_op(
      graph, spec, session_config, _backward_part(graph, '/device:CPU:0'))
  np.testing.assert_array_equal(alone, beside)
  assert np.any(alone)


@pytest.mark.fast
def test_each_join_waits_for_every_other_member():
  # Towers^2 - towers edges per exchange: the forward and the backward one.
  graph, _, _ = _build(_batch_norm, 3)
  collectives = [op for op in graph.get_operations()
                 if op.type == 'CollectiveReduce']
  assert len(collectives) == 2 * 3
  added = 0
  for op in collectives:
    join, = op.outputs[0].consumers()
    waits = set(join.control_inputs)
    same = {c for c in collectives
            if c.get_attr('instance_key') == op.get_attr('instance_key')}
    assert waits == same - {op}, join.name
    added += len(waits)
  assert added == 2 * 3 * 2


def _logged_at_end(model_fn, model_dir, towers):
  """Tower 0's logits (one device's, with 1 tower) as a LoggingTensorHook
  with at_end=True fetches them alone after 3 steps."""
  rng = np.random.RandomState(1)
  x = rng.randn(4 * BATCH, 5).astype(np.float32)
  y = (rng.rand(4 * BATCH) > 0.5).astype(np.int32)
  logged = {}
  hook = tf1.train.LoggingTensorHook(
      {'logits': 'logits:0'}, at_end=True,
      formatter=lambda values: str(logged.update(values)))
  make_estimator(model_fn, model_dir, towers=towers).train(
      dataset_input_fn({'x': x}, y, batch_size=BATCH), steps=3, hooks=[hook])
  return logged['logits']


@pytest.mark.training
# The session cannot be interrupted while a collective waits: were the
# hang back, this ends the worker with the stacks (pytest-timeout) instead
# of waiting for the suite's 900 s. A hang guard, not a timing bound.
@pytest.mark.timeout(300, method='thread')
def test_a_logging_hook_at_end_reads_tower_0_through_an_estimator(tmp_path):
  tower_0 = _logged_at_end(_batch_norm, tmp_path / 'towers', 2)
  one = _logged_at_end(_batch_norm, tmp_path / 'one', 1)
  assert tower_0.shape == (4, 2)  # Tower 0's 4 of the batch's 7 rows.
  np.testing.assert_allclose(tower_0, one[:4], rtol=1e-4, atol=1e-6)
