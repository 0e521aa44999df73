"""Sequence masks of sparse sequences, as wide as one device's."""

import numpy as np
import pytest
import tensorflow as tf

from helpers import assert_same_variables, make_estimator, seeded, variables_of

pytestmark = pytest.mark.training

tf1 = tf.compat.v1
LENGTHS = [3, 1, 2, 1, 1, 2, 1]  # Shards after the first are shorter.


def _input_fn():
  indices = [[row, k] for row, n in enumerate(LENGTHS) for k in range(n)]
  values = np.random.RandomState(2).rand(len(indices)).astype(np.float32)
  series = tf.SparseTensor(indices, values, [len(LENGTHS), 3])
  labels = tf.constant(np.arange(len(LENGTHS)) % 2, tf.float32)
  return tf.data.Dataset.from_tensors(({'series': series}, labels)).repeat()


def _lengths(series):
  """Each row's last index + 1, as the sequence feature columns count."""
  return tf.math.unsorted_segment_max(
      series.indices[:, 1] + 1, series.indices[:, 0],
      tf.cast(series.dense_shape[0], tf.int32))


def masked_gru_model_fn(features, labels, mode):
  """A GRU over densified sparse series, masked by tf.sequence_mask."""
  series = features['series']
  dense = tf.sparse.to_dense(series)[:, :, None]
  mask = tf.sequence_mask(_lengths(series))  # No maxlen: the longest's.
  state = tf.keras.layers.GRU(3, kernel_initializer=seeded(1),
                              recurrent_initializer=seeded(2))(dense,
                                                               mask=mask)
  logits = tf1.layers.dense(state, 1, kernel_initializer=seeded(3))[:, 0]
  loss = tf1.losses.sigmoid_cross_entropy(labels, logits)
  train_op = tf1.train.AdamOptimizer(0.05).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('towers', [2, 3])
def test_a_masked_recurrent_layer_over_sparse_series_equals_one_device(
    tmp_path, towers):
  # The mask was as wide as the shard's longest series, the series as wide
  # as the batch's: the GRU's loop failed on every tower but the first.
  trained = []
  for name, count in (('one', 1), ('many', towers)):
    estimator = make_estimator(masked_gru_model_fn, tmp_path / name, count)
    estimator.train(_input_fn, steps=3)
    trained.append(variables_of(estimator))
  assert_same_variables(*trained)

