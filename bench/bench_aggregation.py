"""Benchmarks the aggregation strategies of replicate_model_fn.

For each strategy (global_loss, round_robin, all_reduce) at each tower count
(default 2, 4, 8 virtual CPU devices), on bench_towers' MLP and synthetic
data (MomentumOptimizer, same global batch), this prints:

  examples/s   Interleaved rounds in ONE process: each round times every
               variant once (one `Estimator.train(steps=S)` call, the first
               K steps not timed), the variants of one tower count back to
               back in a shuffled order; medians over rounds, ratios to
               global_loss side by side. A plain one-device Estimator is
               timed too, for scale.
  bytes/step   Bytes crossing device boundaries in one training step,
               computed from the step's graph, not measured: walk every op
               the train_op and the loss need (data and control inputs);
               for every data edge whose producer and consumer sit on
               different devices, add the tensor's size (static shape times
               dtype size), each tensor once per destination device, as
               TensorFlow's send/recv does. Devices are canonicalised the way
               the placer resolves them: an op reading a resource variable
               runs where the variable is, a colocated op where its group is,
               an unpinned op on /cpu:0. A dimension unknown while building
               (the shard's batch) counts as global batch / towers. The
               data an all-reduce moves inside its collective op is not a
               graph edge; it is added as a ring all-reduce moves it:
               2 (N-1)/N of the tensor per device.

No timing is asserted anywhere: this prints figures and ratios only. Only
virtual CPU devices of one machine are measured: the devices share memory,
so crossing a device boundary costs a copy at most, not a PCIe or NVLink
transfer; the bytes column is what would cross such links.

  .venv/bin/python bench/bench_aggregation.py           # full run, ~7 min
  .venv/bin/python bench/bench_aggregation.py --quick   # smoke run, ~1 min
"""

import argparse
import collections
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
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

import bench_towers  # pylint: disable=g-import-not-at-top,wrong-import-position
import estimator_towers  # pylint: disable=g-import-not-at-top,wrong-import-position
from estimator_towers.aggregation import strategies as aggregation_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys
STRATEGIES = aggregation_lib.AGGREGATIONS
_NEVER = 10**9


# --------------------------------------------------------------------------
# Bytes crossing devices, from the graph.


def _canonical(device: str) -> str:
  return tf.DeviceSpec.from_string(device or '/device:CPU:0').to_string()


class _Devices:
  """Where the placer will run each op (see the module docstring)."""

  def __init__(self, graph):
    self._graph = graph
    self._memo = {}

  def __call__(self, op) -> str:
    if op.name not in self._memo:
      self._memo[op.name] = _canonical(op.device)  # Breaks cycles.
      self._memo[op.name] = self._resolve(op)
    return self._memo[op.name]

  def _resolve(self, op) -> str:
    for t in op.inputs:
      if t.dtype == tf.resource or t.dtype._is_ref_dtype:  # pylint: disable=protected-access
        return self(t.op)
    own = f'loc:@{op.name}'.encode()
    for group in op.colocation_groups():
      if group != own:
        return self(self._graph.get_operation_by_name(group[5:].decode()))
    return _canonical(op.device)


def _tensor_bytes(tensor, unknown_dim: int) -> int:
  if tensor.dtype in (tf.resource, tf.variant, tf.string):
    return 0
  dims = tensor.shape.as_list() if tensor.shape.rank is not None else []
  count = 1
  for d in dims:
    count *= unknown_dim if d is None else d
  return count * tensor.dtype.base_dtype.size


def cross_device_bytes(graph, fetches, unknown_dim: int):
  """What one run of `fetches` moves between devices.

  Returns:
    (edge bytes, all-reduce bytes, bytes the busiest device sends plus
    receives): the busiest device's link is the bottleneck.
  """
  device_of = _Devices(graph)
  pending = [f if isinstance(f, tf.Operation) else f.op for f in fetches]
  seen, sent = set(), set()
  edge_bytes = 0
  per_device = collections.Counter()
  collective = collections.defaultdict(list)  # instance key -> tensors
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.type in ('CollectiveReduce', 'CollectiveReduceV2', 'NcclAllReduce'):
      key = (op.get_attr('instance_key') if op.type == 'CollectiveReduce'
             else op.name)
      collective[key].append(op.inputs[0])
    for t in op.inputs:
      destination = device_of(op)
      source = device_of(t.op)
      if source != destination and (t.name, destination) not in sent:
        sent.add((t.name, destination))
        size = _tensor_bytes(t, unknown_dim)
        edge_bytes += size
        per_device[source] += size
        per_device[destination] += size
      pending.append(t.op)
    pending.extend(op.control_inputs)
  reduce_bytes = 0
  for tensors in collective.values():
    n = len(tensors)
    # Ring all-reduce: each member sends 2 (n-1)/n of the tensor.
    size = _tensor_bytes(tensors[0], unknown_dim)
    reduce_bytes += int(2 * (n - 1) * size)
    for t in tensors:  # Sends 2 (n-1)/n of it and receives as much.
      per_device[device_of(t.op)] += int(4 * (n - 1) / n * size)
  return edge_bytes, reduce_bytes, max(per_device.values(), default=0)


def graph_bytes(strategy: str, towers: int, global_batch: int):
  """Bytes crossing devices per step of the replicated training graph."""
  config = estimator_towers.make_run_config(None, cpu_devices=towers)
  fn = estimator_towers.replicate_model_fn(bench_towers.model_fn,
                                           aggregation=strategy)
  graph = tf.Graph()
  with graph.as_default():
    tf1.train.get_or_create_global_step()
    ds = bench_towers.make_input_fn(global_batch)()
    features, labels = tf1.data.make_one_shot_iterator(ds).get_next()
    spec = fn(features, labels, ModeKeys.TRAIN, {}, config)
    return cross_device_bytes(graph, [spec.train_op, spec.loss],
                              max(1, global_batch // towers))


def variable_bytes_per_device(strategy: str, towers: int, global_batch: int):
  """{device: bytes of variables (and slots) placed there}."""
  config = estimator_towers.make_run_config(None, cpu_devices=towers)
  fn = estimator_towers.replicate_model_fn(bench_towers.model_fn,
                                           aggregation=strategy)
  graph = tf.Graph()
  with graph.as_default():
    tf1.train.get_or_create_global_step()
    ds = bench_towers.make_input_fn(global_batch)()
    features, labels = tf1.data.make_one_shot_iterator(ds).get_next()
    fn(features, labels, ModeKeys.TRAIN, {}, config)
    device_of = _Devices(graph)
    loads = collections.Counter()
    for v in tf1.global_variables() + tf1.local_variables():
      loads[device_of(v.op)] += v.shape.num_elements() * v.dtype.base_dtype.size
  return dict(loads)


# --------------------------------------------------------------------------
# Throughput.


class Variant:
  """One strategy at one tower count; its Estimator is reused across rounds."""

  def __init__(self, strategy, towers, global_batch, root):
    self.strategy, self.towers = strategy, towers
    self.name = strategy if strategy == 'plain' else f'{strategy}_{towers}'
    self.global_batch = global_batch
    config = estimator_towers.make_run_config(
        os.path.join(root, self.name), cpu_devices=towers,
        tf_random_seed=bench_towers.SEED, save_checkpoints_steps=_NEVER,
        save_checkpoints_secs=None, save_summary_steps=_NEVER,
        log_step_count_steps=_NEVER, keep_checkpoint_max=1)
    fn = bench_towers.model_fn
    if strategy != 'plain':
      fn = estimator_towers.replicate_model_fn(fn, aggregation=strategy)
    self.estimator = tf.estimator.Estimator(fn, config=config)
    self.input_fn = bench_towers.make_input_fn(global_batch)
    self.rates, self.loads = [], []

  def warm_up(self, steps):
    self.estimator.train(self.input_fn, steps=steps)

  def measure(self, steps, skip):
    timer = bench_towers._StepTimer(skip)  # pylint: disable=protected-access
    self.estimator.train(self.input_fn, steps=steps, hooks=[timer])
    rate = timer.timed_steps() * self.global_batch / timer.seconds()
    self.rates.append(rate)
    self.loads.append(timer.foreign_load())
    return rate

  def median(self):
    return statistics.median(self.rates)


def run_throughput(args, root):
  groups = [[('plain', 1)]] + [[(s, n) for s in STRATEGIES]
                               for n in args.towers]
  variants = {}
  for group in groups:
    for strategy, n in group:
      v = Variant(strategy, n, args.global_batch, root)
      variants[v.name] = v
  print(f'\n== Training throughput: global batch {args.global_batch}, '
        f'{args.steps} steps per measurement ({args.skip} not timed), '
        f'{args.rounds} interleaved rounds ==', flush=True)
  for v in variants.values():
    t0 = time.perf_counter()
    v.warm_up(args.skip + 1)
    print(f'  warm-up {v.name:<16s} {time.perf_counter() - t0:6.1f} s',
          flush=True)
  rng = random.Random(bench_towers.SEED)
  order_groups = [[variants[s if s == 'plain' else f'{s}_{n}'] for s, n in g]
                  for g in groups]
  for r in range(args.rounds):
    order = [list(g) for g in order_groups]
    rng.shuffle(order)
    cells = []
    for group in order:
      rng.shuffle(group)
      for v in group:
        rate = v.measure(args.steps, args.skip)
        cells.append(f'{v.name}={rate:,.0f} ({v.loads[-1]:.1f})')
    print(f'  round {r + 1}/{args.rounds} examples/s (other processes\' '
          'load, cores): ' + ', '.join(cells), flush=True)
  return variants


def print_table(args, variants, traffic, loads):
  plain = variants.get('plain')
  print('\nexamples/s: median over rounds (min..max); "/gl" = median of '
        'per-round ratios to global_loss at the same tower count; MB per '
        'step crossing devices (graph edges + all-reduce = total; busiest = '
        'sent + received by the busiest device); variable (and slot) MB '
        'per device, max/min')
  print(f'{"strategy":<12s} {"towers":>6s} {"median":>9s} {"min..max":>17s} '
        f'{"/gl":>7s} {"/plain":>7s} {"edge MB":>8s} {"reduce MB":>9s} '
        f'{"total MB":>8s} {"busiest MB":>11s} {"var MB max/min":>15s}')
  for n in args.towers:
    base = variants.get(f'global_loss_{n}')
    for s in STRATEGIES:
      v = variants.get(f'{s}_{n}')
      edge, reduce, busiest = traffic[(s, n)]
      per_device = loads[(s, n)]
      most = max(per_device.values()) / 1e6
      var_cell = (f'{most:6.1f}/{min(per_device.values()) / 1e6:<6.1f}'
                  if len(per_device) == n else
                  f'{most:6.1f}/(on {len(per_device)})')
      if v is None:
        rate_cells = f'{"-":>9s} {"-":>17s} {"-":>7s} {"-":>7s}'
      else:
        ratio = statistics.median(a / b for a, b in zip(v.rates, base.rates))
        to_plain = (f'{v.median() / plain.median():6.3f}x' if plain
                    else '     -')
        rate_cells = (f'{v.median():>9,.0f} '
                      f'{min(v.rates):>8,.0f}..{max(v.rates):<7,.0f} '
                      f'{ratio:6.3f}x {to_plain:>7s}')
      print(f'{s:<12s} {n:>6d} {rate_cells} {edge / 1e6:8.2f} '
            f'{reduce / 1e6:9.2f} {(edge + reduce) / 1e6:8.2f} '
            f'{busiest / 1e6:11.2f} {var_cell:>15s}')
  if plain:
    print(f'{"plain":<12s} {1:>6d} {plain.median():>9,.0f} '
          f'{min(plain.rates):>8,.0f}..{max(plain.rates):<7,.0f}')


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--rounds', type=int, default=10)
  p.add_argument('--steps', type=int, default=100,
                 help='Steps per train call (measurement).')
  p.add_argument('--skip', type=int, default=20,
                 help='Steps at the start of each train call not timed.')
  p.add_argument('--global-batch', type=int, default=256)
  p.add_argument('--hidden', default=','.join(map(str, bench_towers.HIDDEN)),
                 help='Comma-separated hidden layer widths of the MLP.')
  p.add_argument('--towers', default='2,4,8')
  p.add_argument('--bytes-only', action='store_true',
                 help='Only the graph-derived bytes, no timing.')
  p.add_argument('--quick', action='store_true',
                 help='Smoke run: 2 rounds of 12 steps, hidden 256,256, '
                 'towers 2,4.')
  args = p.parse_args(argv)
  if args.quick:
    args.rounds, args.steps, args.skip = 2, 12, 4
    args.hidden, args.towers = '256,256', '2,4'
  args.towers = [int(n) for n in args.towers.split(',') if n]
  args.hidden = tuple(int(n) for n in args.hidden.split(',') if n)
  if args.steps <= args.skip:
    p.error('--steps must exceed --skip.')
  return args


def main(argv=None):
  args = parse_args(argv)
  bench_towers.HIDDEN = args.hidden  # _logits reads the module global.
  warnings.filterwarnings('ignore')
  tf1.logging.set_verbosity(tf1.logging.ERROR)
  py_logging.getLogger('tensorflow').setLevel(py_logging.ERROR)
  print(f'TensorFlow {tf.__version__}, {os.cpu_count()} CPU cores; MLP '
        f'{bench_towers.INPUT_DIM}-{"-".join(map(str, args.hidden))}-'
        f'{bench_towers.NUM_CLASSES}, MomentumOptimizer; rounds={args.rounds} '
        f'steps={args.steps} skip={args.skip} '
        f'global_batch={args.global_batch} towers={args.towers}', flush=True)
  t0 = time.perf_counter()
  traffic, loads = {}, {}
  for n in args.towers:
    for s in STRATEGIES:
      traffic[(s, n)] = graph_bytes(s, n, args.global_batch)
      loads[(s, n)] = variable_bytes_per_device(s, n, args.global_batch)
  variants = {}
  root = tempfile.mkdtemp(prefix='bench_aggregation_')
  try:
    if not args.bytes_only:
      variants = run_throughput(args, root)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print_table(args, variants, traffic, loads)
  print(f'\ntotal wall time {time.perf_counter() - t0:.0f} s')


if __name__ == '__main__':
  main()
