"""Adversarial probes of the synchronous cluster (not part of the suite).

    python tests/probes/probe.py drive NAME [STEPS] [ROWS...]

saves a start checkpoint, trains a chief+worker pair (in `unshare --net`),
one process on 4 towers and one device, and prints the largest differences.
"""

import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'tests'))
import estimator_towers  # noqa
from tests import helpers  # noqa
from tests import sync_cluster_task as sct  # noqa
from trainer.cluster import private_network  # noqa
from tests.probes import models  # noqa

tf1 = tf.compat.v1


def task_main(model_dir, name, steps, rows):
  spec = models.MODELS[name]
  config = estimator_towers.make_run_config(
      model_dir=model_dir, cpu_devices=2,
      tf_random_seed=int(os.environ.get('PROBE_SEED', 0)) or None)
  if config.task_type == 'worker' and os.environ.get('PROBE_WORKER_CPUS'):
    config = estimator_towers.make_run_config(
        model_dir=model_dir, cpu_devices=int(os.environ['PROBE_WORKER_CPUS']))
  estimator = tf.estimator.Estimator(
      estimator_towers.replicate_model_fn(
          spec['fn'], aggregation='all_reduce', sync_timeout_secs=30,
          **spec.get('kwargs', {})),
      config=config, params=spec.get('params'))
  input_fn = spec.get('task_input_fn', sct.task_input_fn)(rows, steps)
  task = f'{config.task_type}-{config.task_id}'
  tf.estimator.train_and_evaluate(
      estimator, tf.estimator.TrainSpec(
          input_fn, max_steps=steps,
          hooks=[sct._SaveFinalVariables(os.path.join(
              model_dir, f'final-{task}.npz'))] + spec.get('hooks', [])),
      tf.estimator.EvalSpec(input_fn, steps=1))
  print('TASK DONE', task, flush=True)


def pair_main(argv):
  return sct.run_pair(argv, 100, 'task', __file__)


def drive(name, steps, rows):
  spec = models.MODELS[name]
  tmp = tempfile.mkdtemp(prefix=f'probe-{name}-')
  dirs = [os.path.join(tmp, d) for d in ('cluster', 'four', 'one')]
  start = lambda: spec.get('global_input_fn', sct.global_batches)(
      sum(rows), steps).take(1)
  if spec.get('label_less'):  # save_start_checkpoint unpacks a pair.
    start = (lambda first: lambda: first().map(lambda f: (f, 0)))(start)
  helpers.save_start_checkpoint(spec['fn'], start, dirs, spec.get('params'))
  command = private_network.unshare_command() + [
      '--', sys.executable, os.path.abspath(__file__), 'pair', dirs[0], name,
      str(steps), *map(str, rows)]
  t = time.monotonic()
  done = subprocess.run(command, capture_output=True, text=True, timeout=200,
                        stdin=subprocess.DEVNULL,
                        env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'})
  print(f'pair rc={done.returncode} in {time.monotonic() - t:.0f}s')
  print([l for l in (done.stdout + done.stderr).splitlines() if 'PROBE' in l or 'CHIEF END' in l or 'rror' in l][-8:])
  if done.returncode:
    print((done.stdout + done.stderr)[-3000:])
    return
  results = {}
  for d, towers in ((dirs[1], 4), (dirs[2], 1)):
    est = helpers.make_estimator(
        spec['fn'], d, towers=towers, params=spec.get('params'),
        aggregation='all_reduce', **spec.get('kwargs', {}))
    est.train(lambda: spec.get('global_input_fn', sct.global_batches)(
        sum(rows), steps), max_steps=steps)
    results[towers] = helpers.variables_of(est)
  reader = tf.train.load_checkpoint(dirs[0])
  chief = {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()
           if n != '_CHECKPOINTABLE_OBJECT_GRAPH'}
  for towers, expected in results.items():
    print(f'vs {towers} tower(s): names equal',
          sorted(expected) == sorted(chief),
          set(expected) ^ set(chief) or '')
    worst = sorted(((float(np.max(np.abs(np.asarray(expected[n], np.float64)
                                          - chief[n]))) if np.size(chief[n])
                     else 0.0, n) for n in expected if n in chief),
                   reverse=True)[:4]
    print('   worst', worst)
    print('   worst relative', max(
        float(np.max(np.abs(np.asarray(expected[n], np.float64) - chief[n])
                     / (np.abs(np.asarray(expected[n], np.float64)) + 1e-6)))
        for n in expected if n in chief and np.size(chief[n])))
  fc = np.load(os.path.join(dirs[0], 'final-chief-0.npz'))
  fw = np.load(os.path.join(dirs[0], 'final-worker-0.npz'))
  bad = [n for n in fc if not np.array_equal(fc[n], fw[n])]
  if 'mask' in fc:
    print('chief mask', fc['mask'].tolist(), 'worker mask', fw['mask'].tolist())
  print('worker != chief final:', bad)


if __name__ == '__main__':
  mode = sys.argv[1]
  if mode == 'drive':
    name = sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    rows = [int(r) for r in sys.argv[4:]] or [5, 4]
    drive(name, steps, rows)
  elif mode == 'pair':
    sys.exit(pair_main(sys.argv[2:]))
  else:
    task_main(sys.argv[2], sys.argv[3], int(sys.argv[4]),
              [int(r) for r in sys.argv[5:]])
