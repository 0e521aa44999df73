"""What the first-batch checks cost `estimator.predict` and `train`.

A prediction or a training loss the graph walk cannot follow (here a Keras
LSTM's while loop) makes replicate_model_fn build the model_fn once more, on
the whole batch, and run that copy on the first batch (see prediction_audit
and first_step_check). This times one `Estimator.predict` over the whole
input from one checkpoint (`--mode=predict`), or one `Estimator.train` of
`--batches` steps from scratch (`--mode=train`), on 2 virtual CPU towers
with `check_first_batch=True` and `False`, and unwrapped on one device for
scale. Each round runs every variant once in a shuffled order (the machine
is shared: only ratios measured side by side mean anything); it prints per
round and the medians, with two times per variant:

  first       from the call to its first row (predict) or to the end of its
              first step (train): graph build, session start and the first
              batch (the check's whole cost lands here);
  total       the whole call.

No timing is asserted anywhere.

  .venv/bin/python bench/bench_prediction_check.py            # ~2 min
  .venv/bin/python bench/bench_prediction_check.py --mode=train
  .venv/bin/python bench/bench_prediction_check.py --rounds=2 --batches=5
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

import estimator_towers  # pylint: disable=g-import-not-at-top,wrong-import-position

tf1 = tf.compat.v1
_STEPS, _FEATURES, _UNITS = 20, 8, 64


def _model_fn(features, labels, mode):
  sequence = tf.reshape(features['x'], [-1, _STEPS, _FEATURES])
  h = tf.keras.layers.LSTM(_UNITS)(sequence)
  logits = tf.keras.layers.Dense(2)(h)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf1.train.GradientDescentOptimizer(0.01).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _config(model_dir: str, devices: int):
  return estimator_towers.make_run_config(model_dir, cpu_devices=devices)


def _timed(estimator, input_fn):
  start = time.perf_counter()
  rows = estimator.predict(input_fn)
  next(rows)
  first = time.perf_counter() - start
  count = 1 + sum(1 for _ in rows)
  return first, time.perf_counter() - start, count


class _FirstStepTime(tf1.train.SessionRunHook):
  """Records when the first training step has run."""

  def __init__(self):
    self.finished = None

  def after_run(self, run_context, run_values):
    if self.finished is None:
      self.finished = time.perf_counter()


def _timed_training(estimator, input_fn, steps):
  start, first = time.perf_counter(), _FirstStepTime()
  estimator.train(input_fn, steps=steps, hooks=[first])
  return first.finished - start, time.perf_counter() - start, steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--batches', type=int, default=20)
  parser.add_argument('--batch-size', type=int, default=256)
  parser.add_argument('--mode', choices=('predict', 'train'),
                      default='predict')
  args = parser.parse_args()
  tf1.logging.set_verbosity(tf1.logging.ERROR)
  rows = args.batches * args.batch_size
  x = np.random.RandomState(0).randn(rows, _STEPS * _FEATURES).astype(
      np.float32)
  model_dir = tempfile.mkdtemp(prefix='bench_prediction_check_')
  tf.estimator.Estimator(_model_fn, config=_config(model_dir, 1)).train(
      lambda: tf.data.Dataset.from_tensors(
          ({'x': x[:8]}, np.zeros(8, np.int32))), steps=1)

  def input_fn():
    return tf.data.Dataset.from_tensor_slices({'x': x}).batch(args.batch_size)

  def train_input_fn():
    labels = (x[:, 0] > 0).astype(np.int32)
    return tf.data.Dataset.from_tensor_slices(({'x': x}, labels)).batch(
        args.batch_size)

  variants = {
      'checked': estimator_towers.replicate_model_fn(
          _model_fn, check_first_batch=True),
      'unchecked': estimator_towers.replicate_model_fn(
          _model_fn, check_first_batch=False),
      'one_device': _model_fn,
  }
  times = {name: [] for name in variants}
  print(f'{args.mode}: {args.batches} batches of {args.batch_size}, '
        f'LSTM({_UNITS}) over {_STEPS} steps, 2 towers (one_device: 1)')
  for round_index in range(args.rounds):
    order = list(variants)
    random.Random(round_index).shuffle(order)
    for name in order:
      devices = 1 if name == 'one_device' else 2
      if args.mode == 'predict':
        estimator = tf.estimator.Estimator(
            variants[name], config=_config(model_dir, devices))
        first, total, count = _timed(estimator, input_fn)
        assert count == rows, (name, count)
      else:
        estimator = tf.estimator.Estimator(
            variants[name], config=_config(tempfile.mkdtemp(), devices))
        first, total, _ = _timed_training(estimator, train_input_fn,
                                          args.batches)
      times[name].append((first, total))
    print(f'round {round_index + 1}: ' + ', '.join(
        f'{n} {times[n][-1][0]:.2f}/{times[n][-1][1]:.2f} s' for n in order))
  print(f'{"variant":>12} {"first s":>12} {"total s":>9} '
        f'{"first vs unchecked":>19} {"total vs unchecked":>19}')
  base = [statistics.median(t[i] for t in times['unchecked'])
          for i in (0, 1)]
  for name, pairs in times.items():
    first = statistics.median(t[0] for t in pairs)
    total = statistics.median(t[1] for t in pairs)
    print(f'{name:>12} {first:12.2f} {total:9.2f} {first / base[0]:19.2f} '
          f'{total / base[1]:19.2f}')


if __name__ == '__main__':
  main()
