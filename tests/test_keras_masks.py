"""Keras' masked mean read as sum(l * m) / sum(m) (towers/keras_masks.py).

Training with it on towers equals one device in test_real_losses.py
(`keras_masked_sequence`, `keras_masked_weighted_sequence`); here, what is
recognised and what is still refused.
"""

import numpy as np
import pytest
import tensorflow as tf

from estimator_towers.towers import keras_masks
from helpers import build_replicated, loss_model_fn, seeded

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1
K = tf.keras
IDS = np.array([[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 1, 2]], np.int32)


def _tagger_loss(ids, reduction=K.losses.Reduction.AUTO, weights=None):
  """A per-token Keras loss over Embedding(mask_zero=True) outputs."""
  embedded = K.layers.Embedding(6, 4, mask_zero=True,
                                embeddings_initializer=seeded(7))(ids)
  out = K.layers.Dense(6, kernel_initializer=seeded(9))(embedded)
  return K.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=reduction)(ids, out, sample_weight=weights)


@pytest.mark.parametrize('static_batch', [False, True])
@pytest.mark.parametrize('weighted', [False, True])
def test_the_divisor_read_is_the_count_of_valid_tokens(static_batch,
                                                       weighted):
  # A static batch folds both tf.size calls into constants.
  with tf.Graph().as_default() as graph:
    ids = tf1.placeholder(tf.int32, [3 if static_batch else None, 4])
    weights = tf.cast(ids, tf.float32) + 0.5 if weighted else None
    loss = _tagger_loss(ids, weights=weights)
    mean = keras_masks.masked_mean(loss.op)
    assert mean is not None and mean.ratio == 1
    valid = mean.valid
    assert len(keras_masks.scalings(graph.get_operations())) == 1
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      assert session.run(valid, {ids: IDS}) == np.count_nonzero(IDS)


def test_other_reductions_and_plain_means_are_not_read_as_masked_means():
  with tf.Graph().as_default() as graph:
    ids = tf1.placeholder(tf.int32, [None, 4])
    summed = _tagger_loss(ids, reduction=K.losses.Reduction.SUM)
    per_token = tf.cast(ids, tf.float32)
    plain = tf.math.divide_no_nan(tf.reduce_sum(per_token * 2.0),
                                  tf.cast(tf.size(per_token), tf.float32))
    for loss in (summed, plain):
      assert keras_masks.masked_mean(loss.op) is None
    assert not keras_masks.scalings(graph.get_operations())


def _masked_mean_reused(reused):
  """Keras' masked mean written out, plus a second term of its scaled mask
  or of its weighted losses (which the mean's division does not cancel)."""

  def loss_of(x, y, logits, hidden):
    ids = tf.cast(tf.abs(x[:, :4]) * 3, tf.int32) % 3
    per_token = tf.matmul(tf.cast(ids, tf.float32), tf.ones([4, 4])) * (
        tf.reduce_sum(hidden, 1, keepdims=True))
    mask = tf.cast(tf.not_equal(ids, 0), tf.float32)
    scaled = mask * (tf.cast(tf.size(mask), tf.float32) /
                     tf.reduce_sum(mask))
    weighted = tf.square(per_token) * scaled
    mean = tf.math.divide_no_nan(tf.reduce_sum(weighted),
                                 tf.cast(tf.size(weighted), tf.float32))
    again = scaled * per_token if reused == 'scaled mask' else weighted
    return mean + 0.1 * tf.reduce_mean(again)

  return loss_of


@pytest.mark.parametrize('reused', ['scaled mask', 'weighted losses'])
def test_a_masked_mean_whose_parts_are_used_again_is_refused(reused):
  # The weighted losses reduced again: 0.0016-0.0054 off one device,
  # silently, when only the scaled mask's uses were checked.
  with pytest.raises(ValueError, match=r"with Size .*Keras .*reduction='sum'"):
    build_replicated(loss_model_fn(_masked_mean_reused(reused)), 2,
                     static_batch=False)
