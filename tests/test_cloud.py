"""The trainer where Cloud runs it: Vertex AI's TF_CONFIG and environment."""

import json

import tensorflow as tf

from cli_helpers import CSV_FLAGS, eval_line, run_module
from trainer import cluster_config


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


def test_chief_of_a_bigger_cluster_stays_a_cluster_task():
  config = {'cluster': {'chief': ['h:1'], 'worker': ['h:2']},
            'task': {'type': 'chief', 'index': 0}}
  environ = {'TF_CONFIG': json.dumps(config)}
  assert cluster_config.single_machine(config, environ) is config
  assert json.loads(environ['TF_CONFIG']) == config


def test_missing_evaluator_is_known_from_vertex_cluster_spec_only():
  spec = {'cluster': {'workerpool0': ['c:1'], 'workerpool3': ['e:1']},
          'task': {'type': 'workerpool0', 'index': 0}}
  assert not cluster_config.without_evaluator(
      {'CLUSTER_SPEC': json.dumps(spec)})
  del spec['cluster']['workerpool3']
  assert cluster_config.without_evaluator({'CLUSTER_SPEC': json.dumps(spec)})
  # TF_CONFIG alone never lists the evaluator: nothing is known.
  assert not cluster_config.without_evaluator({})
