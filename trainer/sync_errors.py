"""Failures of a synchronous cluster, as one line for the command line.

In a cluster of a chief and workers without ps (estimator_towers.cluster.task_sync)
no task can train without the others. When one dies, stops, starts too late
or ends its input early, the others fail with TensorFlow errors whose
messages are pages of graph context:

* DeadlineExceededError from a collective that waited longer than
  sync_timeout_secs (a stuck, late or finished peer);
* UnavailableError from a collective whose peer's server is gone, or
  InternalError ('Delete called on non-empty BufRendezvous') from one whose
  peer closed its session in the middle of the exchange (its input ended);
* the restart guard's RuntimeError (task_sync.TaskGroup.restart_guard),
  reported as an UnknownError, when the Estimator re-creates the session
  after a peer died;
* FailedPreconditionError from the chief's group leader when this task was
  restarted alone (a per-task restart policy) and the chief was not, or
  when the chief it reached is another job's (it never wrote this job
  dir's cluster_rendezvous file);
* task_agreement's line, reported as an InvalidArgumentError, when the
  tasks were started with different options, data or models (it names the
  difference; the remedy is to start them alike);
* InternalError ('joining a group with size 2, but that group has size 3')
  when the tasks' TF_CONFIGs list different numbers of tasks and their
  job dirs are not shared (cluster_rendezvous compares them otherwise).

`cli_message` turns each into one line that names the task and the remedy:
restart every task (they resume from the chief's last checkpoint).
"""

import re
from typing import Any, Dict, Optional

import tensorflow as tf

from estimator_towers.cluster import task_agreement
from estimator_towers.cluster import task_sync
from trainer import cluster_rendezvous

_GUARD = re.compile(r'\S+: ' + re.escape(task_sync.RESTARTED) +
                    r'[^\n]*?checkpoint\.')
_REMEDY = ('Restart every task; they resume from the chief\'s last '
           'checkpoint.')
# task_agreement's line: the tasks were started with different options,
# data or models.
_DISAGREE = re.compile(re.escape(task_agreement.DISAGREE) + r'[^\n]*\.')
# The group leader, when the tasks' TF_CONFIGs count the tasks apart (job
# dirs not shared, so cluster_rendezvous could not compare them first).
_GROUP_SIZE = re.compile(r'joining a group with size\s*(\d+), but that '
                         r'group has size (\d+)')
# What the group leader says to a task that restarted without it.
_RESTARTED_ALONE = "incarnation doesn't match with one in the group"
# A collective whose peer ended its session while they exchanged.
_ABORTED_BY_PEER = 'Collective ops is aborted by'
_ENDED_EARLY = ('stopped because its input ended after fewer steps (every '
                'task\'s input must give the same number of steps)')


def _task(tf_config: Dict[str, Any]) -> str:
  task = tf_config.get('task') or {}
  return f'{task.get("type")}:{task.get("index", 0)}'


def is_sync(tf_config: Optional[Dict[str, Any]]) -> bool:
  """Whether TF_CONFIG names a training task of a cluster without ps."""
  if not tf_config:
    return False
  cluster = tf_config.get('cluster') or {}
  training = sum(len(cluster.get(job) or ())
                 for job in task_sync.TRAINING_JOBS)
  task_type = (tf_config.get('task') or {}).get('type')
  return (training > 1 and not cluster.get('ps') and
          task_type in task_sync.TRAINING_JOBS)


def _leader(tf_config: Dict[str, Any]) -> str:
  cluster = tf_config.get('cluster') or {}
  for job in ('chief', 'master'):
    if cluster.get(job):
      return f'{job}:0 at {cluster[job][0]}'
  return 'chief:0'


def _restarted_alone(task: str, tf_config: Dict[str, Any],
                     model_dir: Optional[str]) -> str:
  """The group leader refused this task: restarted alone, or led by
  another job's chief (which never wrote this job dir's file)."""
  if model_dir is not None and not cluster_rendezvous.leader_wrote(
      model_dir, tf_config.get('cluster') or {}):
    return (f'{task}: the leader this task reached ({_leader(tf_config)}) '
            'is not this job\'s: it never wrote this job dir\'s '
            f'{cluster_rendezvous.FOLDER}/ file with this cluster, so it '
            'trains another job (or was given another --job-dir). Point '
            'TF_CONFIG\'s chief address at this job\'s chief, give every '
            'task the same --job-dir, and start this task again.')
  return (f'{task}: this task was restarted but the chief was not, and '
          'the chief\'s collectives still wait for the task that died; a '
          f'synchronous cluster restarts only as a whole. {_REMEDY}')


def cli_message(error: BaseException,
                tf_config: Optional[Dict[str, Any]],
                model_dir: Optional[str] = None) -> Optional[str]:
  """The one-line message of a synchronous cluster's failure.

  Args:
    error: An exception from training.
    tf_config: TF_CONFIG as a dict (None without one).
    model_dir: The task's model dir, where the tasks' cluster_rendezvous
      files are (None: a leader's refusal is read as a restart alone).

  Returns:
    E.g. 'worker:0: a collective of the synchronous cluster timed out ...
    Restart every task; ...'; None when `error` is not such a failure
    (re-raise it then).
  """
  if not isinstance(error, tf.errors.OpError) or not is_sync(tf_config):
    return None
  for known in (_GUARD, _DISAGREE):
    found = known.search(error.message)
    if found:
      return found.group(0)
  task = _task(tf_config)
  sizes = _GROUP_SIZE.search(error.message)
  if isinstance(error, tf.errors.InternalError) and sizes:
    return (f'{task}: the tasks of the synchronous cluster count '
            f'themselves apart: one TF_CONFIG lists {sizes.group(1)} '
            f'training tasks, another {sizes.group(2)}. Give every task the '
            'same TF_CONFIG "cluster" (only "task" differs) and start every '
            'task again.')
  if (isinstance(error, tf.errors.DeadlineExceededError) and
      'Collective' in error.message):
    return (f'{task}: a collective of the synchronous cluster waited longer '
            'than sync_timeout_secs for another task, which is stuck, '
            f'started too late, failed, or {_ENDED_EARLY}. {_REMEDY}')
  if (isinstance(error, tf.errors.FailedPreconditionError) and
      _RESTARTED_ALONE in error.message):
    return _restarted_alone(task, tf_config, model_dir)
  # A peer that ended aborts the step's collectives; which of their errors
  # the step reports first (its own, a receive the peer cancelled) depends
  # on timing.
  if isinstance(error, tf.errors.UnavailableError) or (
      isinstance(error, (tf.errors.InternalError, tf.errors.CancelledError))
      and _ABORTED_BY_PEER in error.message):
    return (f'{task}: another task of the synchronous cluster is '
            f'unreachable: it failed, or {_ENDED_EARLY}. {_REMEDY}')
  return None
