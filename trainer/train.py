"""Training, evaluation and export for `python -m trainer.task`.

`run(options)` does the work; `trainer.task` only turns flags into
`TaskOptions`. Everything a later `trainer.predict` needs to rebuild the
model is saved next to the checkpoints as `trainer_config.json`.
"""

import dataclasses
import os
import time
from typing import Any, Dict, List, Optional

from absl import logging
import tensorflow as tf

from input_fns import files as files_lib
import model_fns
from model_fns import hparams
from estimator_towers.replicate import replicate_model_fn
from estimator_towers.run_config import make_run_config
from estimator_towers.run_config import session_device_counts
from estimator_towers.cluster import task_sync
from trainer import assembly
from trainer import checkpoint_check
from trainer import cluster_agreement
from trainer import cluster_rendezvous
from trainer import cluster_config
from trainer import data_sample
from trainer.cluster import private_network
from trainer import faults
from trainer import finite_weights
from trainer import hptuning
from trainer import hypertune_reporter
from trainer import job_dir as job_dir_lib
from trainer import limits
from trainer import options as options_lib
from trainer import preemption
from trainer import progress
from trainer import run_log as run_log_lib
from trainer import skipped_rows
from trainer import vertex
from trainer import step_logging
from trainer import step_order
from trainer import stop_at
from trainer import tool_hooks
from trainer import warm_start

tf1 = tf.compat.v1
CONFIG_FILE = assembly.CONFIG_FILE
TaskOptions = options_lib.TaskOptions  # Where users of train.run find it.
_EVALUATOR_POLL_SECS = 1


def default_job_dir() -> str:
  return os.path.join('runs', time.strftime('task-%Y%m%d-%H%M%S'))


class ModelFnError(ValueError):
  """The model_fn raised or returned something other than an EstimatorSpec."""


def _checked(name: str, model_fn):
  """`model_fn`, whose failures become one clear error naming the model.

  Errors the library raises to explain a misuse (ValueError, TypeError
  naming the fix) pass through unchanged; anything else the model code
  raises is reported with its type and message.
  """

  def checked_model_fn(features, labels, mode, params, config):
    try:
      spec = model_fn(features, labels, mode, params, config)
    except (ValueError, TypeError, preemption.Preempted):
      raise  # A stop signal may land while the graph is built.
    except Exception as e:  # pylint: disable=broad-except
      raise ModelFnError(f'--model={name} failed building the {mode} graph: '
                         f'{type(e).__name__}: {e}'
                         f'{assembly.missing_feature_hint(e, features)}') from e
    if not isinstance(spec, tf.estimator.EstimatorSpec):
      raise ModelFnError(
          f'--model={name} returned {type(spec).__name__} in {mode} mode; a '
          'model_fn must return a tf.estimator.EstimatorSpec.')
    return spec

  return checked_model_fn


def _with_step_logging(model_fn, global_batch_size: int, num_towers: int,
                       max_steps: int, eval_steps: Optional[int] = None,
                       run_log: Optional[run_log_lib.RunLog] = None):
  """Adds a StepLoggingHook on the merged loss to TRAIN specs.

  The chief's (or a local run's) also writes its lines to `run_log`.

  Also orders the step's increment after the Estimator's read of it (see
  step_order), and adds to EVAL specs a hook that logs their progress.
  """

  def logged_model_fn(features, labels, mode, params, config):
    spec = model_fn(features, labels, mode, params, config)
    if mode == tf.estimator.ModeKeys.EVAL:
      return spec._replace(evaluation_hooks=list(spec.evaluation_hooks) + [
          progress.EvalProgressHook(eval_steps)])
    if mode != tf.estimator.ModeKeys.TRAIN:
      return spec
    step_order.order_increment_after_read(tf1.get_default_graph())
    hook = step_logging.StepLoggingHook(
        spec.loss, global_batch_size, num_towers,
        config.log_step_count_steps or 100,
        summary_dir=config.model_dir if config.is_chief else None,
        max_steps=max_steps, run_log=run_log if config.is_chief else None)
    return spec._replace(training_hooks=list(spec.training_hooks) + [hook])

  return logged_model_fn


class _SaveConfigWhenTraining(tf1.train.SessionRunHook):
  """Writes trainer_config.json once the training session exists.

  Not before: a run that fails while checking its options, data or graph
  must leave an existing job dir's config (which trainer.predict reads) as
  it was; and a re-run that finds training done trains nothing.
  """

  def __init__(self, model_dir: str, options: TaskOptions):
    self._model_dir = model_dir
    self._options = options

  def after_create_session(self, session, coord):
    del session, coord
    assembly.save_options(self._model_dir, self._options)


class _LogTaskDevices(tf1.train.SessionRunHook):
  """Logs the devices this cluster task's server has, once it trains.

  The server, not the session config, decides them: a server started
  without the virtual CPUs of --cpu-towers would soft-place every tower
  on one CPU, and only this line would show it.
  """

  def __init__(self, task_type: str, task_id: int):
    self._prefix = f'/job:{task_type}/replica:0/task:{task_id}/'
    self._task = f'{task_type}:{task_id}'

  def after_create_session(self, session, coord):
    del coord
    names = sorted(d.name[len(self._prefix) + len('device:'):]
                   for d in session.list_devices()
                   if d.name.startswith(self._prefix))
    logging.info('Task %s has the devices %s', self._task, ', '.join(names))


def _exporters(options, data, metric, final: bool = True,
               run_log: Optional[run_log_lib.RunLog] = None):
  receiver = data.serving_input_receiver_fn(options.export_format)
  exporters = ([tf.estimator.FinalExporter('final', receiver)] if final
               else []) + [hypertune_reporter.HypertuneReporter(
                   metric, options.hypertune_summary_tag)]
  if run_log:
    exporters.append(run_log_lib.EvalRecorder(run_log))
  if options.export_best:
    maximize = hptuning.goal_for(metric) == 'MAXIMIZE'

    # BestExporter checks these argument names. It also replays every event
    # of the eval directory, including ones without the metric (such as the
    # tuning-metric summary): those never count as better.
    def better(best_eval_result, current_eval_result):
      if metric not in current_eval_result:
        return False
      if metric not in best_eval_result:
        return True
      best, current = best_eval_result[metric], current_eval_result[metric]
      return current > best if maximize else current < best

    exporters.append(tf.estimator.BestExporter(
        'best', receiver, compare_fn=better, exports_to_keep=1))
  return exporters


def _vertex_hooks(config) -> List[tf1.train.SessionRunHook]:
  directory = vertex.tensorboard_dir()
  if not directory or not config.is_chief:
    return []
  return [vertex.TrainSummaries(directory, config.save_summary_steps or 100)]


def _vertex_exporters() -> List[tf.estimator.Exporter]:
  directory = vertex.tensorboard_dir()
  return [vertex.EvalSummaries(directory)] if directory else []


def _eval_metric_names(estimator, data, options: TaskOptions) -> List[str]:
  """The evaluation results of the model: `loss` and its eval_metric_ops.

  Builds the EVAL graph once, as evaluation will, and reads its metric
  names.
  """
  with tf.Graph().as_default():
    dataset = data.eval_input_fn(options.eval_batch_size)()
    features, labels = tf1.data.make_one_shot_iterator(dataset).get_next()
    spec = estimator.model_fn(features, labels, tf.estimator.ModeKeys.EVAL,
                              estimator.config)
  return sorted({'loss', *spec.eval_metric_ops})


def _checkpoint_step(model_dir: str) -> int:
  checkpoint = tf.train.latest_checkpoint(model_dir)
  return int(tf.train.load_variable(checkpoint, 'global_step'))


def _final_export(estimator, eval_spec, model_dir: str, metrics) -> None:
  """Runs the final exporter on the latest checkpoint and its metrics."""
  checkpoint = tf.train.latest_checkpoint(model_dir)
  for exporter in eval_spec.exporters:
    if isinstance(exporter, tf.estimator.FinalExporter):
      exporter.export(estimator,
                      os.path.join(model_dir, 'export', exporter.name),
                      checkpoint, metrics, is_the_final_export=True)


def _evaluate_and_export(estimator, eval_spec, model_dir: str):
  """What train_and_evaluate does after the last step, for a finished run."""
  checkpoint = tf.train.latest_checkpoint(model_dir)
  if checkpoint is None:
    raise ValueError(f'{model_dir} has no checkpoint to evaluate.')
  logging.info('Training is complete in %s; evaluating and exporting %s.',
               model_dir, checkpoint)
  metrics = estimator.evaluate(eval_spec.input_fn, steps=eval_spec.steps,
                               checkpoint_path=checkpoint)
  for exporter in eval_spec.exporters:
    exporter.export(estimator,
                    os.path.join(model_dir, 'export', exporter.name),
                    checkpoint, metrics, is_the_final_export=True)
  return metrics


def latest_export(model_dir: str, name: str = 'final') -> Optional[str]:
  """The newest complete SavedModel directory of an exporter, or None."""
  base = os.path.join(model_dir, 'export', name)
  if not tf.io.gfile.isdir(base):
    return None
  # Estimator writes into temp-<ts> and renames when done: skip those.
  done = sorted(d for d in tf.io.gfile.listdir(base)
                if d.strip('/').isdigit())
  return os.path.join(base, done[-1].strip('/')) if done else None


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What `run` did.

  Attributes:
    metrics: The final eval metrics; None for the tasks of a cluster that
      do not report them.
    export_dir: The newest final SavedModel, or None.
    model_dir: Where the checkpoints went.
    towers: The tower count.
    task: E.g. 'worker:1'; None outside a cluster.
    skipped: What --skip-malformed skipped, or None.
  """
  metrics: Optional[Dict[str, Any]]
  export_dir: Optional[str]
  model_dir: str
  towers: int
  task: Optional[str]
  skipped: Optional[str]


def run(options: TaskOptions, clean: bool = False) -> RunResult:
  """Trains, evaluates and exports as the options say.

  Args:
    options: The run's options.
    clean: Empty the job dir first (`--clean`; a local run's only).

  Returns:
    What the run did: its metrics, export, model dir, towers and task.

  Raises:
    ValueError: a bad option, TF_CONFIG or data problem, before training
      starts.
    preemption.Preempted: a stop signal arrived; a checkpoint was saved.
  """
  cluster_config.adopt_cluster_spec()
  tf_config = cluster_config.single_machine(cluster_config.check_tf_config())
  cluster_config.warn_if_exposed(tf_config, private_network.inside())
  job_dir = vertex.job_dir(options.job_dir) or default_job_dir()
  model_dir = hptuning.trial_dir(job_dir, hptuning.trial_id())
  task = (tf_config or {}).get('task') or {}
  if options.tf_random_seed is not None:
    # Keras initializers without a seed draw theirs from Python's random
    # module, which the graph-level seed does not reach.
    tf.keras.utils.set_random_seed(options.tf_random_seed)
  # Everything that can be checked is checked before the job dir is touched.
  _check_reachable(job_dir)
  vertex.check_outputs()
  if clean and task.get('type'):  # (A trial's TF_CONFIG has a task too.)
    raise options_lib.OptionError(
        '--clean empties the job dir of a local run; a cluster\'s tasks '
        'share theirs while they start: remove it before starting the '
        'cluster.')
  run_ = _Run(options, model_dir, task)
  # After the options are checked, before any server starts: the runtime
  # fails late and unreadably (or crashes) on tasks given different clusters.
  cluster_rendezvous.check_same_cluster(model_dir, tf_config)
  # trainer.faults phrases a port taken or a full disk with these.
  with faults.run_noted(model_dir, tf_config):
    if task.get('type') not in (None, 'chief', 'master'):
      return run_.train_and_evaluate()
    # A local run or a cluster's chief: the one writer of the job dir.
    with job_dir_lib.locked(model_dir):
      if clean:
        job_dir_lib.clean(model_dir, (CONFIG_FILE, run_log_lib.FILE_NAME))
      checkpoint_check.resumable(model_dir)  # Falls back from a damaged one.
      job_dir_lib.check_same_architecture(model_dir, CONFIG_FILE, options)
      warm_start.check_job_dir(model_dir, CONFIG_FILE,
                               options.warm_start_from)
      return run_.train_and_evaluate()


def _check_reachable(job_dir: str) -> None:
  """Fails at once, in one line, when a remote --job-dir cannot be reached.

  Raises:
    ValueError: reading the bucket failed (no network, no credentials).
  """
  if '://' not in job_dir:
    return
  try:
    tf.io.gfile.exists(job_dir)
  except tf.errors.OpError as e:
    raise ValueError(f'--job-dir {job_dir}: '
                     f'{files_lib.unreachable(job_dir, e)}') from e


def check(options: TaskOptions) -> str:
  """What `run` checks before training, without training or writing.

  Options, data (the first rows of each split, read and parsed), model
  graph and tuning metric, as the local run (or a trial) with these options
  would check them.

  Returns:
    The tuning metric the run would report.

  Raises:
    ValueError: what `run` would raise before training.
  """
  job_dir = vertex.job_dir(options.job_dir) or default_job_dir()
  model_dir = hptuning.trial_dir(job_dir, hptuning.trial_id())
  run_ = _Run(options, model_dir, {})
  data_sample.check(run_.data, same_files=not options.eval_files)
  return run_.metric


def create_run_config(options: TaskOptions,
                      model_dir: str) -> tf.estimator.RunConfig:
  """The RunConfig of the run: its devices, session and checkpoints."""
  return make_run_config(
      model_dir, num_gpus=options.num_gpus, gpu_ids=options.gpu_ids,
      cpu_devices=options.cpu_towers,
      gpu_memory_fraction=options.gpu_memory_fraction,
      allow_growth=options.allow_growth,
      inter_op_threads=options.inter_op_threads,
      intra_op_threads=options.intra_op_threads,
      mixed_precision=options.mixed_precision, xla=options.xla,
      tf_random_seed=options.tf_random_seed,
      save_checkpoints_steps=options.save_checkpoints_steps,
      keep_checkpoint_max=options.keep_checkpoint_max,
      log_step_count_steps=options.log_step_count_steps)


def create_estimator(options: TaskOptions, config: tf.estimator.RunConfig,
                     data, aggregation: str, towers: int,
                     run_log: Optional[run_log_lib.RunLog] = None
                     ) -> tf.estimator.Estimator:
  """The Estimator of the towered, checked and step-logged model_fn.

  Raises:
    ValueError: --warm-start-from names no checkpoint (the chief's, or a
      local run's, check).
  """
  model_fn = replicate_model_fn(
      model_fns.get_model_fn(options.model), aggregation=aggregation,
      random_ops=options.random_ops,
      batch_norm=options.batch_norm,
      sync_timeout_secs=options.sync_timeout_secs,
      micro_batches=options.micro_batches,
      # A task started with other options must not train with the others.
      task_agreement=(cluster_agreement.values(options)
                      if task_sync.is_sync_cluster(config) else None))
  return tf.estimator.Estimator(
      _with_step_logging(_checked(options.model, model_fn),
                         options.train_batch_size, towers,
                         options.train_steps, options.eval_steps, run_log),
      config=config, params=assembly.model_params(options, data),
      # Only the chief initialises the variables: a worker takes them from
      # the chief (its broadcast, or the ps it initialised), and its
      # machine need not hold the checkpoint.
      warm_start_from=warm_start.settings(
          options.warm_start_from if config.is_chief else None))


def create_train_hooks(options: TaskOptions, config: tf.estimator.RunConfig,
                       model_dir: str) -> List[tf1.train.SessionRunHook]:
  """The training hooks: preemption, finite weights, summaries, config,
  and the chief's (or local run's) --stop-at and --profile-steps."""
  hooks = [preemption.PreemptionHook(model_dir, config.is_chief),
           finite_weights.FiniteWeightsHook(), *_vertex_hooks(config)]
  if config.cluster_spec:
    hooks.append(_LogTaskDevices(config.task_type, config.task_id))
  if config.is_chief:  # One writer per job dir: the chief (or a local run).
    hooks.append(_SaveConfigWhenTraining(model_dir, options))
    if options.stop_at:
      hooks.append(tool_hooks.StopAtHook(
          stop_at.parse(options.stop_at), os.path.join(model_dir, 'eval'),
          options.save_checkpoints_steps))
    if options.profile_steps:
      hooks.append(tool_hooks.ProfileHook(model_dir, *options.profile_steps))
  return hooks


def create_train_spec(options: TaskOptions, data,
                      hooks: List[tf1.train.SessionRunHook]
                      ) -> tf.estimator.TrainSpec:
  """The training input_fn, step count and hooks."""
  return tf.estimator.TrainSpec(
      data.train_input_fn(options.train_batch_size,
                          seed=options.tf_random_seed or 0,
                          num_epochs=options.num_epochs),
      max_steps=options.train_steps, hooks=hooks)


def create_eval_spec(options: TaskOptions, data, metric: str,
                     task_type: Optional[str],
                     model_dir: Optional[str] = None,
                     run_log: Optional[run_log_lib.RunLog] = None
                     ) -> tf.estimator.EvalSpec:
  """The evaluation input_fn, exporters, hooks and pacing of this task."""
  hooks = []
  if task_type == 'evaluator' and model_dir:
    # A reversed vocabulary evaluated a 0.99-accuracy model at ~0.01.
    hooks.append(cluster_agreement.EvaluatorCheckHook(model_dir, options))
  return tf.estimator.EvalSpec(
      data.eval_input_fn(options.eval_batch_size), steps=options.eval_steps,
      hooks=hooks,
      # A cluster's final export is the chief's (see train_and_evaluate).
      exporters=_exporters(options, data, metric,
                           final=task_type != 'evaluator', run_log=run_log) +
      _vertex_exporters(),
      start_delay_secs=0,
      # Locally each checkpoint is evaluated as it is saved; an evaluator
      # task polls for new ones, and with no pause it spins, logging each
      # time it finds none.
      throttle_secs=_EVALUATOR_POLL_SECS if task_type == 'evaluator' else 0)


def _evaluates(task_type: Optional[str]) -> bool:
  """Whether this task evaluates (locally, a chief or the evaluator)."""
  return not task_type or task_type in ('chief', 'master', 'evaluator')


class _Run:
  """One task's Estimator and specs, built and checked before training."""

  def __init__(self, options: TaskOptions, model_dir: str,
               task: Dict[str, Any]):
    self._options, self._model_dir, self._task = options, model_dir, task
    if options.stop_at and task.get('type'):
      # Its evaluator lags the chief, and a synchronous cluster's workers
      # would wait for a chief that stopped.
      raise options_lib.OptionError(
          '--stop-at stops a local run; a cluster\'s evaluation runs apart '
          'from its training. Drop it, or train in one process.')
    # One writer of the training records: the chief (or the local run); the
    # evaluator adds its evaluations.
    self.run_log = (run_log_lib.RunLog(options.run_log or os.path.join(
        model_dir, run_log_lib.FILE_NAME))
                    if _evaluates(task.get('type')) else None)
    data = self.data = assembly.build_data(
        options, model_fns.model_kind(options.model))
    config = create_run_config(options, model_dir)
    # Before any graph is built: a cluster it cannot train in is a usage
    # error of every task.
    self.aggregation = options_lib.aggregation_for(options, config)
    self.sync = task_sync.is_sync_cluster(config)
    num_gpus, num_cpus = session_device_counts(config.session_config)
    self.towers = num_gpus or num_cpus
    self.devices = (f'GPU 0-{num_gpus - 1}' if num_gpus else
                    f'virtual CPU 0-{num_cpus - 1}' if num_cpus > 1 else 'CPU')
    self.estimator = create_estimator(options, config, data, self.aggregation,
                                      self.towers, self.run_log)
    self._check_batch_sizes(data, assembly.model_params(options, data))
    self.skipped, self.metric = self._checked_metric(data, task.get('type'))
    self.train_spec = create_train_spec(
        options, data, create_train_hooks(options, config, model_dir))
    self.eval_spec = create_eval_spec(options, data, self.metric,
                                      task.get('type'), model_dir,
                                      self.run_log)
    if assembly.evaluates_on_training_files(options):
      logging.warning('No --eval-files: evaluating on the training files, so '
                      'the eval metrics (and the tuning metric) measure '
                      'training data.')

  def _checked_metric(self, data, task_type: Optional[str]):
    """(what --skip-malformed skips, the tuning metric), checked now."""
    options = self._options
    if not _evaluates(task_type):  # Its exporters never run.
      return None, options.hypertune_metric or 'accuracy'
    # Found out only after the first evaluation otherwise.
    hptuning.check_metric_file()
    skipped = skipped_rows.check(data, not options.eval_files)
    names = _eval_metric_names(self.estimator, data, options)
    if options.stop_at:
      stop_at.check_metric(stop_at.parse(options.stop_at), names)
    return skipped, hptuning.tuning_metric(options.hypertune_metric, names,
                                           options.model)

  def _check_batch_sizes(self, data, params) -> None:
    try:
      hidden = hparams.hidden_units(params)
    except ValueError:
      hidden = ()
    floats = limits.floats_per_example(data.feature_signature(), hidden)
    memory = limits.machine_memory_bytes()
    limits.check_batch_size('train-batch-size',
                            self._options.train_batch_size, floats, memory)
    limits.check_batch_size('eval-batch-size', self._options.eval_batch_size,
                            floats, memory)

  def _train_and_evaluate(self):
    """tf.estimator.train_and_evaluate, a misfit warm start phrased."""
    try:
      return tf.estimator.train_and_evaluate(
          self.estimator, self.train_spec, self.eval_spec)
    except ValueError as e:
      start = self._options.warm_start_from
      # The Estimator warm-starts while it builds the training graph.
      if start and warm_start.is_misfit(e):
        raise warm_start.phrased(e, start) from e
      raise

  def _record_failure(self, error: Exception) -> None:
    """Writes the 'failed' record; if that fails too (the disk the run
    failed on is full), says so in one log line and leaves the run's own
    failure to be reported."""
    try:
      self.run_log.write('failed', error=f'{type(error).__name__}: {error}')
    except (OSError, tf.errors.OpError) as e:
      logging.error('The run log %s could not record the failure: %s',
                    self.run_log.path, e)

  def train_and_evaluate(self) -> RunResult:
    """Trains, evaluates and exports; returns what `run` returns."""
    task, model_dir = self._task, self._model_dir
    logging.info('Training %s on %d tower(s) (%s) into %s, %d steps of %d '
                 'examples', self._options.model, self.towers, self.devices,
                 model_dir, self._options.train_steps,
                 self._options.train_batch_size)
    if task.get('type') in task_sync.TRAINING_JOBS:
      logging.info(
          'Cluster task %s:%d trains %s: %s', task['type'],
          task.get('index', 0), *(
              ('synchronously', 'each step, every training task keeps its '
               'part of the global batch and all apply the same update')
              if self.sync else
              ('asynchronously', 'each training task updates the ps\'s '
               'variables with its own batches')))
    resumed = tf.train.latest_checkpoint(model_dir)
    if resumed:
      # TensorFlow's own "Restoring parameters" line is hidden by default.
      logging.info('Resuming from %s', resumed)
    is_chief = task.get('type') in (None, 'chief', 'master')
    if is_chief:
      self.run_log.write(
          'options', options=dataclasses.asdict(self._options),
          model_dir=model_dir, towers=self.towers, devices=self.devices,
          aggregation=self.aggregation, resumed_from=resumed,
          task=task.get('type') and f"{task['type']}:{task.get('index', 0)}")
    try:
      with preemption.sigterm_handled():
        result = self._train_and_evaluate()
    except Exception as e:
      if is_chief:  # A reader of the log learns how the run ended.
        self._record_failure(e)
      raise
    # Local runs and the evaluator get (metrics, exports); other cluster
    # tasks get None.
    metrics = result[0] if result else None
    if metrics is None and task.get('type') in (None, 'chief', 'master'):
      # Locally: training was already done (e.g. the last run was killed
      # after its final checkpoint, before the export). On a cluster's
      # chief: an evaluator's final export and report could be cut off (a
      # Vertex job ends with its primary replica, a TFJob's cleanPodPolicy
      # removes a running evaluator), or there is no evaluator: the chief
      # evaluates the final checkpoint, exports and reports before it exits.
      metrics = _evaluate_and_export(self.estimator, self.eval_spec,
                                     model_dir)
    if task.get('type') == 'evaluator':
      metrics = None  # Its evaluations are for TensorBoard; see above.
    if metrics is not None and _checkpoint_step(model_dir) == 0:
      # E.g. every row skipped: a model of zero steps is no result.
      raise ValueError(
          f'training ran no step in {model_dir}: the training input ended '
          'before its first batch, and nothing was exported. Check the '
          'training data.')
    if metrics is not None and (latest_export(model_dir) is None or
                                _checkpoint_step(model_dir) <
                                self._options.train_steps):
      # Training ended before --train-steps (--num-epochs): the Estimator's
      # final export waits for the last step, which never came; an export
      # of an earlier run would be stale.
      _final_export(self.estimator, self.eval_spec, model_dir, metrics)
    if metrics is not None:
      vertex.copy_model(latest_export(model_dir))
      self.run_log.write('final', metrics=run_log_lib.metrics_record(metrics),
                         export_dir=latest_export(model_dir),
                         model_dir=model_dir)
    return RunResult(
        metrics=metrics, export_dir=latest_export(model_dir),
        model_dir=model_dir, towers=self.towers, skipped=self.skipped,
        task=(f"{task['type']}:{task.get('index', 0)}" if task.get('type')
              else None))
