"""assembly.py: the saved task config, its writers and its readers."""

import json
import threading

import pytest

from trainer import assembly
from trainer import options

pytestmark = pytest.mark.fast


def test_concurrent_config_writers_never_collide(tmp_path):
  # Tasks of a cluster share the job dir; before each writer had its own
  # temporary name, one task renamed another's file away.
  errors = []

  def write(seed):
    try:
      for _ in range(20):
        assembly.save_options(str(tmp_path),
                              options.TaskOptions(train_steps=seed))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)  # Re-raised below, in the test's thread.

  threads = [threading.Thread(target=write, args=(i + 1,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors[0]
  saved = json.loads((tmp_path / assembly.CONFIG_FILE).read_text())
  assert saved['train_steps'] in range(1, 9)
  assert [p.name for p in tmp_path.iterdir()] == [assembly.CONFIG_FILE]


def test_saved_options_load_back_equal(tmp_path):
  saved = options.TaskOptions(hidden_units=[8, 4], image_size=(16, 8),
                              categorical_columns={'c': ['a', 'b']})
  assembly.save_options(str(tmp_path), saved)
  assert assembly.load_options(str(tmp_path)) == saved


def test_loading_from_a_dir_without_config_names_the_fix(tmp_path):
  with pytest.raises(ValueError, match='written by trainer.task'):
    assembly.load_options(str(tmp_path))
