"""Times building a canned Estimator's graph on towers against one device.

A canned head's spec carries many per-example outputs (logits, probabilities,
class ids, classes, ... and the export outputs that repeat them); on towers
each is put back in input order. This script calls the model_fn of a
`tf.estimator.DNNClassifier` (3 classes, a label vocabulary) once per mode in
a fresh graph: unwrapped on one device ("plain") and wrapped by
`replicate_model_fn` on N virtual CPU towers. Each round times every
(mode, towers) cell once in a shuffled order; the median over rounds is
shown, with the ratio to plain measured in the same run (the machine is
shared: only ratios compare between runs).

No timing is asserted anywhere: this prints figures and ratios only.

  .venv/bin/python bench/bench_canned_build.py            # ~1 minute
  .venv/bin/python bench/bench_canned_build.py --rounds=3 --towers=2
"""

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

import estimator_towers  # pylint: disable=g-import-not-at-top,wrong-import-position

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys
MODES = (ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT)
BATCH = 32


def _estimator() -> tf.estimator.Estimator:
  columns = [tf.feature_column.numeric_column('x', shape=[8])]
  return tf.estimator.DNNClassifier(
      hidden_units=[16, 16], feature_columns=columns, n_classes=3,
      label_vocabulary=['a', 'b', 'c'])


def build_seconds(model_fn, mode: str, towers: int) -> float:
  """Seconds of one model_fn call in `mode`, in a fresh graph."""
  config = estimator_towers.make_run_config(None, cpu_devices=max(towers, 1))
  with tf.Graph().as_default():
    tf1.train.get_or_create_global_step()
    # From an input_fn's dataset, as Estimator feeds it (placeholders
    # would be taken for a serving graph in PREDICT).
    data = tf.data.Dataset.from_tensors(
        ({'x': tf.zeros([BATCH, 8])}, tf.fill([BATCH, 1], 'a'))).repeat()
    features, labels = tf1.data.make_one_shot_iterator(data).get_next()
    if mode == ModeKeys.PREDICT:
      labels = None
    start = time.perf_counter()
    model_fn(features=features, labels=labels, mode=mode, config=config)
    return time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--towers', default='2,4',
                      help='Comma-separated tower counts to time.')
  args = parser.parse_args(argv)
  counts = [int(n) for n in args.towers.split(',')]
  canned = _estimator().model_fn
  wrapped = estimator_towers.replicate_model_fn(canned)

  def call(towers):  # 0: plain, the canned model_fn as Estimator calls it.
    return wrapped if towers else canned

  cells = [(m, n) for m in MODES for n in [0] + counts]
  times = {cell: [] for cell in cells}
  for mode, towers in cells:  # Warm-up: Python and TF caches.
    build_seconds(call(towers), mode, towers)
  rng = random.Random(0)
  for _ in range(args.rounds):
    order = list(cells)
    rng.shuffle(order)
    for mode, towers in order:
      times[(mode, towers)].append(
          build_seconds(call(towers), mode, towers))
  print(f'model_fn call of DNNClassifier (3 classes, vocabulary), batch '
        f'{BATCH}: median of {args.rounds} interleaved rounds')
  print('   mode  towers  seconds  vs plain')
  for mode in MODES:
    plain = statistics.median(times[(mode, 0)])
    print(f'{mode:>7s}   plain  {plain:7.3f}      1.00')
    for towers in counts:
      t = statistics.median(times[(mode, towers)])
      print(f'{mode:>7s}  {towers:>6d}  {t:7.3f}  {t / plain:8.2f}')


if __name__ == '__main__':
  main()
