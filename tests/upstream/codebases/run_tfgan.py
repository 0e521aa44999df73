"""TF-GAN's GANEstimator model_fn, unchanged, on one device and on towers.

Needs tensorflow-gan 2.1.0 and tensorflow-probability 0.23.0 (TF 2.15's)
on PYTHONPATH, installed apart from the project (see
docs/compatibility_codebases.md):

  PYTHONPATH=/tmp/h8gan:tests/upstream/codebases \
      .venv/bin/python tests/upstream/codebases/run_tfgan.py

The GAN is tiny (a 2-layer generator with batch norm, whose update ops
TF-GAN checks by scope; a 2-layer discriminator), Wasserstein losses, Adam
for both; data are fixed in-memory arrays (noise in, 'real' data as labels),
so nothing random runs inside the model_fn. Python 3.11 lacks
`inspect.getargspec`, which tensorflow-gan 2.1.0 calls: a shim below.
"""

import collections
import inspect

import numpy as np
import tensorflow as tf

# tensorflow-gan 2.1.0 (its last release, 2021) calls inspect.getargspec,
# which Python 3.11 removed; the shim gives it the old answer. This is the
# only change to the environment, and it is outside our library.
_ArgSpec = collections.namedtuple('ArgSpec',
                                  ['args', 'varargs', 'keywords', 'defaults'])
if not hasattr(inspect, 'getargspec'):
  inspect.getargspec = lambda fn: _ArgSpec(*inspect.getfullargspec(fn)[:4])

import tensorflow_gan as tfgan  # pylint: disable=g-import-not-at-top,wrong-import-position

import harness

tf1 = tf.compat.v1
BATCH = 12


def generator_fn(noise, mode):
  hidden = tf1.layers.dense(noise, 8, name='g_hidden')
  hidden = tf1.layers.batch_normalization(
      hidden, training=mode == tf.estimator.ModeKeys.TRAIN, name='g_bn')
  return tf1.layers.dense(tf.nn.relu(hidden), 3, name='g_out')


def discriminator_fn(data, unused_conditioning):
  hidden = tf1.layers.dense(data, 8, activation=tf.nn.relu, name='d_hidden')
  return tf1.layers.dense(hidden, 1, name='d_out')


def eval_metrics_fn(gan_model):
  return {'generated_mean': tf1.metrics.mean(gan_model.generated_data),
          'real_mean': tf1.metrics.mean(gan_model.real_data)}


def _data():
  rng = np.random.RandomState(0)
  noise = rng.normal(size=(48, 4)).astype(np.float32)
  real = (rng.normal(size=(48, 3)) * 0.5 + 1.0).astype(np.float32)
  return noise, real


def train_input_fn():
  noise, real = _data()
  return tf.data.Dataset.from_tensor_slices((noise, real)).repeat().batch(
      BATCH)


def eval_input_fn():
  noise, real = _data()
  return tf.data.Dataset.from_tensor_slices((noise, real)).batch(BATCH)


def predict_input_fn():
  noise, _ = _data()
  return tf.data.Dataset.from_tensor_slices(noise).batch(BATCH)


def main():
  gan = tfgan.estimator.GANEstimator(
      generator_fn=generator_fn,
      discriminator_fn=discriminator_fn,
      generator_loss_fn=tfgan.losses.wasserstein_generator_loss,
      discriminator_loss_fn=tfgan.losses.wasserstein_discriminator_loss,
      generator_optimizer=tf1.train.AdamOptimizer(0.01, 0.5),
      discriminator_optimizer=tf1.train.AdamOptimizer(0.01, 0.5),
      get_eval_metric_ops_fn=eval_metrics_fn)
  # The Estimator's own model_fn (GANEstimator builds it in __init__) is
  # what a user of replicate_model_fn wraps.
  harness.run_all('tfgan', gan.model_fn, train_input_fn, eval_input_fn,
                  predict_input_fn, params=None, steps=5, eval_steps=4)


if __name__ == '__main__':
  main()
