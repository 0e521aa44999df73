"""What ordering the step's writes after its reads costs (write_order).

ResNet-20 (batch norm in every block: the most ordered writes of the model
zoo) on 2 virtual CPU towers, trained from the same start with the
ordering on (the library) and off (`write_order.order_writes` replaced by
a no-op for this benchmark only). Each round builds both graphs and runs
both in a shuffled order, seconds apart; the medians over rounds and the
per-round ratios are printed. Nothing is asserted.

  .venv/bin/python bench/bench_write_order.py            # ~2 minutes
  .venv/bin/python bench/bench_write_order.py --rounds=1 --steps=3  # smoke

With --counters=N it times the graph build instead on the model that
gives order_writes the most to do per op: N counters, each read after the
update and written again (issue 24 F7), on --towers towers and on one device.
"""

import os
import random
import statistics
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import time

import tensorflow as tf

from bench import resnet_steps
import estimator_towers
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


def _counters_model_fn(count: int):
  """A dense model whose train_op reads `count` counters after the update
  and writes each again: every write must wait for the reads."""
  tf1 = tf.compat.v1

  def model_fn(features, labels, mode):
    step = tf1.train.get_or_create_global_step()
    counters = [tf1.get_variable(f'counter_{i}', [], trainable=False,
                                 initializer=tf1.zeros_initializer())
                for i in range(count)]
    predictions = tf1.layers.dense(features, 1)
    loss = tf1.losses.mean_squared_error(labels, predictions[:, 0])
    update = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, step)
    with tf.control_dependencies([update]):
      reads = [c.read_value() for c in counters]
    writes = [c.assign(r + 1.0) for c, r in zip(counters, reads)]
    tf1.summary.scalar('counted', tf.add_n(reads))
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      train_op=tf.group(update, *writes))

  return model_fn


def _build_seconds(count: int, towers: int) -> tuple:
  """(build seconds, order_writes seconds) of the counters model."""
  spent = []

  def timed(*args, **kwargs):
    start = time.perf_counter()
    result = _ORDERED(*args, **kwargs)
    spent.append(time.perf_counter() - start)
    return result

  write_order.order_writes = timed
  model_fn = _counters_model_fn(count)
  try:
    with tf.Graph().as_default():
      features = tf.zeros([8, 4])
      labels = tf.zeros([8])
      start = time.perf_counter()
      if towers > 1:
        config = estimator_towers.make_run_config(cpu_devices=towers)
        estimator_towers.replicate_model_fn(model_fn)(
            features, labels, tf.estimator.ModeKeys.TRAIN, {}, config)
      else:
        model_fn(features, labels, tf.estimator.ModeKeys.TRAIN)
      return time.perf_counter() - start, sum(spent)
  finally:
    write_order.order_writes = _ORDERED


def _time_counters(args) -> None:
  rows = {1: [], args.towers: []}
  for round_ in range(args.rounds):
    for towers in rows:
      rows[towers].append(_build_seconds(args.counters, towers))
    print(f'round {round_}: build {args.towers} towers / one device '
          f'{rows[args.towers][-1][0] / rows[1][-1][0]:.2f}, order_writes '
          f'{rows[args.towers][-1][1]:.2f} s', flush=True)
  built, ordering = zip(*rows[args.towers])
  ratios = [m[0] / o[0] for m, o in zip(rows[args.towers], rows[1])]
  print(f'{args.counters} counters, {args.towers} towers: build '
        f'{statistics.median(built):.2f} s (one device '
        f'{statistics.median(b for b, _ in rows[1]):.2f} s, median ratio '
        f'{statistics.median(ratios):.2f}), order_writes '
        f'{statistics.median(ordering):.2f} s = '
        f'{statistics.median(o / b for o, b in zip(ordering, built)):.1%} '
        'of the build')


def main():
  parser = resnet_steps.arguments(__doc__.splitlines()[0])
  parser.add_argument('--counters', type=int, default=0)
  args = parser.parse_args()
  tf.get_logger().setLevel('ERROR')
  if args.counters:
    _time_counters(args)
    return
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
