"""The tasks of a synchronous cluster agree on what they train, or stop.

Tasks started with different options (another learning rate, a reversed
label vocabulary, other files of the same schema) train together without a
single error: the sums and the broadcast only need equal shapes, so the
chief exports a model no one process would produce. At the start, before
the chief's variables are broadcast, every task gathers every task's
statement of what must be equal: the values the caller lists
(`replicate_model_fn(task_agreement=...)`; `trainer.task` lists its options
and input files) and the model's variables (names, shapes, dtypes). A
difference ends every task with one line naming it, within seconds.

The gather uses an instance key that does not depend on the graph, so that
tasks whose graphs differ still meet on it instead of waiting out the
timeout on collectives that never pair up.
"""

import hashlib
import json
from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

# What the line says, for trainer.sync_errors to find it in TensorFlow's
# error message.
DISAGREE = 'the tasks of the synchronous cluster disagree'
# Characters of one task's statement: the gather needs one length on every
# task. Longer values are replaced by a digest.
LENGTH = 8192
_SHOWN = 120  # Characters of a value a line shows.
_TASK_ROOM = 64  # Characters a task's name may take ('worker:12').
# What replicate_model_fn adds when its towers exchange batch-norm moments.
TOWERS_FOR_GLOBAL_BATCH_NORM = 'towers per task (batch_norm=global)'
_SAME_EVERYWHERE = ('Start every task with the same options and data (only '
                    'device and thread counts may differ)')
# What to do about a difference in these, instead of _SAME_EVERYWHERE.
_REMEDIES = {
    TOWERS_FOR_GLOBAL_BATCH_NORM: (
        "With batch_norm='global' each tower exchanges its batch-norm "
        'moments with the towers of its index on the other tasks, so every '
        'task needs as many towers: give every task as many devices, or '
        "train with batch_norm='per_tower'"),
}


def statement(task: str, values: Mapping[str, Any],
              variables: Sequence[tf.Variable]) -> str:
  """What this task must share with every other, as canonical JSON.

  Args:
    task: This task's name ('worker:0').
    values: Names (e.g. '--learning-rate') and values that must be equal.
    variables: The model's variables.

  Returns:
    JSON of at most LENGTH characters.
  """
  model = sorted(f'{v.op.name}:{v.shape}:{v.dtype.base_dtype.name}'
                 for v in variables)
  shown = {str(k): _text(v) for k, v in values.items()}
  document = {'task': task, 'values': shown, 'variables': _digest(model),
              'variable_count': len(model), 'first_variables': model[:20]}
  text = json.dumps(document, sort_keys=True)
  # Whether to digest must not depend on the task's own name: tasks with
  # equal values but names of other lengths would state them apart.
  if len(json.dumps({**document, 'task': ' ' * _TASK_ROOM},
                    sort_keys=True)) > LENGTH:
    # Long values (file lists) compare as digests.
    document['values'] = {k: v if len(v) <= _SHOWN else _digest(v)
                          for k, v in shown.items()}
    document['first_variables'] = []
    text = json.dumps(document, sort_keys=True)
  if len(text) > LENGTH:
    raise ValueError(f'task_agreement has {len(values)} values, too many to '
                     'compare across tasks; pass fewer (or digests).')
  return text


def first_difference(statements: Sequence[str]) -> Optional[str]:
  """The line naming the first way a task differs from the leader.

  Args:
    statements: Each task's `statement`, in any order.

  Returns:
    The line, or None when every task agrees.
  """
  documents = sorted((json.loads(s) for s in statements), key=_task_order)
  first = documents[0]
  for document in documents[1:]:
    task = document['task']
    for name in sorted(set(first['values']) | set(document['values'])):
      theirs = document['values'].get(name, '(not given)')
      ours = first['values'].get(name, '(not given)')
      if theirs != ours:
        return _line(f'{task} has {name}={_short(theirs)}, {first["task"]} has '
                     f'{name}={_short(ours)}', _REMEDIES.get(name))
    if document['variables'] != first['variables']:
      return _line(f'{task} built other model variables than {first["task"]} '
                   f'({document["variable_count"]} against '
                   f'{first["variable_count"]}'
                   f'{_first_other(document, first)})')
  return None


def agreement_op(task: str, values: Mapping[str, Any],
                 variables: Sequence[tf.Variable], size: int,
                 gather) -> tf.Operation:
  """An op that fails with the line of `first_difference` on any task.

  Args:
    task: See `statement`.
    values: See `statement`.
    variables: See `statement`.
    size: The number of tasks.
    gather: (int32 Tensor [LENGTH]) -> int32 Tensor [size * LENGTH], every
      task's tensor (the task group's all-gather).

  Returns:
    The op; run it before anything that needs the tasks to agree.
  """
  codes = np.zeros([LENGTH], np.int32)
  text = statement(task, values, variables)
  codes[:len(text)] = [ord(c) for c in text]
  gathered = gather(tf.constant(codes))

  def check(all_codes):
    parts = np.reshape(all_codes, [size, LENGTH])
    line = first_difference([''.join(chr(c) for c in part if c)
                             for part in parts])
    if line is not None:
      raise ValueError(line)
    return np.int64(0)

  return tf1.py_func(check, [gathered], tf.int64, stateful=True,
                     name='task_agreement').op


def _task_order(document: Dict) -> tuple:
  """The leader (chief or master) first, then the workers by index."""
  job, index = document['task'].rsplit(':', 1)
  return (job not in ('chief', 'master'), job, int(index))


def _line(difference: str, remedy: Optional[str] = None) -> str:
  return f'{DISAGREE}: {difference}. {remedy or _SAME_EVERYWHERE}.'


def _first_other(document: Dict, first: Dict) -> str:
  for theirs, ours in zip(document['first_variables'],
                          first['first_variables']):
    if theirs != ours:
      return f'; first: {theirs} against {ours}'
  return ''


def _text(value: Any) -> str:
  if isinstance(value, str):
    return value
  return json.dumps(value, sort_keys=True, default=str)


def _short(value: str) -> str:
  return value if len(value) <= _SHOWN else value[:_SHOWN] + '...'


def _digest(value: Any) -> str:
  text = value if isinstance(value, str) else json.dumps(value)
  return 'sha256:' + hashlib.sha256(text.encode()).hexdigest()[:16]
