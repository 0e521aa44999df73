"""Synchronous vs asynchronous loopback clusters, side by side (issue 18).

    .venv/bin/python bench/bench_sync_cluster.py            # 7-12 min here
    .venv/bin/python bench/bench_sync_cluster.py --quick    # ~2 min

Ways to train the same model (a 5000x32 embedding and a 2x256 DNN, Adam) on
the same global batch per step, every process in ONE network namespace of
its own (`unshare --net`, loopback only):

  sync      chief + 1 worker (--workers=N: N workers), 2 virtual CPU
            towers each,
            replicate_model_fn(aggregation='all_reduce'), train_and_evaluate
  async_ps  chief + 1 worker + 1 ps, 2 towers each, aggregation='global_loss';
            each worker's batch is half the global batch, so each task does
            per step the work it does in `sync`
  one       one process, 2 towers per task of `sync` (4; 6 with
            --workers=2), all_reduce, no cluster
  mwms      Estimator + RunConfig(train_distribute=
            tf.distribute.experimental.MultiWorkerMirroredStrategy()),
            TF_CONFIG chief + worker(s), one replica (CPU:0) per task
  sync_1tower  as `sync` with 1 tower per task: the same layout as `mwms`
            (not in --quick)
  mwms_shared  `mwms` with each task's thread pools sized as `sync`'s
  sync_tf_threads  `sync` with TensorFlow's own thread pools (not in --quick)
  async_ps_tf_threads  `async_ps` with TensorFlow's own thread pools (only
            by --configs)
  sync_bn_global, sync_bn_per_tower
            as `sync` with a batch norm after each hidden layer, with
            batch_norm='global' (moments exchanged between the towers and
            the tasks at each call) or 'per_tower' (only by --configs)
  sync_dropout_per_tower, sync_dropout_one_device
            as `sync` with dropout 0.1 after each hidden layer, with
            random_ops='per_tower' or 'one_device' (only by --configs)

Every process here shares the machine's cores. The cluster tasks get the
share `python -m trainer.cluster` gives each task it starts
(trainer/core_share.py: intra-op = cores // training tasks, inter-op half
that, at least 1 each); `one`, `mwms` and the `*_tf_threads`
configurations keep TensorFlow's default (every core, in every process),
as a user running them gets it.

Configurations alternate within each round (the order rotates), so the
load other processes put on the machine hits all alike; the median over
rounds and the ratio to `one`, measured in the same run, are what to read.

A hook in the chief (the one process for `one`) opens a window once global
step `skip` is reached and closes it `steps` global batches later. In it:
* examples/sec = examples in the window's global steps / wall seconds;
* bytes sent: `ss -tinp` reads each TCP socket's `bytes_sent` (kernel
  tcp_info) in the namespace at both ends of the window, per process; the
  table gives what the training tasks sent per task and step (a step being
  one update of the variables: a global step in sync, one worker's update
  under async_ps) and, apart, what the ps sent. /proc/net/dev's loopback
  total is printed as a cross-check;
* the CPU other processes of the machine used meanwhile (/proc/stat minus
  the benchmark's own processes, those owning sockets), in cores;
* the CPU the configuration's own processes used (`own cores`: below the
  machine's cores when tasks wait for each other with cores idle), and
  examples per second of that CPU against `one`'s (`ex/cpu-s vs one`:
  the work each example costs, whatever the waits);
* the chief's thread count when the window closes.
The chief's model_fn also reports how many replicas were in sync and how
many rows each saw, a check of the batch split. All tasks are killed as
soon as the window closes.

`--packing` (on by default) then measures what packing gradients into one
collective is worth: two processes in the namespace, each with its gRPC
server and a graph of variables shaped like a model's (ResNet-20's
trainable variables: many small tensors; the DNN here: few large ones),
time `TaskGroup.sum(all)` (one packed all-reduce per dtype, as training
does) against one `TaskGroup.sum([v])` per variable, alternating, both
without a collective timeout and with `--pack-timeout` seconds.

`--trace` also traces 5 steps of every task before the window
(bench/step_trace.py) and prints, per task, the step's wall time, each
device's busy time, the collectives' time and the longest op types.

No thresholds: this only prints.
"""

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainer import core_share  # pylint: disable=wrong-import-position
from trainer.cluster import private_network  # pylint: disable=wrong-import-position

_TRACED_STEPS = 5
CONFIGS = ('sync', 'async_ps', 'one', 'mwms', 'sync_1tower', 'mwms_shared',
           'sync_tf_threads', 'async_ps_tf_threads', 'sync_bn_global',
           'sync_bn_per_tower', 'sync_dropout_per_tower',
           'sync_dropout_one_device')
DEFAULT_CONFIGS = CONFIGS[:7]
QUICK_CONFIGS = ('sync', 'one', 'mwms', 'mwms_shared')
# Thread pools of TensorFlow's own choosing (every core, in every process):
# the one process, MultiWorkerMirroredStrategy as its users run it, and the
# synchronous and the ps cluster as they ran before trainer.cluster shared
# the cores.
_TF_THREADS = ('one', 'mwms', 'sync_tf_threads', 'async_ps_tf_threads')
INPUT_DIM = 128
VOCAB = 5000
EMBEDDING_DIM = 32
HIDDEN = (256, 256)
NUM_CLASSES = 10
NUM_EXAMPLES = 4096
_NEVER = 10**9
_BYTES_SENT = re.compile(r'bytes_sent:(\d+)')
_PID = re.compile(r'pid=(\d+)')
# What the model_fn saw when it was last built: a check that each
# configuration splits the global batch as it should.
_BUILT = {}


# --------------------------------------------------------------------------
# The model, the input and the measuring hook (run in the task processes).


def model_fn(features, labels, mode):
  """An embedding (sparse gradients) and a 2x256 DNN, Adam.

  Estimator checks a model_fn's arguments by name and refuses any it does
  not pass (`mwms` hands it to Estimator unwrapped): the variants are
  `bn_model_fn` and `dropout_model_fn`.
  """
  return _model(features, labels, mode, batch_norm=False, dropout=False)


def _model(features, labels, mode, batch_norm, dropout):
  """`model_fn`; with `batch_norm`, a batch norm after each hidden layer's
  product; with `dropout`, BERT's dropout (0.1) after each hidden layer."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  table = tf1.get_variable(
      'embedding', [VOCAB, EMBEDDING_DIM],
      initializer=tf1.random_normal_initializer(stddev=0.05, seed=1))
  hidden = tf.concat(
      [features['x'], tf.nn.embedding_lookup(table, features['ids'])], 1)
  for units in HIDDEN:
    if batch_norm:
      hidden = tf.nn.relu(tf1.layers.batch_normalization(
          tf1.layers.dense(hidden, units),
          training=mode == tf.estimator.ModeKeys.TRAIN))
      continue
    hidden = tf1.layers.dense(hidden, units, activation=tf.nn.relu)
    if dropout and mode == tf.estimator.ModeKeys.TRAIN:
      hidden = tf1.nn.dropout(hidden, keep_prob=0.9)
  logits = tf1.layers.dense(hidden, NUM_CLASSES)
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  _BUILT['rows_per_replica'] = features['x'].shape[0]
  _BUILT['replicas_in_sync'] = (
      tf.distribute.get_replica_context().num_replicas_in_sync)
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = tf1.train.AdamOptimizer(1e-3).minimize(
        loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def bn_model_fn(features, labels, mode):
  """`model_fn` with batch norm (the sync_bn_* configurations)."""
  return _model(features, labels, mode, batch_norm=True, dropout=False)


def dropout_model_fn(features, labels, mode):
  """`model_fn` with dropout (the sync_dropout_* configurations)."""
  return _model(features, labels, mode, batch_norm=False, dropout=True)


def make_input_fn(batch):
  """Batches of `batch` rows of a fixed synthetic array, forever."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def input_fn(input_context=None):
    del input_context  # Every task reads the whole array; speed only.
    rng = np.random.RandomState(0)
    x = rng.standard_normal((NUM_EXAMPLES, INPUT_DIM)).astype(np.float32)
    ids = rng.randint(0, VOCAB, NUM_EXAMPLES).astype(np.int64)
    y = rng.randint(0, NUM_CLASSES, NUM_EXAMPLES).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices(({'x': x, 'ids': ids}, y))
    return data.cache().repeat().batch(batch, drop_remainder=True).prefetch(2)
  return input_fn


def _socket_bytes_sent():
  """{(pid, local, peer): bytes_sent} of every TCP socket in the namespace."""
  listing = subprocess.run(['ss', '-tinpH'], capture_output=True, text=True,
                           check=True).stdout
  sent, key = {}, None
  for line in listing.splitlines():
    if not line[:1].isspace():  # A socket's first line: addresses, users.
      fields, pid = line.split(), _PID.search(line)
      key = (int(pid.group(1)), fields[3], fields[4]) if pid else None
      continue
    found = _BYTES_SENT.search(line)
    if key is not None:
      sent[key] = int(found.group(1)) if found else 0
  return sent


def _loopback_tx_bytes():
  with open('/proc/net/dev') as f:
    for line in f:
      name, _, counters = line.partition(':')
      if name.strip() == 'lo':
        return int(counters.split()[8])
  return 0


def _cpu_seconds(pids):
  """(busy seconds of the whole machine, of the processes `pids`)."""
  tick = os.sysconf('SC_CLK_TCK')
  with open('/proc/stat') as f:
    ticks = [int(x) for x in f.readline().split()[1:9]]
  machine = sum(ticks) - ticks[3] - ticks[4]  # Minus idle and iowait.
  ours = 0
  for pid in pids:
    try:
      with open(f'/proc/{pid}/stat') as f:
        fields = f.read().rpartition(')')[2].split()
      ours += int(fields[11]) + int(fields[12])  # utime, stime.
    except OSError:
      pass
  return machine / tick, ours / tick


def _snapshot():
  sockets = _socket_bytes_sent()
  pids = {key[0] for key in sockets} | {os.getpid()}
  machine, ours = _cpu_seconds(pids)
  return {'time': time.monotonic(), 'sockets': sockets,
          'lo': _loopback_tx_bytes(), 'machine_cpu': machine,
          'our_cpu': ours}


def _threads():
  """This process's thread count (/proc/self/status)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('Threads:'):
        return int(line.split()[1])
  return 0


def _window(first, last, global_steps):
  """What the benchmark reports of one window, JSON-ready."""
  sent = {}
  for key, count in last['sockets'].items():
    before = first['sockets'].get(key, 0)
    sent[str(key[0])] = sent.get(str(key[0]), 0) + max(0, count - before)
  seconds = last['time'] - first['time']
  return {
      'seconds': seconds, 'global_steps': global_steps, 'sent_by_pid': sent,
      'lo_bytes': last['lo'] - first['lo'], 'built': dict(_BUILT),
      'threads': _threads(),
      'own_cores': (last['our_cpu'] - first['our_cpu']) / seconds,
      'other_cores': ((last['machine_cpu'] - first['machine_cpu']) -
                      (last['our_cpu'] - first['our_cpu'])) / seconds}


def make_window_hook(skip, steps, path):
  """A hook timing global steps [skip, skip + steps); writes `path`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1

  class WindowHook(tf1.train.SessionRunHook):
    """Measures one steady-state window, then writes it as JSON."""

    def begin(self):
      self._step = tf1.train.get_global_step()
      self._first = None
      self._done = False

    def before_run(self, run_context):
      return tf1.train.SessionRunArgs(self._step)

    def after_run(self, run_context, run_values):
      step = int(run_values.results)
      if self._done or step < skip:
        return
      if self._first is None:
        self._first, self._first_step = _snapshot(), step
      elif step >= self._first_step + steps:
        self._done = True
        window = _window(self._first, _snapshot(), step - self._first_step)
        scratch = f'{path}.{os.getpid()}'
        with open(scratch, 'w') as f:
          json.dump(window, f)
        os.replace(scratch, path)

  return WindowHook()


def run_task(spec):
  """One task (or the one process) of a configuration; `spec` from main."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import estimator_towers  # pylint: disable=g-import-not-at-top
  tf.get_logger().setLevel('ERROR')
  name, batch = spec['config'], spec['batch']
  quiet = dict(save_checkpoints_steps=_NEVER, save_summary_steps=_NEVER,
               log_step_count_steps=_NEVER,
               experimental_max_worker_delay_secs=0)
  intra, inter = spec['intra_op_threads'], spec['inter_op_threads']
  if name.startswith('mwms'):
    strategy = tf.distribute.experimental.MultiWorkerMirroredStrategy()
    if intra:
      quiet['session_config'] = tf.compat.v1.ConfigProto(
          inter_op_parallelism_threads=inter,
          intra_op_parallelism_threads=intra)
    config = tf.estimator.RunConfig(model_dir=spec['model_dir'],
                                    train_distribute=strategy, **quiet)
    estimator = tf.estimator.Estimator(model_fn, config=config)
  else:
    aggregation = 'global_loss' if name.startswith('async') else 'all_reduce'
    config = estimator_towers.make_run_config(
        model_dir=spec['model_dir'], cpu_devices=spec['towers'],
        inter_op_threads=inter, intra_op_threads=intra, **quiet)
    model, options = model_fn, {}
    if name.startswith('sync_bn'):
      model = bn_model_fn
      options['batch_norm'] = name[len('sync_bn_'):]
    elif name.startswith('sync_dropout'):
      model = dropout_model_fn
      options['random_ops'] = name[len('sync_dropout_'):]
    estimator = tf.estimator.Estimator(
        estimator_towers.replicate_model_fn(model, aggregation=aggregation,
                                            **options),
        config=config)
  hooks = []
  # Not config.is_chief: a RunConfig with train_distribute says True on
  # every task until the distribute coordinator rewrites it.
  if json.loads(os.environ.get('TF_CONFIG', '{}')).get(
      'task', {}).get('type', 'chief') == 'chief':
    hooks.append(make_window_hook(spec['skip'], spec['steps'],
                                  spec['result']))
  if spec['trace']:
    import step_trace  # pylint: disable=g-import-not-at-top
    task = json.loads(os.environ.get('TF_CONFIG', '{}')).get('task', {})
    hooks.append(step_trace.make_hook(
        spec['trace_at'], _TRACED_STEPS, os.path.join(
            spec['model_dir'],
            f'trace-{task.get("type", "one")}-{task.get("index", 0)}.json')))
  input_fn = make_input_fn(batch)
  if name == 'one':
    estimator.train(input_fn, hooks=hooks, max_steps=_NEVER)
    return
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(input_fn, max_steps=_NEVER, hooks=hooks),
      tf.estimator.EvalSpec(input_fn, steps=1))


# --------------------------------------------------------------------------
# The driver (inside the namespace).


def _tasks_of(name, workers=1):
  """[(job, index)] of a configuration; job None for the one process."""
  if name == 'one':
    return [(None, 0)]
  tasks = [('chief', 0)] + [('worker', i) for i in range(workers)]
  return tasks + [('ps', 0)] if name.startswith('async') else tasks


def _start(command, env, log_path):
  log = open(log_path, 'w')  # pylint: disable=consider-using-with
  try:
    return subprocess.Popen(command, env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=private_network.die_with_parent)
  finally:
    log.close()


def _stop(children):
  for child in children:
    if child.poll() is None:
      child.kill()
  for child in children:
    child.wait()


def _tail(path, lines=15):
  with open(path) as f:
    return ''.join(f.readlines()[-lines:])


def run_config(name, args, work_dir):
  """Runs one configuration until its window closes; its figures."""
  tasks = _tasks_of(name, args.workers)
  cluster = {}
  for job, _ in tasks:
    if job:
      cluster.setdefault(job, []).append(
          f'127.0.0.1:{private_network.free_port()}')
  training = sum(1 for job, _ in tasks if job != 'ps')
  # Per task: the global batch split over the training tasks; async_ps
  # then counts one worker's batch per global step.
  batch = args.global_batch // training
  # `one` has as many towers as the tasks of `sync` together.
  towers = {'one': 2 * (args.workers + 1), 'mwms': 1, 'mwms_shared': 1,
            'sync_1tower': 1}.get(name, 2)
  # As trainer.cluster starts tasks on one machine: each its share.
  # (0, 0): TensorFlow's choice.
  intra, inter = (0, 0) if name in _TF_THREADS else core_share.pool_sizes(
      training, core_share.machine_cores())
  per_update = batch if name.startswith('async') else args.global_batch
  updates_per_batch = training if name.startswith('async') else 1
  model_dir = tempfile.mkdtemp(prefix=f'{name}_', dir=work_dir)
  result = os.path.join(model_dir, 'window.json')
  spec = {'config': name, 'batch': batch, 'towers': towers,
          'intra_op_threads': intra, 'inter_op_threads': inter,
          'model_dir': model_dir, 'result': result,
          'skip': args.skip * updates_per_batch,
          'steps': args.steps * updates_per_batch,
          # Traced steps end before the window opens: they do not count.
          'trace': args.trace, 'trace_at': args.skip * updates_per_batch // 2}
  children, roles = [], {}
  try:
    for job, index in tasks:
      env = {**os.environ, 'PYTHONPATH': ROOT}
      env.pop('TF_CONFIG', None)
      if job:
        env['TF_CONFIG'] = json.dumps(
            {'cluster': cluster, 'task': {'type': job, 'index': index}})
      log_path = os.path.join(model_dir, f'{job or "one"}-{index}.log')
      child = _start([sys.executable, os.path.abspath(__file__),
                      '--task-spec', json.dumps(spec)], env, log_path)
      children.append(child)
      roles[str(child.pid)] = (job or 'one', log_path)
    deadline = time.monotonic() + args.timeout
    while not os.path.exists(result):
      for child in children:
        if child.poll() is not None:
          role, log_path = roles[str(child.pid)]
          raise RuntimeError(f'{name}: {role} exited with {child.returncode}'
                             f' before the window closed:\n'
                             f'{_tail(log_path)}')
      if time.monotonic() > deadline:
        raise RuntimeError(f'{name}: no result within {args.timeout} s')
      time.sleep(0.2)
  finally:
    _stop(children)
  with open(result) as f:
    window = json.load(f)
  row = _summarise(window, roles, per_update,
                   1 if name.startswith('async') else training)
  if args.trace:
    import step_trace  # pylint: disable=g-import-not-at-top
    row['traces'] = {
        os.path.basename(path)[len('trace-'):-len('.json')]:
            step_trace.summarise(path)
        for path in sorted(glob.glob(os.path.join(model_dir, 'trace-*')))}
  return row


def _summarise(window, roles, per_update, tasks_per_update):
  """examples/sec, bytes sent per training-task step, ps bytes per step.

  A global step is one update of the variables: every training task takes
  part in it when synchronous, one worker makes it under async_ps.
  """
  steps = window['global_steps']
  sent = {'train': 0, 'ps': 0}
  for pid, count in window['sent_by_pid'].items():
    role = roles.get(pid, ('other', ''))[0]
    sent['ps' if role == 'ps' else 'train'] += count
  return {
      'examples_per_sec': steps * per_update / window['seconds'],
      'sent_per_task_step': sent['train'] / (steps * tasks_per_update),
      'ps_sent_per_step': sent['ps'] / steps,
      'lo_per_step': window['lo_bytes'] / steps,
      'other_cores': window['other_cores'],
      'own_cores': window['own_cores'],
      # Examples per second of CPU the configuration's own processes used:
      # what it would reach if idle cores were no bottleneck.
      'examples_per_cpu_sec': steps * per_update / window['seconds'] / max(
          window['own_cores'], 1e-9),
      'seconds': window['seconds'], 'built': window['built'],
      'threads': window['threads']}


# --------------------------------------------------------------------------
# Packing: one collective for all gradients vs one per variable.


def _resnet20_shapes():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from model_fns import resnet  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    images = tf.compat.v1.placeholder(tf.float32, [None, 32, 32, 3])
    resnet.resnet_model_fn({'image': images}, None,
                           tf.estimator.ModeKeys.PREDICT,
                           {'n_classes': 10, 'image_shape': (32, 32, 3)})
    return [v.shape.as_list() for v in tf.compat.v1.trainable_variables()]


def _dnn_shapes():
  """This benchmark's dense variables' shapes.

  The embedding's gradient is sparse: training gathers it apart.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    features = {'x': tf.zeros([1, INPUT_DIM]),
                'ids': tf.zeros([1], tf.int64)}
    model_fn(features, tf.zeros([1], tf.int32), tf.estimator.ModeKeys.TRAIN)
    return [v.shape.as_list() for v in tf.compat.v1.trainable_variables()
            if 'embedding' not in v.name]


PACKING_MODELS = {'resnet20': _resnet20_shapes, 'dnn_2x256': _dnn_shapes}


def _sum_graph(task_group, device, prefix, shapes, packed):
  """A graph whose one op sums `shapes`-shaped variables over the tasks."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  graph = tf.Graph()
  with graph.as_default():
    with tf.device(device):
      values = [tf1.get_variable(
          f'{prefix}/v{i}', shape,
          initializer=tf1.random_normal_initializer(seed=i)).read_value()
                for i, shape in enumerate(shapes)]
    if packed:
      sums = task_group.sum(values)
    else:
      sums = [task_group.sum([value])[0] for value in values]
    return graph, tf.group(*sums), tf1.global_variables_initializer()


def run_pack_task(spec):
  """One of the two processes of the packing benchmark."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from estimator_towers.cluster import task_sync  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  cluster, index = spec['cluster'], spec['index']
  job = 'chief' if index == 0 else 'worker'
  server = tf.distribute.Server(
      tf.train.ClusterSpec(cluster), job_name=job, task_index=0,
      config=task_sync.server_config(None, cluster))
  config = types.SimpleNamespace(
      num_worker_replicas=2, global_id_in_cluster=index,
      is_chief=index == 0, task_type=job, task_id=0)
  # Timeout 0: none. Each collective with a timeout starts a thread that
  # lives as long as the timeout (measured: see docs/benchmarks.md).
  groups = {timeout: task_sync.TaskGroup(config, '/device:CPU:0', timeout)
            for timeout in (0, spec['timeout'])}
  # (packed, collective timeout in seconds), alternated.
  modes = [(packed, timeout) for timeout in groups
           for packed in (True, False)]
  device = f'/job:{job}/replica:0/task:0/device:CPU:0'
  runs, sizes = {}, {}
  for model, shapes_of in PACKING_MODELS.items():
    shapes = shapes_of()
    sizes[model] = (len(shapes), sum(_count(s) for s in shapes))
    for packed, timeout in modes:
      graph, op, init = _sum_graph(
          groups[timeout], device, f'{model}_{packed}_{timeout}', shapes,
          packed)
      session = tf1.Session(server.target, graph=graph)
      session.run(init)
      for _ in range(3):  # Warm-up: the collectives' first resolution.
        session.run(op)
      runs[(model, packed, timeout)] = (session, op)
  times = {':'.join(map(str, run)): [] for run in runs}
  for round_index in range(spec['rounds']):
    shift = round_index % len(modes)
    for model in PACKING_MODELS:
      for packed, timeout in modes[shift:] + modes[:shift]:
        session, op = runs[(model, packed, timeout)]
        start = time.monotonic()
        for _ in range(spec['reps']):
          session.run(op)
        times[f'{model}:{packed}:{timeout}'].append(
            spec['reps'] / (time.monotonic() - start))
  if index == 0:
    with open(spec['result'], 'w') as f:
      json.dump({'steps_per_sec': times, 'sizes': sizes,
                 'threads': _threads()}, f)


def _count(shape):
  count = 1
  for dim in shape:
    count *= dim
  return count


def run_packing(args, work_dir):
  """The packing benchmark's two processes; steps/sec per model and mode."""
  cluster = {job: [f'127.0.0.1:{private_network.free_port()}']
             for job in ('chief', 'worker')}
  result = os.path.join(work_dir, 'packing.json')
  children = []
  try:
    for index in (0, 1):
      spec = {'cluster': cluster, 'index': index, 'result': result,
              'rounds': args.pack_rounds, 'reps': args.pack_reps,
              'timeout': args.pack_timeout}
      log_path = os.path.join(work_dir, f'pack-{index}.log')
      children.append(_start([sys.executable, os.path.abspath(__file__),
                              '--pack-spec', json.dumps(spec)],
                             {**os.environ, 'PYTHONPATH': ROOT}, log_path))
    for child, index in zip(children, (0, 1)):
      if child.wait(timeout=args.timeout) != 0:
        raise RuntimeError(
            f'packing task {index} exited with {child.returncode}:\n'
            f'{_tail(os.path.join(work_dir, f"pack-{index}.log"))}')
  finally:
    _stop(children)
  with open(result) as f:
    return json.load(f)


# --------------------------------------------------------------------------


def _medians(rows):
  return lambda key: statistics.median(row[key] for row in rows)


def _print_table(results, global_batch):
  print(f'\nglobal batch {global_batch} per step; median over rounds; '
        'KB = 1000 bytes')
  print(f'{"config":>23} {"examples/s":>11} {"vs one":>7} '
        f'{"KB sent/task-step":>18} {"ps KB sent/step":>16} '
        f'{"lo KB/step":>11} {"others cores":>14} {"own cores":>10} '
        f'{"ex/cpu-s vs one":>16}')
  one = statistics.median(r['examples_per_sec'] for r in results['one'])
  one_cpu = statistics.median(r['examples_per_cpu_sec']
                              for r in results['one'])
  for name in CONFIGS:
    if not results.get(name):
      continue
    median = _medians(results[name])
    rate = median('examples_per_sec')
    print(f'{name:>23} {rate:>11.0f} {rate / one:>7.2f} '
          f'{median("sent_per_task_step") / 1e3:>18.1f} '
          f'{median("ps_sent_per_step") / 1e3:>16.1f} '
          f'{median("lo_per_step") / 1e3:>11.1f} '
          f'{median("other_cores"):>14.2f} {median("own_cores"):>10.2f} '
          f'{median("examples_per_cpu_sec") / one_cpu:>16.2f}')


def _print_packing(packing, timeout):
  print('\npacking: steps/sec of summing every variable over 2 tasks '
        '(median over rounds); collective timeout none or '
        f'{timeout:g} s')
  print(f'{"model":>10} {"variables":>9} {"floats":>9} {"timeout":>8} '
        f'{"packed":>8} {"per-var":>8} {"packed/per-var":>15}')
  rates = packing['steps_per_sec']
  for model, (count, floats) in packing['sizes'].items():
    for limit in (0, timeout):
      packed = statistics.median(rates[f'{model}:True:{limit}'])
      apart = statistics.median(rates[f'{model}:False:{limit}'])
      print(f'{model:>10} {count:>9} {floats:>9} '
            f'{f"{limit:g} s" if limit else "none":>8} {packed:>8.1f} '
            f'{apart:>8.1f} {packed / apart:>15.2f}')
  print(f'chief threads at the end: {packing["threads"]}')


def benchmark(args):
  """Runs every round and prints the tables (inside the namespace)."""
  private_network.bring_up_loopback()
  work_dir = tempfile.mkdtemp(prefix='bench_sync_cluster_')
  configs = _names(args.configs)
  results = {name: [] for name in configs}
  try:
    for round_index in range(args.rounds if configs else 0):
      shift = round_index % len(configs)
      for name in configs[shift:] + configs[:shift]:
        started = time.monotonic()
        row = run_config(name, args, work_dir)
        results[name].append(row)
        print(f'round {round_index + 1}: {name:>11}: '
              f'{row["examples_per_sec"]:.0f} examples/s, '
              f'{row["sent_per_task_step"] / 1e3:.1f} KB sent/task-step, '
              f'own processes used {row["own_cores"]:.2f} cores, '
              f'others used {row["other_cores"]:.2f} cores; chief\'s '
              f'model_fn: {row["built"]["replicas_in_sync"]} replica(s) in '
              f'sync, {row["built"]["rows_per_replica"]} rows each, '
              f'{row["threads"]} threads at the end '
              f'({time.monotonic() - started:.0f} s run)', flush=True)
    if results.get('one'):
      _print_table(results, args.global_batch)
    if args.trace:
      _print_traces(results)
    if args.packing:
      started = time.monotonic()
      packing = run_packing(args, work_dir)
      print(f'(packing: {time.monotonic() - started:.0f} s)')
      _print_packing(packing, args.pack_timeout)
  finally:
    if args.keep_logs:
      print(f'logs kept in {work_dir}')
    else:
      shutil.rmtree(work_dir, ignore_errors=True)


def _print_traces(results):
  import step_trace  # pylint: disable=g-import-not-at-top
  print(f'\nTraced steps ({_TRACED_STEPS} per task, before the window; the '
        'last round\'s):')
  for name, rows in results.items():
    for task, summary in rows[-1].get('traces', {}).items():
      print(step_trace.format_summary(f'{name} {task}', summary))


def _names(configs):
  return [name for name in configs.split(',') if name]


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true',
                      help='1 round of fewer steps (~2 min).')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=300,
                      help='Global batches timed per run.')
  parser.add_argument('--skip', type=int, default=40,
                      help='Global batches before the window opens.')
  parser.add_argument('--workers', type=int, default=1,
                      help='Workers beside the chief in every cluster '
                      'configuration (`one` then has 2 towers per task).')
  parser.add_argument('--global-batch', type=int, default=256)
  parser.add_argument('--configs', help=f'Default {",".join(DEFAULT_CONFIGS)}; '
                      f'--quick: {",".join(QUICK_CONFIGS)}.')
  parser.add_argument('--packing', action=argparse.BooleanOptionalAction,
                      default=True)
  parser.add_argument('--pack-rounds', type=int, default=6)
  parser.add_argument('--pack-reps', type=int, default=100)
  parser.add_argument('--pack-timeout', type=float, default=10,
                      help='The collective timeout of the timed-out rows.')
  parser.add_argument('--timeout', type=float, default=300,
                      help='Seconds one configuration may take.')
  parser.add_argument('--trace', action='store_true',
                      help='Trace a few steps of every task before the '
                      'window and print where their time went.')
  parser.add_argument('--keep-logs', action='store_true',
                      help='Keep the tasks\' model dirs and logs.')
  parser.add_argument('--task-spec', help=argparse.SUPPRESS)
  parser.add_argument('--pack-spec', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.task_spec:
    run_task(json.loads(args.task_spec))
    return 0
  if args.pack_spec:
    run_pack_task(json.loads(args.pack_spec))
    return 0
  if args.workers < 1:
    parser.error(f'--workers={args.workers}: give 1 or more')
  towers = 2 * (args.workers + 1)
  if args.global_batch <= 0 or args.global_batch % towers:
    parser.error(f'--global-batch={args.global_batch}: give a positive '
                 f'multiple of {towers} ({args.workers + 1} tasks x 2 '
                 f'towers, or {towers} towers in one process), e.g. '
                 f'{64 * towers}')
  unknown = set(_names(args.configs or '')) - set(CONFIGS)
  if unknown:
    parser.error(f'unknown --configs {sorted(unknown)}; choose from '
                 f'{",".join(CONFIGS)}')
  if not private_network.inside():
    return private_network.reexec_inside([os.path.abspath(__file__), *argv])
  if args.quick:
    args.rounds, args.steps, args.skip = 1, 50, 10
    args.pack_rounds, args.pack_reps = 2, 20
  if args.configs is None:
    args.configs = ','.join(QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)
  benchmark(args)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
