"""Processes that share one machine's cores get their share of it."""

import os

from absl import flags
import pytest

from trainer import core_share

pytestmark = pytest.mark.fast


@pytest.mark.parametrize('processes, cores, intra, inter', [
    (2, 2, 1, 1),   # The loopback chief + worker of the tests and benches.
    (3, 2, 1, 1),   # More processes than cores: a thread each, never 0.
    (3, 8, 2, 1),   # Rounded down: 3 x 2 of 8 cores, none oversubscribed.
    (1, 8, 8, 4),   # One process (a chief beside ps tasks): every core.
])
def test_each_process_gets_its_share_of_the_cores(processes, cores, intra,
                                                  inter):
  assert core_share.pool_sizes(processes, cores) == (intra, inter)
  assert core_share.default_flags(processes, cores) == [
      f'--inter-op-threads={inter}', f'--intra-op-threads={intra}']


@pytest.mark.parametrize('processes, cores', [(0, 2), (2, 0), (-1, 4)])
def test_counts_below_one_are_refused(processes, cores):
  with pytest.raises(ValueError,
                     match=f'processes={processes} and cores={cores}'):
    core_share.pool_sizes(processes, cores)


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
  share = core_share.default_flags(2, 4)
  assert _parsed(share) == (1, 2)
  assert _parsed([*share, '--intra-op-threads=0']) == (1, 0)
  flagfile = tmp_path / 'task.flags'
  flagfile.write_text('--inter-op-threads=4\n')
  assert _parsed([*share, f'--flagfile={flagfile}']) == (4, 2)
