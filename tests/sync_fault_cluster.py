"""Faults of a synchronous loopback cluster, for tests/test_sync_faults.py.

    python tests/sync_fault_cluster.py scenario SCENARIO JSON

(run inside a network namespace of its own: `unshare --net`) starts a chief
and a worker on free loopback ports, each a `task` below, makes the fault
SCENARIO names, and prints one JSON line: for each task its exit code (None
if it still ran at the deadline and was killed then), the seconds from the
fault to its exit, and the last line of its log.

    python tests/sync_fault_cluster.py task JSON

is one task (TF_CONFIG names it): tests/sync_cluster_task.py's model on 2
virtual CPU towers through `tf.estimator.train_and_evaluate`, with
replicate_model_fn's sync_timeout_secs=JSON's `timeout`. After each step it
writes its global step to MODEL_DIR/step-<task> (the step it started
from to step-<task>.start) and sleeps `step_secs`, so
that a fault lands mid-training. A failure trainer.sync_errors explains
ends it with that one line, as `trainer.task` would.

Scenarios (the fault happens once both tasks trained a step, unless said):
  kill_worker: SIGKILL the worker.
  kill_chief: SIGKILL the chief.
  stop_worker: SIGSTOP the worker (SIGCONT and SIGKILL at the end).
  late_worker: start the worker `late_secs` after the chief.
  after_chief: start the worker once the chief has exited.
  short_input: the worker's input ends after `worker_batches` batches
    (the fault is its exit).
  disagree: both start at once with JSON's `agreement` (job -> values),
    `replicate` (job -> replicate_model_fn options) and `extra_variable_on`
    (a job whose model has one more variable); the fault is the start.
  sigterm_worker: SIGTERM the worker; the tasks stop on signals as
    `trainer.task` does (trainer.preemption, trainer.faults).
  resume: no fault; the tasks train on from the job dir's checkpoint.
"""

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import forked_tasks  # pylint: disable=g-import-not-at-top
from trainer.cluster import private_network  # pylint: disable=g-import-not-at-top

ROWS = (3, 2)  # The chief's and the worker's rows of each global batch.
_SIGNALS = {'stop_worker': signal.SIGSTOP, 'sigterm_worker': signal.SIGTERM,
            'resume': None}


def run_task(args):
  """One task, forked from the scenario's process (forked_tasks)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import estimator_towers  # pylint: disable=g-import-not-at-top
  from tests import sync_cluster_task  # pylint: disable=g-import-not-at-top
  from trainer import cluster_config  # pylint: disable=g-import-not-at-top
  from trainer import faults  # pylint: disable=g-import-not-at-top
  from trainer import preemption  # pylint: disable=g-import-not-at-top
  from trainer import sync_errors  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1

  class Pace(tf1.train.SessionRunHook):
    """Writes the global step after each step, then sleeps a while."""

    def __init__(self, path, secs):
      self._path, self._secs = path, secs

    def after_create_session(self, session, coord):
      self._step = tf1.train.get_global_step()
      # The step this run starts from (a restart resumes a checkpoint's).
      with open(self._path + '.start', 'w') as f:
        f.write(str(session.run(self._step)))

    def after_run(self, run_context, run_values):
      step = run_context.session.run(self._step)
      with open(self._path + '.tmp', 'w') as f:
        f.write(str(step))
      os.replace(self._path + '.tmp', self._path)
      time.sleep(self._secs)

  config = estimator_towers.make_run_config(model_dir=args['model_dir'],
                                            cpu_devices=2)
  model_fn = sync_cluster_task.model_fn
  if args.get('extra_variable_on') == config.task_type:
    def model_fn(features, labels, mode):  # pylint: disable=function-redefined
      tf1.get_variable('extra', [2], initializer=tf1.zeros_initializer())
      return sync_cluster_task.model_fn(features, labels, mode)
  estimator = tf.estimator.Estimator(
      estimator_towers.replicate_model_fn(
          model_fn, aggregation='all_reduce',
          sync_timeout_secs=args['timeout'],
          task_agreement=args.get('agreement', {}).get(config.task_type),
          **args.get('replicate', {}).get(config.task_type, {})),
      config=config)
  steps = args['steps']
  batches = steps
  if config.task_type == 'worker':
    batches = args.get('worker_batches', steps)
  input_fn = sync_cluster_task.task_input_fn(ROWS, steps)
  task = f'{config.task_type}-{config.task_id}'
  # Pace first: the preemption hook's stop skips the hooks after it.
  hooks = [Pace(os.path.join(args['model_dir'], f'step-{task}'),
                args.get('step_secs', 0.0)),
           preemption.PreemptionHook(args['model_dir'], config.is_chief)]
  # A signal ends the task as trainer.task ends it: faults' one line.
  with faults.handled(task), preemption.sigterm_handled():
    try:
      tf.estimator.train_and_evaluate(
          estimator, tf.estimator.TrainSpec(
              lambda config: input_fn(config).take(batches), max_steps=steps,
              hooks=hooks),
          tf.estimator.EvalSpec(input_fn, steps=1))
    except tf.errors.OpError as e:
      line = sync_errors.cli_message(e, cluster_config.load_tf_config())
      if line is None:
        raise
      sys.stderr.write(line + '\n')
      sys.exit(1)
  print('TASK DONE', flush=True)


def _step_of(model_dir, task):
  try:
    with open(os.path.join(model_dir, f'step-{task}')) as f:
      return int(f.read())
  except (OSError, ValueError):
    return 0


def _last_line(path):
  with open(path, errors='replace') as f:
    lines = [l for l in f.read().splitlines() if l.strip()]
  return lines[-1] if lines else ''


class _Pair:
  """The chief and the worker processes of one scenario."""

  def __init__(self, args):
    self.args = args
    self.cluster = {'chief': [f'127.0.0.1:{private_network.free_port()}'],
                    'worker': [f'127.0.0.1:{private_network.free_port()}']}
    self.children = {}
    self.ended = {}

  def start(self, job):
    tf_config = {'cluster': self.cluster, 'task': {'type': job, 'index': 0}}
    # A file, not a pipe: a full pipe would block the task's logging.
    with open(self.log(job), 'w') as log:
      self.children[job] = forked_tasks.Task(
          __file__, ['task', json.dumps(self.args)],
          {**os.environ, 'TF_CONFIG': json.dumps(tf_config)}, log)

  def log(self, job):
    return os.path.join(self.args['model_dir'], f'log-{job}')

  def poll(self):
    """Records the tasks that ended; whether all did."""
    for job, child in self.children.items():
      if job not in self.ended and child.poll() is not None:
        self.ended[job] = time.monotonic()
    return len(self.ended) == len(self.children)

  def trained(self):
    return all(_step_of(self.args['model_dir'], f'{job}-0') >= 1
               for job in ('chief', 'worker'))

  def stop(self):
    for child in self.children.values():
      if child.poll() is None:
        child.send_signal(signal.SIGCONT)
        child.kill()
      child.wait()


def run_scenario(scenario, args, deadline_secs=150):
  """Starts the pair, makes the fault and reports how each task ended."""
  private_network.bring_up_loopback()
  forked_tasks.preload()  # Once here, not in each task (a fork of this).
  pair = _Pair(args)
  deadline = time.monotonic() + deadline_secs
  fault = None
  try:
    pair.start('chief')
    if scenario == 'late_worker':
      time.sleep(args['late_secs'])
    while scenario == 'after_chief' and not pair.poll():
      time.sleep(0.2)
    pair.start('worker')
    if scenario in ('late_worker', 'after_chief', 'disagree'):
      fault = time.monotonic()
    while time.monotonic() < deadline and not pair.poll():
      time.sleep(0.2)
      if scenario == 'short_input':
        fault = pair.ended.get('worker')
      elif fault is None and pair.trained():
        fault = time.monotonic()
        victim = pair.children['worker' if 'worker' in scenario else 'chief']
        signum = _SIGNALS.get(scenario, signal.SIGKILL)
        if signum is not None:
          victim.send_signal(signum)
        if scenario == 'stop_worker':
          pair.ended['worker'] = fault  # It would never end by itself.
  finally:
    pair.stop()
  report = {}
  for job, child in pair.children.items():
    ended = pair.ended.get(job)
    report[job] = {
        'code': child.returncode if ended else None,
        'secs': round(ended - fault, 1) if ended and fault else None,
        'line': _last_line(pair.log(job)),
        'step': _step_of(args['model_dir'], f'{job}-0'),
        'start': _step_of(args['model_dir'], f'{job}-0.start')}
  print(json.dumps(report), flush=True)
  return 0


if __name__ == '__main__':
  if sys.argv[1] == 'scenario':
    sys.exit(run_scenario(sys.argv[2], json.loads(sys.argv[3])))
  from tests import sync_cluster_task  # pylint: disable=g-import-not-at-top
  sync_cluster_task.exit_without_teardown(
      lambda: run_task(json.loads(sys.argv[2])))
