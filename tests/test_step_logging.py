"""Training's progress lines: by steps, by wall time, and the summary."""

import time

from absl import logging as absl_logging
import pytest
import tensorflow as tf

from trainer import step_logging

pytestmark = pytest.mark.fast
tf1 = tf.compat.v1


@pytest.fixture(autouse=True)
def info_logs():
  """absl INFO lines reach caplog, whatever other tests set the level to."""
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.INFO)
  yield
  absl_logging.set_verbosity(verbosity)


def _train(steps, pause_secs, **hook_kwargs):
  with tf.Graph().as_default():
    step = tf1.train.get_or_create_global_step()
    train_op = tf1.assign_add(step, 1)
    hook = step_logging.StepLoggingHook(
        tf.constant(0.5), global_batch_size=8, num_towers=2,
        every_n_steps=1000, **hook_kwargs)
    with tf1.train.MonitoredSession(hooks=[hook]) as session:
      for _ in range(steps):
        session.run(train_op)
        time.sleep(pause_secs)


def _lines(caplog, start):
  return [r.getMessage() for r in caplog.records
          if r.getMessage().startswith(start)]


def test_a_slow_step_is_logged_by_time_before_the_step_period(caplog):
  _train(4, 0.06, every_secs=0.05, warmup_steps=1)
  lines = _lines(caplog, 'step ')
  assert len(lines) == 3, lines  # Every step after the first, by time.
  assert lines[0].startswith('step 1: loss=0.5000 examples/sec=')


def test_the_summary_rates_the_steps_after_the_warm_up(caplog):
  _train(6, 0.0, every_secs=3600, warmup_steps=2)
  assert not _lines(caplog, 'step ')
  (summary,) = _lines(caplog, 'trained ')
  assert summary.startswith('trained 6 steps; examples/sec=')
  assert summary.endswith('(%s per tower, 2 towers) over steps 3-5, the first '
                          '2 steps excluded as warm-up' % summary.split(
                              '(')[1].split(' ')[0])


def test_too_short_a_run_says_so(caplog):
  _train(2, 0.0, every_secs=3600, warmup_steps=10)
  assert _lines(caplog, 'trained ') == [
      'trained 2 steps (too few after 10 warm-up steps for a steady '
      'examples/sec)']
