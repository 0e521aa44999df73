"""Splitting a global batch: sizes, order, every input kind, bad batches."""

import numpy as np
import pytest
import tensorflow as tf

from estimator_towers.towers import sharding

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1


def _run(fetches, feed_dict=None):
  with tf1.Session() as session:
    return session.run(fetches, feed_dict)


@pytest.mark.parametrize('batch,towers,expected', [
    (12, 4, [3, 3, 3, 3]), (10, 4, [3, 3, 2, 2]), (3, 4, [1, 1, 1, 0]),
    (1, 4, [1, 0, 0, 0]), (7, 3, [3, 2, 2])])
def test_shard_sizes_differ_by_at_most_one(batch, towers, expected):
  with tf.Graph().as_default():
    assert list(_run(sharding.shard_sizes(tf.constant(batch), towers))) == \
        expected


def _split(structure, towers, pad=False):
  leaves = sharding.named_leaves(structure, None)
  sizes = sharding.shard_sizes(sharding.global_batch_size(leaves), towers)
  return sharding.split_batch(structure, sizes, towers, pad)


def test_dense_nested_dict_shards_keep_input_order():
  with tf.Graph().as_default():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    ids = np.arange(10, dtype=np.int64)
    shards = _run(_split({'a': {'x': tf.constant(x)}, 'ids': tf.constant(ids)},
                         4))
  assert [len(s['ids']) for s in shards] == [3, 3, 2, 2]
  np.testing.assert_array_equal(np.concatenate([s['ids'] for s in shards]),
                                ids)
  np.testing.assert_array_equal(
      np.concatenate([s['a']['x'] for s in shards]), x)


def test_sparse_shards_rebase_rows_and_keep_width():
  with tf.Graph().as_default():
    sparse = tf.SparseTensor([[0, 0], [1, 2], [2, 1], [2, 3]],
                             [b'a', b'b', b'c', b'd'], [3, 4])
    shards = _run(_split({'s': sparse}, 4))
  assert [list(s['s'].dense_shape) for s in shards] == [
      [1, 4], [1, 4], [1, 4], [0, 4]]
  assert shards[1]['s'].indices.tolist() == [[0, 2]]
  assert shards[2]['s'].values.tolist() == [b'c', b'd']
  assert shards[3]['s'].values.size == 0


def test_ragged_and_bare_tensor_shards():
  with tf.Graph().as_default():
    ragged = tf.ragged.constant([[1], [2, 3], [], [4, 5, 6], [7]])
    shards = _run(_split((tf.range(5), ragged), 2))
  assert shards[0][0].tolist() == [0, 1, 2]
  assert shards[1][1].to_list() == [[4, 5, 6], [7]]


def test_padding_gives_idle_towers_a_copy_of_the_first_example():
  with tf.Graph().as_default():
    shards = _run(_split(tf.constant([[5.0], [6.0]]), 4, pad=True))
  assert [s.tolist() for s in shards] == [[[5.0]], [[6.0]], [[5.0]], [[5.0]]]


@pytest.mark.parametrize('pad', [False, True])
def test_a_scalar_feature_goes_whole_to_every_tower(pad):
  # One value per batch (one device sees it once per step), not a row.
  with tf.Graph().as_default():
    shards = _run(_split({'x': tf.zeros([3, 2]), 'scale': tf.constant(7.0)},
                         4, pad=pad))
  assert [shard['scale'] for shard in shards] == [7.0] * 4
  assert [len(shard['x']) for shard in shards] == (
      [1, 1, 1, 1] if pad else [1, 1, 1, 0])


def test_static_batch_sizes_that_differ_are_named():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"features\['a'\]: 4.*features\['b'\]: 5"):
      _split({'a': tf.zeros([4]), 'b': tf.zeros([5])}, 2)


def test_dynamic_batch_sizes_that_differ_fail_when_run():
  with tf.Graph().as_default():
    a = tf1.placeholder(tf.float32, [None])
    b = tf1.placeholder(tf.float32, [None])
    shards = _split({'a': a, 'b': b}, 2)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match='must share one batch size'):
      _run(shards, {a: np.zeros(4), b: np.zeros(5)})


def test_labels_must_match_features_batch():
  with tf.Graph().as_default():
    leaves = sharding.named_leaves({'x': tf.zeros([4, 1])}, tf.zeros([3]))
    with pytest.raises(ValueError, match='labels: 3'):
      sharding.global_batch_size(leaves)


def test_non_tensor_leaf_is_a_type_error():
  with tf.Graph().as_default():
    with pytest.raises(TypeError, match=r"features\['n'\] is a object"):
      _split({'x': tf.zeros([2]), 'n': object()}, 2)


def test_python_and_numpy_scalars_go_whole_to_every_tower():
  # tf.estimator hands an input_fn's Python values to the model_fn as they
  # are; one value for the whole batch is every tower's.
  scalars = {'n': 3, 'name': 'abc', 'f': np.float32(2.5), 'a': np.array(7)}
  with tf.Graph().as_default():
    shards = _split({'x': tf.zeros([5, 2]), **scalars}, 2)
  for shard in shards:
    assert {key: shard[key] for key in scalars} == scalars


def test_nested_lists_of_python_values_are_split_like_arrays():
  # tf.estimator's head tests feed labels [[b'iroh'], [b'iroh']], which the
  # head converts to a [2, 1] string Tensor: a batch of 2.
  labels = [[b'iroh'], [b'aang'], [b'iroh']]
  with tf.Graph().as_default():
    features = sharding.with_array_rows_as_tensors(
        {'x': np.zeros([3, 1], np.float32), 'w': [1., 2., 3.],
         'ragged': ([1, 2], [3])})
    labels = sharding.with_array_rows_as_tensors(labels)
    assert isinstance(labels, tf.Tensor) and labels.shape == [3, 1]
    assert isinstance(features['w'], tf.Tensor)
    assert isinstance(features['ragged'][1], tf.Tensor)  # Its own array.
    sizes = sharding.shard_sizes(tf.constant(3), 2)
    shards = sharding.split_batch(labels, sizes, 2, pad_empty=False)
    values = _run(shards)
  assert [v.tolist() for v in values] == [[[b'iroh'], [b'aang']], [[b'iroh']]]


def test_numpy_arrays_with_rows_are_split_like_tensors():
  x = np.arange(10, dtype=np.float32).reshape(5, 2)
  with tf.Graph().as_default():
    features = sharding.with_array_rows_as_tensors({'x': x, 'c': np.array(1)})
    assert sharding.has_batch(features, None)
    shards = _split(features, 2)
    assert all(shard['c'] == 1 for shard in shards)
    values = _run([shard['x'] for shard in shards])
  np.testing.assert_array_equal(np.concatenate(values), x)


def test_padding_gives_an_empty_batch_one_zero_row_of_every_kind():
  # A task of a synchronous cluster whose part of a small last global batch
  # is nothing has no example to copy.
  with tf.Graph().as_default():
    dense = tf1.placeholder(tf.float32, [None, 2])
    words = tf1.placeholder(tf.string, [None])
    sparse = tf1.sparse_placeholder(tf.int64, [None, 3])
    ragged = tf.RaggedTensor.from_row_lengths(
        tf1.placeholder(tf.int32, [None]), tf1.placeholder(tf.int64, [None]))
    shards = _split({'x': dense, 'w': words, 's': sparse, 'r': ragged}, 2,
                    pad=True)
    feed = {dense: np.zeros([0, 2]), words: np.zeros([0], object),
            sparse: tf1.SparseTensorValue(np.zeros([0, 2], np.int64),
                                          np.zeros([0], np.int64), [0, 3]),
            ragged.values: np.zeros([0]), ragged.row_lengths(): []}
    values = _run(shards, feed)
  for shard in values:
    assert shard['x'].tolist() == [[0.0, 0.0]]
    assert shard['w'].tolist() == [b'']
    assert list(shard['s'].dense_shape) == [1, 3] and shard['s'].values.size == 0
    assert shard['r'].to_list() == [[]]


def _scaled_model_fn(features, labels, mode):
  """A dense regression scaled by an optional per-batch scalar feature."""
  features = features or {}
  x = features.get('x', tf.ones_like(labels)[:, None])
  if 'scale' in features:
    x = x * features['scale']
  predictions = tf.compat.v1.layers.dense(
      x, 1, kernel_initializer=tf.compat.v1.constant_initializer(0.1))
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions[:, 0])
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _trained_kernel(input_fn, towers, tmp_path):
  import estimator_towers  # pylint: disable=g-import-not-at-top
  model_fn = _scaled_model_fn
  if towers > 1:
    model_fn = estimator_towers.replicate_model_fn(model_fn)
  estimator = tf.estimator.Estimator(
      model_fn, config=estimator_towers.make_run_config(
          str(tmp_path / str(towers)), cpu_devices=towers))
  estimator.train(input_fn, steps=3)
  return estimator.get_variable_value('dense/kernel')


@pytest.mark.parametrize('features', ['scalar', 'static_batch', 'none',
                                      'numpy'])
def test_a_per_batch_scalar_or_no_features_train_as_one_device(tmp_path,
                                                                 features):
  # A scalar is every tower's whole; without features, labels are split;
  # numpy arrays are split as Tensors, a Python scalar goes whole.
  rng = np.random.RandomState(0)
  x, y = rng.randn(20, 3).astype(np.float32), rng.randn(20).astype(np.float32)

  def input_fn():
    if features == 'none':
      return None, tf.constant(y[:7])
    if features == 'numpy':
      return {'x': x[:7], 'scale': 2.0}, y[:7]
    # With a static batch, the scalar (sorted first) once hid the shard's
    # static rows from the loss analysis: the mean was refused.
    data = tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(
        7, drop_remainder=features == 'static_batch')
    return data.map(lambda f, l: (dict(f, scale=tf.constant(2.0)), l))

  expected = _trained_kernel(input_fn, 1, tmp_path)
  for towers in (2, 3):
    np.testing.assert_allclose(_trained_kernel(input_fn, towers, tmp_path),
                               expected, rtol=1e-5, atol=1e-7,
                               err_msg=f'{towers}')


def _batch_free_model_fn(calls):
  """A regression on Python scalar features and labels (no batch at all)."""

  def model_fn(features, labels, mode):
    calls.append(mode)
    x = tf.fill([4, 1], features['x'])
    predictions = tf.compat.v1.layers.dense(
        x, 1, kernel_initializer=tf.compat.v1.constant_initializer(0.1))
    loss = tf.reduce_mean(tf.square(predictions - labels))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(1e-4).minimize(
        loss, tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def test_python_scalars_without_a_batch_run_the_model_fn_once(tmp_path):
  # tf.estimator's own tests feed ({'x': 42.}, 44.): there is nothing to
  # split, and one call is one device's step (a second would repeat it).
  import estimator_towers  # pylint: disable=g-import-not-at-top
  kernels = []
  for towers in (1, 2):
    calls = []
    model_fn = _batch_free_model_fn(calls)
    if towers > 1:
      model_fn = estimator_towers.replicate_model_fn(model_fn)
    estimator = tf.estimator.Estimator(
        model_fn, config=estimator_towers.make_run_config(
            str(tmp_path / str(towers)), cpu_devices=towers))
    estimator.train(lambda: ({'x': 42.}, 44.), steps=3)
    assert calls == [tf.estimator.ModeKeys.TRAIN]
    kernels.append(estimator.get_variable_value('dense/kernel'))
  np.testing.assert_allclose(kernels[1], kernels[0], rtol=1e-6)
  assert abs(kernels[0].item() - 0.1) > 1e-3  # It trained.


def test_batch_free_input_with_micro_batches_is_refused():
  import estimator_towers  # pylint: disable=g-import-not-at-top
  model_fn = estimator_towers.replicate_model_fn(
      _batch_free_model_fn([]), micro_batches=2)
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    with pytest.raises(ValueError, match='no feature or label with a batch.*'
                       'micro_batches splits a batch'):
      model_fn({'x': 42.}, 44., tf.estimator.ModeKeys.TRAIN,
               config=estimator_towers.make_run_config(cpu_devices=2))


def test_only_scalars_have_nothing_to_split():
  with pytest.raises(ValueError, match='no feature or label with a batch'):
    sharding.global_batch_size(
        sharding.named_leaves({'scale': tf.constant(2.0)}, None))


@pytest.mark.fast
def test_int_and_str_feature_keys_split_as_tf_estimator_allows_them():
  # tf.estimator takes any dict key; tf.nest cannot sort 42 with 'b'.
  with tf.Graph().as_default():
    features = {42: tf.reshape(tf.range(10), [5, 2]), 'b': tf.range(5)}
    sizes = sharding.shard_sizes(tf.constant(5), 2)
    shards = sharding.split_batch(features, sizes, 2, pad_empty=False)
    assert [sorted(s, key=str) for s in shards] == [[42, 'b']] * 2
    with tf.compat.v1.Session() as session:
      first, second = session.run(shards)
  np.testing.assert_array_equal(first[42], [[0, 1], [2, 3], [4, 5]])
  np.testing.assert_array_equal(second['b'], [3, 4])


def test_lists_without_a_batch_reach_the_model_fn_as_they_are():
  # tf.estimator's own tests compare what the model_fn received with what
  # the input_fn returned: with no batch beside them, lists stay lists.
  import estimator_towers  # pylint: disable=g-import-not-at-top
  given = ({'test-features': [[1], [1]]}, {'test-labels': [[1], [1]]})
  received = []

  def model_fn(features, labels, mode):
    received.append((features, labels))
    step = tf.compat.v1.train.get_or_create_global_step()
    return tf.estimator.EstimatorSpec(mode, loss=tf.constant(0.0),
                                      train_op=step.assign_add(1))

  with tf.Graph().as_default():
    estimator_towers.replicate_model_fn(model_fn)(
        *given, tf.estimator.ModeKeys.TRAIN,
        config=estimator_towers.make_run_config(cpu_devices=2))
  assert len(received) == 1
  assert received[0][0] is given[0] and received[0][1] is given[1]
