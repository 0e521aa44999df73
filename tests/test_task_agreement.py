"""The statements tasks compare before the first step (task_agreement).

The gather itself runs in tests/test_sync_faults.py, between real tasks.
"""

import json

import pytest
import tensorflow as tf

from estimator_towers.cluster import task_agreement

pytestmark = pytest.mark.fast
tf1 = tf.compat.v1


def _variables(*shapes):
  with tf.Graph().as_default():
    return [tf1.get_variable(f'v{i}', shape) for i, shape in enumerate(shapes)]


def test_the_first_different_value_is_named_with_both_tasks():
  variables = _variables([3, 2])
  chief = task_agreement.statement('chief:0', {'--dropout': 0.1}, variables)
  worker = task_agreement.statement('worker:0', {'--dropout': 0.5}, variables)
  # Gathered in any order, the leader is the reference.
  line = task_agreement.first_difference([worker, chief])
  assert line.startswith(task_agreement.DISAGREE)
  assert 'worker:0 has --dropout=0.5, chief:0 has --dropout=0.1' in line


def test_a_value_only_one_task_has_is_a_difference():
  variables = _variables([2])
  chief = task_agreement.statement('chief:0', {}, variables)
  worker = task_agreement.statement('worker:1', {'--xla': True}, variables)
  assert 'worker:1 has --xla=true, chief:0 has --xla=(not given)' in (
      task_agreement.first_difference([chief, worker]))


def test_other_variables_are_named_and_equal_tasks_agree():
  chief = task_agreement.statement('chief:0', {'a': 1}, _variables([3, 2]))
  same = task_agreement.statement('worker:0', {'a': 1}, _variables([3, 2]))
  other = task_agreement.statement('worker:1', {'a': 1}, _variables([3, 4]))
  assert task_agreement.first_difference([chief, same]) is None
  line = task_agreement.first_difference([chief, same, other])
  assert 'worker:1 built other model variables than chief:0' in line
  assert 'v0:(3, 4):float32 against v0:(3, 2):float32' in line


def test_long_values_compare_as_digests_within_the_gathered_length():
  variables = _variables([2])
  files = [[f'/data/part-{i:05d}.csv', 1000 + i] for i in range(2000)]
  chief = task_agreement.statement('chief:0', {'files': files}, variables)
  assert len(chief) <= task_agreement.LENGTH
  assert json.loads(chief)['values']['files'].startswith('sha256:')
  files[7][1] += 1  # One file of another size on the worker.
  worker = task_agreement.statement('worker:0', {'files': files}, variables)
  assert 'worker:0 has files=sha256:' in task_agreement.first_difference(
      [chief, worker])


def test_too_many_values_are_refused():
  values = {f'--option-{i}': 'x' for i in range(2000)}
  with pytest.raises(ValueError, match='too many to compare'):
    task_agreement.statement('chief:0', values, _variables([2]))


def test_towers_under_global_batch_norm_name_their_remedy():
  variables = _variables([2])
  key = task_agreement.TOWERS_FOR_GLOBAL_BATCH_NORM
  line = task_agreement.first_difference([
      task_agreement.statement('chief:0', {key: 1}, variables),
      task_agreement.statement('worker:0', {key: 3}, variables)])
  assert f'worker:0 has {key}=3, chief:0 has {key}=1' in line
  # Not the usual "only device counts may differ": here they may not.
  assert 'only device' not in line
  assert "batch_norm='per_tower'" in line


def _built_statement(model_fn, towers=2, **options):
  """The statement a chief of chief + worker gathers, from its graph."""
  import os  # pylint: disable=g-import-not-at-top
  import estimator_towers  # pylint: disable=g-import-not-at-top
  saved = os.environ.get('TF_CONFIG')
  os.environ['TF_CONFIG'] = json.dumps({
      'cluster': {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']},
      'task': {'type': 'chief', 'index': 0}})
  try:
    with tf.Graph().as_default() as graph:
      config = estimator_towers.make_run_config(cpu_devices=towers)
      spec = estimator_towers.replicate_model_fn(
          model_fn, aggregation='all_reduce', **options)(
              {'x': tf.ones([8, 3])}, tf.zeros([8], tf.int32),
              tf.estimator.ModeKeys.TRAIN, None, config)
      spec.scaffold.finalize()
  finally:
    if saved is None:
      os.environ.pop('TF_CONFIG')
    else:
      os.environ['TF_CONFIG'] = saved
  [gather] = [op for op in graph.get_operations()
              if op.type.startswith('CollectiveGather') and
              'task_agreement' in op.name]
  codes = tf.get_static_value(gather.inputs[0])
  return json.loads(''.join(chr(c) for c in codes if c))['values']


def _model(reduction='mean', batch_norm=False):
  def model_fn(features, labels, mode):
    x = features['x']
    if batch_norm:
      x = tf1.layers.batch_normalization(x, training=True)
    logits = tf1.layers.dense(x, 2)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    loss = (tf.reduce_mean(losses) if reduction == 'mean'
            else tf.reduce_sum(losses))
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, global_step=tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def test_a_cluster_task_states_the_wrappers_settings_and_the_loss_reduction():
  # A library user's tasks with micro_batches 1 and 2, or a mean on one
  # and a sum on the other, waited out the step timeout and then blamed
  # a stuck task.
  mean = _built_statement(_model('mean'))
  summed = _built_statement(_model('sum'), micro_batches=2)
  reductions = "the losses' reductions over the examples"
  assert json.loads(mean[reductions]) == ['ratio']
  assert json.loads(summed[reductions]) == ['sum']
  assert mean["replicate_model_fn's micro_batches"] == '1'
  assert summed["replicate_model_fn's micro_batches"] == '2'
  for setting in ('aggregation', 'batch_norm', 'loss_reduction',
                  'random_ops', 'check_first_batch'):
    assert f"replicate_model_fn's {setting}" in mean
  # Tower counts may differ per task unless batch norms exchange moments.
  assert task_agreement.TOWERS_FOR_GLOBAL_BATCH_NORM not in mean
  with_bn = _built_statement(_model(batch_norm=True), towers=3)
  assert with_bn[task_agreement.TOWERS_FOR_GLOBAL_BATCH_NORM] == '3'
  assert task_agreement.TOWERS_FOR_GLOBAL_BATCH_NORM not in (
      _built_statement(_model(batch_norm=True), batch_norm='per_tower'))


def test_equal_values_at_the_length_limit_agree_whatever_the_names():
  # 'chief:0' is one character shorter than 'worker:0': at the limit, the
  # chief sent its file list whole and the worker a digest of it, and
  # identical files were refused.
  variables = _variables([2])
  base = len(task_agreement.statement('chief:0', {'files': ''}, variables))
  room = task_agreement.LENGTH - base
  for pad in range(room - 70, room + 3):
    values = {'files': 'x' * pad}
    chief = task_agreement.statement('chief:0', values, variables)
    worker = task_agreement.statement('worker:12', values, variables)
    assert task_agreement.first_difference([chief, worker]) is None, pad
