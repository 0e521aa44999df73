"""What ordering the step's writes after its reads costs (write_order).

ResNet-20 (batch norm in every block: the most ordered writes of the model
zoo) on 2 virtual CPU towers, trained from the same start with the
ordering on (the library) and off (`write_order.order_writes` replaced by
a no-op for this benchmark only). Each round builds both graphs and runs
both in a shuffled order, seconds apart; the medians over rounds and the
per-round ratios are printed. Nothing is asserted.

  .venv/bin/python bench/bench_write_order.py            # ~2 minutes
  .venv/bin/python bench/bench_write_order.py --rounds=1 --steps=3  # smoke
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
from estimator_towers.update import write_order

_ORDERED = write_order.order_writes


def _measure(ordered: bool, towers: int, batch: int, steps: int,
             warmup: int):
  """(graph build seconds, seconds per step, control edges added)."""
  edges = []

  def counted(*args, **kwargs):
    edges.append(_ORDERED(*args, **kwargs))
    return edges[-1]

  write_order.order_writes = counted if ordered else (lambda *a, **k: 0)
  try:
    built, per_step, _, _ = resnet_steps.time_steps(towers, batch, steps,
                                                    warmup)
  finally:
    write_order.order_writes = _ORDERED
  return built, per_step, sum(edges)


def main():
  parser = resnet_steps.arguments(__doc__.splitlines()[0])
  args = parser.parse_args()
  tf.get_logger().setLevel('ERROR')
  results = {True: [], False: []}
  for round_ in range(args.rounds):
    variants = [True, False]
    random.shuffle(variants)
    for ordered in variants:
      results[ordered].append(_measure(ordered, args.towers, args.batch,
                                       args.steps, args.warmup))
    on, off = results[True][-1], results[False][-1]
    print(f'round {round_}: step on/off {on[1] / off[1]:.3f}, '
          f'build on/off {on[0] / off[0]:.3f}', flush=True)
  for ordered, name in ((True, 'ordered'), (False, 'not ordered')):
    built, per_step, edges = zip(*results[ordered])
    print(f'{name:12s} build {statistics.median(built):6.2f} s  step '
          f'{statistics.median(per_step) * 1000:7.1f} ms  edges {edges[0]}')
  ratios = [on[1] / off[1] for on, off in zip(results[True], results[False])]
  builds = [on[0] / off[0] for on, off in zip(results[True], results[False])]
  print(f'median ratio ordered/not: step {statistics.median(ratios):.3f}, '
        f'build {statistics.median(builds):.3f} (ResNet-20, '
        f'{args.towers} towers, batch {args.batch}, {args.rounds} rounds)')


if __name__ == '__main__':
  main()
