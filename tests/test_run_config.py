"""Tests for estimator_towers.run_config, on real TensorFlow objects."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

from estimator_towers import run_config as rc

ONE = tf.compat.v1.GraphOptions().rewrite_options.ONE
CLUSTER = {
    'chief': ['127.0.0.1:2222'],
    'worker': ['127.0.0.1:2223'],
    'ps': ['127.0.0.1:2224'],
}


@pytest.fixture(name='gpus')
def fixture_gpus():
  """GPUs TensorFlow sees here; tests ask for more to trigger the errors."""
  return rc.available_gpu_count()


@pytest.fixture(autouse=True)
def fixture_no_tf_config(monkeypatch):
  # A TF_CONFIG leaking in from the environment would change RunConfig.
  monkeypatch.delenv('TF_CONFIG', raising=False)


def _set_tf_config(monkeypatch, task_type, index=0):
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': CLUSTER, 'task': {'type': task_type, 'index': index}}))


@pytest.mark.fast
def test_defaults(gpus):
  config = rc.make_run_config()
  session_config = config.session_config
  assert isinstance(session_config, tf.compat.v1.ConfigProto)
  assert dict(session_config.device_count) == {'GPU': gpus}
  assert session_config.allow_soft_placement
  assert session_config.gpu_options.allow_growth
  assert not session_config.log_device_placement
  assert session_config.gpu_options.visible_device_list == ''
  assert session_config.gpu_options.per_process_gpu_memory_fraction == 0
  assert session_config.inter_op_parallelism_threads == 0
  assert session_config.intra_op_parallelism_threads == 0
  # Estimator's own default when session_config is None; kept on purpose.
  assert (session_config.graph_options.rewrite_options
          .meta_optimizer_iterations == ONE)
  assert list(session_config.device_filters) == []


@pytest.mark.fast
def test_every_option_lands_in_session_config():
  session_config = rc.make_run_config(
      num_gpus=0,
      cpu_devices=2,
      allow_soft_placement=False,
      allow_growth=False,
      gpu_memory_fraction=0.25,
      log_device_placement=True,
      inter_op_threads=3,
      intra_op_threads=5).session_config
  assert dict(session_config.device_count) == {'GPU': 0, 'CPU': 2}
  assert not session_config.allow_soft_placement
  assert not session_config.gpu_options.allow_growth
  assert session_config.gpu_options.per_process_gpu_memory_fraction == 0.25
  assert session_config.log_device_placement
  assert session_config.inter_op_parallelism_threads == 3
  assert session_config.intra_op_parallelism_threads == 5


@pytest.mark.fast
def test_run_config_kwargs_pass_through(tmp_path):
  config = rc.make_run_config(
      str(tmp_path),
      tf_random_seed=7,
      save_checkpoints_steps=123,
      keep_checkpoint_max=2,
      log_step_count_steps=9,
      cpu_devices=2)
  assert config.model_dir == str(tmp_path)
  assert config.tf_random_seed == 7
  assert config.save_checkpoints_steps == 123
  assert config.save_checkpoints_secs is None
  assert config.keep_checkpoint_max == 2
  assert config.log_step_count_steps == 9
  assert config.session_config.device_count['CPU'] == 2


@pytest.mark.fast
def test_session_config_kwarg_is_rejected():
  with pytest.raises(ValueError, match='cpu_devices'):
    rc.make_run_config(session_config=tf.compat.v1.ConfigProto())


@pytest.mark.fast
def test_cpu_devices_give_real_session_devices():
  session_config = rc.make_run_config(cpu_devices=3).session_config
  with tf.compat.v1.Session(graph=tf.Graph(), config=session_config) as sess:
    cpus = [d.name for d in sess.list_devices() if d.device_type == 'CPU']
  assert sorted(name.rsplit('/', 1)[-1] for name in cpus) == [
      'device:CPU:0', 'device:CPU:1', 'device:CPU:2']
  assert rc.session_device_counts(session_config)[1] == 3


@pytest.mark.fast
def test_too_many_gpus_names_what_exists(gpus):
  with pytest.raises(ValueError) as error:
    rc.make_run_config(num_gpus=gpus + 1)
  message = str(error.value)
  assert f'num_gpus={gpus + 1}' in message
  assert f'has {gpus} GPUs visible to TensorFlow ({list(range(gpus))})' in (
      message)
  assert 'fallback_to_available_gpus=True' in message


@pytest.mark.fast
def test_missing_gpu_id_names_it(gpus):
  with pytest.raises(ValueError, match=rf'includes \[{gpus}\].* has {gpus} '):
    rc.make_run_config(gpu_ids=[gpus])


@pytest.mark.fast
def test_fallback_logs_and_uses_what_exists(gpus, caplog):
  with caplog.at_level(logging.WARNING):
    config = rc.make_run_config(num_gpus=gpus + 2,
                                fallback_to_available_gpus=True)
  assert config.session_config.device_count['GPU'] == gpus
  assert any(f'num_gpus={gpus + 2}' in record.getMessage()
             and record.levelno == logging.WARNING
             for record in caplog.records)


@pytest.mark.fast
def test_fallback_drops_missing_gpu_ids(caplog):
  with caplog.at_level(logging.WARNING):
    session_config = rc.build_session_config(
        available_gpus=2, gpu_ids=[3, 1, 0, 5],
        fallback_to_available_gpus=True)
  assert session_config.device_count['GPU'] == 2
  assert session_config.gpu_options.visible_device_list == '1,0'
  assert any('[3, 5]' in record.getMessage() for record in caplog.records)


@pytest.mark.fast
def test_fallback_with_no_gpus_left():
  session_config = rc.build_session_config(
      available_gpus=0, gpu_ids=[1], fallback_to_available_gpus=True)
  assert session_config.device_count['GPU'] == 0
  assert session_config.gpu_options.visible_device_list == ''


@pytest.mark.fast
@pytest.mark.parametrize('kwargs, count, visible', [
    ({}, 4, ''),
    ({'num_gpus': 2}, 2, ''),
    ({'num_gpus': 0}, 0, ''),
    ({'gpu_ids': [3, 1]}, 2, '3,1'),
    ({'num_gpus': 2, 'gpu_ids': [0, 2]}, 2, '0,2'),
    ({'gpu_ids': []}, 0, ''),
])
def test_build_session_config_with_four_gpus(kwargs, count, visible):
  session_config = rc.build_session_config(available_gpus=4, **kwargs)
  assert session_config.device_count['GPU'] == count
  assert session_config.gpu_options.visible_device_list == visible
  assert rc.session_device_counts(session_config, available_gpus=4) == (
      count, 1)


@pytest.mark.fast
@pytest.mark.parametrize('kwargs, error, match', [
    ({'num_gpus': 5}, ValueError, r'num_gpus=5 .* has 4 GPUs .*\[0, 1, 2, 3\]'),
    ({'gpu_ids': [1, 4]}, ValueError, r'includes \[4\]'),
    ({'num_gpus': 1, 'gpu_ids': [0, 1]}, ValueError, 'lists 2 GPUs'),
    ({'gpu_ids': [1, 1]}, ValueError, r'repeats \[1\]'),
    ({'gpu_ids': [0, -1]}, ValueError, r'gpu_ids\[1\] must be >= 0'),
    ({'gpu_ids': [0.0]}, TypeError, r'gpu_ids\[0\] must be an int'),
    ({'gpu_ids': '0,1'}, TypeError, 'list of ints'),
    ({'gpu_ids': 1}, TypeError, 'list of ints'),
    ({'num_gpus': -1}, ValueError, 'num_gpus must be >= 0, got -1'),
    ({'num_gpus': True}, TypeError, 'num_gpus must be an int'),
    ({'num_gpus': 1.0}, TypeError, 'num_gpus must be an int'),
    ({'num_gpus': '2'}, TypeError, 'num_gpus must be an int'),
    ({'cpu_devices': 0}, ValueError, 'cpu_devices must be >= 1, got 0'),
    ({'cpu_devices': 2.5}, TypeError, 'cpu_devices must be an int'),
    ({'gpu_memory_fraction': 0}, ValueError, r'\(0, 1\], got 0'),
    ({'gpu_memory_fraction': 1.5}, ValueError, r'\(0, 1\], got 1.5'),
    ({'gpu_memory_fraction': -0.1}, ValueError, r'\(0, 1\]'),
    ({'gpu_memory_fraction': float('nan')}, ValueError, r'\(0, 1\]'),
    ({'gpu_memory_fraction': '0.5'}, TypeError, 'must be a number'),
    ({'inter_op_threads': -1}, ValueError, 'inter_op_threads must be >= 0'),
    ({'intra_op_threads': None}, TypeError, 'intra_op_threads must be an int'),
    ({'allow_growth': 'yes'}, TypeError, 'allow_growth must be True or False'),
    ({'available_gpus': -1}, ValueError, 'available_gpus must be >= 0'),
])
def test_bad_input_raises(kwargs, error, match):
  kwargs = {'available_gpus': 4, **kwargs}
  with pytest.raises(error, match=match):
    rc.build_session_config(**kwargs)


@pytest.mark.fast
def test_make_run_config_validates_too():
  with pytest.raises(ValueError, match='gpu_memory_fraction'):
    rc.make_run_config(gpu_memory_fraction=2.0)
  with pytest.raises(TypeError, match='num_gpus'):
    rc.make_run_config(num_gpus=False)


@pytest.mark.fast
def test_fraction_of_one_is_allowed():
  session_config = rc.build_session_config(available_gpus=1,
                                           gpu_memory_fraction=1)
  assert session_config.gpu_options.per_process_gpu_memory_fraction == 1.0


@pytest.mark.fast
def test_worker_keeps_cluster_device_filters(monkeypatch):
  _set_tf_config(monkeypatch, 'worker', 0)
  config = rc.make_run_config(cpu_devices=2, inter_op_threads=4,
                              allow_growth=False, tf_random_seed=3)
  assert config.task_type == 'worker'
  assert not config.is_chief
  assert config.tf_random_seed == 3
  session_config = config.session_config
  assert list(session_config.device_filters) == [
      '/job:ps', '/job:worker/task:0']
  assert (session_config.graph_options.rewrite_options
          .meta_optimizer_iterations == ONE)
  assert session_config.device_count['CPU'] == 2
  assert session_config.inter_op_parallelism_threads == 4
  assert not session_config.gpu_options.allow_growth


@pytest.mark.fast
def test_chief_keeps_cluster_device_filters(monkeypatch):
  _set_tf_config(monkeypatch, 'chief', 0)
  config = rc.make_run_config(log_device_placement=True)
  assert config.is_chief
  assert list(config.session_config.device_filters) == ['/job:ps', '/job:chief']
  assert config.session_config.log_device_placement


@pytest.mark.fast
def test_evaluator_gets_no_filters_but_our_settings(monkeypatch):
  _set_tf_config(monkeypatch, 'evaluator', 0)
  config = rc.make_run_config(cpu_devices=2, intra_op_threads=2)
  assert config.task_type == 'evaluator'
  assert list(config.session_config.device_filters) == []
  assert config.session_config.device_count['CPU'] == 2
  assert config.session_config.intra_op_parallelism_threads == 2


@pytest.mark.fast
@pytest.mark.parametrize('fields, available, expected', [
    ({}, 4, (4, 1)),
    ({}, 0, (0, 1)),
    ({'device_count': {'GPU': 2}}, 4, (2, 1)),
    ({'device_count': {'GPU': 8}}, 2, (2, 1)),
    ({'device_count': {'CPU': 5}}, 3, (3, 5)),
    ({'device_count': {'GPU': 0, 'CPU': 2}}, 4, (0, 2)),
    ({'gpu_options': {'visible_device_list': '0,2'}}, 4, (2, 1)),
    ({'device_count': {'GPU': 3},
      'gpu_options': {'visible_device_list': '1'}}, 4, (1, 1)),
])
def test_session_device_counts(fields, available, expected):
  session_config = tf.compat.v1.ConfigProto(**fields)
  assert rc.session_device_counts(session_config, available) == expected


@pytest.mark.fast
def test_session_device_counts_of_none_uses_this_machine(gpus):
  assert rc.session_device_counts(None) == (gpus, 1)


# mixed_precision and xla: the session-config fields, the refusals, and
# (on a real session) that the switch changes what runs.

_ON = rewriter_config_pb2.RewriterConfig.ON


def _in_a_process(check: str, onednn: str) -> None:
  """Runs this module's function `check` in a fresh Python process with
  TF_ENABLE_ONEDNN_OPTS=`onednn`: TensorFlow reads it once, at import, and
  without it turns oneDNN on only on CPUs with AVX-512."""
  tests = os.path.dirname(os.path.abspath(__file__))
  code = (f'import sys; sys.path[:0] = [{tests!r}, {os.path.dirname(tests)!r}]'
          f'; import test_run_config; test_run_config.{check}()')
  result = subprocess.run(
      [sys.executable, '-c', code], capture_output=True, text=True,
      timeout=300, stdin=subprocess.DEVNULL,
      env={**os.environ, 'TF_ENABLE_ONEDNN_OPTS': onednn,
           'TF_CPP_MIN_LOG_LEVEL': '2'})
  assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.cli
@pytest.mark.parametrize('check', [
    '_check_bfloat16_switches_on_the_onednn_rewrite',
    '_check_bfloat16_session_multiplies_in_bfloat16_and_xla_compiles'])
def test_bfloat16_with_onednn_on(check):
  _in_a_process(check, onednn='1')


@pytest.mark.cli
def test_bfloat16_with_onednn_off_is_refused_saying_how_to_turn_it_on():
  _in_a_process('_check_bfloat16_refused', onednn='0')


def _check_bfloat16_refused():
  with pytest.raises(ValueError, match='set TF_ENABLE_ONEDNN_OPTS=1 before '
                     'TensorFlow is imported'):
    rc.make_run_config(num_gpus=0, cpu_devices=2, mixed_precision='bfloat16')


def _check_bfloat16_switches_on_the_onednn_rewrite():
  rewrite_options = rc.make_run_config(
      num_gpus=0, cpu_devices=2,
      mixed_precision='bfloat16').session_config.graph_options.rewrite_options
  assert rewrite_options.auto_mixed_precision_onednn_bfloat16 == _ON
  assert rewrite_options.auto_mixed_precision != _ON
  # The Estimator default survives the added switch.
  assert rewrite_options.meta_optimizer_iterations == ONE


@pytest.mark.fast
def test_float16_switches_on_the_gpu_rewrite_for_gpu_towers():
  rewrite_options = rc.build_session_config(
      available_gpus=2, mixed_precision='float16').graph_options.rewrite_options
  assert rewrite_options.auto_mixed_precision == _ON
  assert rewrite_options.auto_mixed_precision_onednn_bfloat16 != _ON


@pytest.mark.fast
def test_float16_on_cpu_towers_is_refused():
  # Grappler's float16 rewrite converts GPU ops only: on CPU towers it would
  # train in float32 while the user believes otherwise.
  with pytest.raises(ValueError, match="float16' needs GPU towers.*'bfloat16'"):
    rc.build_session_config(available_gpus=0, cpu_devices=2,
                            mixed_precision='float16')


@pytest.mark.fast
def test_bfloat16_on_gpu_towers_is_refused():
  with pytest.raises(ValueError, match="2 GPU towers in float32.*'float16'"):
    rc.build_session_config(available_gpus=2, mixed_precision='bfloat16')


@pytest.mark.fast
@pytest.mark.parametrize('value', ['fp16', 'float32', 16])
def test_unknown_mixed_precision_is_refused(value):
  with pytest.raises(ValueError, match=f"one of 'float16', 'bfloat16', got "
                     f'{value!r}'):
    rc.build_session_config(available_gpus=0, mixed_precision=value)


@pytest.mark.fast
def test_xla_sets_the_global_jit_level():
  default = rc.make_run_config(num_gpus=0).session_config
  assert (default.graph_options.optimizer_options.global_jit_level ==
          tf.compat.v1.OptimizerOptions.DEFAULT)
  session_config = rc.make_run_config(num_gpus=0, xla=True).session_config
  assert (session_config.graph_options.optimizer_options.global_jit_level ==
          tf.compat.v1.OptimizerOptions.ON_1)


@pytest.mark.fast
def test_xla_must_be_a_bool():
  with pytest.raises(TypeError, match="xla must be True or False, got 'on'"):
    rc.make_run_config(xla='on')


def _ops_run(session_config):
  """The (op type, dtype) pairs a session runs for a small dense layer."""
  graph = tf.Graph()
  with graph.as_default():
    # Fed, so that grappler cannot fold the layer into a constant.
    x = tf.compat.v1.placeholder(tf.float32, [8, 16])
    w = tf.compat.v1.placeholder(tf.float32, [16, 4])
    # Enough ops for XLA's auto-clustering (which skips tiny clusters).
    y = tf.reduce_sum(tf.square(tf.nn.relu(tf.matmul(x, w)) * 2. + 1.))
  metadata = tf.compat.v1.RunMetadata()
  with tf.compat.v1.Session(graph=graph, config=session_config) as sess:
    sess.run(y, {x: np.ones([8, 16]), w: np.full([16, 4], 0.5)},
             options=tf.compat.v1.RunOptions(output_partition_graphs=True),
             run_metadata=metadata)
  return {(node.op, tf.dtypes.as_dtype(node.attr['T'].type).name
           if node.attr['T'].type else None)
          for graph_def in metadata.partition_graphs
          for node in graph_def.node}


def _check_bfloat16_session_multiplies_in_bfloat16_and_xla_compiles():
  plain = _ops_run(rc.make_run_config(num_gpus=0,
                                      cpu_devices=2).session_config)
  assert not any(dtype == 'bfloat16' for _, dtype in plain)
  bfloat16 = _ops_run(rc.make_run_config(
      num_gpus=0, cpu_devices=2, mixed_precision='bfloat16').session_config)
  assert any('MatMul' in op and dtype == 'bfloat16' for op, dtype in bfloat16)
  compiled = _ops_run(rc.make_run_config(num_gpus=0, cpu_devices=2,
                                         xla=True).session_config)
  assert {'_XlaCompile', '_XlaRun'} <= {op for op, _ in compiled}


@pytest.mark.training
def test_a_synchronous_cluster_starts_workers_without_delay(monkeypatch):
  # train_and_evaluate staggers workers by 5 s each; a synchronous step would
  # wait for the last one.
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']},
       'task': {'type': 'worker', 'index': 0}}))
  assert rc.make_run_config().experimental_max_worker_delay_secs == 0
  assert rc.make_run_config(
      experimental_max_worker_delay_secs=7
  ).experimental_max_worker_delay_secs == 7
  # With ps tasks (asynchronous), the staggering stays.
  _set_tf_config(monkeypatch, 'worker')
  assert rc.make_run_config().experimental_max_worker_delay_secs is None
