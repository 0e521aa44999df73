"""Trains a small classifier on virtual CPU towers and prints its metrics.

    python -m trainer.demo --towers=2 --steps=300

The data are embedded (generated from a fixed seed), so it needs no download.
"""

import os
import tempfile

# Keep TensorFlow's C++ start-up chatter out of the demo's output.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from absl import logging
import tensorflow as tf

import trainer
from input_fns import synthetic
from model_fns import dnn

FLAGS = flags.FLAGS
flags.DEFINE_integer('towers', 2, 'Virtual CPU devices, one tower each.',
                     lower_bound=1)
flags.DEFINE_integer('steps', 300, 'Training steps.', lower_bound=1)
flags.DEFINE_integer('batch_size', 64, 'Global batch, split across towers.',
                     lower_bound=1)
flags.DEFINE_string('model_dir', None,
                    'Checkpoint directory; a new temporary one by default.')


def main(argv):
  del argv  # Unused.
  tf.get_logger().setLevel('ERROR')
  model_dir = FLAGS.model_dir or tempfile.mkdtemp(prefix='towers_demo_')
  x, y = synthetic.gaussian_blobs()
  train_x, train_y, eval_x, eval_y = x[:1536], y[:1536], x[1536:], y[1536:]
  config = trainer.make_run_config(model_dir, cpu_devices=FLAGS.towers,
                                   tf_random_seed=1)
  estimator = tf.estimator.Estimator(
      trainer.replicate_model_fn(dnn.dnn_model_fn), config=config,
      params={'n_classes': 4, 'hidden_units': [32, 16],
              'learning_rate': 0.05, 'optimizer': 'adagrad'})
  estimator.train(synthetic.arrays_input_fn(
      train_x, train_y, FLAGS.batch_size, shuffle=True, repeat=True),
                  steps=FLAGS.steps)
  metrics = estimator.evaluate(synthetic.arrays_input_fn(
      eval_x, eval_y, FLAGS.batch_size))
  logging.info('model_dir: %s', model_dir)
  print(f'towers={FLAGS.towers} global_step={metrics["global_step"]} '
        f'loss={metrics["loss"]:.4f} accuracy={metrics["accuracy"]:.4f} '
        f'model_dir={model_dir}')


if __name__ == '__main__':
  app.run(main)
