"""Benchmarks the start-up of training: one device vs towers' batch norms.

Trains Keras' MobileNet (alpha 0.25, 27 batch-norm layers) on 32x32
images (model_fns 'keras_app', SGD, global batch 16) for a few steps in a
fresh process per variant, one process at a time, and prints per variant:

  session    Seconds from the hooks' `begin` to the session's creation
             (graph finalisation, the init ops' grappler and executor).
  step 1/2   The first two steps: the Estimator fetches other tensors in
             each, so each builds its own executor (pruning, grappler,
             partitioning between the devices, kernels).
  steady     Median of the later steps, for scale.
  clock      Wall seconds, and the process's CPU seconds (all threads),
             which the other processes on the machine disturb less.
  ops/edges  The train graph's ops, its data edges and its control edges.

Variants: one device (the plain model_fn), and 2 virtual CPU towers with
batch_norm='per_tower' and 'global' (the default), each built as now
('after') and with the one-update control gate disabled ('before', what
the library did before estimator_towers/graph/control_gate.py: every
backward op carried one control input per batch-norm update op), and
'global unjoined': as 'global after' without the control edges that make
every tower's member of an exchange wait for the others'
(collectives/exchange.py `join_members`, which lets one tower's tensor be
fetched alone). Ratios are to the first variant run (one device). No
timing is asserted: figures only.

  .venv/bin/python bench/bench_startup.py             # ~4 min on 2 cores
  .venv/bin/python bench/bench_startup.py --rounds=3  # medians of 3
  .venv/bin/python bench/bench_startup.py \
      --variants='one device,global after,global unjoined'
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)

# name -> (towers, batch_norm or None for the plain model_fn, gate on,
# exchanges' members joined).
VARIANTS = {
    'one device': (1, None, True, True),
    'per_tower before': (2, 'per_tower', False, True),
    'per_tower after': (2, 'per_tower', True, True),
    'global before': (2, 'global', False, True),
    'global after': (2, 'global', True, True),
    'global unjoined': (2, 'global', True, False),
}


def _child(name: str, steps: int) -> None:
  """Trains one variant and prints its figures as one JSON line."""
  sys.path.insert(0, _ROOT)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import model_fns  # pylint: disable=g-import-not-at-top
  import trainer  # pylint: disable=g-import-not-at-top
  from estimator_towers.collectives import exchange  # pylint: disable=g-import-not-at-top
  from estimator_towers.graph import control_gate  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  towers, batch_norm, gate, join = VARIANTS[name]
  if not gate:
    # The library before the gate: the enclosing control inputs as they are.
    control_gate.gated = lambda name='': contextlib.nullcontext()
  if not join:  # Each member of an exchange on its own (fetches may hang).
    exchange.join_members = lambda graph: 0
  figures = {'step': [], 'cpu': []}

  class Timer(tf1.train.SessionRunHook):
    """Times session creation and every step; counts the graph's edges."""

    def begin(self):
      graph_def = tf1.get_default_graph().as_graph_def()
      inputs = [i for n in graph_def.node for i in n.input]
      control = sum(1 for i in inputs if i.startswith('^'))
      figures.update(ops=len(graph_def.node), data=len(inputs) - control,
                     control=control)
      self._start, self._cpu = time.time(), time.process_time()

    def after_create_session(self, session, coord):
      figures['session'] = time.time() - self._start
      figures['session_cpu'] = time.process_time() - self._cpu

    def before_run(self, run_context):
      self._start, self._cpu = time.time(), time.process_time()

    def after_run(self, run_context, run_values):
      figures['step'].append(time.time() - self._start)
      figures['cpu'].append(time.process_time() - self._cpu)

  params = dict(n_classes=2, image_shape=(32, 32, 3),
                keras_application='MobileNet',
                keras_application_kwargs={'alpha': 0.25}, optimizer='sgd',
                learning_rate=0.01)
  rng = np.random.RandomState(0)
  features = {'image': rng.rand(32, 32, 32, 3).astype('float32')}
  labels = rng.randint(0, 2, size=32).astype('int32')
  model_fn = model_fns.get_model_fn('keras_app')
  if batch_norm is not None:
    model_fn = trainer.replicate_model_fn(model_fn, batch_norm=batch_norm)
  config = trainer.make_run_config(tempfile.mkdtemp(), cpu_devices=towers,
                                   tf_random_seed=1,
                                   checkpoint_save_graph_def=False)
  estimator = tf.estimator.Estimator(model_fn, config=config, params=params)
  estimator.train(lambda: tf.data.Dataset.from_tensor_slices(
      (features, labels)).repeat().batch(16), steps=steps, hooks=[Timer()])
  print('FIGURES ' + json.dumps(figures), flush=True)


def _run(name: str, steps: int) -> dict:
  """One variant in a fresh process (a process's first session differs)."""
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), '--child', name,
       f'--steps={steps}'], capture_output=True, text=True, check=True).stdout
  line = [l for l in out.splitlines() if l.startswith('FIGURES ')][-1]
  return json.loads(line[len('FIGURES '):])


def _row(name: str, runs: list, base: dict, clock: str):
  """One table row of `clock` ('wall' or 'cpu') seconds, and its start-up."""
  session_key, step_key = (('session', 'step') if clock == 'wall'
                           else ('session_cpu', 'cpu'))
  med = lambda f: statistics.median(f(r) for r in runs)  # pylint: disable=unnecessary-lambda-assignment
  session, first, second = (med(lambda r: r[session_key]),
                            med(lambda r: r[step_key][0]),
                            med(lambda r: r[step_key][1]))
  steady = med(lambda r: statistics.median(r[step_key][2:]))
  startup = session + first + second
  ratio = startup / base[clock] if base else 1.0
  run = runs[0]
  return (f'| {name} | {clock} | {session:.1f} | {first:.2f} | {second:.2f} '
          f'| {startup:.1f} | **{ratio:.1f}x** | {steady * 1000:.0f} ms | '
          f"{run['ops']} | {run['data']} | {run['control']} |"), startup


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--child', help=argparse.SUPPRESS)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--rounds', type=int, default=1)
  parser.add_argument('--variants', default=','.join(VARIANTS),
                      help='Comma-separated variants, in order; the first '
                      'is the ratios\' base.')
  args = parser.parse_args()
  if args.child:
    _child(args.child, args.steps)
    return
  names = args.variants.split(',')
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    parser.error(f'unknown variants {unknown}; choose from {list(VARIANTS)}')
  runs = {name: [] for name in names}
  for _ in range(args.rounds):
    for name in names:  # One process at a time: they share the cores.
      runs[name].append(_run(name, args.steps))
  print(f'load average {os.getloadavg()[0]:.1f}; seconds; medians of '
        f'{args.rounds} round(s); start-up = session + step 1 + step 2\n')
  print('| variant | clock | session | step 1 | step 2 | start-up | '
        f'vs {names[0]} | steady step | ops | data edges | control edges |')
  print('| --- ' * 11 + '|')
  base = {}
  for name in names:
    rows = {}
    for clock in ('wall', 'cpu'):
      rows[clock], startup = _row(name, runs[name], base, clock)
      rows[clock + ' start-up'] = startup
    base = base or {c: rows[c + ' start-up'] for c in ('wall', 'cpu')}
    print(rows['wall'])
    print(rows['cpu'])


if __name__ == '__main__':
  main()
