"""What random_ops='one_device' costs against 'per_tower' (random_draws).

A BERT-like classifier (tests/helpers.bert_model_fn: 2 layers, hidden 64,
sequence 32, 4 heads, dropout 0.1 in the places BERT puts it) on 2 virtual
CPU towers, trained from the same start with each tower drawing its own
dropout masks ('per_tower', the default) and with every tower drawing one
device's global masks and keeping its rows ('one_device'). Each round
builds both graphs (in a shuffled order), opens both sessions and
alternates their steps, so that the shared machine's load falls on both
alike; a round's step time is the median of its steps. The per-round
ratios and the medians over rounds are printed. Nothing is asserted.

  .venv/bin/python bench/bench_random_ops.py            # ~2 minutes
  .venv/bin/python bench/bench_random_ops.py --rounds=1 --steps=3  # smoke
"""

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, 'tests')]

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

import estimator_towers
from helpers import bert_model_fn

tf1 = tf.compat.v1
_PARAMS = dict(vocab=1000, seq=32, hidden=64, heads=4, layers=2,
               dropout=0.1, learning_rate=0.1)
_CHOICES = ('per_tower', 'one_device')


def _build(random_ops: str, towers: int, batch: int):
  """(graph, train_op, session config, graph build seconds)."""
  graph = tf.Graph()
  with graph.as_default():
    tf1.set_random_seed(1)
    tf1.train.get_or_create_global_step()
    rng = np.random.RandomState(0)
    ids = tf.constant(rng.randint(0, _PARAMS['vocab'], (batch, _PARAMS[
        'seq'])).astype(np.int32))
    labels = tf.constant(rng.randint(0, 2, batch).astype(np.int32))
    config = estimator_towers.make_run_config(cpu_devices=towers)
    start = time.perf_counter()
    spec = estimator_towers.replicate_model_fn(
        bert_model_fn, random_ops=random_ops)(
            {'ids': ids}, labels, tf.estimator.ModeKeys.TRAIN, _PARAMS,
            config)
    built = time.perf_counter() - start
  return graph, spec.train_op, config.session_config, built


def _round(towers: int, batch: int, steps: int, warmup: int):
  """{choice: (build seconds, median seconds per step)} of one round.

  Both sessions are open at once and their steps alternate, so that the
  load of the shared machine falls on both alike.
  """
  order = list(_CHOICES)
  random.shuffle(order)
  built, sessions, times = {}, {}, {choice: [] for choice in _CHOICES}
  for choice in order:
    graph, train_op, session_config, built[choice] = _build(
        choice, towers, batch)
    with graph.as_default():
      session = tf1.Session(graph=graph, config=session_config)
      session.run(tf1.global_variables_initializer())
    sessions[choice] = (session, train_op)
  for step in range(warmup + steps):
    for choice in order:
      session, train_op = sessions[choice]
      start = time.perf_counter()
      session.run(train_op)
      if step >= warmup:
        times[choice].append(time.perf_counter() - start)
  for session, _ in sessions.values():
    session.close()
  return {choice: (built[choice], statistics.median(times[choice]))
          for choice in _CHOICES}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps', type=int, default=40)
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--towers', type=int, default=2)
  parser.add_argument('--batch', type=int, default=32)
  args = parser.parse_args()
  tf.get_logger().setLevel('ERROR')
  results = {choice: [] for choice in _CHOICES}
  for round_ in range(args.rounds):
    measured = _round(args.towers, args.batch, args.steps, args.warmup)
    for choice in _CHOICES:
      results[choice].append(measured[choice])
    one, per = measured['one_device'], measured['per_tower']
    print(f'round {round_}: step one_device/per_tower {one[1] / per[1]:.3f}'
          f', build {one[0] / per[0]:.3f}', flush=True)
  for choice in _CHOICES:
    built, per_step = zip(*results[choice])
    print(f'{choice:11s} build {statistics.median(built):6.2f} s  step '
          f'{statistics.median(per_step) * 1000:7.1f} ms')
  pairs = list(zip(results['one_device'], results['per_tower']))
  print(f'median ratio one_device/per_tower: step '
        f'{statistics.median(o[1] / p[1] for o, p in pairs):.3f}, build '
        f'{statistics.median(o[0] / p[0] for o, p in pairs):.3f} (BERT-like '
        f'{_PARAMS["layers"]} layers, hidden {_PARAMS["hidden"]}, seq '
        f'{_PARAMS["seq"]}, {args.towers} towers, batch {args.batch}, '
        f'{args.rounds} rounds)')


if __name__ == '__main__':
  main()
