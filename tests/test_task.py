"""`python -m trainer.task` end to end, as real processes on tiny data."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import preloaded
from cli_helpers import (CSV_FLAGS, ROOT, eval_line, read_json_lines,
                         run_module, wait_until, write_tabular_csv)

@pytest.mark.cli
def test_trains_evaluates_and_exports(trained):
  job_dir, result = trained
  metrics = eval_line(result)
  assert int(metrics['global_step']) == 120
  assert float(metrics['accuracy']) > 0.8
  assert metrics['towers'] == '2'
  export_dir = metrics['export']
  assert export_dir.startswith(str(job_dir))
  assert os.path.exists(os.path.join(export_dir, 'saved_model.pb'))
  # --export-best kept the best model on the tuning metric as well.
  best = tf.io.gfile.glob(os.path.join(job_dir, 'export', 'best', '*',
                                       'saved_model.pb'))
  assert len(best) == 1
  # The towers really ran: ops were placed on both virtual devices.
  assert 'examples/sec' in result.stderr and '2 towers' in result.stderr


@pytest.mark.cli
def test_writes_train_and_eval_summaries_with_the_tuning_tag(trained):
  job_dir, _ = trained
  assert tf.io.gfile.glob(os.path.join(job_dir, 'events.out.tfevents.*'))
  tags = set()
  for path in tf.io.gfile.glob(os.path.join(job_dir, 'eval', 'events.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(v.tag for v in event.summary.value)
  assert {'accuracy', 'loss', 'training/hptuning/metric'} <= tags


# Served in this process (eager, as TF Serving's Python API would): a
# subprocess would load TensorFlow again just to call the signature.
_ROWS = [('0.9', '-0.2', 'red'), ('-2.0', '0.1', 'blue'), ('0.1', '0.3', 'red'),
         ('1.5', '1.0', 'green'), ('-1.0', '0.0', 'green'),
         ('0.0', '0.0', 'red'), ('2.0', '-1.0', 'blue')]


def _served_classes(export_dir, inputs):
  """class_ids of the export's serving signature on the first 1 and 7 rows.

  Args:
    export_dir: A SavedModel directory.
    inputs: Maps a list of rows to the signature's keyword arguments.

  Returns:
    {1: [class id], 7: [7 class ids]}.
  """
  serve = tf.saved_model.load(export_dir).signatures['serving_default']
  return {n: serve(**inputs(_ROWS[:n]))['class_ids'].numpy().tolist()
          for n in (1, 7)}


def _feature_inputs(rows):
  return {'x1': tf.constant([float(r[0]) for r in rows]),
          'x2': tf.constant([float(r[1]) for r in rows]),
          'colour': tf.constant([r[2] for r in rows])}


def _csv_inputs(rows):
  return {'csv_lines': tf.constant([','.join(r) for r in rows])}


@pytest.mark.cli
def test_saved_model_serves_batches_of_1_and_7(trained):
  _, result = trained
  classes = _served_classes(eval_line(result)['export'], _feature_inputs)
  assert len(classes[1]) == 1 and len(classes[7]) == 7
  assert classes[7][0] == classes[1][0]
  # The model learned the rule: x1 + (colour == red) > 0.5.
  assert classes[7][:2] == [1, 0]


@pytest.mark.cli
def test_saved_model_cli_describes_the_export(trained):
  _, result = trained
  cli = os.path.join(os.path.dirname(sys.executable), 'saved_model_cli')
  shown = subprocess.run([cli, 'show', '--all', '--dir',
                          eval_line(result)['export']],
                         capture_output=True, text=True, check=True)
  assert "signature_def['serving_default']" in shown.stdout
  assert 'class_ids' in shown.stdout


def _csv_args(job_dir, csv_files):
  return (f'--job-dir={job_dir}', f'--train-files={csv_files[0]}',
          f'--eval-files={csv_files[1]}', *CSV_FLAGS)


@pytest.fixture(scope='module')
def trained_40(tmp_path_factory, csv_files):
  """One finished 40-step CSV job: (job_dir, completed process).

  The rerun tests copy it (`_copy_of`) instead of each training it again.
  """
  job_dir = tmp_path_factory.mktemp('job_40')
  result = run_module('trainer.task', *_csv_args(job_dir, csv_files),
                      '--train-steps=40')
  return job_dir, result


def _copy_of(trained_40, tmp_path):
  """A private copy of the 40-step job in tmp_path (checkpoint paths are
  relative, so the copy resumes from its own files)."""
  shutil.copytree(trained_40[0], tmp_path, dirs_exist_ok=True)
  return tmp_path


@pytest.fixture
def task_here(capfd, monkeypatch):
  """Runs `python -m trainer.task ARGS` in this process, to its exit.

  For failures of the options, data, model, job dir and bucket: what the
  process would print and its exit code, without loading TensorFlow once
  more (most of a failing run's seconds). Not for what only a process does
  (signals, another process's lock, the variables trainer.environment sets
  before TensorFlow loads): those tests start `python -m trainer.task`.

  Yields:
    run(*args, env=None) -> (exit code, stdout, stderr); `env` adds
    environment variables. The flags, the environment and the logging and
    warning switches the task turns are restored after the test.
  """
  # pylint: disable=g-import-not-at-top
  import threading
  from absl import flags
  from tensorflow.python.util import deprecation
  from trainer import cli
  from trainer import task  # Defines the task's flags, as its process does.
  logger = tf.get_logger()
  level, handlers = logger.level, list(logger.handlers)
  monkeypatch.setattr(threading, 'excepthook', threading.excepthook)
  monkeypatch.setattr(deprecation, '_PRINT_DEPRECATION_WARNINGS',
                      deprecation._PRINT_DEPRECATION_WARNINGS)  # pylint: disable=protected-access
  monkeypatch.delenv('TF_CONFIG', raising=False)  # As run_module.

  def run(*args, env=None):
    for name, value in (env or {}).items():
      monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, 'argv', ['task', *map(str, args)])
    capfd.readouterr()  # Only this run's output.
    try:
      with pytest.raises(SystemExit) as exited:
        cli.run(task.main, 'task')
    finally:
      flags.FLAGS.unparse_flags()
    out, err = capfd.readouterr()
    return exited.value.code, out, err

  yield run
  logger.setLevel(level)
  logger.handlers = handlers


@pytest.mark.cli
def test_rerun_resumes_from_the_latest_checkpoint(tmp_path, csv_files,
                                                  trained_40):
  assert int(eval_line(trained_40[1])['global_step']) == 40
  args = _csv_args(_copy_of(trained_40, tmp_path), csv_files)
  second = run_module('trainer.task', *args, '--train-steps=80')
  assert int(eval_line(second)['global_step']) == 80
  # Restored from its own copy, not started over.
  assert str(tmp_path / 'model.ckpt-40') in second.stderr


@pytest.mark.cli
def test_rejected_rerun_leaves_the_saved_config_alone(tmp_path, csv_files,
                                                      trained_40, task_here):
  args = _csv_args(_copy_of(trained_40, tmp_path), csv_files)
  config = tmp_path / 'trainer_config.json'
  saved = config.read_text()
  code, _, err = task_here(*args, '--train-steps=80', '--learning-rate=0')
  assert code == 1
  assert 'task: error: --learning-rate=0.0;' in err
  assert config.read_text() == saved
  # The job still predicts with the config it was trained with.
  assert json.loads(saved)['learning_rate'] == 0.05


@pytest.fixture(scope='module')
def rerun_unexported(tmp_path_factory, csv_files, trained_40):
  """The 40-step job, rerun as if killed after its final checkpoint, before
  evaluating and exporting: (job_dir, completed process).

  The rerun exports with --export-format=csv (not an architecture flag), so
  this one run also gives the CSV-serving test its export.
  """
  job_dir = _copy_of(trained_40, tmp_path_factory.mktemp('unexported'))
  for name in ('export', 'eval'):
    tf.io.gfile.rmtree(str(job_dir / name))
  rerun = run_module('trainer.task', *_csv_args(job_dir, csv_files),
                     '--train-steps=40', '--export-format=csv',
                     env={'CLOUD_ML_HP_METRIC_FILE': str(job_dir / 'hp.json')})
  return job_dir, rerun


@pytest.mark.cli
def test_rerun_of_a_finished_but_unexported_job_evaluates_and_exports(
    rerun_unexported):
  job_dir, rerun = rerun_unexported
  assert int(eval_line(rerun)['global_step']) == 40
  assert tf.io.gfile.glob(str(job_dir / 'export' / 'final' / '*' /
                              'saved_model.pb'))
  assert (job_dir / 'hp.json').exists()  # The tuning metric is reported.


@pytest.mark.cli
def test_gcloud_local_train_trial_layout_and_metric_file(tmp_path, csv_files):
  metric_file = tmp_path / 'hypertune' / 'metrics.txt'
  # What a non-distributed `gcloud ai-platform local train` sets (no cluster,
  # so no task type), plus the trial id a tuning service adds.
  tf_config = {'cluster': {}, 'environment': 'cloud', 'task': {'trial': '7'},
               'job': {'job_name': 'trainer.task', 'args': []}}
  result = run_module(
      'trainer.task', f'--job_dir={tmp_path / "job"}',  # underscore spelling
      f'--train-files={csv_files[0]}', f'--eval-files={csv_files[1]}',
      '--train_steps=80', *CSV_FLAGS,
      env={'TF_CONFIG': json.dumps(tf_config),
           'CLOUD_ML_HP_METRIC_FILE': str(metric_file)})
  trial_dir = tmp_path / 'job' / '7'
  assert tf.train.latest_checkpoint(str(trial_dir)).endswith('model.ckpt-80')
  assert eval_line(result)['export'].startswith(str(trial_dir))
  reports = read_json_lines(metric_file)
  assert [r['global_step'] for r in reports] == ['40', '80']
  assert all(r['trial'] == '7' for r in reports)
  assert float(reports[-1]['training/hptuning/metric']) == pytest.approx(
      float(eval_line(result)['accuracy']), abs=1e-4)


@pytest.mark.cli
def test_trial_id_cannot_escape_the_job_dir(tmp_path, csv_files):
  job_dir = tmp_path / 'job'
  result = run_module(
      'trainer.task', f'--job-dir={job_dir}', f'--train-files={csv_files[0]}',
      f'--eval-files={csv_files[1]}', '--train-steps=5', *CSV_FLAGS,
      env={'CLOUD_ML_TRIAL_ID': '../../escaped',
           'CLOUD_ML_HP_METRIC_FILE': str(tmp_path / 'm.txt'),
           'CLOUD_ML_HP_METRIC_TAG': 'loss'})
  assert sorted(os.listdir(job_dir)) == ['_.._escaped']
  assert not (tmp_path / 'escaped').exists()
  # The tag names a metric of the model: that metric is reported under it
  # (it was the accuracy, under the tag `loss`, which a tuner minimised).
  reported = read_json_lines(tmp_path / 'm.txt')[-1]['loss']
  assert float(reported) == pytest.approx(float(eval_line(result)['loss']),
                                          abs=1e-4)


@pytest.mark.cli
def test_default_run_trains_on_embedded_digits(tmp_path):
  result = run_module('trainer.task', f'--job-dir={tmp_path}',
                      '--train-steps=300', '--cpu-towers=2')
  assert float(eval_line(result)['accuracy']) > 0.9


@pytest.mark.cli
def test_bfloat16_and_xla_train_on_cpu_towers(tmp_path):
  result = run_module('trainer.task', f'--job-dir={tmp_path}',
                      '--train-steps=50', '--cpu-towers=2',
                      '--mixed-precision=bfloat16', '--xla')
  assert float(eval_line(result)['accuracy']) > 0.8
  saved = json.loads((tmp_path / 'trainer_config.json').read_text())
  assert (saved['mixed_precision'], saved['xla']) == ('bfloat16', True)


@pytest.mark.fast
def test_float16_on_cpu_towers_fails_in_one_line(tmp_path, task_here):
  code, _, err = task_here(f'--job-dir={tmp_path}', '--cpu-towers=2',
                           '--mixed-precision=float16')
  assert code == 1
  assert err.strip().splitlines()[-1:] == [
      "task: error: --mixed-precision='float16' needs GPU towers: "
      "TensorFlow's float16 rewrite converts GPU ops only, and on CPU towers "
      "it would train in float32. On CPUs use --mixed-precision='bfloat16'."]


@pytest.mark.cli
def test_helpfull_lists_every_flag():
  result = run_module('trainer.task', '--helpfull')
  for flag in ('--job-dir', '--train-files', '--eval-files', '--model',
               '--train-batch-size', '--cpu-towers', '--gpu-memory-fraction',
               '--export-format', '--hypertune-metric', '--verbosity'):
    assert flag in result.stdout, flag


@pytest.mark.cli
@pytest.mark.parametrize('args,message', [
    (['--no-such-flag=1'], "Unknown command line flag 'no-such-flag'"),
    (['--train-steps=many'], 'train-steps'),
    (['--train-steps=0'], 'train-steps'),
    (['--optimizer=lbfgs'], 'optimizer'),
    (['--categorical-column=colour'], 'NAME=VALUE'),
    (['--categorical-column=colour=hash:1'], 'at least 2'),
    (['--hidden-units=16,x'], '--hidden-units takes integers'),
    (['--image-size=32'], 'HEIGHT,WIDTH'),
    (['stray'], 'unexpected arguments'),
    (['--input-format=csv'], '--input-format=csv needs --train-files'),
])
def test_bad_flags_exit_2_with_a_message(tmp_path, args, message):
  result = run_module('trainer.task', f'--job-dir={tmp_path}', *args,
                      check=False, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert message in result.stderr
  assert not os.listdir(tmp_path)  # Nothing was started.


@pytest.mark.fast
def test_missing_train_files_fail_before_training(tmp_path, task_here):
  code, _, err = task_here(f'--job-dir={tmp_path / "job"}',
                           f'--train-files={tmp_path}/nothing-*.csv',
                           '--label-column=label', '--n-classes=2')
  assert code == 1
  assert 'nothing-*.csv' in err
  assert not (tmp_path / 'job').exists()


@pytest.mark.cli
def test_malformed_csv_row_names_file_and_line(tmp_path):
  bad = write_tabular_csv(tmp_path / 'bad.csv', 30,
                          extra_lines=['0.5,not-a-number,red,1'])
  result = run_module('trainer.task', f'--job-dir={tmp_path / "job"}',
                      f'--train-files={bad}', '--train-steps=20', *CSV_FLAGS,
                      check=False)
  assert result.returncode == 1
  assert 'bad.csv:32' in result.stderr  # Header is line 1, 30 rows follow.
  # One line that says how to go on, not a traceback.
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith(
      'task: error: Malformed CSV row ')
  assert '--skip-malformed' in result.stderr
  skipped = run_module('trainer.task', f'--job-dir={tmp_path / "job2"}',
                       f'--train-files={bad}', '--train-steps=20',
                       '--skip-malformed', *CSV_FLAGS)
  assert int(eval_line(skipped)['global_step']) == 20
  # The command line says what --skip-malformed skipped, and where.
  assert (f'skipped malformed rows: 1 of 31 rows of --train-files (the '
          f'first: {bad}:32: column `x2`: `not-a-number` is not a number)'
          in skipped.stdout), skipped.stdout


@pytest.mark.cli
def test_csv_export_format_serves_csv_lines(rerun_unexported):
  _, result = rerun_unexported
  classes = _served_classes(eval_line(result)['export'], _csv_inputs)
  assert len(classes[1]) == 1 and len(classes[7]) == 7
  assert classes[7][:2] == [1, 0]


@pytest.mark.cli
def test_second_task_on_a_busy_job_dir_is_refused(tmp_path):
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT}
  env.pop('TF_CONFIG', None)
  with open(tmp_path / 'first.log', 'w') as log:
    first = preloaded.start(
        'trainer.task', [f'--job-dir={tmp_path}', '--train-steps=1000000',
                         '--save-checkpoints-steps=100000', '--hidden-units=8'],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
      wait_until(lambda: 'examples/sec' in (tmp_path / 'first.log').read_text(),
                 120, 'the first task to train', first,
                 lambda: (tmp_path / 'first.log').read_text())
      second = run_module('trainer.task', f'--job-dir={tmp_path}',
                          '--train-steps=10', '--hidden-units=8', check=False)
    finally:
      first.kill()
      first.wait()
  assert second.returncode == 1
  assert 'another trainer.task is running' in second.stderr


@pytest.mark.cli
def test_rerun_with_another_architecture_is_refused(tmp_path, csv_files,
                                                   trained_40, task_here):
  args = _csv_args(_copy_of(trained_40, tmp_path), csv_files)
  code, _, err = task_here(*args, '--train-steps=80', '--hidden-units=32')
  assert code == 1
  assert '--hidden-units: [16, 8] -> [32]' in err
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith('-40')


@pytest.mark.fast
def test_job_dir_that_is_a_file_is_one_clear_error(tmp_path, task_here):
  path = tmp_path / 'a_file'
  path.write_text('not a directory')
  code, _, err = task_here(f'--job-dir={path}', '--train-steps=5')
  assert code == 1
  assert 'is not a directory this task can write to' in err
  assert 'Traceback' not in err


# No network here but package registries: Cloud Storage cannot be reached,
# as on a machine without network or credentials.
@pytest.mark.fast
@pytest.mark.parametrize('where,args', [
    ('--job-dir gs://no-bucket/jobs/x', ('--job-dir=gs://no-bucket/jobs/x',)),
    ('--train-files', ('--train-files=gs://no-bucket/data/train-*.csv',
                     '--label-column=label')),
])
def test_unreachable_bucket_is_one_line_naming_the_path(tmp_path, task_here,
                                                        where, args):
  if not args[0].startswith('--job-dir'):
    args = (f'--job-dir={tmp_path / "job"}',) + args
  code, _, err = task_here(*args, '--train-steps=5')
  assert code == 1, err[-3000:]
  assert 'Traceback' not in err
  last = err.strip().splitlines()[-1]
  assert last.startswith(f'task: error: {where}: cannot read gs://no-bucket/'
                         ), err[-3000:]
  assert ('the bucket gs://no-bucket is unreachable from this machine ('
          in last)
  assert 'Check the network and the credentials' in last


_BROKEN_MODELS = '''
import tensorflow as tf

def raises(features, labels, mode, params):
  raise KeyError('no such feature: age')

def returns_none(features, labels, mode, params):
  tf.compat.v1.layers.dense(features['x'], 2)
  return None
'''


@pytest.mark.fast
@pytest.mark.parametrize('name,message', [
    ('raises', "--model=broken_models:raises failed building the eval graph: "
               "KeyError: 'no such feature: age'"),
    ('returns_none', 'returned NoneType'),
])
def test_user_model_that_fails_is_one_clear_error(tmp_path, monkeypatch,
                                                  task_here, name, message):
  (tmp_path / 'broken_models.py').write_text(_BROKEN_MODELS)
  monkeypatch.syspath_prepend(str(tmp_path))  # The process's PYTHONPATH.
  try:
    code, _, err = task_here(f'--job-dir={tmp_path / "job"}',
                             f'--model=broken_models:{name}',
                             '--train-steps=5',
                             '--input-format=synthetic_tabular')
  finally:
    sys.modules.pop('broken_models', None)  # The next test's is its own.
  assert code == 1, err[-2000:]
  assert message in err
  assert 'Traceback' not in err


@pytest.mark.fast
@pytest.mark.parametrize('args,env,message', [
    (('--hypertune-metric=accurracy',), {},
     '--hypertune-metric=accurracy is not an evaluation result of '
     '--model=dnn; it reports accuracy'),
    ((), {'CLOUD_ML_HP_METRIC_FILE': '/proc/no/such/dir/metrics'},
     'CLOUD_ML_HP_METRIC_FILE=/proc/no/such/dir/metrics cannot be written'),
])
def test_tuning_problems_fail_before_training(tmp_path, task_here, args, env,
                                              message):
  tmp_path = tmp_path / 'job'
  code, _, err = task_here(f'--job-dir={tmp_path}', '--train-steps=5', *args,
                           env=env)
  assert code == 1, err[-2000:]
  assert message in err
  assert not tmp_path.exists() or not any(tmp_path.iterdir())  # Untouched.


@pytest.fixture(scope='module')
def seeded_jobs(tmp_path_factory):
  """One-step digits jobs with --aggregation=all_reduce: seeds 7, 7 and 8.

  Returns:
    {name: (job_dir, completed process, {kernel name: value})}, the kernels
    read before any test resumes a job.
  """
  root = tmp_path_factory.mktemp('seeded')
  jobs = {}
  for name, seed in (('a', 7), ('b', 7), ('c', 8)):
    job = root / name
    result = run_module('trainer.task', f'--job-dir={job}', '--train-steps=1',
                        '--cpu-towers=2', '--aggregation=all_reduce',
                        f'--tf-random-seed={seed}')
    reader = tf.train.load_checkpoint(str(job))
    jobs[name] = (job, result, {
        n: reader.get_tensor(n) for n, _ in tf.train.list_variables(str(job))
        if n.endswith('kernel')})
  return jobs


@pytest.mark.cli
def test_aggregation_flag_trains_and_checkpoints_move_between_strategies(
    seeded_jobs):
  job, first, _ = seeded_jobs['a']  # Trained with --aggregation=all_reduce.
  assert int(eval_line(first)['global_step']) == 1
  names = {name for name, _ in tf.train.list_variables(str(job))}
  assert not any('replica' in name for name in names), sorted(names)
  second = run_module('trainer.task', f'--job-dir={job}', '--train-steps=2',
                      '--cpu-towers=2', '--aggregation=round_robin',
                      '--tf-random-seed=7')
  assert int(eval_line(second)['global_step']) == 2
  assert 'Resuming from' in second.stderr


@pytest.mark.cli
def test_same_tf_random_seed_gives_the_same_start_weights(seeded_jobs):
  first, again, other = (seeded_jobs[n][2] for n in 'abc')
  assert first.keys() == again.keys() and first
  for name in first:
    np.testing.assert_allclose(first[name], again[name], atol=1e-6)
  assert any(not np.allclose(first[n], other[n]) for n in first)


@pytest.mark.fast
def test_only_an_evaluator_task_pauses_between_checkpoint_polls(tmp_path):
  # With no pause an evaluator that finds no new checkpoint loops at once,
  # logging each time: megabytes a minute.
  from trainer import train  # pylint: disable=g-import-not-at-top
  options = train.TaskOptions(train_steps=10, cpu_towers=2)
  evaluator = train._Run(options, str(tmp_path / 'e'),  # pylint: disable=protected-access
                         {'type': 'evaluator', 'index': 0})
  local = train._Run(options, str(tmp_path / 'l'), {})  # pylint: disable=protected-access
  assert evaluator.eval_spec.throttle_secs >= 1
  assert local.eval_spec.throttle_secs == 0


@pytest.mark.fast
def test_a_bad_model_option_is_named_as_its_flag(tmp_path, task_here):
  code, _, err = task_here(f'--job-dir={tmp_path}', '--model=resnet',
                           '--resnet-depth=21', '--train-steps=5')
  assert code == 1
  assert err.strip().splitlines()[-1].startswith(
      'task: error: --resnet-depth=21; a CIFAR ResNet has 6n+2 layers')
