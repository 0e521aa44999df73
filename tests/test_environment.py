"""Environment defaults set from the command line before TensorFlow loads."""

import os

import pytest

from trainer import environment

pytestmark = pytest.mark.fast


@pytest.fixture
def clean_env(monkeypatch):
  """No TensorFlow variables set; the test's changes are undone after it."""
  for name in ('TF_ENABLE_ONEDNN_OPTS', 'TF_CPP_MIN_LOG_LEVEL'):
    monkeypatch.setenv(name, 'placeholder')
    monkeypatch.delenv(name)


@pytest.mark.parametrize('args', [['--cpu-towers=2'], ['--cpu_towers', '3']])
def test_cpu_towers_turn_onednn_off(clean_env, args):
  environment.configure(['task', *args])
  assert os.environ['TF_ENABLE_ONEDNN_OPTS'] == '0'


def test_one_cpu_tower_keeps_onednn(clean_env):
  environment.configure(['task', '--cpu-towers=1'])
  assert 'TF_ENABLE_ONEDNN_OPTS' not in os.environ


@pytest.mark.parametrize('args', [['--mixed-precision=bfloat16'],
                                  ['--mixed_precision', 'bfloat16']])
def test_bfloat16_turns_onednn_on_for_cpu_towers(clean_env, args):
  # The bfloat16 rewrite is oneDNN's, which TensorFlow turns on by default
  # only on CPUs with AVX-512: without it the run is refused.
  environment.configure(['task', '--cpu-towers=2', *args])
  assert os.environ['TF_ENABLE_ONEDNN_OPTS'] == '1'


def test_flags_in_a_flagfile_count_too(clean_env, tmp_path):
  inner = tmp_path / 'inner.cfg'
  inner.write_text('--cpu-towers=2\n')
  outer = tmp_path / 'outer.cfg'
  outer.write_text(f'# nested, as absl allows\n--flagfile={inner}\n'
                   '--verbosity=1\n')
  argv = ['task', f'--flagfile={outer}']
  environment.configure(argv)
  assert os.environ['TF_ENABLE_ONEDNN_OPTS'] == '0'
  assert os.environ['TF_CPP_MIN_LOG_LEVEL'] == '0'  # --verbosity=1: all.
  assert argv == ['task', f'--flagfile={outer}']  # absl reads it again.


def test_verbosity_names_become_absl_numbers(clean_env):
  argv = ['task', '--verbosity=error', '--job-dir=j']
  environment.configure(argv)
  assert argv == ['task', '--verbosity=-2', '--job-dir=j']
  assert os.environ['TF_CPP_MIN_LOG_LEVEL'] == '3'


def test_a_missing_flagfile_is_left_to_absl_to_report(clean_env, tmp_path):
  environment.configure(['task', f'--flagfile={tmp_path}/none.cfg'])
  assert os.environ['TF_CPP_MIN_LOG_LEVEL'] == '3'  # The default.
