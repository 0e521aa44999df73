"""A loss that mixes the examples of its batch is refused, or made exact.

A loss whose negatives are the other examples of the batch (SimCLR's
NT-Xent over z1 @ z2^T, two-tower retrieval with in-batch negatives) per
tower sees only the tower's shard: it trained another model than one device,
silently (the two views' kernels ended 0.13 apart after 3 steps on 2
towers). It is refused while the graph is built, naming the op, whichever
way the pairs are made (a MatMul, a transposed operand, an einsum, a
broadcast); losses that keep examples apart (attention within an example,
per-example similarities, embedding lookups, batch norm) still build.
`estimator_towers.whole_batch` exchanges the towers' rows, and the NT-Xent
model trains what one device trains on 2 and 3 towers, uneven and idle
shards, both aggregations of the variables.
"""

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers
from helpers import build_replicated, seeded, train_in_session
import trainer

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys


def _views(features):
  """Two dense views of the input, L2-normalised: [rows, 4] each."""
  x = features['x']
  return [tf.math.l2_normalize(tf1.layers.dense(
      x, 4, kernel_initializer=seeded(seed), name=f'view{seed}'), 1)
          for seed in (1, 2)]


def _spec(mode, loss):
  train_op = tf1.train.MomentumOptimizer(0.5, 0.9).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _nt_xent(logits, labels):
  """Softmax cross entropy of each row against its own column, mean."""
  return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
      labels=labels, logits=logits / 0.5))


def _in_batch(pairs):
  """A model_fn whose loss is NT-Xent over pairs(z1, z2) [rows, rows]."""
  def model_fn(features, labels, mode):
    del labels
    z1, z2 = _views(features)
    rows = tf.shape(z1)[0]
    return _spec(mode, _nt_xent(pairs(z1, z2),
                                tf.one_hot(tf.range(rows), rows)))
  return model_fn


_MIXING = {
    'matmul_transpose_b': (
        lambda z1, z2: tf.matmul(z1, z2, transpose_b=True), 'MatMul'),
    'transposed_operand': (
        lambda z1, z2: tf.matmul(z1, tf.transpose(z2)), 'MatMul'),
    'einsum': (lambda z1, z2: tf.einsum('id,jd->ij', z1, z2), 'Einsum'),
    'broadcast_pairs': (
        lambda z1, z2: -tf.reduce_sum(tf.square(
            z1[:, None, :] - z2[None, :, :]), -1), 'Sub'),
}


@pytest.mark.parametrize('name', sorted(_MIXING))
def test_in_batch_negatives_are_refused_naming_the_op(name):
  pairs, op_type = _MIXING[name]
  with pytest.raises(ValueError) as raised:
    build_replicated(_in_batch(pairs), towers=2)
  message = str(raised.value)
  assert 'mixes the examples of its batch' in message
  assert f'{op_type} ' in message and 'whole_batch' in message
  assert '\n' not in message


def test_in_batch_negatives_are_refused_in_eval_too():
  pairs, _ = _MIXING['matmul_transpose_b']
  with pytest.raises(ValueError, match='mixes the examples'):
    build_replicated(_in_batch(pairs), towers=2, mode=ModeKeys.EVAL)


def _stacked_views(features, pairs):
  """SimCLR's layout: both views stacked along the rows, one projection
  for all, split back into the two views; loss over pairs(h1, h2)."""
  z1, z2 = _views(features)
  stacked = tf1.layers.dense(tf.concat([z1, z2], 0), 4,
                             kernel_initializer=seeded(7), name='head')
  h1, h2 = tf.split(tf.math.l2_normalize(stacked, 1), 2, 0)
  return pairs(h1, h2)


def test_in_batch_negatives_of_stacked_views_are_refused_as_such():
  # The split takes back the stacked views, each in shard order: refused
  # for pairing the shard's examples, not as a subset by position.
  def model_fn(features, labels, mode):
    del labels
    logits = _stacked_views(features, lambda h1, h2: tf.matmul(
        h1, h2, transpose_b=True))
    rows = tf.shape(logits)[0]
    return _spec(mode, _nt_xent(logits, tf.one_hot(tf.range(rows), rows)))

  with pytest.raises(ValueError, match='mixes the examples of its batch'):
    build_replicated(model_fn, towers=2)


def _own_views_of_stacked_rows(features, labels, mode):
  """Each example's two views compared with each other only."""
  del labels
  own = _stacked_views(features, lambda h1, h2: tf.reduce_sum(h1 * h2, 1))
  return _spec(mode, -tf.reduce_mean(own))


def _views_of_the_channels(pairs):
  """SimCLR's input layout: the views side by side in the channels, split
  apart, stacked along the rows, projected, split back."""
  def model_fn(features, labels, mode):
    del labels
    views = tf.split(features['x'][:, :4], 2, axis=1)
    stacked = tf1.layers.dense(tf.concat(views, 0), 3,
                               kernel_initializer=seeded(10), name='head')
    h1, h2 = tf.split(tf.math.l2_normalize(stacked, 1), 2, 0)
    return _spec(mode, pairs(h1, h2))
  return model_fn


def test_views_split_from_the_channels_keep_their_rows_on_any_batch():
  # The views' rows are the batch's, also where their number is unknown:
  # the split back is not a subset (it was, before 2026-11-28), and
  # in-batch negatives over them are refused for what they are.
  own = _views_of_the_channels(
      lambda h1, h2: -tf.reduce_mean(tf.reduce_sum(h1 * h2, 1)))
  build_replicated(own, towers=2, static_batch=False)
  negatives = _views_of_the_channels(lambda h1, h2: _nt_xent(
      tf.matmul(h1, h2, transpose_b=True),
      tf.one_hot(tf.range(tf.shape(h1)[0]), tf.shape(h1)[0])))
  with pytest.raises(ValueError, match='mixes the examples of its batch'):
    build_replicated(negatives, towers=2, static_batch=False)


def _vectorized_per_example(features, labels, mode):
  """Logits computed example by example with tf.vectorized_map, whose
  loop gathers every row by tf.range of the rows."""
  w = tf1.get_variable('w', [5, 2], initializer=seeded(8))
  logits = tf.vectorized_map(
      lambda row: tf.linalg.matvec(w, row, transpose_a=True), features['x'])
  return _spec(mode, tf1.losses.sparse_softmax_cross_entropy(labels, logits))


@pytest.mark.parametrize('towers', [2, 3])
def test_a_vectorized_map_over_the_examples_trains_as_one_device(towers):
  # Refused until 2026-11-28 on a batch of unknown size: "gathers along
  # axis 0 ... by position" (pfor's gather by tf.range(n) keeps every row).
  rng = np.random.RandomState(5)
  x = rng.randn(30, 5).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  _, one = train_in_session(_vectorized_per_example, x, y, 1, 10, 3)
  _, replicated = train_in_session(_vectorized_per_example, x, y, towers,
                                   10, 3)
  np.testing.assert_allclose(replicated['w'], one['w'], rtol=1e-5)


def test_a_gather_by_a_reversed_range_of_the_rows_is_refused():
  # Every row, but not in order: each shard reversed on its own.
  def model_fn(features, labels, mode):
    logits = tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(9))
    rows = tf.range(tf.shape(logits)[0])
    return _spec(mode, tf1.losses.sparse_softmax_cross_entropy(
        labels, tf.gather(logits, tf.reverse(rows, [0]))))

  with pytest.raises(ValueError, match="GatherV2 'GatherV2' gathers along "
                     'axis 0'):
    build_replicated(model_fn, towers=2, static_batch=False)


def _per_example_similarity(features, labels, mode):
  """Cosine similarity of each example's two views, and of each example's
  view with its own k candidates (a batched matmul per example)."""
  del labels
  z1, z2 = _views(features)
  candidates = tf.stack([z2, -z2, 2 * z2], 1)  # [rows, 3, 4]
  scores = tf.squeeze(tf.matmul(candidates, z1[:, :, None]), -1)
  own = tf.reduce_sum(z1 * z2, 1)
  return _spec(mode, tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
      labels=tf.one_hot(tf.zeros_like(own, tf.int32), 3), logits=scores))
               - tf.reduce_mean(own))


def _attention_within_examples(features, labels, mode):
  """[rows, heads, seq, seq] attention scores: examples stay apart."""
  x = tf.reshape(tf1.layers.dense(features['x'], 12,
                                  kernel_initializer=seeded(3)), [-1, 2, 3, 2])
  scores = tf.matmul(x, x, transpose_b=True)
  pooled = tf.reduce_mean(tf.matmul(tf.nn.softmax(scores), x), [1, 2])
  logits = tf1.layers.dense(pooled, 2, kernel_initializer=seeded(4))
  return _spec(mode, tf1.losses.sparse_softmax_cross_entropy(labels, logits))


def _lookup_and_batch_norm(features, labels, mode):
  """An embedding lookup of the labels and a batch-norm layer."""
  table = tf1.get_variable('table', [4, 5], initializer=seeded(5))
  x = features['x'] + tf.gather(table, labels % 4)
  x = tf1.layers.batch_normalization(x, training=mode == ModeKeys.TRAIN)
  logits = tf1.layers.dense(x, 2, kernel_initializer=seeded(6))
  return _spec(mode, tf1.losses.sparse_softmax_cross_entropy(labels, logits))


@pytest.mark.parametrize('model_fn', [
    _per_example_similarity, _attention_within_examples,
    _lookup_and_batch_norm, _own_views_of_stacked_rows])
def test_losses_that_keep_examples_apart_build(model_fn):
  _, spec = build_replicated(model_fn, towers=2)
  assert spec.loss is not None


def _whole_batch_nt_xent(features, labels, mode):
  """NT-Xent against every tower's z2 rows: one device's loss."""
  del labels
  z1, z2 = _views(features)
  rows, offset = estimator_towers.whole_batch(z2)
  logits = tf.matmul(z1, rows, transpose_b=True)
  targets = tf.one_hot(offset + tf.range(tf.shape(z1)[0]), tf.shape(rows)[0])
  return _spec(mode, _nt_xent(logits, targets))


@pytest.mark.parametrize('towers,aggregation,examples', [
    (2, 'global_loss', 21), (3, 'all_reduce', 21), (3, 'global_loss', 2)])
def test_whole_batch_trains_what_one_device_trains(towers, aggregation,
                                                   examples):
  # Batches of 7 split 4+3 and 3+2+2; 2 examples leave the third tower idle.
  x = np.random.RandomState(0).randn(examples, 5).astype(np.float32)
  y = np.zeros(examples, np.int32)
  batch = min(7, examples)
  _, one = train_in_session(_whole_batch_nt_xent, x, y, 1, batch, 3)
  _, replicated = train_in_session(_whole_batch_nt_xent, x, y, towers,
                                   batch, 3, aggregation=aggregation)
  assert sorted(one) == sorted(replicated)
  for name, value in one.items():
    np.testing.assert_allclose(replicated[name], value, rtol=1e-4, atol=1e-6,
                               err_msg=name)
  assert not np.allclose(one['view1/kernel'], _start_kernel(x, batch))


def _start_kernel(x, batch):
  start, _ = train_in_session(_whole_batch_nt_xent, x, np.zeros(len(x),
                                                                np.int32),
                              1, batch, 0)
  return start['view1/kernel']


def test_whole_batch_is_the_tensor_itself_outside_towers():
  with tf.Graph().as_default():
    z = tf.constant([[1.0], [2.0]])
    rows, offset = estimator_towers.whole_batch(z)
    with tf1.Session() as session:
      assert session.run(offset) == 0
      np.testing.assert_array_equal(session.run(rows), [[1.0], [2.0]])


def test_whole_batch_with_micro_batches_is_refused():
  with pytest.raises(ValueError, match='whole_batch is not available here: '
                     'with micro_batches > 1'):
    build_replicated(_whole_batch_nt_xent, towers=2, micro_batches=2)


def test_whole_batch_inside_a_cond_is_refused():
  def model_fn(features, labels, mode):
    del labels
    z1, z2 = _views(features)
    rows = tf.cond(tf.reduce_all(z2 > -2.0),
                   lambda: estimator_towers.whole_batch(z2).rows,
                   lambda: z2)
    return _spec(mode, tf.reduce_mean(tf.matmul(z1, rows, transpose_b=True)))

  with pytest.raises(ValueError, match=r'whole_batch\(.*\) is called inside '
                     'a tf.cond'):
    build_replicated(model_fn, towers=2)


def test_labels_broadcast_against_a_column_of_predictions_are_refused():
  # [batch] - [batch, 1] is [batch, batch]: one device averages every pair
  # of examples, a tower only its shard's pairs.
  def model_fn(features, labels, mode):
    predictions = tf1.layers.dense(features['x'], 1,
                                   kernel_initializer=seeded(7))
    return _spec(mode, tf.reduce_mean(tf.square(
        tf.cast(labels, tf.float32) - predictions)))

  with pytest.raises(ValueError, match='SquaredDifference|Sub .*reshape one'):
    build_replicated(model_fn, towers=2)


def _regression(loss_of):
  """y ~ x @ w + b by SGD on loss_of(predictions, labels, x)."""
  def model_fn(features, labels, mode):
    x = features['x']
    w = tf1.get_variable('w', [5, 2], initializer=seeded(1))
    b = tf1.get_variable('b', [2], initializer=tf1.zeros_initializer())
    loss = loss_of(tf.matmul(x, w) + b, labels, x)
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def _squares(p, l):
  if l.shape.rank == 1:  # build_replicated's class ids.
    l = tf.one_hot(l, 2)
  return tf.square(p - l)


_SUBSETS = {
    # Each trained silently on towers: a shard drops its own last row.
    'drop_last_row': (lambda p, l, x: tf.reduce_mean(_squares(p, l)[:-1]),
                      'StridedSlice'),
    'first_rows': (lambda p, l, x: tf.reduce_mean(_squares(p, l)[:2]),
                   'StridedSlice'),
    'smoothness': (lambda p, l, x: tf.reduce_mean(_squares(p, l)) + 0.1 *
                   tf.reduce_mean(tf.square(p[1:] - p[:-1])), 'StridedSlice'),
    'sorted_tail': (lambda p, l, x: tf.reduce_mean(
        tf.sort(tf.reduce_sum(_squares(p, l), 1))[1:]), 'StridedSlice'),
    'one_row': (lambda p, l, x: tf.reduce_mean(_squares(p, l)[0]),
                'StridedSlice'),
    'tf_slice': (lambda p, l, x: tf.reduce_mean(
        tf.slice(_squares(p, l), [1, 0], [-1, -1])), 'Slice'),
    # As many rows as a shard of the static batch of 10 holds (5 on 2
    # towers), or more, but fewer than one device's 10: every row of each
    # shard, some of one device's batch (with a batch of 6, [:3] and [:4]
    # trained 0.17 and 0.16 off one device in 3 steps, silently).
    'first_rows_of_a_shards_size': (lambda p, l, x: tf.reduce_mean(
        _squares(p, l)[:5]), 'StridedSlice'),
    'first_rows_beyond_a_shard': (lambda p, l, x: tf.reduce_mean(
        _squares(p, l)[:7]), 'StridedSlice'),
    'tf_slice_of_a_shards_size': (lambda p, l, x: tf.reduce_mean(
        tf.slice(_squares(p, l), [0, 0], [5, -1])), 'Slice'),
    'gather': (lambda p, l, x: tf.reduce_mean(
        tf.gather(_squares(p, l), [0, 1])), 'GatherV2'),
    'top_k': (lambda p, l, x: tf.reduce_mean(tf.math.top_k(
        tf.reduce_sum(_squares(p, l), 1), k=2).values), 'TopKV2'),
    # k a shard's rows, fewer than the batch's 10: each shard kept whole.
    'top_k_of_a_shards_size': (lambda p, l, x: tf.reduce_mean(tf.math.top_k(
        tf.reduce_sum(_squares(p, l), 1), k=5).values), 'TopKV2'),
    # The first row as a product (0.26 of the update off, silently).
    'first_row_by_product': (lambda p, l, x: tf.reduce_mean(tf.matmul(
        tf.one_hot([0], tf.shape(p)[0]), _squares(p, l))), 'MatMul'),
    'rows_weighted_by_position': (lambda p, l, x: tf.reduce_mean(tf.einsum(
        'i,ij->j', tf.cast(tf.range(tf.shape(p)[0]), tf.float32),
        _squares(p, l))), 'Einsum'),
    # A mask of the first rows by position: each shard's first 3, silently.
    'weights_of_positions': (lambda p, l, x: tf.reduce_mean(_squares(
        p, l) * tf.cast(tf.range(tf.shape(p)[0]) < 3, tf.float32)[:, None]),
                             'Less'),
    'mask_of_positions': (lambda p, l, x: tf.reduce_mean(tf.boolean_mask(
        _squares(p, l), tf.range(tf.shape(p)[0]) >= 1)), 'GreaterEqual'),
    # Parts of the rows by position: each shard's own parts (halves paired
    # trained silently off one device with a batch of unknown size).
    'split_parts_paired': (lambda p, l, x: tf.reduce_mean(tf.square(
        tf.split(p, 5)[0] - tf.split(p, 5)[1])), 'Split'),
    'split_first_part': (lambda p, l, x: tf.reduce_mean(
        tf.split(_squares(p, l), 5)[0]), 'Split'),
    'split_by_sizes': (lambda p, l, x: tf.reduce_mean(
        tf.split(_squares(p, l), [2, -1])[1]), 'SplitV'),
    'unstacked_rows': (lambda p, l, x: tf.reduce_mean(
        tf.unstack(_squares(p, l))[0]), 'Unpack'),
}


@pytest.mark.parametrize('ones', [
    lambda n: tf.ones([1, n]), lambda n: tf.fill([1, n], 0.5),
    lambda n: 2.0 * tf.ones([n, 1]) + 1.0,
    lambda n: tf.ones([1, n]) / tf.cast(n, tf.float32),
    # Through indexing, stop_gradient, a stack of one, a function of each
    # element (refused at first: adversary).
    lambda n: tf.ones([n])[None, :],
    lambda n: tf.stop_gradient(tf.stack([tf.sqrt(tf.fill([n], 4.0))])),
    lambda n: tf.math.reciprocal(tf.ones([1, 100])[:, :n])],
                         ids=['ones', 'fill', 'scaled', 'mean', 'indexed',
                              'stacked_sqrt', 'sliced_reciprocal'])
def test_a_sum_of_the_rows_as_a_product_builds(ones):
  # A uniform row vector sums the rows: each tower's sum is its share.
  def loss_of(p, l, x):
    squares = _squares(p, l)
    matrix = ones(tf.shape(p)[0])
    if matrix.shape[0] != 1:
      return tf.reduce_sum(tf.matmul(squares, matrix, transpose_a=True))
    return tf.reduce_sum(tf.matmul(matrix, squares))

  build_replicated(_regression(loss_of), towers=2, loss_reduction='sum')


@pytest.mark.parametrize('rows', [
    lambda e: e[:tf.shape(e)[0]], lambda e: e[:10], lambda e: e[:1000],
    lambda e: tf.slice(e, [0, 0], [tf.shape(e)[0], -1])],
                         ids=['own_rows', 'the_batchs_rows', 'beyond',
                              'slice_own_rows'])
def test_a_slice_of_every_row_builds(rows):
  # Every row on one device (a batch of 10) and on each 5-row shard.
  build_replicated(_regression(
      lambda p, l, x: tf.reduce_mean(rows(_squares(p, l)))), towers=2,
                   loss_reduction='mean')


@pytest.mark.parametrize('name', sorted(_SUBSETS))
def test_a_subset_of_rows_by_position_is_refused(name):
  loss_of, op_type = _SUBSETS[name]
  with pytest.raises(ValueError, match=f'keeps only some examples of its '
                     f'batch by their position: {op_type} .*tf.boolean_mask'):
    build_replicated(_regression(loss_of), towers=2, loss_reduction='mean')


@pytest.mark.parametrize('static_batch', [True, False])
def test_rows_weighed_by_their_position_are_refused(static_batch):
  # Each shard numbers its rows from 0: a loss weighing row i by i trained
  # silently off one device (found for train_op adds, adversary round 31).
  def loss_of(p, l, x):
    ranks = tf.cast(tf.range(tf.shape(p)[0]), tf.float32)
    return tf.reduce_mean(_squares(p, l) * ranks[:, None])
  with pytest.raises(ValueError, match='weighs examples by their position in '
                     "the batch: Mul .*Pass the position in as a feature"):
    build_replicated(_regression(loss_of), towers=2, loss_reduction='mean',
                     static_batch=static_batch)


def test_indices_built_from_positions_are_not_a_weighting():
  # The flattened index of each row's own label scales no row.
  def loss_of(p, l, x):
    rows = tf.range(tf.shape(p)[0])
    picked = tf.gather(tf.reshape(p, [-1]), rows * 2 + l)
    return tf.reduce_mean(tf.square(picked - 1.0))
  graph, spec = build_replicated(_regression(loss_of), towers=2,
                                 loss_reduction='mean')
  assert spec.train_op.graph is graph


_REORDERED = {
    # Each trained silently on towers: a shard paired its own rows.
    'mixup_reversed': (lambda p, l, x: tf.reduce_mean(_squares(
        0.7 * p + 0.3 * tf.reverse(p, [0]), l)), 'ReverseV2'),
    'rolled_negatives': (lambda p, l, x: tf.reduce_mean(_squares(p, l)) +
                         0.1 * tf.reduce_mean(p * tf.roll(p, 1, 0)), 'Roll'),
    'shuffled_partner': (lambda p, l, x: tf.reduce_mean(_squares(
        p, l) * tf.random.shuffle(x[:, :1], seed=3)), 'RandomShuffle'),
    # Mixup written as a product with a permutation matrix that holds no
    # example (0.42 of the update off on 2 towers, silently).
    'permutation_matmul': (lambda p, l, x: tf.reduce_mean(_squares(
        0.7 * p + 0.3 * tf.matmul(_reversal(p), p), l)), 'MatMul'),
    'reversed_eye_einsum': (lambda p, l, x: tf.reduce_mean(_squares(
        0.7 * p + 0.3 * tf.einsum('ij,jk->ik', tf.reverse(
            tf.eye(tf.shape(p)[0]), [0]), p), l)), 'Einsum'),
    # The permutation on the matrix's batch axis, its kept axis of size 1.
    'permutation_on_a_batch_axis': (lambda p, l, x: tf.reduce_mean(_squares(
        0.7 * p + 0.3 * tf.squeeze(tf.matmul(_reversal(p)[:, None, :],
                                             p[None]), 1), l)), 'MatMul'),
    # An einsum with an ellipsis (0.26-0.38 off on 2 towers, silently).
    'permutation_einsum_ellipsis': (lambda p, l, x: tf.reduce_mean(_squares(
        0.7 * p + 0.3 * tf.einsum('ij,j...->i...', _reversal(p), p), l)),
                                    'Einsum'),
    # A batched matmul over a leading batch of 1 made by a reshape, and back.
    'permutation_on_a_reshaped_batch': (lambda p, l, x: tf.reduce_mean(
        _squares(0.7 * p + 0.3 * tf.reshape(tf.matmul(
            _reversal(p)[None], tf.reshape(p, [1, -1, 2])), [-1, 2]), l)),
                                        'BatchMatMulV2'),
}


def test_a_permutation_written_as_a_broadcast_sum_is_refused():
  # P @ p as sum(P[:, :, None] * p[None], 1): each partner row is a sum over
  # the shard's rows (a statistic of the shard, shard_statistics).
  loss_of = lambda p, l, x: tf.reduce_mean(_squares(0.7 * p + 0.3 * (
      tf.reduce_sum(_reversal(p)[:, :, None] * p[None], 1)), l))
  with pytest.raises(ValueError, match=r'combines examples with a statistic '
                     r"of their batch: AddV2 .* with Sum .*statistic of the "
                     r"shard's rows"):
    build_replicated(_regression(loss_of), towers=2, loss_reduction='mean')


def _reversal(rows):
  """The one-hot matrix that reverses `rows`' rows."""
  count = tf.shape(rows)[0]
  return tf.one_hot(tf.reverse(tf.range(count), [0]), count)


@pytest.mark.parametrize('name', sorted(_REORDERED))
def test_rows_paired_by_position_are_refused(name):
  loss_of, op_type = _REORDERED[name]
  with pytest.raises(ValueError, match=f'pairs examples of its batch by '
                     f'their position: .* reordered by .*{op_type}.*'
                     'whole_batch'):
    build_replicated(_regression(loss_of), towers=2, loss_reduction='mean')


_REORDERED_ALIKE = {
    # Each example still meets its own label (refused by ce0c3be, which
    # told orders apart by the op that made them).
    'both_reversed': lambda p, l, x: tf.reduce_mean(_squares(
        tf.reverse(p, [0]), tf.reverse(l, [0]))),
    'both_rolled': lambda p, l, x: tf.reduce_mean(_squares(
        tf.roll(p, 1, 0), tf.roll(l, 1, 0))),
    'reversed_twice': lambda p, l, x: tf.reduce_mean(_squares(
        tf.reverse(tf.reverse(p, [0]), [0]), l)),
    'rolled_back': lambda p, l, x: tf.reduce_mean(_squares(
        tf.roll(tf.roll(p, 2, 0), -2, 0), l)),
    # Rows stacked after one another, not paired.
    'concat_along_rows': lambda p, l, x: tf.reduce_mean(tf.concat(
        [_squares(p, l), tf.reverse(_squares(p, l), [0])], 0)),
    # Equal along the rows: meets rows in any order.
    'times_ones_like': lambda p, l, x: tf.reduce_mean(
        tf.reverse(_squares(p, l), [0]) * tf.ones_like(l)),
    # Rows combined by a permutation matrix, then reduced on their own.
    'permuted_then_reduced': lambda p, l, x: tf.reduce_mean(_squares(
        p, l)) + 0.1 * tf.reduce_mean(tf.square(tf.matmul(_reversal(p), p))),
    # One permutation (built twice) for predictions and labels alike.
    'same_permutation_both': lambda p, l, x: tf.reduce_mean(tf.square(
        tf.matmul(_reversal(p), p) - tf.matmul(_reversal(p), l))),
    # Products with matrices of the examples' own values weigh each row.
    'diagonal_weights': lambda p, l, x: tf.reduce_mean(_squares(
        tf.matmul(tf.linalg.diag(tf.nn.sigmoid(x[:, 0])), p), l)),
    'row_scaled_eye': lambda p, l, x: tf.reduce_mean(_squares(tf.matmul(
        tf.nn.sigmoid(x[:, :1]) * tf.eye(tf.shape(p)[0]), p), l)),
}


@pytest.mark.parametrize('name', sorted(_REORDERED_ALIKE))
def test_rows_reordered_alike_train_as_one_device(name):
  rng = np.random.RandomState(0)
  x = rng.randn(48, 5).astype(np.float32)
  y = rng.randn(48, 2).astype(np.float32)
  model_fn = _regression(_REORDERED_ALIKE[name])
  start, _ = train_in_session(model_fn, x, y, 1, 6, 0)
  _, one = train_in_session(model_fn, x, y, 1, 6, 2, start=start)
  _, many = train_in_session(model_fn, x, y, 2, 6, 2, start=start,
                             loss_reduction='mean')
  for variable, value in one.items():
    np.testing.assert_allclose(many[variable], value, rtol=1e-5, atol=1e-6,
                               err_msg=variable)


def test_rows_gathered_by_a_mask_column_other_than_the_rows_are_refused():
  # tf.where of a [rows, 2] mask: column 1 holds positions on the other
  # axis, not the rows a mask kept.
  loss_of = lambda p, l, x: tf.reduce_mean(tf.gather(
      tf.reduce_sum(_squares(p, l), 1), tf.where(x[:, :2] > 0)[:, 1]))
  with pytest.raises(ValueError, match='keeps only some examples'):
    build_replicated(_regression(loss_of), towers=2, loss_reduction='mean')


def test_per_example_selections_train_as_one_device():
  # Other axes' slices, a full-range slice, a full sort and a boolean mask
  # by a per-example condition keep each example's term its own; so do a
  # reversal of the rows reduced on its own and a roll of another axis.
  def loss_of(p, l, x):
    squares = _squares(p, l)
    return (tf.reduce_mean(squares[:, 0]) + tf.reduce_mean(squares[..., 1:])
            + tf.reduce_mean(squares[:]) + tf.reduce_mean(
                tf.sort(tf.reduce_sum(squares, 1)))
            + tf.reduce_mean(tf.boolean_mask(squares, x[:, 0] > 0))
            # tf.boolean_mask by hand (refused before as a subset).
            + tf.reduce_mean(tf.gather(tf.reduce_sum(squares, 1),
                                       tf.where(x[:, 0] > 0)[:, 0]))
            + tf.reduce_mean(tf.reverse(squares, [0]))
            + tf.reduce_mean(_squares(tf.roll(p, 1, 1), l)))

  rng = np.random.RandomState(0)
  x = rng.randn(48, 5).astype(np.float32)
  x[:, 0] = np.tile([1, -1, 1, 1, -1, 1], 8)  # Both shards keep rows.
  y = rng.randn(48, 2).astype(np.float32)
  model_fn = _regression(loss_of)
  start, _ = train_in_session(model_fn, x, y, 1, 6, 0)
  _, one = train_in_session(model_fn, x, y, 1, 6, 3, start=start)
  _, many = train_in_session(model_fn, x, y, 2, 6, 3, start=start)
  for name, value in one.items():
    np.testing.assert_allclose(many[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_an_eval_loss_from_batch_statistics_names_the_eval_remedy():
  # Outside TRAIN the towers exchange no batch-norm moments: the message
  # told EVAL to use the batch-norm layer it already used.
  def model_fn(features, labels, mode):
    normalised = tf1.layers.batch_normalization(features['x'], training=True)
    logits = tf1.layers.dense(normalised, 2, kernel_initializer=seeded(1))
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    return tf.estimator.EstimatorSpec(mode, loss=loss)

  with pytest.raises(ValueError, match=r'(?s)outside TRAIN.*training=False '
                     'in EVAL and PREDICT'):
    build_replicated(model_fn, 2, mode=ModeKeys.EVAL)
