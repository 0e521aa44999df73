"""What normalising with the global batch's moments costs (global_batch_norm).

ResNet-20 (19 batch-norm layers, fused) on 2 virtual CPU towers, trained
from the same start with batch_norm='global' (the default: one collective
per batch-norm call and tower, and one for its gradient) and
batch_norm='per_tower' (each tower its shard's moments). Each round builds
both graphs and runs both in a shuffled order, seconds apart; the medians
over rounds and the per-round ratios are printed. Nothing is asserted.

  .venv/bin/python bench/bench_batch_norm.py            # ~2 minutes
  .venv/bin/python bench/bench_batch_norm.py --rounds=1 --steps=3  # smoke
"""

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

import estimator_towers
from model_fns.resnet import resnet_model_fn

tf1 = tf.compat.v1
_PARAMS = dict(resnet_depth=20, n_classes=10, learning_rate=0.1,
               optimizer='momentum', image_shape=[32, 32, 3])
_VARIANTS = ('global', 'per_tower')


def _measure(batch_norm: str, towers: int, batch: int, steps: int,
             warmup: int, aggregation: str):
  """(graph build seconds, seconds per step, batch-norm collectives)."""
  with tf.Graph().as_default() as graph:
    tf1.set_random_seed(1)
    tf1.train.get_or_create_global_step()
    rng = np.random.RandomState(0)
    images = tf.constant(rng.rand(batch, 32, 32, 3).astype(np.float32))
    labels = tf.constant(rng.randint(0, 10, batch).astype(np.int32))
    config = estimator_towers.make_run_config(cpu_devices=towers)
    start = time.perf_counter()
    spec = estimator_towers.replicate_model_fn(
        resnet_model_fn, batch_norm=batch_norm, aggregation=aggregation)(
            {'image': images}, labels, tf.estimator.ModeKeys.TRAIN, _PARAMS,
            config)
    built = time.perf_counter() - start
    collectives = sum(1 for op in graph.get_operations()
                      if op.type == 'CollectiveReduce' and
                      'global_moments' in op.name)
    spec.scaffold.finalize()
    with tf1.Session(config=config.session_config) as session:
      session.run(spec.scaffold.init_op)
      session.run(spec.scaffold.local_init_op)
      for _ in range(warmup):
        session.run(spec.train_op)
      start = time.perf_counter()
      for _ in range(steps):
        session.run(spec.train_op)
      per_step = (time.perf_counter() - start) / steps
  return built, per_step, collectives


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps', type=int, default=15)
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--towers', type=int, default=2)
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--aggregation', default='global_loss')
  args = parser.parse_args()
  tf.get_logger().setLevel('ERROR')
  results = {name: [] for name in _VARIANTS}
  for round_ in range(args.rounds):
    variants = list(_VARIANTS)
    random.shuffle(variants)
    for name in variants:
      results[name].append(_measure(name, args.towers, args.batch,
                                    args.steps, args.warmup,
                                    args.aggregation))
    on, off = results['global'][-1], results['per_tower'][-1]
    print(f'round {round_}: step global/per_tower {on[1] / off[1]:.3f}, '
          f'build global/per_tower {on[0] / off[0]:.3f}', flush=True)
  for name in _VARIANTS:
    built, per_step, collectives = zip(*results[name])
    print(f'{name:10s} build {statistics.median(built):6.2f} s  step '
          f'{statistics.median(per_step) * 1000:7.1f} ms  batch-norm '
          f'collectives {collectives[0]}')
  pairs = list(zip(results['global'], results['per_tower']))
  steps = [on[1] / off[1] for on, off in pairs]
  builds = [on[0] / off[0] for on, off in pairs]
  print(f'median ratio global/per_tower: step {statistics.median(steps):.3f} '
        f'(rounds {min(steps):.3f}-{max(steps):.3f}), build '
        f'{statistics.median(builds):.3f} (ResNet-20, {args.towers} towers, '
        f'batch {args.batch}, {args.aggregation}, {args.rounds} rounds)')


if __name__ == '__main__':
  main()
