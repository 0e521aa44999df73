"""SIGTERM, Ctrl-C, SIGHUP and kill -9 during training: nothing is lost,
nothing goes back."""

import os
import signal
import subprocess
import time

import pytest
import tensorflow as tf

import preloaded
from cli_helpers import ROOT, eval_line, run_module, wait_until

pytestmark = pytest.mark.cli

# Long enough that the signal always lands mid-training.
ARGS = ('--train-steps=1000000', '--save-checkpoints-steps=2000',
        '--train-batch-size=32', '--hidden-units=16')


def _start(job_dir):
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT}
  env.pop('TF_CONFIG', None)
  log = open(os.path.join(job_dir, 'task.log'), 'w')
  process = preloaded.start('trainer.task', [f'--job-dir={job_dir}', *ARGS],
                            cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
  return process, log


def _wait_for_training(job_dir, process, timeout=120):
  """Returns once the task logs training steps (the graph is built)."""
  path = os.path.join(job_dir, 'task.log')

  def log():
    with open(path) as f:
      return f.read()

  try:
    wait_until(lambda: 'examples/sec' in log(), timeout, 'training to start',
               process, log)
  except AssertionError:
    process.kill()  # It would train a million steps.
    raise


def _checkpoint_step(job_dir):
  path = tf.train.latest_checkpoint(str(job_dir))
  return int(path.rsplit('-', 1)[1]) if path else None


def test_sigterm_saves_a_checkpoint_and_rerun_resumes(tmp_path):
  process, log = _start(tmp_path)
  try:
    _wait_for_training(tmp_path, process)
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=60)
  finally:
    process.kill()
    log.close()
  output = (tmp_path / 'task.log').read_text()
  assert code == 143, output[-2000:]
  assert 'Received SIGTERM: saved' in output
  saved = _checkpoint_step(tmp_path)
  # The periodic saver ran only at step 0; the step saved is the SIGTERM one.
  assert saved and saved > 0 and f'model.ckpt-{saved}' in output
  resumed = run_module('trainer.task', f'--job-dir={tmp_path}',
                       f'--train-steps={saved + 50}', *ARGS[1:])
  assert f'model.ckpt-{saved}' in resumed.stderr  # Restored from it.
  assert int(eval_line(resumed)['global_step']) == saved + 50


@pytest.mark.parametrize('signum,code', [(signal.SIGINT, 130),
                                         (signal.SIGHUP, 129)])
def test_ctrl_c_and_hangup_save_a_checkpoint_and_exit_cleanly(tmp_path, signum,
                                                             code):
  process, log = _start(tmp_path)
  try:
    _wait_for_training(tmp_path, process)
    process.send_signal(signum)
    returncode = process.wait(timeout=60)
  finally:
    process.kill()
    log.close()
  output = (tmp_path / 'task.log').read_text()
  name = signal.Signals(signum).name
  assert returncode == code, output[-2000:]
  assert f'Received {name}: saved' in output
  assert 'Traceback' not in output and 'KeyboardInterrupt' not in output
  saved = _checkpoint_step(tmp_path)
  assert saved and saved > 0 and f'model.ckpt-{saved}' in output


def test_kill_9_then_rerun_resumes_from_the_last_checkpoint(tmp_path):
  steps = []
  for _ in range(2):
    process, log = _start(tmp_path)
    try:
      _wait_for_training(tmp_path, process)
      time.sleep(2)  # Past at least one periodic checkpoint write, often mid-write.
      process.send_signal(signal.SIGKILL)
      process.wait(timeout=30)
    finally:
      log.close()
    steps.append(_checkpoint_step(tmp_path))
  assert steps[0] is not None and steps[1] >= steps[0]  # Never backwards.
  final = run_module('trainer.task', f'--job-dir={tmp_path}',
                     f'--train-steps={steps[1] + 20}', *ARGS[1:])
  assert f'model.ckpt-{steps[1]}' in final.stderr
  assert int(eval_line(final)['global_step']) == steps[1] + 20
