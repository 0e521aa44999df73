"""--aggregation's default and check in a TF_CONFIG cluster (options)."""

import json

import pytest
import tensorflow as tf

from cli_helpers import run_module
from estimator_towers.run_config import make_run_config
from trainer import options as options_lib


def _tf_config(workers, ps, task_type='chief'):
  cluster = {'chief': ['localhost:1'],
             'worker': [f'localhost:{2 + i}' for i in range(workers)],
             'ps': [f'localhost:{8 + i}' for i in range(ps)]}
  return json.dumps({'cluster': {k: v for k, v in cluster.items() if v},
                     'task': {'type': task_type, 'index': 0}})


@pytest.mark.fast
@pytest.mark.parametrize('workers,ps,task_type,given,expected', [
    (1, 0, 'chief', None, 'all_reduce'),      # Synchronous: the only way.
    # The evaluator only evaluates (the same graph under any aggregation);
    # its RunConfig counts no training tasks.
    (2, 0, 'evaluator', None, 'global_loss'),
    (1, 0, 'worker', 'all_reduce', 'all_reduce'),
    (1, 1, 'worker', None, 'global_loss'),    # Asynchronous, as before.
    (1, 1, 'chief', 'round_robin', 'round_robin'),
    (0, 0, 'chief', None, 'global_loss'),     # A chief alone.
])
def test_aggregation_defaults_to_all_reduce_in_a_cluster_without_ps(
    monkeypatch, workers, ps, task_type, given, expected):
  monkeypatch.setenv('TF_CONFIG', _tf_config(workers, ps, task_type))
  options = options_lib.TaskOptions(aggregation=given)
  assert options_lib.aggregation_for(options,
                                     tf.estimator.RunConfig()) == expected


@pytest.mark.fast
@pytest.mark.parametrize('workers,ps,refused', [(1, 0, True), (1, 1, False),
                                                (0, 0, False)])
def test_xla_on_cpu_towers_of_a_synchronous_cluster_is_refused(
    monkeypatch, workers, ps, refused):
  monkeypatch.setenv('TF_CONFIG', _tf_config(workers, ps))
  options = options_lib.TaskOptions(xla=True, cpu_towers=2)
  config = make_run_config(None, cpu_devices=2, xla=True)
  if not refused:  # Asynchronous or one task: --xla trains as locally.
    assert options_lib.aggregation_for(options, config) == 'global_loss'
    return
  with pytest.raises(options_lib.OptionError, match='--xla cannot compile'):
    options_lib.aggregation_for(options, config)


@pytest.mark.fast
def test_no_cluster_keeps_global_loss(monkeypatch):
  monkeypatch.delenv('TF_CONFIG', raising=False)
  assert options_lib.aggregation_for(options_lib.TaskOptions(),
                                     tf.estimator.RunConfig()) == 'global_loss'


@pytest.mark.fast
@pytest.mark.parametrize('workers,ps,given,fix', [
    (1, 0, 'global_loss', '--aggregation=all_reduce'),
    (1, 0, 'round_robin', '--aggregation=all_reduce'),
    (1, 1, 'all_reduce', 'Remove the ps tasks'),
])
def test_an_aggregation_the_cluster_cannot_train_is_a_usage_error(
    monkeypatch, workers, ps, given, fix):
  monkeypatch.setenv('TF_CONFIG', _tf_config(workers, ps))
  with pytest.raises(options_lib.OptionError) as error:
    options_lib.aggregation_for(options_lib.TaskOptions(aggregation=given),
                                tf.estimator.RunConfig())
  assert f'--aggregation={given}' in str(error.value)
  assert fix in str(error.value)
  assert "aggregation='" not in str(error.value)  # In flag terms.


@pytest.mark.fast
def test_micro_batches_train_in_a_synchronous_cluster_too(monkeypatch):
  # A device's micro-batches share its copies under all_reduce.
  monkeypatch.setenv('TF_CONFIG', _tf_config(1, 0))
  assert options_lib.aggregation_for(options_lib.TaskOptions(micro_batches=2),
                                     tf.estimator.RunConfig()) == 'all_reduce'
  with pytest.raises(options_lib.OptionError, match='--micro-batches=0'):
    options_lib.aggregation_for(options_lib.TaskOptions(micro_batches=0),
                                tf.estimator.RunConfig())
  monkeypatch.delenv('TF_CONFIG')
  assert options_lib.aggregation_for(options_lib.TaskOptions(micro_batches=2),
                                     tf.estimator.RunConfig()) == 'global_loss'


@pytest.mark.cli
def test_the_task_refuses_it_in_one_line_before_training(tmp_path):
  result = run_module('trainer.task', f'--job-dir={tmp_path / "job"}',
                      '--aggregation=global_loss', '--train-steps=1',
                      env={'TF_CONFIG': _tf_config(1, 0)}, check=False,
                      timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  # TensorFlow's own start-up noise aside, one line says what to do.
  (line,) = [l for l in result.stderr.splitlines() if l.startswith('task:')]
  assert 'Traceback' not in result.stderr
  assert '--aggregation=global_loss' in line
  assert '--aggregation=all_reduce' in line
  assert not (tmp_path / 'job').exists()


@pytest.mark.fast
@pytest.mark.parametrize('kwargs,flags', [
    ({'num_gpus': 1}, ['--num-gpus=1']),
    ({'gpu_ids': [0]}, ['--gpu-ids=[0]']),
    ({'num_gpus': 0, 'cpu_devices': 2, 'mixed_precision': 'float16'},
     ["--mixed-precision='float16'", "--mixed-precision='bfloat16'"]),
])
def test_run_config_errors_name_the_task_flags(kwargs, flags):
  # The library names its arguments and offers fallback_to_available_gpus,
  # which no flag sets; a command-line user sees flags only.
  with pytest.raises(ValueError) as error:
    make_run_config(available_gpus=0, **kwargs)
  message = options_lib.in_flag_terms(str(error.value))
  for flag in flags:
    assert flag in message, message
  for argument in ('num_gpus', 'gpu_ids', 'mixed_precision', 'cpu_devices',
                   'fallback_to_available_gpus'):
    assert argument not in message, message

