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

import os
import random
import statistics
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf

from bench import resnet_steps

_VARIANTS = ('global', 'per_tower')


def _collectives(graph):
  """The batch-norm exchanges of the graph (forward and gradient)."""
  return sum(1 for op in graph.get_operations()
             if op.type == 'CollectiveReduce' and 'global_moments' in op.name)


def _measure(batch_norm: str, towers: int, batch: int, steps: int,
             warmup: int, aggregation: str):
  """(graph build seconds, seconds per step, CPU seconds per step,
  batch-norm collectives)."""
  return resnet_steps.time_steps(
      towers, batch, steps, warmup,
      dict(batch_norm=batch_norm, aggregation=aggregation), _collectives)


def main():
  parser = resnet_steps.arguments(__doc__.splitlines()[0])
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
    print(f'round {round_}: global/per_tower step {on[1] / off[1]:.3f}, '
          f'CPU per step {on[2] / off[2]:.3f}, build {on[0] / off[0]:.3f}',
          flush=True)
  for name in _VARIANTS:
    built, per_step, cpu, collectives = zip(*results[name])
    print(f'{name:10s} build {statistics.median(built):6.2f} s  step '
          f'{statistics.median(per_step) * 1000:7.1f} ms  CPU '
          f'{statistics.median(cpu) * 1000:7.1f} ms  batch-norm collectives '
          f'{collectives[0]}')
  pairs = list(zip(results['global'], results['per_tower']))
  ratios = {what: [on[i] / off[i] for on, off in pairs]
            for what, i in (('step', 1), ('CPU per step', 2), ('build', 0))}
  print('median ratio global/per_tower: ' + ', '.join(
      f'{what} {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})'
      for what, r in ratios.items()) +
        f' (ResNet-20, {args.towers} towers, batch {args.batch}, '
        f'{args.aggregation}, {args.rounds} rounds)')


if __name__ == '__main__':
  main()
