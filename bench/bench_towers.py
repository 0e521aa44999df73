"""Benchmarks replicate_model_fn against the usual ways to train on N devices.

All variants train the same MLP (784-1024-1024-10, ReLU, softmax cross entropy)
on the same global batch of synthetic, in-memory data with the same
MomentumOptimizer:

  plain      tf.estimator.Estimator on one device (cpu_devices=1)
  replicate  trainer.replicate_model_fn, one tower per virtual CPU device
  handwritten  in-graph towers written by hand (tf.split, tf.device per tower,
             variable_scope reuse, per-tower compute_gradients, averaged
             gradients, one apply_gradients), as the old CIFAR-10 multi-GPU
             tutorial did
  mirrored   RunConfig(train_distribute=tf.distribute.MirroredStrategy(...)),
             input_fn batch = global batch / N (MirroredStrategy's input_fn
             batch is per replica)

Everything runs in ONE process and is INTERLEAVED: each round times every
variant once, and the median over rounds is reported. Within a round the
variants compared at one tower count (replicate_n, handwritten_n, mirrored_n)
run back to back in a shuffled order, so a per-round ratio compares runs made
seconds apart. The machine is shared, so each measurement also records how
many cores other processes used meanwhile (from /proc/stat).
A measurement is one `Estimator.train(steps=S)` call; a SessionRunHook takes
the wall time from the end of step K (warm-up, after graph build, session
creation and the first steps) to the end of step S, so graph construction,
checkpoint restore and the final checkpoint are not in the figure.

The script also times graph construction of replicate_model_fn (and of the
hand-written towers) for 1, 2, 4 and 8 towers: one model_fn call in TRAIN
mode in a fresh graph, median of interleaved repeats.

No timing is asserted anywhere: this prints figures and ratios only.

  .venv/bin/python bench/bench_towers.py            # full run, ~8 minutes
  .venv/bin/python bench/bench_towers.py --quick    # smoke run
"""

import argparse
from importlib import metadata
import logging as py_logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

import trainer  # pylint: disable=g-import-not-at-top,wrong-import-position

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys

INPUT_DIM = 784
HIDDEN = (1024, 1024)
NUM_CLASSES = 10
NUM_EXAMPLES = 4096  # Size of the fixed synthetic array the input cycles over.
LEARNING_RATE = 0.01
MOMENTUM = 0.9
SEED = 1234
_NEVER = 10**9  # save_checkpoints_steps / log_step_count_steps: no I/O.


# --------------------------------------------------------------------------
# Model and input.


def _synthetic_data():
  rng = np.random.RandomState(SEED)
  x = rng.standard_normal((NUM_EXAMPLES, INPUT_DIM)).astype(np.float32)
  y = rng.randint(0, NUM_CLASSES, size=(NUM_EXAMPLES,)).astype(np.int32)
  return x, y


_DATA = _synthetic_data()


def make_input_fn(batch_size):
  """An input_fn over a fixed in-memory array, `batch_size` per call."""

  def input_fn(input_context=None):
    del input_context  # One worker: every replica reads the same pipeline.
    x, y = _DATA
    ds = tf.data.Dataset.from_tensor_slices(({'x': x}, y))
    ds = ds.cache().repeat().batch(batch_size, drop_remainder=True)
    return ds.prefetch(tf.data.AUTOTUNE)

  return input_fn


def _logits(x):
  """The network; variables made with get_variable (tf.compat.v1.layers)."""
  net = x
  for i, width in enumerate(HIDDEN):
    net = tf1.layers.dense(net, width, activation=tf.nn.relu, name=f'fc{i}')
  return tf1.layers.dense(net, NUM_CLASSES, name='logits')


def _optimizer():
  return tf1.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM)


def _loss(features, labels):
  logits = _logits(features['x'])
  return tf1.losses.sparse_softmax_cross_entropy(labels, logits)


def model_fn(features, labels, mode):
  """The one-device model_fn: used by plain, replicate and mirrored."""
  assert mode == ModeKeys.TRAIN, mode
  loss = _loss(features, labels)
  train_op = _optimizer().minimize(
      loss, global_step=tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def make_handwritten_model_fn(num_towers):
  """Classic in-graph towers, written by hand.

  The batch is split with tf.split; each tower is built under its own
  /cpu:i with the variables pinned to /cpu:0 and reused from tower 0;
  each tower computes its own gradients; the gradients are averaged on
  /cpu:0 and applied once.
  """
  devices = [f'/cpu:{i}' for i in range(num_towers)]

  def variables_on_cpu0(getter, *args, **kwargs):
    with tf.device('/cpu:0'):
      return getter(*args, **kwargs)

  def handwritten_model_fn(features, labels, mode):
    assert mode == ModeKeys.TRAIN, mode
    global_step = tf1.train.get_or_create_global_step()
    optimizer = _optimizer()
    with tf.device('/cpu:0'):
      x_shards = tf.split(features['x'], num_towers, axis=0)
      y_shards = tf.split(labels, num_towers, axis=0)
    tower_grads, tower_losses = [], []
    for i, device in enumerate(devices):
      with tf.device(device), tf.name_scope(f'tower_{i}'):
        with tf1.variable_scope(tf1.get_variable_scope(), reuse=bool(i),
                                custom_getter=variables_on_cpu0):
          loss = _loss({'x': x_shards[i]}, y_shards[i])
          tower_losses.append(loss)
          tower_grads.append(optimizer.compute_gradients(loss))
    with tf.device('/cpu:0'), tf.name_scope('average_gradients'):
      averaged = []
      for grads_and_vars in zip(*tower_grads):
        grads = [g for g, _ in grads_and_vars]
        var = grads_and_vars[0][1]
        averaged.append((tf.add_n(grads) * (1.0 / num_towers), var))
      loss = tf.add_n(tower_losses) * (1.0 / num_towers)
    train_op = optimizer.apply_gradients(averaged, global_step=global_step)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return handwritten_model_fn


# --------------------------------------------------------------------------
# Throughput.


def _busy_cpu_seconds():
  """CPU seconds all processes on the machine have used, or None."""
  try:
    with open('/proc/stat') as f:
      fields = f.readline().split()
  except OSError:
    return None
  # user nice system idle iowait irq softirq steal ...
  ticks = [int(x) for x in fields[1:9]]
  busy = sum(ticks) - ticks[3] - ticks[4]
  return busy / os.sysconf('SC_CLK_TCK')


class _StepTimer(tf1.train.SessionRunHook):
  """Wall time from the end of step `skip` to the end of the last step.

  Also records how much CPU other processes used meanwhile (machine busy
  time minus this process's CPU time), to show when a neighbour was running.
  """

  def __init__(self, skip):
    self._skip = skip
    self.steps = 0
    self._marks = []

  def begin(self):
    self.steps = 0
    self._marks = []

  def _mark(self):
    return (time.perf_counter(), time.process_time(), _busy_cpu_seconds())

  def after_run(self, run_context, run_values):
    self.steps += 1
    if self.steps == self._skip:
      self._marks = [self._mark()]
    elif self.steps > self._skip:
      self._marks[1:] = [self._mark()]

  def timed_steps(self):
    return self.steps - self._skip

  def seconds(self):
    return self._marks[1][0] - self._marks[0][0]

  def foreign_load(self):
    """Cores' worth of CPU other processes used in the timed window."""
    (w0, own0, all0), (w1, own1, all1) = self._marks
    if all0 is None or all1 is None:
      return float('nan')
    return max(0.0, (all1 - all0) - (own1 - own0)) / (w1 - w0)


class Variant:
  """One way to train; owns an Estimator that is reused across rounds."""

  def __init__(self, kind, towers, global_batch, root):
    self.kind = kind
    self.towers = towers
    self.global_batch = global_batch
    self.name = kind if kind == 'plain' else f'{kind}_{towers}'
    model_dir = os.path.join(root, self.name)
    run_config = trainer.make_run_config(
        model_dir, cpu_devices=towers, tf_random_seed=SEED,
        save_checkpoints_steps=_NEVER, save_checkpoints_secs=None,
        save_summary_steps=_NEVER, log_step_count_steps=_NEVER,
        keep_checkpoint_max=1)
    input_batch = global_batch
    if kind in ('plain', 'replicate'):
      fn = model_fn
      if kind == 'replicate':
        fn = trainer.replicate_model_fn(model_fn)
    elif kind == 'handwritten':
      fn = make_handwritten_model_fn(towers)
    elif kind == 'mirrored':
      fn = model_fn
      strategy = tf.distribute.MirroredStrategy(
          devices=[f'/cpu:{i}' for i in range(towers)])
      # Same session (virtual CPUs, threads, rewrites) as the other variants.
      run_config = tf.estimator.RunConfig(
          model_dir=model_dir, tf_random_seed=SEED,
          save_checkpoints_steps=_NEVER, save_checkpoints_secs=None,
          save_summary_steps=_NEVER, log_step_count_steps=_NEVER,
          keep_checkpoint_max=1, train_distribute=strategy,
          session_config=run_config.session_config)
      if global_batch % towers:
        raise ValueError(f'--global-batch {global_batch} does not divide by '
                         f'{towers} MirroredStrategy replicas.')
      input_batch = global_batch // towers
    else:
      raise ValueError(kind)
    self.input_fn = make_input_fn(input_batch)
    self.estimator = tf.estimator.Estimator(fn, config=run_config)
    self.rates = []
    self.loads = []  # Other processes' CPU use (cores) while timed.

  def warm_up(self, steps):
    """First train call: builds the graph, initializes, writes a checkpoint."""
    self.estimator.train(self.input_fn, steps=steps)

  def measure(self, steps, skip):
    timer = _StepTimer(skip)
    self.estimator.train(self.input_fn, steps=steps, hooks=[timer])
    if timer.timed_steps() != steps - skip:
      raise RuntimeError(f'{self.name}: ran {timer.steps} steps, expected '
                         f'{steps}.')
    rate = timer.timed_steps() * self.global_batch / timer.seconds()
    self.rates.append(rate)
    self.loads.append(timer.foreign_load())
    return rate

  def median(self):
    return statistics.median(self.rates)


def run_throughput(args, root):
  """Warms every variant up, then times them round-robin for args.rounds.

  A round visits the groups {plain}, {replicate_n, handwritten_n,
  mirrored_n} for each n in a random order, and the members of a group back
  to back in a random order, so that the variants a ratio compares ran
  seconds apart and mostly under the same load from other processes.
  """
  groups = [[('plain', 1)]]
  for n in args.towers:
    groups.append([('replicate', n), ('handwritten', n), ('mirrored', n)])
  variants = {}
  for group in groups:
    for kind, n in group:
      v = Variant(kind, n, args.global_batch, root)
      variants[v.name] = v
  print(f'\n== Training throughput: global batch {args.global_batch}, '
        f'{args.steps} steps per measurement ({args.skip} warm-up steps not '
        f'timed), {args.rounds} interleaved rounds ==', flush=True)
  for v in variants.values():
    t0 = time.perf_counter()
    v.warm_up(args.skip + 1)
    print(f'  warm-up {v.name:<14s} {time.perf_counter() - t0:6.1f} s',
          flush=True)
  rng = random.Random(SEED)
  names = [[variants[k if k == 'plain' else f'{k}_{n}'] for k, n in g]
           for g in groups]
  for r in range(args.rounds):
    order = [list(g) for g in names]
    rng.shuffle(order)
    cells = []
    for group in order:
      rng.shuffle(group)
      for v in group:
        rate = v.measure(args.steps, args.skip)
        cells.append(f'{v.name}={rate:,.0f} ({v.loads[-1]:.1f})')
    print(f'  round {r + 1}/{args.rounds} examples/s (other processes\' '
          'load, cores): ' + ', '.join(cells), flush=True)
  return list(variants.values())


def _ratio_cells(pairs):
  if not pairs:
    return '     -'
  return f'{statistics.median(pairs):6.3f}x'


def print_throughput(variants, quiet):
  by_name = {v.name: v for v in variants}
  plain = by_name['plain']
  print('\nexamples/s per variant (median over rounds; "best" = highest '
        'round; "load" = median\ncores used by other processes while '
        'timed, 2 cores in all)')
  print('variant       towers    median      best    min..max            '
        'median/plain  load')
  for v in variants:
    print(f'{v.kind:<13s} {v.towers:>6d}  {v.median():>8,.0f}  '
          f'{max(v.rates):>8,.0f}  {min(v.rates):>7,.0f}..{max(v.rates):<7,.0f}'
          f'    {v.median() / plain.median():>9.3f}x  '
          f'{statistics.median(v.loads):>5.2f}')
  towers = sorted({v.towers for v in variants if v.kind != 'plain'})
  print('\nratios; (k) = number of rounds the median is over    ' +
        ''.join(f'{f"{n} towers":>12s}' for n in towers))
  for other, target in (('handwritten', 0.95), ('mirrored', 1.2)):
    label = f'replicate / {other} (>= {target})'
    rows = {'ratio of medians': [], 'median of per-round ratios': [],
            f'  rounds with |load diff| < {quiet}': [],
            f'  rounds with both loads < {quiet}': [], 'ratio of bests': []}
    for n in towers:
      a, b = by_name[f'replicate_{n}'], by_name[f'{other}_{n}']
      rounds = list(zip(a.rates, b.rates, a.loads, b.loads))
      per_round = [x / y for x, y, _, _ in rounds]
      matched = [x / y for x, y, lx, ly in rounds if abs(lx - ly) < quiet]
      calm = [x / y for x, y, lx, ly in rounds if max(lx, ly) < quiet]
      rows['ratio of medians'].append(f'{a.median() / b.median():6.3f}x')
      rows['median of per-round ratios'].append(
          f'{_ratio_cells(per_round)} ({len(per_round)})')
      rows[f'  rounds with |load diff| < {quiet}'].append(
          f'{_ratio_cells(matched)} ({len(matched)})')
      rows[f'  rounds with both loads < {quiet}'].append(
          f'{_ratio_cells(calm)} ({len(calm)})')
      rows['ratio of bests'].append(f'{max(a.rates) / max(b.rates):6.3f}x')
    print(label)
    for row, cells in rows.items():
      print(f'  {row:<51s}' + ''.join(f'{c:>12s}' for c in cells))


# --------------------------------------------------------------------------
# Graph construction.


def _build_seconds(kind, towers, global_batch):
  """Seconds to call the model_fn once, in a fresh graph, in TRAIN mode."""
  config = trainer.make_run_config(None, cpu_devices=towers)
  if kind == 'replicate':
    fn = trainer.replicate_model_fn(model_fn)
  else:
    fn = make_handwritten_model_fn(towers)
  with tf.Graph().as_default():
    tf1.train.get_or_create_global_step()
    ds = make_input_fn(global_batch)()
    features, labels = tf1.data.make_one_shot_iterator(ds).get_next()
    t0 = time.perf_counter()
    if kind == 'replicate':
      fn(features, labels, ModeKeys.TRAIN, {}, config)
    else:
      fn(features, labels, ModeKeys.TRAIN)
    return time.perf_counter() - t0


def run_graph_build(args):
  counts = args.build_towers
  kinds = ['replicate', 'handwritten']
  times = {(k, n): [] for k in kinds for n in counts}
  print(f'\n== Graph construction: model_fn call only, TRAIN mode, median '
        f'of {args.build_repeats} interleaved repeats ==', flush=True)
  for k in kinds:  # Warm up Python/TF caches once per kind.
    _build_seconds(k, 1, args.global_batch)
  rng = random.Random(SEED)
  for _ in range(args.build_repeats):
    order = list(times)
    rng.shuffle(order)
    for key in order:
      times[key].append(_build_seconds(key[0], key[1], args.global_batch))
  print('\nmodel_fn       towers  seconds  time(n)/time(1)  per tower (s)')
  for k in kinds:
    base = statistics.median(times[(k, counts[0])])
    for n in counts:
      t = statistics.median(times[(k, n)])
      print(f'{k:<14s} {n:>6d}  {t:7.3f}  {t / base:15.2f}  {t / n:13.3f}')
  return times


# --------------------------------------------------------------------------


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--rounds', type=int, default=10,
                 help='Interleaved rounds; the median over rounds is shown.')
  p.add_argument('--steps', type=int, default=100,
                 help='Steps per train call (measurement).')
  p.add_argument('--skip', type=int, default=20,
                 help='Steps at the start of each train call not timed.')
  p.add_argument('--global-batch', type=int, default=256)
  p.add_argument('--hidden', default=','.join(map(str, HIDDEN)),
                 help='Comma-separated hidden layer widths of the MLP.')
  p.add_argument('--towers', default='2,4',
                 help='Comma-separated tower counts to compare.')
  p.add_argument('--build-towers', default='1,2,4,8',
                 help='Tower counts for the graph-construction timing.')
  p.add_argument('--build-repeats', type=int, default=7)
  p.add_argument('--quiet', type=float, default=0.25,
                 help='Load (cores used by other processes) threshold for '
                 'the load-matched and quiet ratio rows.')
  p.add_argument('--skip-throughput', action='store_true')
  p.add_argument('--skip-build', action='store_true')
  p.add_argument('--quick', action='store_true',
                 help='Tiny settings for a smoke run (2 rounds of 12 steps, '
                 'hidden 256,256).')
  args = p.parse_args(argv)
  args.towers = [int(n) for n in args.towers.split(',') if n]
  args.hidden = tuple(int(n) for n in args.hidden.split(',') if n)
  args.build_towers = [int(n) for n in args.build_towers.split(',') if n]
  if args.quick:
    args.rounds, args.steps, args.skip, args.build_repeats = 2, 12, 4, 2
    args.hidden = (256, 256)
  if args.steps <= args.skip:
    p.error('--steps must exceed --skip.')
  for n in args.towers:
    if args.global_batch % n:
      p.error(f'--global-batch {args.global_batch} must divide by {n} towers '
              '(the hand-written towers use tf.split).')
  return args


def main(argv=None):
  global HIDDEN
  args = parse_args(argv)
  HIDDEN = args.hidden
  warnings.filterwarnings('ignore')
  tf1.logging.set_verbosity(tf1.logging.ERROR)
  py_logging.getLogger('tensorflow').setLevel(py_logging.ERROR)
  print(f'TensorFlow {tf.__version__}, tensorflow-estimator '
        f'{metadata.version("tensorflow-estimator")}, {os.cpu_count()} CPU '
        'cores; '
        'model MLP '
        f'{INPUT_DIM}-{"-".join(map(str, HIDDEN))}-{NUM_CLASSES}, '
        f'MomentumOptimizer; settings: rounds={args.rounds} '
        f'steps={args.steps} skip={args.skip} '
        f'global_batch={args.global_batch} towers={args.towers}', flush=True)
  t0 = time.perf_counter()
  root = tempfile.mkdtemp(prefix='bench_towers_')
  try:
    if not args.skip_throughput:
      print_throughput(run_throughput(args, root), args.quiet)
    if not args.skip_build:
      run_graph_build(args)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(f'\ntotal wall time {time.perf_counter() - t0:.0f} s')


if __name__ == '__main__':
  main()
