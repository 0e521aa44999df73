"""Peak memory and throughput of micro-batches at one global batch.

`replicate_model_fn(..., micro_batches=M)` runs each tower's shard as M
micro-batches one after another; the point is memory. For each model and
M in 1, 2, 4, 8 (same global batch, same CPU towers), a FRESH subprocess
builds the towered TRAIN graph (the replicated model_fn called as the
Estimator calls it, with an in-memory batch), initializes it, then:

* after the timed steps, runs one more step traced
  (`RunOptions(trace_level=FULL_TRACE)`): `peak MB` is the largest
  `allocator_bytes_in_use` TensorFlow's CPU allocator reports over that
  step's ops, i.e. the allocator's peak of live tensors, every tower
  together; `variables MB` is what the variables and optimizer slots
  (alive all the time) hold of it, `step MB` the rest: the activations,
  gradients and temporaries the micro-batches are there to bound. (The
  process's peak RSS is no good measure here: glibc keeps freed tensors in
  its heap, and the first run also optimises the graph);
* times steps after one warm-up step: examples/s of the global batch;
* reports the graph's op count and build time (the graph grows M-fold).

Models (no batch norm: micro-batches refuse it, see micro_batches.py):

  resnet       ResNet-20 for 32x32x3 images (3 stages of 3 residual
               blocks, 16/32/64 channels) without normalisation, Momentum
  transformer  a BERT-base-sized layer stack: hidden 768, 12 heads,
               feed-forward 3072, sequence 128, layers as --layers, Adam

  .venv/bin/python bench/bench_micro_batches.py             # ~4 min here
  .venv/bin/python bench/bench_micro_batches.py --quick     # smoke run

With --cap-mb C it prints instead, per M, the largest global batch (a
multiple of --granularity) whose traced step's peak stays at or below C MB
and whose loss is finite: doubling from --start-batch, then bisection, each
probe a fresh subprocess. The CPU allocator has no cap of its own, so the
cap is on the measured peak; --real-cap caps the allocator itself
(TF_MKL_ALLOC_MAX_BYTES: an allocation beyond it fails) and a batch fits
when its step runs.

The children run with TF_ENABLE_ONEDNN_OPTS=1 (unless set): the peak comes
from oneDNN's CPU allocator, the only one that keeps statistics.

No figure is asserted: this prints a table and the ratios to M = 1.
"""

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)


def _resnet_model_fn(features, labels, mode, params):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  init = lambda seed: tf1.glorot_uniform_initializer(seed=seed)  # pylint: disable=unnecessary-lambda-assignment
  seeds = iter(range(1, 1000))

  def conv(x, filters, stride=1):
    return tf1.layers.conv2d(x, filters, 3, stride, padding='same',
                             use_bias=False,
                             kernel_initializer=init(next(seeds)))

  x = tf.nn.relu(conv(features['x'], 16))
  for stage, filters in enumerate((16, 32, 64)):
    for block in range(3):
      stride = 2 if stage and not block else 1
      shortcut = x
      if stride != 1:
        shortcut = tf1.layers.conv2d(x, filters, 1, stride,
                                     kernel_initializer=init(next(seeds)))
      y = tf.nn.relu(conv(x, filters, stride))
      x = tf.nn.relu(shortcut + 0.5 * conv(y, filters))
  logits = tf1.layers.dense(tf.reduce_mean(x, [1, 2]), 10,
                            kernel_initializer=init(999))
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  train_op = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(
      loss, tf1.train.get_or_create_global_step())
  del params
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _transformer_model_fn(features, labels, mode, params):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  hidden, heads, inner = 768, 12, 3072
  init = lambda seed: tf1.truncated_normal_initializer(stddev=0.02, seed=seed)  # pylint: disable=unnecessary-lambda-assignment
  x = features['x']  # [batch, seq, hidden]
  seq = x.shape[1]
  for layer in range(params['layers']):
    with tf1.variable_scope(f'layer_{layer}'):
      flat = tf.reshape(x, [-1, hidden])

      def dense(t, width, name, seed, activation=None):
        return tf1.layers.dense(t, width, activation=activation, name=name,
                                kernel_initializer=init(seed))

      def split(t):
        return tf.transpose(tf.reshape(t, [-1, seq, heads, hidden // heads]),
                            [0, 2, 1, 3])

      q = split(dense(flat, hidden, 'query', 10 * layer + 1))
      k = split(dense(flat, hidden, 'key', 10 * layer + 2))
      v = split(dense(flat, hidden, 'value', 10 * layer + 3))
      scores = tf.matmul(q, k, transpose_b=True) / float(hidden // heads)**.5
      context = tf.matmul(tf.nn.softmax(scores), v)
      context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [-1, hidden])
      attention = dense(context, hidden, 'output', 10 * layer + 4)
      flat = tf.keras.layers.LayerNormalization(name='ln_1')(flat + attention)
      up = dense(flat, inner, 'intermediate', 10 * layer + 5, tf.nn.gelu)
      flat = tf.keras.layers.LayerNormalization(name='ln_2')(
          flat + dense(up, hidden, 'ffn_output', 10 * layer + 6))
      x = tf.reshape(flat, [-1, seq, hidden])
  logits = tf1.layers.dense(x[:, 0], 2, kernel_initializer=init(99))
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  train_op = tf1.train.AdamOptimizer(1e-4).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _child(args) -> dict:
  """One (model, M) run in this process; returns its figures."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import trainer  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  rng = np.random.RandomState(0)
  if args.model == 'resnet':
    x = rng.rand(args.batch, 32, 32, 3).astype(np.float32)
    model_fn, params = _resnet_model_fn, {}
  else:
    x = rng.randn(args.batch, 128, 768).astype(np.float32)
    model_fn, params = _transformer_model_fn, {'layers': args.layers}
  y = rng.randint(0, 2, args.batch).astype(np.int32)
  config = trainer.make_run_config(cpu_devices=args.towers)
  graph = tf.Graph()
  with graph.as_default():
    features, labels = tf1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensors(({'x': x}, y)).repeat()).get_next()
    start = time.perf_counter()
    spec = trainer.replicate_model_fn(model_fn,
                                      micro_batches=args.micro_batches)(
                                          features, labels,
                                          tf.estimator.ModeKeys.TRAIN, params,
                                          config)
    build_secs = time.perf_counter() - start
    init = tf1.global_variables_initializer()
  ops = len(graph.get_operations())
  with tf1.Session(graph=graph, config=config.session_config) as session:
    session.run(init)
    # Warm-up: the first run optimises the graph (and reports no memory in
    # a trace).
    _, loss = session.run((spec.train_op, spec.loss))
    start = time.perf_counter()
    for _ in range(args.steps):
      session.run(spec.train_op)
    secs = time.perf_counter() - start
    metadata = tf1.RunMetadata()
    # The warm-up's fetches again: a new set's first run would trace none.
    _, loss = session.run((spec.train_op, spec.loss), options=tf1.RunOptions(
        trace_level=tf1.RunOptions.FULL_TRACE), run_metadata=metadata)
    variables = sum(v.shape.num_elements() * v.dtype.size
                    for v in graph.get_collection(
                        tf1.GraphKeys.GLOBAL_VARIABLES))
  peak = max(memory.allocator_bytes_in_use
             for device in metadata.step_stats.dev_stats
             for node in device.node_stats for memory in node.memory)
  if not peak:
    raise RuntimeError(
        'The trace reports no allocator bytes in use: TensorFlow\'s CPU '
        'allocator keeps no statistics with TF_ENABLE_ONEDNN_OPTS='
        f"{os.environ.get('TF_ENABLE_ONEDNN_OPTS')!r}; leave it unset or 1.")
  return {'model': args.model, 'M': args.micro_batches,
          'peak_mb': peak / 2**20, 'variables_mb': variables / 2**20,
          'examples_per_sec': args.batch * args.steps / max(secs, 1e-9),
          'build_secs': build_secs, 'ops': ops,
          'loss_finite': bool(np.isfinite(loss))}


def _run_child(args, model: str, m: int, batch: int, steps: int,
               cap_bytes: int = 0) -> dict:
  """Runs one (model, M, batch) in a fresh subprocess (its allocator capped
  at `cap_bytes` if not 0); returns its figures, or {'error': last stderr
  line} when the subprocess fails."""
  command = [sys.executable, os.path.abspath(__file__), '--child',
             '--model', model, '--micro_batches', str(m),
             '--towers', str(args.towers), '--batch', str(batch),
             '--layers', str(args.layers), '--steps', str(steps)]
  env = dict(os.environ)
  # oneDNN's CPU allocator ('mklcpu', a BFC allocator) keeps the statistics
  # the trace reports; TensorFlow's plain CPU allocator, its default where
  # oneDNN is off (CPUs without AVX-512 such as this AMD host), reports 0.
  env.setdefault('TF_ENABLE_ONEDNN_OPTS', '1')
  if cap_bytes:
    # A real cap: that allocator fails an allocation beyond it (an OOM).
    env['TF_MKL_ALLOC_MAX_BYTES'] = str(cap_bytes)
  result = subprocess.run(command, capture_output=True, text=True, cwd=_ROOT,
                          check=False, env=env)
  if result.returncode:
    lines = result.stderr.strip().splitlines() or ['(no stderr)']
    return {'error': f'exit {result.returncode}: {lines[-1][:200]}'}
  return json.loads(result.stdout.strip().splitlines()[-1])


def _fits(args, model: str, m: int, batch: int, log: list) -> bool:
  """Whether a global batch trains under the cap: its step runs, its loss
  is finite and its measured peak stays at or below --cap-mb (with
  --real-cap: the allocator refuses more, and the step still runs)."""
  if args.real_cap:
    row = _run_child(args, model, m, batch, 0, int(args.cap_mb * 2**20))
    fits = 'error' not in row and row['loss_finite']
  else:
    # A batch far over the cap fails fast instead of running a long step:
    # its allocator refuses twice the cap (a batch under the cap, even
    # with the allocator's fragmentation, never gets there).
    row = _run_child(args, model, m, batch, 0, int(2 * args.cap_mb * 2**20))
    fits = 'error' not in row and row['loss_finite'] and (
        row['peak_mb'] <= args.cap_mb)
  log.append((batch, row, fits))
  print(f'  M={m} batch {batch}: '
        f"{row.get('error') or format(row['peak_mb'], '.0f') + ' MB'}"
        f"{'' if fits else ' (over)'}", flush=True)
  return fits


def _largest_batch(args, model: str, m: int) -> dict:
  """The largest global batch (a multiple of --granularity) whose step runs
  under the cap: doubling from --start-batch, then bisection."""
  start = time.perf_counter()
  log = []
  grain = args.granularity
  low, high = 0, args.start_batch
  while high <= args.max_batch and _fits(args, model, m, high, log):
    low, high = high, 2 * high
  if high > args.max_batch:
    high = args.max_batch + grain  # Not reached: the answer is a bound.
  while high - low > grain:
    middle = (low + high) // 2 // grain * grain
    if _fits(args, model, m, middle, log):
      low = middle
    else:
      high = middle
  peak = next((row['peak_mb'] for batch, row, _ in log if batch == low), 0.0)
  return {'model': model, 'M': m, 'batch': low, 'peak_mb': peak,
          'probes': len(log), 'secs': time.perf_counter() - start}


def _cap_table(args, models) -> None:
  """Prints the largest global batch under the cap for M = 1, 2, 4, 8."""
  rows = []
  for model in models:
    for m in args.counts:
      rows.append(_largest_batch(args, model, m))
      print(rows[-1], flush=True)
  what = ('of the CPU allocator (TF_MKL_ALLOC_MAX_BYTES)' if args.real_cap
          else 'on the measured allocator peak')
  print(f'\n{args.towers} CPU towers; cap {args.cap_mb:.0f} MB {what}, every '
        f'tower together; granularity {args.granularity} examples')
  print('| model | M | largest global batch | vs M=1 | peak MB at it | '
        'probes | search s |')
  print('| --- | --- | --- | --- | --- | --- | --- |')
  for row in rows:
    base = next((r for r in rows if r['model'] == row['model'] and
                 r['M'] == 1), None)
    ratio = row['batch'] / base['batch'] if base and base['batch'] else (
        float('nan'))
    print(f"| {row['model']} | {row['M']} | {row['batch']} | {ratio:.2f}x | "
          f"{row['peak_mb']:.0f} | {row['probes']} | {row['secs']:.0f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--model', default='resnet')
  parser.add_argument('--models', default='resnet,transformer',
                      help='comma-separated models of the table')
  parser.add_argument('--micro_batches', type=int, default=1)
  parser.add_argument('--towers', type=int, default=2)
  parser.add_argument('--batch', type=int, default=0)
  parser.add_argument('--layers', type=int, default=2)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--cap-mb', dest='cap_mb', type=float, default=0,
                      help='instead of the table at one batch: the largest '
                      'global batch whose measured peak stays under this')
  parser.add_argument('--granularity', type=int, default=16,
                      help='--cap-mb: batches searched are multiples of it')
  parser.add_argument('--counts', type=lambda text: [
      int(m) for m in text.split(',')], default=[1, 2, 4, 8],
                      help='--cap-mb: the micro-batch counts M searched')
  parser.add_argument('--real-cap', dest='real_cap', action='store_true',
                      help='--cap-mb caps the allocator itself: a batch fits '
                      'when its step runs (no OOM) with a finite loss')
  parser.add_argument('--start-batch', dest='start_batch', type=int,
                      default=64, help='--cap-mb: first batch tried')
  parser.add_argument('--max-batch', dest='max_batch', type=int,
                      default=16384, help='--cap-mb: largest batch tried')
  args = parser.parse_args()
  if args.child:
    print(json.dumps(_child(args)))
    return
  models = args.models.split(',')
  unknown = set(models) - {'resnet', 'transformer'}
  if unknown:
    parser.error(f'--models: unknown {sorted(unknown)}; choose among '
                 'resnet, transformer')
  if args.cap_mb:
    _cap_table(args, models)
    return
  counts = (1, 4) if args.quick else (1, 2, 4, 8)
  batches = {'resnet': 256, 'transformer': 32}
  rows = []
  for model in models:
    for m in counts:
      rows.append(_run_child(args, model, m, args.batch or batches[model],
                             1 if args.quick else args.steps))
      if 'error' in rows[-1]:
        sys.exit(f'{model} M={m}: {rows[-1]["error"]}')
      print(rows[-1], flush=True)
  print(f'\n{args.towers} CPU towers; global batch resnet '
        f'{args.batch or batches["resnet"]}, transformer '
        f'{args.batch or batches["transformer"]} x 128 tokens, '
        f'{args.layers} layers')
  print('| model | M | peak MB | variables MB | step MB | step vs M=1 | '
        'examples/s | vs M=1 | ops | build s |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
  for row in rows:
    base = next(r for r in rows if r['model'] == row['model'] and r['M'] == 1)
    step = row['peak_mb'] - row['variables_mb']
    base_step = base['peak_mb'] - base['variables_mb']
    print(f"| {row['model']} | {row['M']} | {row['peak_mb']:.0f} | "
          f"{row['variables_mb']:.0f} | {step:.0f} | "
          f"{step / base_step:.2f}x | {row['examples_per_sec']:.1f} | "
          f"{row['examples_per_sec'] / base['examples_per_sec']:.2f}x | "
          f"{row['ops']} | {row['build_secs']:.1f} |")


if __name__ == '__main__':
  main()
