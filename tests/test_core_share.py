"""Tasks that trainer.cluster starts on one machine share its cores."""

import os

from absl import flags
import pytest

from trainer.cluster import core_share

pytestmark = pytest.mark.fast


@pytest.mark.parametrize('training_tasks, cores, threads', [
    (2, 2, 1),   # The loopback chief + worker of the tests and benchmarks.
    (3, 2, 1),   # More tasks than cores: one thread each, never 0.
    (3, 8, 2),   # Rounded down: 3 x 2 of 8 cores, none oversubscribed.
    (1, 8, 8),   # One training task (a chief beside ps): every core.
])
def test_each_task_gets_its_share_of_the_cores(training_tasks, cores,
                                               threads):
  assert core_share.threads_per_task(training_tasks, cores) == threads
  assert core_share.default_flags(training_tasks, cores) == [
      f'--inter-op-threads={threads}', f'--intra-op-threads={threads}']


@pytest.mark.parametrize('training_tasks, cores', [(0, 2), (2, 0), (-1, 4)])
def test_counts_below_one_are_refused(training_tasks, cores):
  with pytest.raises(ValueError, match=f'training_tasks={training_tasks} '
                     f'and cores={cores}'):
    core_share.threads_per_task(training_tasks, cores)


def test_the_share_follows_this_process_affinity():
  assert core_share.machine_cores() == len(os.sched_getaffinity(0))
  assert core_share.default_flags(1) == core_share.default_flags(
      1, len(os.sched_getaffinity(0)))


def _parsed(argv):
  values = flags.FlagValues()
  for name in ('inter-op-threads', 'intra-op-threads'):
    flags.DEFINE_integer(name, 0, '', flag_values=values)
  values(['task', *argv])
  return values['inter-op-threads'].value, values['intra-op-threads'].value


def test_the_users_thread_flags_override_the_share(tmp_path):
  # trainer.cluster puts the share before the user's flags (absl keeps a
  # flag's last value), so `--intra-op-threads` after `--` wins, and so does
  # a flagfile's; `=0` gives TensorFlow's own choice back.
  share = core_share.default_flags(2, 2)
  assert _parsed(share) == (1, 1)
  assert _parsed([*share, '--intra-op-threads=0']) == (1, 0)
  flagfile = tmp_path / 'task.flags'
  flagfile.write_text('--inter-op-threads=4\n')
  assert _parsed([*share, f'--flagfile={flagfile}']) == (4, 1)
