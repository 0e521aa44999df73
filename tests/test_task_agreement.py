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
