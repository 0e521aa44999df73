"""train.py's own pieces: the saved task config and its writers."""

import json
import threading

from trainer import train


def test_concurrent_config_writers_never_collide(tmp_path):
  # Tasks of a cluster share the job dir; before each writer had its own
  # temporary name, one task renamed another's file away.
  errors = []

  def write(seed):
    try:
      for _ in range(20):
        train._save_task_config(str(tmp_path),  # pylint: disable=protected-access
                                train.TaskOptions(train_steps=seed))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)  # Re-raised below, in the test's thread.

  threads = [threading.Thread(target=write, args=(i + 1,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors[0]
  saved = json.loads((tmp_path / train.CONFIG_FILE).read_text())
  assert saved['train_steps'] in range(1, 9)
  assert [p.name for p in tmp_path.iterdir()] == [train.CONFIG_FILE]
