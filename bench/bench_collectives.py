"""Latency and bandwidth of one task collective on loopback (issue 28.5).

    .venv/bin/python bench/bench_collectives.py               # 5 min loaded
    .venv/bin/python bench/bench_collectives.py --quick       # 2-3 min
    .venv/bin/python bench/bench_collectives.py --paper_only  # instant

Feeds the cost model in docs/cost_model.md. Two parts, in one run:

1. What the library issues per step. The synchronous training graph of two
   models (this repo's bench_sync_cluster model: an embedding and a 2x256
   DNN; and ResNet-20 with its batch norms) is built for the chief of a
   chief + worker cluster with 2 towers, as the Estimator would build it
   (graph only, nothing runs). The collective ops the step's train_op and
   loss depend on are counted by kind and group, with the bytes each
   carries, and the longest chain of collectives that must run one after
   another (what latency adds up over).

2. What one collective costs. Inside a network namespace of its own
   (`unshare --net`, loopback only), max(--tasks) processes start a gRPC
   server each (task_sync.server_config, as training does) and time one
   CollectiveReduce ('Add', 'Id': TaskGroup.sum's op; TensorFlow picks ring
   on CPU) of one float32 tensor of 4 B .. --max-bytes, for each task
   count W of --tasks, among the first W tasks. Every cell (W, size) runs
   in every round, in an order rotated each round, so the load of other
   processes hits all alike; the chief times it and the median over rounds
   is what is printed, with
   * a no-op session run of the chief (the per-run overhead alone), and
   * 8 chained 4-byte collectives in one run (each reducing the previous
     result): the latency of a collective inside a step, without the
     session run around it.
   Then t(n) = alpha + n / beta is fitted per W, weighing every size's
   relative error alike, and the implied ring link rate 2 (W-1) / W * beta
   (what each task sends per second) is printed beside it.

3. On paper. The terms of one step's communication at 8 machines x 8 GPUs
   for BERT-base and ResNet-50, from ASSUMED hardware figures (constants
   in part 3 below; nothing of it is measured here): docs/cost_model.md.

No thresholds: this only prints.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

from absl import app
from absl import flags

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainer.cluster import private_network  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_bool('quick', False, '2 rounds, shorter cells.')
flags.DEFINE_list('tasks', ['2', '3'], 'Task counts W to time, side by side.')
flags.DEFINE_integer('rounds', 5, 'Rounds over every (W, size) cell.')
flags.DEFINE_float('cell_seconds', 0.2,
                   'About how long one cell runs per round.')
flags.DEFINE_integer('max_bytes', 16 * 2**20, 'Largest message, in bytes.')
flags.DEFINE_bool('count', True, 'Count the collectives of built sync graphs.')
flags.DEFINE_float('timeout', 300, 'Seconds the timing processes may take.')
flags.DEFINE_float('paper_alpha0', 0.3e-3,
                   'Per-collective CPU-side overhead (s) of the on-paper '
                   'table: the chained 4 B latency measured here.')
flags.DEFINE_bool('paper_only', False,
                  'Print only the on-paper table (nothing runs).')
flags.DEFINE_string('task_spec', None, 'Internal: run one timing task.')

# Group keys of the timed collectives, one per W, away from the library's.
_GROUP_BASE = 0x7E5B_0000
_CHAIN = 8
_COLLECTIVE_TYPES = ('CollectiveReduce', 'CollectiveReduceV2',
                     'CollectiveGather', 'CollectiveGatherV2',
                     'CollectiveBcastSend', 'CollectiveBcastRecv')


# --------------------------------------------------------------------------
# Part 1: the collectives of one synchronous training step.


def _dnn_model():
  """bench_sync_cluster's model and features (batch 16)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(ROOT, 'bench'))
  import bench_sync_cluster as sync_bench  # pylint: disable=g-import-not-at-top
  features = {'x': tf.zeros([16, sync_bench.INPUT_DIM]),
              'ids': tf.zeros([16], tf.int64)}
  return sync_bench.model_fn, features, {}


def _resnet20_model():
  """model_fns.resnet at depth 20 on 32x32x3 images (batch 16), momentum."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from model_fns import resnet  # pylint: disable=g-import-not-at-top

  def model_fn(features, labels, mode, params):
    return resnet.resnet_model_fn(features, labels, mode, params)
  params = {'n_classes': 10, 'image_shape': (32, 32, 3),
            'learning_rate': 0.1, 'optimizer': 'momentum'}
  return model_fn, {'image': tf.zeros([16, 32, 32, 3])}, params


COUNTED_MODELS = {'dnn_embedding': _dnn_model, 'resnet20': _resnet20_model}


def _step_graph(model):
  """(graph, spec) of `model`'s sync training step, as the chief's."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import estimator_towers  # pylint: disable=g-import-not-at-top
  cluster = {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']}
  saved = os.environ.get('TF_CONFIG')
  os.environ['TF_CONFIG'] = json.dumps(
      {'cluster': cluster, 'task': {'type': 'chief', 'index': 0}})
  try:
    graph = tf.Graph()
    with graph.as_default():
      model_fn, features, params = COUNTED_MODELS[model]()
      config = estimator_towers.make_run_config(cpu_devices=2)
      spec = estimator_towers.replicate_model_fn(
          model_fn, aggregation='all_reduce')(
              features, tf.zeros([16], tf.int32),
              tf.estimator.ModeKeys.TRAIN, params, config)
  finally:
    if saved is None:
      os.environ.pop('TF_CONFIG', None)
    else:
      os.environ['TF_CONFIG'] = saved
  return graph, spec


def _kind(op):
  """What a collective op exchanges, and between whom."""
  from estimator_towers.collectives import collective_keys as keys  # pylint: disable=g-import-not-at-top
  group = op.get_attr('group_key')
  verb = 'gather' if 'Gather' in op.type else 'reduce'
  if group == keys.TASK_GROUP:
    scope = op.name.split('/')
    where = next((s for s in scope if s.endswith('_over_tasks')), scope[0])
    return f'tasks {verb} ({where})'
  if group >= keys._TOWER_INDEX_GROUP_BASE:  # pylint: disable=protected-access
    return f'BN moments across tasks ({verb})'
  if group >= keys._TASK_TOWERS_GROUP_BASE:  # pylint: disable=protected-access
    return f'BN moments in the task ({verb})'
  return f'towers in the task ({verb})'


def _bytes(op):
  """Bytes of the op's input, or None when its shape is not static."""
  tensor = op.inputs[0]
  count = tensor.shape.num_elements()
  return None if count is None else count * tensor.dtype.size


def count_step_collectives(model):
  """The collectives one training step of `model` runs, on the chief.

  Returns:
    {'kinds': {kind: [ops, bytes or None]}, 'total': ops, 'chain': the
    longest dependency chain of collectives}.
  """
  graph, spec = _step_graph(model)
  del graph
  # The ops the step runs: everything train_op and the loss depend on.
  depth, order, stack = {}, [], [spec.train_op, spec.loss.op]
  seen = set()
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    order.append(op)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  kinds = {}
  # Longest chain of collectives: depth over the DAG, inputs first.
  pending = {op: [t.op for t in op.inputs] + list(op.control_inputs)
             for op in order}
  for op in _topological(pending):
    here = 1 if op.type in _COLLECTIVE_TYPES else 0
    depth[op] = here + max((depth[p] for p in pending[op]), default=0)
    if here:
      entry = kinds.setdefault(_kind(op), [0, 0])
      entry[0] += 1
      size = _bytes(op)
      entry[1] = None if size is None or entry[1] is None else entry[1] + size
  return {'kinds': kinds, 'total': sum(k[0] for k in kinds.values()),
          'chain': max(depth.values(), default=0)}


def _topological(parents):
  """The ops of `parents` (op -> its inputs), every op after its inputs."""
  done, result = set(), []
  for root in parents:
    stack = [(root, False)]
    while stack:
      op, expanded = stack.pop()
      if op in done:
        continue
      if expanded:
        done.add(op)
        result.append(op)
        continue
      stack.append((op, True))
      stack.extend((p, False) for p in parents[op] if p not in done)
  return result


def print_counts(models):
  print('collectives of one synchronous training step (chief of chief + '
        'worker, 2 towers each, graph built, not run):')
  for model in models:
    counted = count_step_collectives(model)
    print(f'  {model}: {counted["total"]} collectives per step, longest '
          f'chain of dependent collectives {counted["chain"]}')
    for kind, (ops, size) in sorted(counted['kinds'].items()):
      shown = 'dynamic' if size is None else f'{size:,} B'
      print(f'    {ops:>4} x {kind:<44} {shown:>14}')


# --------------------------------------------------------------------------
# Part 2: timing one collective (in the task processes).


def message_sizes(max_bytes):
  """4 B, 16 B, ... up to `max_bytes` (powers of 4)."""
  sizes, size = [], 4
  while size <= max_bytes:
    sizes.append(size)
    size *= 4
  return sizes


def reps_for(size, cell_seconds):
  """Runs per cell: the same on every task, from a rough guess of t(n)."""
  guess = 1e-3 + size / 2e8
  return max(3, min(400, int(cell_seconds / guess)))


def _cells(spec):
  """[(cell name, W, message bytes, reps)], the same list on every task."""
  cells = [('noop', 1, 0, reps_for(0, spec['cell_seconds']))]
  for width in spec['tasks']:
    cells.append((f'chain{_CHAIN}:{width}', width, 4,
                  reps_for(4 * _CHAIN, spec['cell_seconds'])))
    cells.extend((f'{size}:{width}', width, size,
                  reps_for(size, spec['cell_seconds']))
                 for size in spec['sizes'])
  return cells


def _cell_op(name, width, size, number, device):
  """The op of cell `number` (its place in `_cells`), on `device`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.ops import collective_ops  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  group = _GROUP_BASE + width
  with tf.device(device), tf1.variable_scope(name.replace(':', '_')):
    if name == 'noop':
      return tf.no_op()
    value = tf1.get_variable('value', [max(1, size // 4)],
                             initializer=tf1.zeros_initializer()).read_value()
    # The instance keys: the same on every task, one per collective.
    key = 1 + 64 * number
    links = _CHAIN if name.startswith('chain') else 1
    for link in range(links):
      # TaskGroup.sum's op: CollectiveReduce, merge 'Add', final 'Id'.
      value = collective_ops.all_reduce(value, width, group, key + link,
                                        'Add', 'Id')
    return value.op


def run_task(spec):
  """One timing process: joins every cell whose W includes it."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from estimator_towers.cluster import task_sync  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  cluster, index = spec['cluster'], spec['index']
  job, task = ('chief', 0) if index == 0 else ('worker', index - 1)
  server = tf.distribute.Server(
      tf.train.ClusterSpec(cluster), job_name=job, task_index=task,
      config=task_sync.server_config(None, cluster))
  device = f'/job:{job}/replica:0/task:{task}/device:CPU:0'
  cells = _cells(spec)
  numbers = {cell[0]: number for number, cell in enumerate(cells)}
  # Every task runs the cells it is in, in the same order as its peers.
  def in_it(cell):
    return index < cell[1] and (cell[0] != 'noop' or index == 0)
  mine = [cell for cell in cells if in_it(cell)]
  graph = tf.Graph()
  with graph.as_default():
    ops = {name: _cell_op(name, width, size, numbers[name], device)
           for name, width, size, _ in mine}
    init = tf1.global_variables_initializer()
  session = tf1.Session(server.target, graph=graph)
  session.run(init)
  for name, *_ in mine:  # Warm-up: the groups' and instances' resolution.
    for _ in range(3):
      session.run(ops[name])
  times = {name: [] for name, *_ in mine}
  for round_index in range(spec['rounds']):
    # Rotated over the whole list, so that the tasks' orders agree.
    shift = round_index % len(cells)
    for name, _, _, reps in filter(in_it, cells[shift:] + cells[:shift]):
      start = time.perf_counter()
      for _ in range(reps):
        session.run(ops[name])
      times[name].append((time.perf_counter() - start) / reps)
  session.close()
  if index == 0:
    with open(spec['result'], 'w') as f:
      json.dump(times, f)


# --------------------------------------------------------------------------
# Part 3: on paper, 8 machines x 8 GPUs. Every figure here is ASSUMED (no
# GPU, no second machine here); docs/cost_model.md gives the reasons.

PAPER_MACHINES, PAPER_GPUS = 8, 8
NVLINK_BUS = 100e9       # bytes/s, an NCCL all-reduce inside one machine
NVLINK_LATENCY = 20e-6   # s per NCCL collective inside one machine
INTO_ONE_GPU = 50e9      # bytes/s into (or out of) one GPU from its peers
HOP_LATENCY = 50e-6      # s per ring hop between machines (TCP + gRPC)
NET_GBITS = (25, 100)    # each machine's NIC, Gbit/s
# name: (float32 parameters, gradient tensors, batch-norm layers)
PAPER_MODELS = {'BERT-base': (110e6, 200, 0), 'ResNet-50': (25.6e6, 214, 53)}


def paper_rows(alpha0):
  """[(model, Gbit/s, {term: seconds})] of one step's communication.

  Args:
    alpha0: Per-collective overhead on the CPU side (s), from loopback.
  """
  machines, gpus = PAPER_MACHINES, PAPER_GPUS
  devices = machines * gpus
  cross_latency = alpha0 + 2 * (machines - 1) * HOP_LATENCY
  rows = []
  for model, (params, tensors, bn_layers) in PAPER_MODELS.items():
    size = 4 * params
    for gbits in NET_GBITS:
      net = gbits * 1e9 / 8
      rows.append((model, gbits, {
          'net_bw': 2 * (machines - 1) / machines * size / net,
          'lat_packed': cross_latency,
          'lat_per_tensor': tensors * cross_latency,
          'in_gpu0': 2 * (gpus - 1) * size / INTO_ONE_GPU,
          'in_nccl': (2 * (gpus - 1) / gpus * size / NVLINK_BUS +
                              NVLINK_LATENCY),
          'flat_ring64': (alpha0 + 2 * (devices - 1) * HOP_LATENCY +
                           2 * (devices - 1) / devices * size / net),
          'bn_chain': 2 * bn_layers * (cross_latency + NVLINK_LATENCY),
          'n*_MB': cross_latency * net * machines / (
              2 * (machines - 1)) / 1e6}))
  return rows


def print_paper(alpha0):
  print(f'\non paper (ASSUMED hardware, see docs/cost_model.md): '
        f'{PAPER_MACHINES} machines x {PAPER_GPUS} GPUs, float32 gradients, '
        f'per-collective overhead {alpha0 * 1e3:.2f} ms + '
        f'{HOP_LATENCY * 1e6:.0f} us per hop; ms per step')
  rows = paper_rows(alpha0)
  terms = list(rows[0][2])
  print(f'{"model":>10} {"Gb/s":>5} ' + ' '.join(f'{t:>14}' for t in terms))
  for model, gbits, values in rows:
    cells = [f'{v:>14.1f}' if t == 'n*_MB' else f'{v * 1e3:>14.1f}'
             for t, v in values.items()]
    print(f'{model:>10} {gbits:>5} ' + ' '.join(cells))


# --------------------------------------------------------------------------
# The driver (inside the namespace).


def _start(command, log_path):
  with open(log_path, 'w') as log:
    return subprocess.Popen(command, env={**os.environ, 'PYTHONPATH': ROOT},
                            stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            preexec_fn=private_network.die_with_parent)


def _stop(children):
  for child in children:
    if child.poll() is None:
      child.kill()
  for child in children:
    child.wait()


def time_collectives(spec, work_dir, timeout):
  """Runs the timing processes; {cell name: [seconds per run, per round]}."""
  count = max(spec['tasks'])
  cluster = {'chief': [f'127.0.0.1:{private_network.free_port()}']}
  cluster['worker'] = [f'127.0.0.1:{private_network.free_port()}'
                       for _ in range(count - 1)]
  spec = {**spec, 'cluster': cluster,
          'result': os.path.join(work_dir, 'times.json')}
  children = []
  try:
    for index in range(count):
      children.append(_start(
          [sys.executable, os.path.abspath(__file__),
           f'--task_spec={json.dumps({**spec, "index": index})}'],
          os.path.join(work_dir, f'task-{index}.log')))
    deadline = time.monotonic() + timeout
    for index, child in enumerate(children):
      try:
        code = child.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        code = f'nothing (still running after {timeout:g} s)'
      if code != 0:
        with open(os.path.join(work_dir, f'task-{index}.log')) as f:
          tail = ''.join(f.readlines()[-15:])
        raise RuntimeError(f'timing task {index} exited with {code}:\n'
                           f'{tail}')
  finally:
    _stop(children)
  with open(spec['result']) as f:
    return json.load(f)


def fit(sizes, seconds):
  """(alpha, beta, worst relative error) of t(n) = alpha + n / beta.

  Least squares on relative errors ((alpha + n g - t) / t), so that the
  4-byte and the 16 MB messages weigh alike.
  """
  # Normal equations of the 2-parameter weighted fit, by hand.
  weights = [1 / t**2 for t in seconds]
  s11 = sum(weights)
  s12 = sum(w * n for w, n in zip(weights, sizes))
  s22 = sum(w * n * n for w, n in zip(weights, sizes))
  b1 = sum(w * t for w, t in zip(weights, seconds))
  b2 = sum(w * n * t for w, n, t in zip(weights, sizes, seconds))
  det = s11 * s22 - s12 * s12
  alpha = (b1 * s22 - b2 * s12) / det
  inverse_beta = (s11 * b2 - s12 * b1) / det
  worst = max(abs(alpha + n * inverse_beta - t) / t
              for n, t in zip(sizes, seconds))
  return alpha, 1 / inverse_beta, worst


def print_timings(spec, times):
  """The table of median times per size and W, and the fits."""
  median = {name: statistics.median(values) for name, values in times.items()}
  widths = spec['tasks']
  print(f'\none CollectiveReduce (Add, float32) per session run, loopback; '
        f'median over {spec["rounds"]} rounds of the chief\'s mean time per '
        'run, in ms')
  print(f'{"bytes":>10} ' + ' '.join(f'{f"W={w} ms":>10} {"MB/s":>8}'
                                      for w in widths))
  for size in spec['sizes']:
    row = [f'{median[f"{size}:{w}"] * 1e3:>10.3f} '
           f'{size / median[f"{size}:{w}"] / 1e6:>8.1f}' for w in widths]
    print(f'{size:>10} ' + ' '.join(row))
  noop = median['noop']
  print(f'\nno-op session run of the chief: {noop * 1e3:.3f} ms')
  print(f'{"W":>3} {"alpha ms":>9} {"beta MB/s":>10} {"link MB/s":>10} '
        f'{"worst fit err":>14} {"alpha-noop ms":>14} '
        f'{"chained 4 B ms each":>20}')
  fits = {}
  for width in widths:
    seconds = [median[f'{size}:{width}'] for size in spec['sizes']]
    alpha, beta, worst = fit(spec['sizes'], seconds)
    chained = (median[f'chain{_CHAIN}:{width}'] - noop) / _CHAIN
    link = beta * 2 * (width - 1) / width
    fits[width] = (alpha, beta)
    print(f'{width:>3} {alpha * 1e3:>9.3f} {beta / 1e6:>10.1f} '
          f'{link / 1e6:>10.1f} {worst * 100:>13.1f}% '
          f'{(alpha - noop) * 1e3:>14.3f} {chained * 1e3:>20.3f}')
  print('beta: message bytes per second of the fit; link: 2 (W-1)/W x beta, '
        'the bytes each task sends per second in a ring all-reduce')
  return fits


def benchmark():
  """Counts, then times (inside the namespace)."""
  private_network.bring_up_loopback()
  if FLAGS.count:
    started = time.monotonic()
    print_counts(COUNTED_MODELS)
    print(f'(counting: {time.monotonic() - started:.0f} s)', flush=True)
  spec = {'tasks': sorted({int(w) for w in FLAGS.tasks}),
          'sizes': message_sizes(FLAGS.max_bytes),
          'rounds': FLAGS.rounds, 'cell_seconds': FLAGS.cell_seconds}
  work_dir = tempfile.mkdtemp(prefix='bench_collectives_')
  try:
    started = time.monotonic()
    times = time_collectives(spec, work_dir, FLAGS.timeout)
    print(f'(timing: {time.monotonic() - started:.0f} s, '
          f'{max(spec["tasks"])} processes)')
    print_timings(spec, times)
    print_paper(FLAGS.paper_alpha0)
  finally:
    shutil.rmtree(work_dir, ignore_errors=True)


def main(argv):
  if FLAGS.task_spec:
    run_task(json.loads(FLAGS.task_spec))
    return 0
  widths = [w for w in FLAGS.tasks]
  if not all(w.isdigit() and int(w) >= 2 for w in widths):
    raise app.UsageError(f'--tasks={",".join(widths)}: give task counts '
                         '>= 2, e.g. --tasks=2,3')
  if FLAGS.max_bytes < 4:
    raise app.UsageError(f'--max_bytes={FLAGS.max_bytes}: give at least 4.')
  if FLAGS.paper_only:
    print_paper(FLAGS.paper_alpha0)
    return 0
  if not private_network.inside():
    return private_network.reexec_inside(
        [os.path.abspath(__file__), *sys.argv[1:]])
  if FLAGS.quick:
    FLAGS.rounds, FLAGS.cell_seconds = 2, 0.05
  del argv
  benchmark()
  return 0


if __name__ == '__main__':
  app.run(main)
