"""Each task's part of the global batch in a synchronous cluster."""

import numpy as np
import pytest
import tensorflow as tf

from estimator_towers.cluster import task_input
from input_helpers import dataset_elements, task_config, task_configs

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1





@pytest.mark.parametrize('rows,tasks', [(9, 2), (9, 3), (10, 4), (1, 2),
                                        (2, 3), (6, 3)])
def test_task_rows_cover_the_batch_in_order_as_evenly_as_possible(rows,
                                                                  tasks):
  parts = [task_input.task_rows(rows, tasks, k) for k in range(tasks)]
  assert sum(count for _, count in parts) == rows
  assert [start for start, _ in parts] == list(
      np.cumsum([0] + [count for _, count in parts[:-1]]))
  counts = [count for _, count in parts]
  assert counts == sorted(counts, reverse=True)  # Larger parts first.
  assert max(counts) - min(counts) <= 1
  with tf.Graph().as_default(), tf1.Session() as session:
    dynamic = session.run([task_input.task_rows(tf.constant(rows), tasks, k)
                           for k in range(tasks)])
  assert [tuple(p) for p in dynamic] == parts


def test_tasks_parts_of_every_batch_add_up_to_it_last_and_empty_too(
    monkeypatch):
  # 19 rows in batches of 9 over a chief and a worker: parts 5+4, 5+4, 1+0.
  x = np.arange(19, dtype=np.float32).reshape(19, 1)
  ragged = [[i] * (i % 3) for i in range(19)]
  parts = []
  for config in task_configs(monkeypatch, workers=1):
    with tf.Graph().as_default():
      batches = tf.data.Dataset.from_tensor_slices(
          ({'x': x, 'r': tf.ragged.constant(ragged)}, np.arange(19))).batch(9)
      sparse = tf.data.Dataset.from_tensor_slices(tf.sparse.from_dense(
          np.eye(19, 4, dtype=np.int64))).batch(9)
      batches = tf.data.Dataset.zip((batches, sparse)).map(
          lambda xy, s: ({**xy[0], 's': s}, xy[1]))
      parts.append(dataset_elements(task_input.task_slice(batches, config)))
  chief, worker = parts
  assert [len(labels) for _, labels in chief] == [5, 5, 1]
  assert [len(labels) for _, labels in worker] == [4, 4, 0]
  for step, expected in enumerate([range(9), range(9, 18), range(18, 19)]):
    (cf, cl), (wf, wl) = chief[step], worker[step]
    assert list(np.concatenate([cl, wl])) == list(expected)
    assert list(np.concatenate([cf['x'], wf['x']])[:, 0]) == list(expected)
    assert cf['r'].to_list() + wf['r'].to_list() == [ragged[i]
                                                     for i in expected]
    dense = np.concatenate([tf1.SparseTensorValue(*v).dense_shape[:1]
                            for v in (cf['s'], wf['s'])])
    assert dense.sum() == len(expected)


def test_a_static_batch_keeps_static_parts(monkeypatch):
  config = task_config(monkeypatch, 'worker', 1, workers=2)  # Task 2 of 3.
  with tf.Graph().as_default():
    batches = tf.data.Dataset.range(20).batch(10, drop_remainder=True)
    part = task_input.task_slice(batches, config)
    assert part.element_spec.shape.as_list() == [3]
    assert [list(b) for b in dataset_elements(part)] == [[7, 8, 9], [17, 18, 19]]


@pytest.mark.parametrize('task_type,ps', [('worker', 1), ('evaluator', 0)])
def test_outside_a_synchronous_cluster_batches_are_kept_whole(monkeypatch,
                                                              task_type, ps):
  config = task_config(monkeypatch, task_type, 0, ps=ps)
  with tf.Graph().as_default():
    batches = tf.data.Dataset.range(5).batch(5)
    assert task_input.task_slice(batches, config) is batches
    assert task_input.task_slice(batches, None) is batches


def _nondeterministic():
  options = tf.data.Options()
  options.deterministic = False
  return options


@pytest.mark.parametrize('pipeline,error', [
    (lambda d: d.shuffle(10), 'has no seed'),
    (lambda d: d.map(lambda x: x + 1, num_parallel_calls=2,
                     deterministic=False), 'deterministic=False'),
    (lambda d: tf.data.Dataset.range(3).interleave(
        lambda _: d, num_parallel_calls=2, deterministic=False),
     'deterministic=False'),
    # A random subsample: each task kept its part of another stream (8 of
    # 104 rows trained twice in 8 steps, silently).
    (lambda d: d.filter(lambda x: tf.random.uniform([]) < 0.7),
     'draws random numbers without a seed'),
    # A shuffle inside a function (its seeds are inputs there): 19 of 104
    # rows trained twice.
    (lambda d: tf.data.Dataset.range(1).flat_map(lambda _: d.shuffle(10)),
     'draws random numbers without a seed'),
    # choose_from_datasets by choices drawn in a map.
    (lambda d: tf.data.Dataset.choose_from_datasets(
        [d, d.map(lambda x: x + 100)],
        tf.data.Dataset.range(10).map(lambda _: tf.random.uniform(
            [], maxval=2, dtype=tf.int64))),
     'draws random numbers without a seed'),
    # Non-determinism asked for in the options, not in an op's attribute.
    (lambda d: d.map(lambda x: x + 1, num_parallel_calls=2).with_options(
        _nondeterministic()), 'deterministic=False'),
    # The draw in a map, the choice in a later filter.
    (lambda d: d.map(lambda x: (x, tf.random.uniform([]))).filter(
        lambda x, r: r < 0.7).map(lambda x, r: x),
     'draws random numbers without a seed'),
])
def test_orders_left_to_chance_are_refused(monkeypatch, pipeline, error):
  config = task_config(monkeypatch)
  with tf.Graph().as_default():
    batches = pipeline(tf.data.Dataset.range(10)).batch(4)
    with pytest.raises(ValueError, match=error):
      task_input.task_slice(batches, config)


@pytest.mark.parametrize('op_seed,graph_seed', [
    (0, None),
    (None, 3),  # The RunConfig's tf_random_seed, as the Estimator sets.
])
def test_seeded_shuffles_are_accepted(monkeypatch, op_seed, graph_seed):
  # Accepted means sliced: every task draws the same order, so the chief's
  # and the worker's parts of each step make up the one global batch.
  def batches():
    return tf.data.Dataset.range(10).shuffle(10, seed=op_seed).batch(4)

  parts = []
  for config in task_configs(monkeypatch, workers=1):
    with tf.Graph().as_default() as graph:
      graph.seed = graph_seed
      parts.append(dataset_elements(task_input.task_slice(batches(), config)))
  with tf.Graph().as_default() as graph:
    graph.seed = graph_seed
    whole = dataset_elements(batches())
  chief, worker = parts
  assert [len(b) for b in chief] == [2, 2, 1]
  assert [len(b) for b in worker] == [2, 2, 1]
  assert [list(np.concatenate(p)) for p in zip(chief, worker)] == [
      list(b) for b in whole]
  assert sorted(np.concatenate(whole)) == list(range(10))


@pytest.mark.parametrize('pipeline', [
    # Augmentation: values change, the rows stay the same on every task.
    lambda d: d.map(lambda x: x + tf.cast(
        tf.random.uniform([], maxval=3, dtype=tf.int32), tf.int64)),
    lambda d: tf.data.Dataset.range(1).flat_map(
        lambda _: d.shuffle(10, seed=3)),
    # A seeded subsample chooses the same rows everywhere.
    lambda d: d.filter(lambda x: tf.random.uniform([], seed=4) < 0.7),
])
def test_draws_that_choose_no_row_or_are_seeded_are_accepted(monkeypatch,
                                                             pipeline):
  config = task_config(monkeypatch)
  with tf.Graph().as_default():
    batches = pipeline(tf.data.Dataset.range(10)).batch(4)
    assert task_input.task_slice(batches, config) is not batches


def test_examples_that_are_not_batched_are_refused(monkeypatch):
  # Slicing a single example would cut its features, not the batch.
  config = task_config(monkeypatch)
  with tf.Graph().as_default():
    examples = tf.data.Dataset.from_tensor_slices(
        ({'pixels': np.zeros([10, 64], np.float32)}, np.zeros([10])))
    with pytest.raises(ValueError, match='after Dataset.batch'):
      task_input.task_slice(examples, config)
