"""Input time per step of one task: parse every row, or only its share.

In a synchronous cluster of W tasks each task trains on 1/W of the global
batch. The old train input_fn parsed the whole global batch on every task
and then kept the task's rows (`task_slice` after parsing); the new one
batches the raw records (CSV lines, image paths), keeps the task's rows and
parses only those. This times the chief's input pipeline alone (nothing
else runs in the step) for W = 1 (one process), 2 and 3 tasks, both ways:

  old   task_slice(source._examples(...).repeat().batch(B)): parse, slice
  new   source.train_input_fn(B)(config): slice, then parse the share
  read  the new pipeline without its parse: reading, shuffling, batching
        and slicing the raw records, which every task does for every row

Sources, written to a temporary directory first:

  csv    20,000 rows of 12 numeric and 2 categorical columns and a label
  image  an image folder of 600 PNGs of 96x96x3 in 2 classes, decoded and
         resized to 64x64x3

Each round opens a fresh session for every cell in turn (order rotated per
round, one pipeline alive at a time, so its buffers start empty), runs
--warmup steps, then times --steps steps; a cell's figure is the median
over rounds of its time per step.

  .venv/bin/python bench/bench_task_input.py            # ~3 min here
  .venv/bin/python bench/bench_task_input.py --quick    # smoke run

No figure is asserted: this prints a table and the new/old ratios.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

import input_fns  # pylint: disable=g-import-not-at-top,wrong-import-position
from estimator_towers.cluster.task_input import task_slice  # pylint: disable=g-import-not-at-top,wrong-import-position

tf1 = tf.compat.v1
SEED = 1
TASKS = (1, 2, 3)
PATHS = ('old', 'new', 'read')
COLOURS = ['red', 'green', 'blue', 'dark, grey']


def _write_csv(folder, rows):
  rng = np.random.RandomState(0)
  numbers = rng.randn(rows, 12)
  path = os.path.join(folder, 'train.csv')
  with open(path, 'w') as f:
    f.write(','.join([f'x{i}' for i in range(12)] +
                     ['colour', 'city', 'label']) + '\n')
    for i, row in enumerate(numbers):
      f.write(','.join(f'{v:.5f}' for v in row) +
              f',"{COLOURS[i % 4]}",c{i % 97},{i % 3}\n')
  return input_fns.csv_data([path], [path], label_column='label',
                            n_classes=3,
                            categorical_columns={'colour': COLOURS,
                                                 'city': 64})


def _write_images(folder, count):
  rng = np.random.RandomState(0)
  root = os.path.join(folder, 'photos')
  for i in range(count):
    class_dir = os.path.join(root, f'class{i % 2}')
    os.makedirs(class_dir, exist_ok=True)
    pixels = rng.randint(0, 256, (96, 96, 3), dtype=np.uint8)
    tf.io.write_file(os.path.join(class_dir, f'{i:05d}.png'),
                     tf.io.encode_png(pixels))
  return input_fns.image_folder_data(root, image_size=(64, 64),
                                     eval_fraction=0.1)


def _config(num_tasks):
  """Task 0's (the chief's) RunConfig of chief + num_tasks - 1 workers."""
  if num_tasks == 1:
    return None
  os.environ['TF_CONFIG'] = json.dumps({
      'cluster': {'chief': ['localhost:1'],
                  'worker': [f'localhost:{2 + i}'
                             for i in range(num_tasks - 1)]},
      'task': {'type': 'chief', 'index': 0}})
  try:
    return tf.estimator.RunConfig()
  finally:
    del os.environ['TF_CONFIG']


def _dataset(data, batch_size, num_tasks, path):
  config = _config(num_tasks)
  if path == 'new':
    return data.train_input_fn(batch_size, seed=SEED)(config)
  if path == 'read':
    records = data._unparsed('train', shuffle=True, seed=SEED).records  # pylint: disable=protected-access
    batches = records.repeat().batch(batch_size)
    return task_slice(batches, config).prefetch(tf.data.AUTOTUNE)
  examples = data._examples('train', shuffle=True, seed=SEED)  # pylint: disable=protected-access
  batches = examples.repeat().batch(batch_size)
  return task_slice(batches, config).prefetch(tf.data.AUTOTUNE)


class _Cell:
  """One source x task count x path: its graph, and its times per step."""

  def __init__(self, data, batch_size, num_tasks, path):
    self.graph = tf.Graph()
    with self.graph.as_default():
      dataset = _dataset(data, batch_size, num_tasks, path)
      self.next = tf1.data.make_one_shot_iterator(dataset).get_next()
    self.times = []

  def run(self, warmup, steps):
    with tf1.Session(graph=self.graph) as session:
      for _ in range(warmup):
        session.run(self.next)
      start = time.perf_counter()
      for _ in range(steps):
        session.run(self.next)
      self.times.append((time.perf_counter() - start) / steps)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--warmup', type=int, default=5)
  parser.add_argument('--quick', action='store_true',
                      help='1 round of 5 steps, smaller data')
  args = parser.parse_args()
  if args.quick:
    args.rounds, args.steps, args.warmup = 1, 5, 2
  with tempfile.TemporaryDirectory() as folder:
    start = time.perf_counter()
    sources = {
        'csv': (_write_csv(folder, 2_000 if args.quick else 20_000), 256),
        'image': (_write_images(folder, 100 if args.quick else 600), 48)}
    cells = {(name, tasks, path): _Cell(data, batch, tasks, path)
             for name, (data, batch) in sources.items()
             for tasks in TASKS for path in PATHS}
    print(f'data and graphs: {time.perf_counter() - start:.1f} s; '
          f'load average {os.getloadavg()[0]:.1f}', flush=True)
    keys = list(cells)
    for round_index in range(args.rounds):
      shift = round_index * 5 % len(keys)
      for key in keys[shift:] + keys[:shift]:
        cells[key].run(args.warmup, args.steps)
      print(f'round {round_index + 1}/{args.rounds} done, load average '
            f'{os.getloadavg()[0]:.1f}', flush=True)
  print(f'{"source":8}{"batch":>7}{"W":>3}{"rows/task":>11}'
        f'{"old ms":>10}{"new ms":>10}{"read ms":>10}{"new/old":>9}')
  for name, (_, batch) in sources.items():
    for tasks in TASKS:
      old, new, read = (
          statistics.median(cells[name, tasks, path].times) * 1e3
          for path in PATHS)
      print(f'{name:8}{batch:>7}{tasks:>3}{-(-batch // tasks):>11}'
            f'{old:>10.2f}{new:>10.2f}{read:>10.2f}{new / old:>9.2f}')

if __name__ == '__main__':
  main()
