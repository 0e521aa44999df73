"""estimator_towers.equivalence.compare and `python -m trainer.check`.

The comparison must find equality where the towers are exact, name
dropout and batch norm where they make towers differ, and call a
difference nothing explains a failure. Each case trains a tiny model for
a few steps (about 2 s).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from cli_helpers import ROOT
from cli_helpers import run_module
from helpers import OPTIMIZERS
from helpers import classifier_model_fn
from helpers import dataset_input_fn
from helpers import seeded
from estimator_towers import difference_sources
from estimator_towers import equivalence
from estimator_towers import make_run_config
from estimator_towers import replicate_model_fn

tf1 = tf.compat.v1


def _small_model_fn(features, labels, mode, params):
  """A dense layer with optional dropout, batch norm or a batch-size bug.

  params: 'dropout' (bool), 'batch_norm' (bool), 'bug' (bool: the loss is
  scaled by the batch size, so each tower's share weighs in wrongly).
  """
  training = mode == tf.estimator.ModeKeys.TRAIN
  net = tf1.layers.dense(features['x'], 6, activation=tf.nn.tanh,
                         kernel_initializer=seeded(1))
  if params.get('dropout'):
    net = tf1.layers.dropout(net, 0.5, training=training, seed=3)
  if params.get('batch_norm'):
    net = tf1.layers.batch_normalization(net, training=training)
  logits = tf1.layers.dense(net, 2, kernel_initializer=seeded(2))
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  if params.get('bug'):
    batch = tf.cast(tf.shape(features['x'])[0], tf.float32)
    loss = loss * batch / 12.0
  with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
        loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _compare(data, model_fn=_small_model_fn, **kwargs):
  x, y = data
  return equivalence.compare(
      model_fn, dataset_input_fn({'x': x}, y), num_towers=2, steps=3,
      **kwargs)


def _explaining(report):
  return [s.name for s in report.sources if s.explains]


@pytest.mark.training
def test_an_exact_model_is_equal_in_every_variable_metric_and_prediction(
    data):
  x, y = data
  report = _compare(data, classifier_model_fn,
                    params={'optimizer': OPTIMIZERS['adam']},
                    eval_input_fn=dataset_input_fn({'x': x}, y, repeat=False))
  assert report.verdict == equivalence.EQUAL, report.format()
  assert report.batches == 3  # Each run's, the same in both.
  names = [d.name for d in report.variables]
  # Optimizer slots are compared too, not only the weights.
  assert {'dense/kernel', 'dense/kernel/Adam', 'dense/kernel/Adam_1',
          'global_step'} <= set(names)
  assert all(d.within and d.max_abs <= 1e-5 for d in report.variables)
  # Towers add in another order: the runs are compared, not one run twice.
  assert max(d.max_abs for d in report.variables) > 0
  assert {m.name for m in report.metrics} >= {'accuracy', 'auc', 'loss'}
  assert all(m.difference.within for m in report.metrics)
  assert {d.name for d in report.predictions} == {'classes', 'logits'}
  assert _explaining(report) == []
  assert report.format().splitlines()[-1].startswith('verdict: EQUAL')


@pytest.mark.training
def test_dropout_and_batch_norm_are_named_as_expected_sources(data):
  report = _compare(data, params={'dropout': True, 'batch_norm': True},
                    batch_norm='per_tower')
  assert report.verdict == equivalence.EXPLAINED, report.format()
  # Each found on its own: without either one, this list is shorter.
  assert _explaining(report) == ['random ops', 'batch norm']
  worst = report.variables[0]
  assert not worst.within and worst.max_abs > 1e-3
  lines = report.format().splitlines()
  assert '  * random ops: ' in '\n'.join(lines)
  assert lines[-2].startswith('warning: the towers differ from one device')
  assert lines[-1].startswith('verdict: EXPLAINED: ')


@pytest.mark.training
def test_dropout_drawn_as_one_device_is_equal(data):
  # random_ops='one_device' rules the random ops out, and the towers do
  # draw one device's masks: nothing is left to explain.
  report = _compare(data, params={'dropout': True}, random_ops='one_device')
  assert report.verdict == equivalence.EQUAL, report.format()
  assert all(d.within for d in report.variables)


@pytest.mark.training
def test_a_difference_nothing_explains_is_a_failure(data):
  # The loss is stated to be a mean but scales with the shard's size: each
  # tower's gradient weighs half, and nothing in the graph says why.
  report = _compare(data, params={'bug': True}, loss_reduction='mean')
  assert report.verdict == equivalence.FAILURE, report.format()
  assert not report.variables[0].within
  assert _explaining(report) == []
  # One device on reversed batches measured the rounding: far smaller.
  rounding = [s for s in report.sources if s.name == 'rounding']
  assert len(rounding) == 1 and 'x more on towers than there: not ' \
      'rounding' in rounding[0].detail
  last = report.format().splitlines()[-1]
  assert last.startswith('verdict: FAILURE')
  assert 'this looks like a bug: please report it with this output' in last


def _cancelling_model_fn(features, labels, mode):
  """Adam on a weight whose gradient is zero but for rounding."""
  logits = tf1.layers.dense(features['x'], 2, kernel_initializer=seeded(2))
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
  weight = tf1.get_variable('w', [], initializer=tf1.zeros_initializer())
  p = tf.nn.softmax(logits)[:, 0]
  # The mean of p less the mean of p reversed is zero up to rounding, which
  # the summation order decides; Adam divides it by its own size: steps of
  # ~1e-2. (Not p - mean(p): rows centred by their shard's mean are
  # refused, shard_statistics.)
  loss += weight * (tf.reduce_mean(p) - tf.reduce_mean(tf.reverse(p, [0])))
  train_op = tf1.train.AdamOptimizer(0.1).minimize(
      loss, tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.training
def test_rounding_a_model_amplifies_is_explained_by_a_reversed_batch_run(
    data):
  report = _compare(data, _cancelling_model_fn)
  assert report.verdict == equivalence.EXPLAINED, report.format()
  assert report.variables[0].name == 'w' and not report.variables[0].within
  assert _explaining(report) == ['rounding']
  rounding = report.sources[0].detail
  assert 'one device trained again on every batch reversed' in rounding
  assert '(w); every difference beyond tolerance is within 20x' in rounding


@pytest.mark.training
def test_an_input_fn_giving_the_runs_other_batches_is_refused(data):
  x, y = data
  calls = []

  def input_fn():
    calls.append(None)
    # Each call starts one example later: the runs read other batches.
    examples = tf.data.Dataset.from_tensor_slices(({'x': x}, y))
    return examples.skip(len(calls)).batch(12).repeat()

  with pytest.raises(ValueError, match=r'the one-device and the towered run '
                     r'different batches \(first at step 1\).*shuffle with '
                     r'a seed'):
    equivalence.compare(_small_model_fn, input_fn, num_towers=2, steps=2,
                        params={})


@pytest.mark.fast
@pytest.mark.parametrize('kwargs,error,words', [
    ({'num_towers': 1}, ValueError, 'num_towers=1'),
    ({'steps': 0}, ValueError, 'steps=0'),
    ({'steps': 2.0}, TypeError, 'steps must be an int'),
    ({'rtol': -1.0}, ValueError, 'rtol=-1.0'),
    ({'atol': math.nan}, ValueError, 'atol=nan'),
    ({'device_type': 'TPU'}, ValueError, "device_type='TPU'"),
    ({'devices': ['/cpu:0']}, ValueError, "sets ['devices']"),
    ({'eval_input_fn': 3}, TypeError, 'eval_input_fn must be callable'),
    ({'no_such_argument': 1}, TypeError, 'no_such_argument'),
])
def test_bad_arguments_are_refused_before_training(data, kwargs, error,
                                                   words):
  arguments = {'num_towers': 2, 'steps': 1, **kwargs}
  with pytest.raises(error, match=words.replace('[', r'\[')):
    equivalence.compare(_small_model_fn, dataset_input_fn(*data),
                        **arguments)


@pytest.mark.fast
def test_sources_are_read_off_the_towered_graph_and_options_rule_them_out(
    data):
  graph_sources = difference_sources.GraphSources()
  with tf.Graph().as_default():
    features, labels = tf1.data.make_one_shot_iterator(
        dataset_input_fn({'x': data[0]}, data[1])()).get_next()
    graph_sources.read(replicate_model_fn(
        _small_model_fn, batch_norm='per_tower')(
            features, labels, tf.estimator.ModeKeys.TRAIN,
            {'dropout': True, 'batch_norm': True},
            make_run_config(cpu_devices=2)))
  tolerance = (1e-4, 1e-5)
  per_tower = {'batch_norm': 'per_tower'}
  found = {s.name: s
           for s in graph_sources.sources('CPU', per_tower, tolerance)}
  assert list(found) == ['random ops', 'batch norm', 'tolerance']
  assert 'dropout/' in found['random ops'].detail  # Tower 0's op name.
  assert '(batch_normalization)' in found['batch norm'].detail
  assert [s.explains for s in found.values()] == [True, True, False]
  ruled_out = graph_sources.sources(
      'CPU', {'random_ops': 'one_device', 'batch_norm': 'global'}, tolerance)
  assert [s.explains for s in ruled_out] == [False, False, False]
  assert "With random_ops='one_device'" in ruled_out[0].detail
  # GPU towers without op determinism add a source of their own.
  on_gpus = graph_sources.sources('GPU', per_tower, tolerance)
  assert on_gpus[2].name == 'non-deterministic kernels' and on_gpus[2].explains


@pytest.mark.fast
def test_a_used_model_dir_is_refused(data, tmp_path):
  (tmp_path / 'towers').mkdir()
  with pytest.raises(ValueError, match='fresh folder'):
    equivalence.compare(_small_model_fn, dataset_input_fn(*data),
                        num_towers=2, steps=1, model_dir=str(tmp_path))


@pytest.mark.fast
def test_differences_count_nan_on_one_side_and_shapes_as_beyond():
  difference = equivalence._difference  # pylint: disable=protected-access
  tolerance = (1e-4, 1e-5)
  close = difference('w', [1.0, 2.0], [1.00001, 2.0], tolerance)
  assert close.within and close.max_abs == pytest.approx(1e-5)
  for one, towers in (([1.0, np.nan], [1.0, 1.0]), ([1.0], [1.0, 1.0])):
    assert not difference('w', one, towers, tolerance).within
  assert difference('w', [np.nan], [np.nan], tolerance).within


@pytest.mark.cli
def test_check_cli_on_the_embedded_digits_exits_0_with_table_and_verdict():
  result = run_module('trainer.check', '--cpu-towers=2', '--check-steps=2',
                      '--eval-steps=1', '--hidden-units=16', '--max-rows=3',
                      timeout=180)
  lines = result.stdout.splitlines()
  assert lines[0] == ('training: 2 identical batches per run, from one '
                      'start checkpoint')
  assert lines[1].startswith('variables (') and 'worst first' in lines[1]
  assert lines[2].split() == ['name', 'shape', 'max', 'abs', 'max', 'rel',
                              'tol', 'ratio']
  assert lines[6].startswith('... ') and lines[6].endswith(' more')
  assert 'eval metrics:' in lines and 'expected sources of difference:' in lines
  assert any(l.split()[0] == 'accuracy' for l in lines if l.strip())
  assert lines[-1].startswith('verdict: EQUAL: ')
  assert '2 CPU towers vs one device, 2 steps' in lines[-1]


_TOWER_BUG = '''
import tensorflow as tf
import trainer
from model_fns import dnn


def model_fn(features, labels, mode, params):
  spec = dnn.tabular_dnn_model_fn(features, labels, mode, params)
  if mode != tf.estimator.ModeKeys.TRAIN:
    return spec
  # A bug replicate_model_fn cannot see: tower 1 trains another loss.
  scale = 3.0 if trainer.tower_context().index == 1 else 1.0
  loss = spec.loss * scale
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_or_create_global_step())
  return spec._replace(loss=loss, train_op=train_op)
'''


@pytest.mark.cli
def test_check_cli_exits_1_on_a_difference_nothing_explains(tmp_path):
  (tmp_path / 'tower_bug.py').write_text(_TOWER_BUG)
  result = run_module(
      'trainer.check', '--model=tower_bug:model_fn', '--cpu-towers=2',
      '--check-steps=1', '--eval-steps=1', '--hidden-units=8', check=False,
      timeout=180, env={'PYTHONPATH': f'{ROOT}:{tmp_path}'})
  assert result.returncode == 1, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert lines[-2].startswith('Before reporting: ')
  assert lines[-1].startswith('verdict: FAILURE: ')
  assert lines[-1].endswith('this looks like a bug: please report it with '
                            'this output.')


@pytest.mark.cli
def test_check_cli_exits_2_with_one_line_on_a_bad_tower_count():
  # Level 3: the C++ runtime's import notices would be lines of their own.
  result = run_module('trainer.check', '--cpu-towers=1', check=False,
                      timeout=120, env={'TF_CPP_MIN_LOG_LEVEL': '3'})
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      'check: error: --cpu-towers=1: the check compares one device with '
      'towers; give --cpu-towers=2 or more.']


@pytest.mark.training
def test_batch_norm_is_equal_by_default(data):
  # batch_norm='global' is replicate_model_fn's default: nothing to explain.
  report = _compare(data, params={'batch_norm': True})
  assert report.verdict == equivalence.EQUAL, report.format()
