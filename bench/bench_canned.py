"""Benchmarks a canned Estimator on N towers: replicate_model_fn vs MirroredStrategy.

The model is a canned DNNClassifier (784-1024-1024-10 on a numeric feature
column, the MLP of bench_towers.py), trained on the same synthetic in-memory
data with the same GLOBAL batch by:

  plain      the canned Estimator on one device
  replicate  tf.estimator.Estimator(trainer.replicate_model_fn(canned.model_fn))
             on N virtual CPU devices; input_fn batch = global batch
  mirrored   the canned Estimator with RunConfig(train_distribute=
             MirroredStrategy(N CPUs)); input_fn batch = global batch / N
             (MirroredStrategy's input_fn batch is per replica)

for both canned families: `v1` (tf.compat.v1.estimator.DNNClassifier, a
tf.compat.v1.train optimizer) and `v2` (tf.estimator.DNNClassifier, a Keras
optimizer). Measurements are interleaved as in bench_towers.py (each round
times every variant once, the variants of one family and tower count back to
back in a shuffled order) and the per-round ratios are reported. No timing is
asserted anywhere.

  .venv/bin/python bench/bench_canned.py            # full run, ~6 minutes
  .venv/bin/python bench/bench_canned.py --quick    # smoke run
"""

import argparse
import logging as py_logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

import bench_towers  # pylint: disable=g-import-not-at-top,wrong-import-position
import trainer  # pylint: disable=g-import-not-at-top,wrong-import-position

tf1 = tf.compat.v1
_NEVER = 10**9


def _canned(family, hidden, config):
  columns = [tf.feature_column.numeric_column(
      'x', shape=(bench_towers.INPUT_DIM,))]
  if family == 'v1':
    return tf1.estimator.DNNClassifier(
        hidden_units=list(hidden), feature_columns=columns,
        n_classes=bench_towers.NUM_CLASSES, config=config,
        optimizer=lambda: tf1.train.MomentumOptimizer(
            bench_towers.LEARNING_RATE, bench_towers.MOMENTUM))
  return tf.estimator.DNNClassifier(
      hidden_units=list(hidden), feature_columns=columns,
      n_classes=bench_towers.NUM_CLASSES, config=config,
      optimizer=lambda: tf.keras.optimizers.legacy.SGD(
          bench_towers.LEARNING_RATE, momentum=bench_towers.MOMENTUM))


class Variant(bench_towers.Variant):
  """One way to train a canned DNNClassifier (see the module docstring)."""

  def __init__(self, family, kind, towers, global_batch, hidden, root):
    # pylint: disable=super-init-not-called
    self.kind, self.towers, self.global_batch = kind, towers, global_batch
    self.name = f'{family}_{kind}' + ('' if kind == 'plain' else f'_{towers}')
    model_dir = os.path.join(root, self.name)
    settings = dict(tf_random_seed=bench_towers.SEED,
                    save_checkpoints_steps=_NEVER, save_checkpoints_secs=None,
                    save_summary_steps=_NEVER, log_step_count_steps=_NEVER,
                    keep_checkpoint_max=1)
    config = trainer.make_run_config(model_dir, cpu_devices=towers,
                                     **settings)
    input_batch = global_batch
    if kind == 'plain':
      self.estimator = _canned(family, hidden, config)
    elif kind == 'replicate':
      canned = _canned(family, hidden, config)
      self.estimator = tf.estimator.Estimator(
          trainer.replicate_model_fn(canned.model_fn), config=config)
    elif kind == 'mirrored':
      strategy = tf.distribute.MirroredStrategy(
          devices=[f'/cpu:{i}' for i in range(towers)])
      mirrored = tf.estimator.RunConfig(
          model_dir=model_dir, train_distribute=strategy,
          session_config=config.session_config, **settings)
      self.estimator = _canned(family, hidden, mirrored)
      input_batch = global_batch // towers
    else:
      raise ValueError(kind)
    self.input_fn = bench_towers.make_input_fn(input_batch)
    self.rates, self.loads = [], []


def run(args, root):
  """Warms every variant up, then times them interleaved for args.rounds."""
  groups = []
  for family in args.families:
    groups.append([Variant(family, 'plain', 1, args.global_batch,
                           args.hidden, root)])
    for n in args.towers:
      groups.append([Variant(family, kind, n, args.global_batch, args.hidden,
                             root) for kind in ('replicate', 'mirrored')])
  for group in groups:
    for v in group:
      t0 = time.perf_counter()
      v.warm_up(args.skip + 1)
      print(f'  warm-up {v.name:<18s} {time.perf_counter() - t0:6.1f} s',
            flush=True)
  rng = random.Random(bench_towers.SEED)
  for r in range(args.rounds):
    order = [list(g) for g in groups]
    rng.shuffle(order)
    cells = []
    for group in order:
      rng.shuffle(group)
      for v in group:
        rate = v.measure(args.steps, args.skip)
        cells.append(f'{v.name}={rate:,.0f} ({v.loads[-1]:.1f})')
    print(f'  round {r + 1}/{args.rounds} examples/s (load): ' +
          ', '.join(cells), flush=True)
  return [v for g in groups for v in g]


def report(variants):
  by_name = {v.name: v for v in variants}
  print('\nvariant                 median ex/s   min..max          load')
  for v in variants:
    print(f'{v.name:<22s} {v.median():>12,.0f}   '
          f'{min(v.rates):>7,.0f}..{max(v.rates):<7,.0f}  '
          f'{statistics.median(v.loads):5.2f}')
  print('\nreplicate / mirrored, same global batch: ratio of medians; '
        'median of per-round ratios (rounds)')
  for v in variants:
    if v.kind != 'replicate':
      continue
    m = by_name[v.name.replace('replicate', 'mirrored')]
    per_round = [a / b for a, b in zip(v.rates, m.rates)]
    print(f'  {v.name:<22s} {v.median() / m.median():6.3f}x  '
          f'{statistics.median(per_round):6.3f}x ({len(per_round)})')


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--rounds', type=int, default=6)
  p.add_argument('--steps', type=int, default=60)
  p.add_argument('--skip', type=int, default=10)
  p.add_argument('--global-batch', type=int, default=256)
  p.add_argument('--hidden', default='1024,1024')
  p.add_argument('--towers', default='2')
  p.add_argument('--families', default='v1,v2')
  p.add_argument('--quick', action='store_true',
                 help='2 rounds of 12 steps, hidden 128,128.')
  args = p.parse_args(argv)
  args.towers = [int(n) for n in args.towers.split(',') if n]
  args.hidden = tuple(int(n) for n in args.hidden.split(',') if n)
  args.families = [f for f in args.families.split(',') if f]
  if args.quick:
    args.rounds, args.steps, args.skip, args.hidden = 2, 12, 4, (128, 128)
  for n in args.towers:
    if args.global_batch % n:
      p.error(f'--global-batch {args.global_batch} must divide by {n} '
              '(MirroredStrategy takes a per-replica batch).')
  if args.steps <= args.skip:
    p.error('--steps must exceed --skip.')
  return args


def main(argv=None):
  args = parse_args(argv)
  warnings.filterwarnings('ignore')
  tf1.logging.set_verbosity(tf1.logging.ERROR)
  py_logging.getLogger('tensorflow').setLevel(py_logging.ERROR)
  print(f'TensorFlow {tf.__version__}; canned DNNClassifier 784-'
        f'{"-".join(map(str, args.hidden))}-10; rounds={args.rounds} '
        f'steps={args.steps} skip={args.skip} global_batch='
        f'{args.global_batch} towers={args.towers} families={args.families}',
        flush=True)
  t0 = time.perf_counter()
  root = tempfile.mkdtemp(prefix='bench_canned_')
  try:
    report(run(args, root))
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(f'\ntotal wall time {time.perf_counter() - t0:.0f} s')


if __name__ == '__main__':
  main()
