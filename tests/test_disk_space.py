"""A disk that fills up while the task saves: one line, nothing half-written.

The disk is real: an 8 MiB tmpfs mounted for the test (root only), too small
for the first checkpoint of a DNN with two 1024-unit layers.
"""

import os
import subprocess

import pytest

from cli_helpers import run_module

pytestmark = pytest.mark.cli


@pytest.fixture
def small_disk(tmp_path):
  mount_point = tmp_path / 'small'
  mount_point.mkdir()
  mounted = subprocess.run(
      ['mount', '-t', 'tmpfs', '-o', 'size=8m', 'tmpfs', str(mount_point)],
      capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
  if mounted.returncode != 0:
    pytest.skip(f'cannot mount a small tmpfs here: {mounted.stderr.strip()}')
  try:
    yield mount_point
  finally:
    subprocess.run(['umount', '--lazy', str(mount_point)], check=True)


def test_disk_full_while_saving_is_one_line_and_leaves_no_temp_dir(
    small_disk):
  job_dir = small_disk / 'job'
  result = run_module('trainer.task', f'--job-dir={job_dir}',
                      '--train-steps=20', '--hidden-units=1024,1024',
                      check=False)
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(
      f'task: error: no space left on the device of --job-dir {job_dir} ('), \
      result.stderr[-3000:]
  assert ('MiB free) while writing there; removed the partial '
          'model.ckpt-0_temp. The last complete checkpoint is none.') in last
  assert not [name for name in os.listdir(job_dir) if '_temp' in name]
