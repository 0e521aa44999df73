"""The trainer where Cloud runs it: Vertex AI's TF_CONFIG and environment."""

import json
import os

import pytest
import tensorflow as tf

from cli_helpers import CSV_FLAGS, eval_line, run_module, write_tabular_csv
from trainer import cluster_config


@pytest.mark.cli
def test_single_replica_vertex_job_evaluates_exports_and_reports(
    tmp_path, csv_files):
  # What Vertex AI gives a one-machine trial of a tuning job.
  tf_config = {'cluster': {'chief': ['cmle-training-workerpool0-0:2222']},
               'task': {'type': 'chief', 'index': 0, 'trial': '3'},
               'environment': 'cloud'}
  metric_file = tmp_path / 'hypertune' / 'metrics'
  result = run_module(
      'trainer.task', f'--job-dir={tmp_path}',
      f'--train-files={csv_files[0]}', f'--eval-files={csv_files[1]}',
      '--train-steps=40', *CSV_FLAGS,
      env={'TF_CONFIG': json.dumps(tf_config),
           'CLOUD_ML_HP_METRIC_FILE': str(metric_file)})
  assert int(eval_line(result)['global_step']) == 40
  trial_dir = tmp_path / '3'
  assert tf.io.gfile.glob(str(trial_dir / 'export' / 'final' / '*' /
                              'saved_model.pb'))
  assert tf.io.gfile.glob(str(trial_dir / 'eval' / 'events.*'))
  reported = [json.loads(line) for line in metric_file.read_text().split('\n')
              if line.strip()]
  assert reported and reported[-1]['global_step'] == '40'


@pytest.mark.fast
def test_chief_of_a_bigger_cluster_stays_a_cluster_task():
  config = {'cluster': {'chief': ['h:1'], 'worker': ['h:2']},
            'task': {'type': 'chief', 'index': 0}}
  environ = {'TF_CONFIG': json.dumps(config)}
  assert cluster_config.single_machine(config, environ) is config
  assert json.loads(environ['TF_CONFIG']) == config


@pytest.mark.fast
def test_lone_chief_with_a_vertex_evaluator_pool_stays_a_cluster_task():
  # With an evaluator (pool 3, never in TF_CONFIG) the chief is no machine
  # alone: the evaluator evaluates while it trains.
  config = {'cluster': {'chief': ['c:1']},
            'task': {'type': 'chief', 'index': 0}}
  spec = {'cluster': {'workerpool0': ['c:1'], 'workerpool3': ['e:1']},
          'task': {'type': 'workerpool0', 'index': 0}}
  environ = {'TF_CONFIG': json.dumps(config),
             'CLUSTER_SPEC': json.dumps(spec)}
  assert cluster_config.single_machine(config, environ) is config
  del spec['cluster']['workerpool3']
  environ['CLUSTER_SPEC'] = json.dumps(spec)
  assert 'cluster' not in cluster_config.single_machine(config, environ)


@pytest.mark.cli
def test_vertex_output_locations_without_job_dir(tmp_path):
  aip = {'AIP_CHECKPOINT_DIR': str(tmp_path / 'checkpoints'),
         'AIP_MODEL_DIR': str(tmp_path / 'model'),
         'AIP_TENSORBOARD_LOG_DIR': str(tmp_path / 'logs')}
  result = run_module('trainer.task', '--train-steps=20', env=aip)
  assert int(eval_line(result)['global_step']) == 20
  assert tf.train.latest_checkpoint(aip['AIP_CHECKPOINT_DIR']).endswith('-20')
  # The SavedModel at the root of AIP_MODEL_DIR, where Vertex imports it.
  assert (tmp_path / 'model' / 'saved_model.pb').exists()
  assert tf.saved_model.load(aip['AIP_MODEL_DIR']).signatures
  assert tf.io.gfile.glob(str(tmp_path / 'logs' / 'events.*'))
  assert tf.io.gfile.glob(str(tmp_path / 'logs' / 'eval' / 'events.*'))


@pytest.mark.cli
def test_job_dir_wins_over_aip_checkpoint_dir(tmp_path):
  result = run_module('trainer.task', f'--job-dir={tmp_path / "job"}',
                      '--train-steps=5',
                      env={'AIP_CHECKPOINT_DIR': str(tmp_path / 'aip')})
  assert int(eval_line(result)['global_step']) == 5
  assert tf.train.latest_checkpoint(str(tmp_path / 'job'))
  assert not (tmp_path / 'aip').exists()


@pytest.mark.fast
def test_cluster_spec_becomes_tf_config_when_it_is_absent():
  spec = {'cluster': {'workerpool0': ['c:1'], 'workerpool1': ['w:1', 'w:2'],
                      'workerpool2': ['p:1'], 'workerpool3': ['e:1']},
          'task': {'type': 'workerpool1', 'index': 1, 'trial': '4'},
          'environment': 'cloud'}
  environ = {'CLUSTER_SPEC': json.dumps(spec)}
  cluster_config.adopt_cluster_spec(environ)
  assert json.loads(environ['TF_CONFIG']) == {
      'cluster': {'chief': ['c:1'], 'worker': ['w:1', 'w:2'],
                  'ps': ['p:1']},
      'task': {'type': 'worker', 'index': 1, 'trial': '4'},
      'environment': 'cloud'}
  assert cluster_config.check_tf_config(environ)
  # An existing TF_CONFIG wins.
  environ = {'CLUSTER_SPEC': json.dumps(spec), 'TF_CONFIG': '{"a": 1}'}
  cluster_config.adopt_cluster_spec(environ)
  assert environ['TF_CONFIG'] == '{"a": 1}'


def _summary_tags(directory):
  tags = set()
  for path in tf.io.gfile.glob(os.path.join(str(directory), 'events.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(value.tag for value in event.summary.value)
  return tags


@pytest.mark.cli
def test_census_sample_conventions(tmp_path):
  # Several files in one flag value, space-separated; the format in capitals;
  # --num-epochs ends training before --train-steps.
  first = write_tabular_csv(tmp_path / 'a.csv', 64, seed=1)
  second = write_tabular_csv(tmp_path / 'b.csv', 64, seed=2)
  flags = [f for f in CSV_FLAGS if not f.startswith('--train-batch-size')]
  result = run_module(
      'trainer.task', f'--job-dir={tmp_path / "job"}',
      f'--train-files={first} {second}', f'--eval-files={first},{second}',
      '--train-batch-size=32', '--num-epochs=1', '--train-steps=1000',
      '--export-format=CSV', '--log-step-count-steps=2', *flags)
  assert int(eval_line(result)['global_step']) == 4  # 128 rows / 32.
  assert tf.io.gfile.glob(str(tmp_path / 'job' / 'export' / 'final' / '*'))
  assert {'global_step/sec', 'examples/sec'} <= _summary_tags(
      tmp_path / 'job')
  # A re-run trains one more epoch from the checkpoint: its export must be
  # of the new step, not the first run's (which would then be reported).
  again = run_module(
      'trainer.task', f'--job-dir={tmp_path / "job"}',
      f'--train-files={first} {second}', f'--eval-files={first},{second}',
      '--train-batch-size=32', '--num-epochs=1', '--train-steps=1000',
      '--export-format=CSV', *flags)
  assert int(eval_line(again)['global_step']) == 8
  assert eval_line(again)['export'] != eval_line(result)['export']
  exported = tf.saved_model.load(eval_line(again)['export'])
  steps = [v for v in exported.variables if 'global_step' in v.name]
  assert int(steps[0].numpy()) == 8


@pytest.mark.cli
@pytest.mark.parametrize('variable', ['AIP_MODEL_DIR',
                                      'AIP_TENSORBOARD_LOG_DIR'])
def test_an_unwritable_vertex_output_stops_the_task_before_training(
    tmp_path, variable):
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  job_dir = tmp_path / 'job'
  result = run_module('trainer.task', f'--job-dir={job_dir}',
                      '--train-steps=20', env={variable: f'{blocker}/out'},
                      check=False)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith('task: error: ') and variable in last, last
  assert 'Traceback' not in result.stderr
  assert not tf.io.gfile.glob(str(job_dir / 'model.ckpt*'))
