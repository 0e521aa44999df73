"""Synchronous training across the tasks of a cluster (task_sync).

A chief and a worker on loopback, 2 virtual CPU towers each, trained through
`tf.estimator.train_and_evaluate`, must end with the variables (Adam slots,
batch-norm statistics and global_step included) of one process on 4 towers
fed the concatenated batch. The tasks run in a network namespace of their
own (their gRPC servers listen on every interface).
"""

import glob
import json
import os
import types

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers
import preloaded
from cli_helpers import ROOT
from estimator_towers.cluster import task_sync
from tests import helpers
from tests import sync_cluster_task
from trainer.cluster import private_network

_STEPS = 4
_ROWS = (5, 4)  # Chief, worker: towers of 3+2 and 2+2, as one process's 9.


def _run_pair(model_dir, steps=_STEPS, rows=_ROWS, mode='pair'):
  return preloaded.run(
      'tests.sync_cluster_pair', [mode, model_dir, steps, *rows], cwd=ROOT,
      env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT},
      timeout=300, private_network=True)


def _start_input_fn():
  return sync_cluster_task.global_batches(sum(_ROWS), _STEPS).take(1)


def _first_logged_loss(model_dir):
  """The 'loss' summary of the first step the chief (or process) wrote."""
  for path in sorted(glob.glob(os.path.join(str(model_dir), 'events.*'))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == 'loss':
          return event.step, tf.make_ndarray(value.tensor) if value.HasField(
              'tensor') else value.simple_value
  raise AssertionError(f'no loss summary in {model_dir}')


def _one_process(model_dir, projection):
  """One process on 4 towers, through the cluster chief's `projection`."""
  def model_fn(features, labels, mode):
    return sync_cluster_task.model_fn(
        features, labels, mode,
        projection=tf.compat.v1.constant_initializer(projection),
        manual_step=True)
  estimator = helpers.make_estimator(model_fn, model_dir, towers=4,
                                     aggregation='all_reduce')
  estimator.train(
      lambda: sync_cluster_task.global_batches(sum(_ROWS), _STEPS),
      max_steps=_STEPS)
  return helpers.variables_of(estimator)


@pytest.mark.cluster
def test_sliced_global_batches_train_as_one_process_to_the_same_end(
    tmp_path):
  # 19 rows in global batches of 9: the tasks keep 5+4, 5+4, then 1+0 (the
  # worker trains on nothing in the last step), and both stop when the
  # one pass ends. Momentum updates only the embedding rows its sparse
  # gradient names: the worker's zero row must not name row 0. The loss is
  # guarded by tf.where(present > 0, ...): every task applies the global
  # batch's condition (summed over the tasks).
  private_network.check_unshare_works()
  cluster_dir, one_dir = tmp_path / 'cluster', tmp_path / 'one'
  batches = lambda: sync_cluster_task.sliced_batches(9, 19)
  helpers.save_start_checkpoint(sync_cluster_task.momentum_model_fn,
                                lambda: batches().take(1),
                                [cluster_dir, one_dir])
  done = _run_pair(cluster_dir, 9, [19], mode='sliced-pair')
  assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
  estimator = helpers.make_estimator(sync_cluster_task.momentum_model_fn,
                                     one_dir, towers=4,
                                     aggregation='all_reduce')
  estimator.train(batches)
  expected = helpers.variables_of(estimator)
  assert int(expected['global_step']) == 3
  chief = tf.train.load_checkpoint(str(cluster_dir))
  actual = {name: chief.get_tensor(name)
            for name in chief.get_variable_to_shape_map()}
  assert 'embedding/Momentum' in actual
  helpers.assert_same_variables(expected, actual, rtol=1e-4, atol=1e-5)
  worker_final = np.load(cluster_dir / 'final-worker-0.npz')
  np.testing.assert_array_equal(worker_final['embedding'],
                                actual['embedding'])


@pytest.mark.cluster
def test_chief_and_worker_train_as_one_process_on_the_global_batch(
    tmp_path):
  private_network.check_unshare_works()
  cluster_dir, one_dir = tmp_path / 'cluster', tmp_path / 'one'
  helpers.save_start_checkpoint(sync_cluster_task.model_fn, _start_input_fn,
                                [cluster_dir, one_dir])
  done = _run_pair(cluster_dir)
  assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
  # The tasks' random local projection is the chief's (broadcast with the
  # variables), so they train as one process through it.
  chief_final = np.load(cluster_dir / 'final-chief-0.npz')
  worker_final = np.load(cluster_dir / 'final-worker-0.npz')
  expected = _one_process(one_dir, chief_final['projection'])
  chief = tf.train.load_checkpoint(str(cluster_dir))
  actual = {name: chief.get_tensor(name)
            for name in chief.get_variable_to_shape_map()}
  assert int(actual['global_step']) == _STEPS
  # Adam's slots and the batch-norm statistics are among them.
  assert {'embedding/Adam', 'batch_normalization/moving_variance'} <= set(
      actual)
  helpers.assert_same_variables(expected, actual, rtol=1e-4, atol=1e-5)
  # The logged loss is the global batch's, not the chief's share of it.
  one_step, one_loss = _first_logged_loss(one_dir)
  chief_step, chief_loss = _first_logged_loss(cluster_dir)
  assert chief_step == one_step
  np.testing.assert_allclose(chief_loss, one_loss, rtol=1e-5)
  # The worker ends with the chief's variables, bit for bit.
  assert 'projection' in chief_final
  assert sorted(chief_final) == sorted(worker_final)
  for name in chief_final:
    np.testing.assert_array_equal(worker_final[name], chief_final[name],
                                  err_msg=name)


@pytest.mark.cluster
def test_one_devices_dropout_trains_a_cluster_as_one_process(tmp_path):
  # random_ops='one_device': every task draws the global batch's masks with
  # one seed and keeps its towers' rows, after the rows of the tasks
  # before it: chief and worker train as one process's 4 towers do.
  _assert_pair_trains_as(tmp_path, sync_cluster_task.dropout_model_fn,
                         'dropout-pair', towers=4, aggregation='all_reduce',
                         random_ops='one_device')


def _assert_pair_trains_as(tmp_path, model_fn, mode, **one_process):
  """Runs the `mode` pair from one start and compares the chief's
  checkpoint with one process's Estimator (`one_process`: make_estimator's
  arguments) trained on the global batches."""
  private_network.check_unshare_works()
  cluster_dir, one_dir = tmp_path / 'cluster', tmp_path / 'one'
  helpers.save_start_checkpoint(model_fn, _start_input_fn,
                                [cluster_dir, one_dir])
  done = _run_pair(cluster_dir, mode=mode)
  assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
  estimator = helpers.make_estimator(model_fn, one_dir, **one_process)
  estimator.train(
      lambda: sync_cluster_task.global_batches(sum(_ROWS), _STEPS),
      max_steps=_STEPS)
  actual = helpers.checkpoint_variables(cluster_dir)  # The chief's.
  assert int(actual['global_step']) == _STEPS
  assert 'embedding/Adam' in actual
  helpers.assert_same_variables(helpers.variables_of(estimator), actual,
                                rtol=1e-4, atol=1e-5)


@pytest.mark.cluster
def test_a_keras_masked_mean_trains_a_cluster_as_one_process(tmp_path):
  # The valid ids differ between the tasks' shares: each task's towers are
  # weighed by their valid ids over the tasks' total.
  _assert_pair_trains_as(tmp_path, sync_cluster_task.masked_model_fn,
                         'masked-pair', towers=4, aggregation='all_reduce')


@pytest.mark.cluster
def test_micro_batches_train_a_cluster_as_one_process(tmp_path):
  # micro_batches=2 on each task's 2 towers: chief 2+1+1+1 rows, worker
  # 1+1+1+1, one all-reduce over the tasks per step.
  _assert_pair_trains_as(tmp_path, sync_cluster_task.micro_batch_model_fn,
                         'micro-pair', towers=1)


@pytest.mark.fast
@pytest.mark.parametrize('dtype', [tf.float32, tf.float16, tf.float64])
def test_a_sparse_gradient_travels_in_one_gather_with_its_indices(dtype):
  # The indices ride bitcast in the values' rows: one collective fewer per
  # step, and every bit back (indices that read as NaN floats included).
  # A task group of one, in this process: its device is the session's.
  config = types.SimpleNamespace(num_worker_replicas=1,
                                 global_id_in_cluster=0, is_chief=True,
                                 task_type='localhost', task_id=0)
  indices = np.array([2**62 + 2**31 + 5, 0x7FC00001 << 32, 3, 2**63 - 1],
                     np.int64)
  values = np.arange(24).reshape(4, 3, 2).astype(dtype.as_numpy_dtype)
  graph = tf.Graph()
  with graph.as_default():
    group = task_sync.TaskGroup(config, '/device:CPU:0')
    gathered = group.gather_slices(tf.IndexedSlices(
        tf.constant(values), tf.constant(indices), tf.constant([9, 3, 2])))
    with tf.compat.v1.Session() as session:
      got_values, got_indices = session.run([gathered.values,
                                             gathered.indices])
  gathers = [op for op in graph.get_operations()
             if op.type == 'CollectiveGather']
  assert len(gathers) == 2  # The rows' count, then rows and indices.
  np.testing.assert_array_equal(got_values, values)
  np.testing.assert_array_equal(got_indices, indices)


@pytest.mark.fast
def test_the_server_keeps_virtual_cpus_and_leads_from_the_chief():
  session = tf.compat.v1.ConfigProto(device_count={'CPU': 3},
                                     intra_op_parallelism_threads=2)
  config = task_sync.server_config(
      session, {'chief': ['a:1'], 'worker': ['b:1']})
  assert config.device_count['CPU'] == 3
  assert config.intra_op_parallelism_threads == 2
  assert (config.experimental.collective_group_leader ==
          '/job:chief/replica:0/task:0')


def _counting_model_fn(features, labels, mode):
  """Counts the examples it sees in a mutable table while training."""
  counts = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)
  seen = tf.cast(tf.shape(features['x'])[:1], tf.float32)
  logits = tf.compat.v1.layers.dense(features['x'], 2)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  with tf.control_dependencies([counts.insert(
      tf.constant([0], tf.int64), counts.lookup(tf.constant([0], tf.int64))
      + seen)]):
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
def test_a_table_written_while_training_is_refused_in_a_cluster(
    monkeypatch):
  # Not a variable: no task would see the others' inserts.
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']},
       'task': {'type': 'worker', 'index': 0}}))
  with pytest.raises(ValueError, match='mutable lookup table.*drift apart'):
    helpers.build_replicated(_counting_model_fn, 2, aggregation='all_reduce')
  monkeypatch.delenv('TF_CONFIG')
  helpers.build_replicated(_counting_model_fn, 2, aggregation='all_reduce')


def _example_counter_model_fn(features, labels, mode):
  """Sums the labels seen in a variable: a write from the shard."""
  seen = tf.compat.v1.get_variable('seen', [], tf.float32,
                                   initializer=tf.zeros_initializer(),
                                   trainable=False)
  logits = tf.compat.v1.layers.dense(features['x'], 2)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  count = seen.assign_add(tf.reduce_sum(tf.cast(labels, tf.float32)))
  with tf.control_dependencies([count]):
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
def test_a_variable_written_from_the_shard_is_refused_in_a_cluster(
    monkeypatch):
  # Exact over one task's towers (they add up), but the chief's checkpoint
  # would hold only the chief's part of the sum.
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']},
       'task': {'type': 'chief', 'index': 0}}))
  with pytest.raises(ValueError, match='seen.*drift apart'):
    helpers.build_replicated(_example_counter_model_fn, 2,
                             aggregation='all_reduce')
  monkeypatch.delenv('TF_CONFIG')
  helpers.build_replicated(_example_counter_model_fn, 2,
                           aggregation='all_reduce')


def _dropout_model_fn(features, labels, mode):
  """A dense layer after dropout."""
  dropped = tf.compat.v1.layers.dropout(features['x'], 0.5, training=True)
  logits = tf.compat.v1.layers.dense(dropped, 2)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _dropout_seeds(monkeypatch, task_type, random_ops='per_tower'):
  """The seeds of the random ops the task's towers build, seed 7 set."""
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']},
       'task': {'type': task_type, 'index': 0}}))
  with tf.Graph().as_default() as graph:
    tf.compat.v1.set_random_seed(7)
    features = {'x': tf.zeros([6, 3])}
    estimator_towers.replicate_model_fn(
        _dropout_model_fn, aggregation='all_reduce', random_ops=random_ops)(
            features, tf.zeros([6], tf.int32), tf.estimator.ModeKeys.TRAIN, {},
            estimator_towers.make_run_config(cpu_devices=2))
  return {(op.get_attr('seed'), op.get_attr('seed2'))
          for op in graph.get_operations()
          if op.type == 'RandomUniform' and 'dropout' in op.name}


@pytest.mark.fast
def test_a_worker_draws_other_random_numbers_than_the_chief(monkeypatch):
  # One seed, one graph on every task: the worker's towers would repeat
  # the chief's dropout masks, where one process's 4 towers all differ.
  chief = _dropout_seeds(monkeypatch, 'chief')
  worker = _dropout_seeds(monkeypatch, 'worker')
  assert len(chief) == len(worker) == 2
  assert not chief & worker


@pytest.mark.fast
def test_one_devices_draws_take_the_chiefs_seeds_on_every_task(monkeypatch):
  # random_ops='one_device': every task draws one device's global masks
  # (and keeps its rows), so a worker keeps the chief's seeds.
  chief = _dropout_seeds(monkeypatch, 'chief', 'one_device')
  worker = _dropout_seeds(monkeypatch, 'worker', 'one_device')
  assert len(chief) == 1 and chief == worker


def _noise_model_fn(features, labels, mode):
  """Keeps a fresh random draw in a variable each step."""
  noise = tf.compat.v1.get_variable('noise', [5], tf.float32,
                                    initializer=tf.zeros_initializer(),
                                    trainable=False)
  logits = tf.compat.v1.layers.dense(features['x'] + noise, 2)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  with tf.control_dependencies([noise.assign(tf.random.normal([5]))]):
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.fast
def test_a_variable_written_from_random_numbers_is_refused_in_a_cluster(
    monkeypatch):
  # Each task draws its own numbers: the variables would drift apart.
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']},
       'task': {'type': 'chief', 'index': 0}}))
  with pytest.raises(ValueError, match='noise.*random numbers'):
    helpers.build_replicated(_noise_model_fn, 2, aggregation='all_reduce')
  # Dropout's draws reach the variables only through the summed gradients.
  helpers.build_replicated(_dropout_model_fn, 2, aggregation='all_reduce')
  monkeypatch.delenv('TF_CONFIG')
  helpers.build_replicated(_noise_model_fn, 2, aggregation='all_reduce')
