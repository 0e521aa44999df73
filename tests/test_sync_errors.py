"""sync_errors: a synchronous cluster's failures as one line naming the task.

The errors are TensorFlow's own exception types with the messages TF 2.15
gives them (tests/test_sync_faults.py raises the real ones in processes).
"""

import pytest
import tensorflow as tf

from estimator_towers.cluster import task_sync
from trainer import cluster_rendezvous
from trainer import sync_errors

pytestmark = pytest.mark.fast

_SYNC = {'cluster': {'chief': ['a:1'], 'worker': ['b:1']},
         'task': {'type': 'worker', 'index': 0}}
_REMEDY = "Restart every task; they resume from the chief's last checkpoint."
_TIMED_OUT = ('From /job:chief/replica:0/task:0:\nCollective ops is aborted '
              'by: Collective has timed out during execution.\n\t [[{{node '
              'sum_over_tasks/CollectiveReduce}}]]')


def _guard_error():
  line = (f'worker:0: {task_sync.RESTARTED} (its collectives broke off; '
          "every task's input must give the same number of steps), and "
          f'this task cannot train alone. {_REMEDY}')
  return line, tf.errors.UnknownError(
      None, None, f'2 root error(s) found.\n  (0) UNKNOWN: RuntimeError: '
      f'{line}\nTraceback (most recent call last):\n  ...\n\t [[{{{{node '
      'restart_guard}}}}]]')


def test_the_restart_guard_says_its_own_line():
  line, error = _guard_error()
  assert sync_errors.cli_message(error, _SYNC) == line


@pytest.mark.parametrize('error, says', [
    (tf.errors.DeadlineExceededError(None, None, _TIMED_OUT),
     'waited longer than sync_timeout_secs'),
    (tf.errors.UnavailableError(None, None, 'Connection reset by peer'),
     'is unreachable'),
    # The worker's input ended and it closed its session while the chief
    # was exchanging batch-norm moments with it.
    (tf.errors.InternalError(
        None, None, 'From /job:chief/replica:0/task:0:\nCollective ops is '
        'aborted by: Delete called on non-empty BufRendezvous\n\t [[{{node '
        'tower_1/batch_normalization/global_moments/CollectiveReduce_1}}]]'),
     'is unreachable'),
    # The same, reported as the worker's cancelled receive (one CI run in
    # ten under load: the first error the chief's step saw).
    (tf.errors.CancelledError(
        None, None, 'From /job:chief/replica:0/task:0:\nCollective ops is '
        'aborted by: op cancelled\nThe error could be from a previous '
        'operation. Restart your program to reset.\nAdditional GRPC error '
        'information from remote target /job:worker/replica:0/task:0 while '
        'calling /tensorflow.WorkerService/RecvBuf'),
     'is unreachable'),
])
def test_a_peer_that_failed_or_stopped_is_one_line(error, says):
  message = sync_errors.cli_message(error, _SYNC)
  assert message.startswith('worker:0: ') and says in message
  assert "every task's input must give the same number of steps" in message
  assert message.endswith(_REMEDY) and '\n' not in message


_REFUSED_BY_LEADER = tf.errors.FailedPreconditionError(
    None, None, 'Device /job:worker/replica:0/task:0/device:CPU:0 current '
    "incarnation doesn't match with one in the group. This usually means "
    "this worker has restarted but the collective leader hasn't")


def _chief_started(model_dir, cluster):
  """The chief's start-up as trainer.task runs it: its cluster file."""
  cluster_rendezvous.check_same_cluster(
      str(model_dir), {'cluster': cluster, 'task': {'type': 'chief'}},
      wait_secs=0)


@pytest.mark.parametrize('with_chief_file', [True, False])
def test_a_task_restarted_alone_is_told_to_restart_every_task(
    tmp_path, with_chief_file):
  # Without a model dir to look in (the library's own tasks), and with this
  # job's chief file in it, the leader's refusal means a restart alone.
  if with_chief_file:
    _chief_started(tmp_path, _SYNC['cluster'])
  message = sync_errors.cli_message(
      _REFUSED_BY_LEADER, _SYNC, str(tmp_path) if with_chief_file else None)
  assert message.startswith('worker:0: this task was restarted but the '
                            'chief was not')
  assert message.endswith(_REMEDY)


@pytest.mark.parametrize('chief_cluster', [
    None,  # The chief never wrote to this job dir.
    {'chief': ['c:1'], 'worker': ['b:1']},  # This job dir's chief is elsewhere.
])
def test_a_worker_led_by_another_jobs_chief_is_told_so(tmp_path,
                                                       chief_cluster):
  # Before: 'this task was restarted' to a worker that never ran with it.
  if chief_cluster:
    _chief_started(tmp_path, chief_cluster)
  message = sync_errors.cli_message(_REFUSED_BY_LEADER, _SYNC, str(tmp_path))
  assert message.startswith("worker:0: the leader this task reached (chief:0 "
                            "at a:1) is not this job's"), message
  assert 'same --job-dir' in message and '\n' not in message


@pytest.mark.parametrize('error, tf_config', [
    # Not a collective's timeout.
    (tf.errors.DeadlineExceededError(None, None, 'Timed out waiting'), _SYNC),
    # Not a synchronous cluster: one process, or ps tasks.
    (tf.errors.DeadlineExceededError(None, None, _TIMED_OUT), None),
    (tf.errors.UnavailableError(None, None, 'ps gone'),
     {**_SYNC, 'cluster': {**_SYNC['cluster'], 'ps': ['c:1']}}),
    (tf.errors.UnknownError(None, None, 'something else'), _SYNC),
    (tf.errors.FailedPreconditionError(None, None, 'not initialized'), _SYNC),
])
def test_other_errors_are_left_alone(error, tf_config):
  assert sync_errors.cli_message(error, tf_config) is None


def test_tasks_counting_the_cluster_apart_are_one_line():
  # Job dirs not shared: the TF_CONFIGs were not compared at start-up, and
  # the group leader's refusal was a ~180-line traceback.
  error = tf.errors.InternalError(
      None, None, 'Device /job:worker/replica:0/task:0/device:CPU:0 is '
      'joining a group with size2, but that group has size 3 (group_key=1)'
      '\n\t [[{{node task_agreement/CollectiveGather}}]]')
  message = sync_errors.cli_message(error, _SYNC)
  assert message.startswith('worker:0: the tasks of the synchronous '
                            'cluster count themselves apart')
  assert 'lists 2 training tasks, another 3' in message
  assert '\n' not in message


def test_a_disagreement_with_its_own_remedy_is_one_line():
  # Not every disagreement ends with "(only device and thread counts may
  # differ)": the global batch norm's tower count names its own remedy.
  from estimator_towers.cluster import task_agreement  # pylint: disable=g-import-not-at-top
  key = task_agreement.TOWERS_FOR_GLOBAL_BATCH_NORM
  with tf.Graph().as_default():
    variables = [tf.compat.v1.get_variable('v', [1])]
  line = task_agreement.first_difference([
      task_agreement.statement('chief:0', {key: 1}, variables),
      task_agreement.statement('worker:0', {key: 2}, variables)])
  error = tf.errors.InvalidArgumentError(
      None, None, f'ValueError: {line}\nTraceback (most recent call last):'
      '\n  ...\n\t [[{{node task_agreement/task_agreement}}]]')
  assert sync_errors.cli_message(error, _SYNC) == line
