"""A damaged latest checkpoint: named, and the previous one resumed."""

import os

import pytest
import tensorflow as tf

from trainer import checkpoint_check

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1


def _save_checkpoints(model_dir, steps):
  """Real checkpoints of a small graph at each step; returns their paths."""
  paths = []
  with tf.Graph().as_default():
    step = tf1.train.get_or_create_global_step()
    tf1.get_variable('w', initializer=tf.ones([64, 8]))
    saver = tf1.train.Saver(max_to_keep=10)
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      for value in steps:
        session.run(step.assign(value))
        paths.append(saver.save(session, os.path.join(model_dir, 'model.ckpt'),
                                global_step=value))
  return paths


def _cut_in_half(path):
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous(tmp_path,
                                                                   caplog):
  first, second, latest = _save_checkpoints(str(tmp_path), [10, 20, 30])
  data = f'{latest}.data-00000-of-00001'
  _cut_in_half(data)
  with caplog.at_level('WARNING'):
    chosen = checkpoint_check.resumable(str(tmp_path))
  assert chosen == second
  assert tf.train.latest_checkpoint(str(tmp_path)) == second
  state = tf.train.get_checkpoint_state(str(tmp_path))
  assert list(state.all_model_checkpoint_paths) == [first, second]
  assert (f'The latest checkpoint {latest} is damaged: {data}: Read less '
          f'bytes than requested. Resuming from the previous one that reads '
          f'whole, {second}') in caplog.text
  assert os.path.exists(data)  # Left for inspection.


def test_a_damaged_index_is_named_and_an_older_one_chosen(tmp_path, caplog):
  first, second = _save_checkpoints(str(tmp_path), [1, 2])
  with open(f'{second}.index', 'wb') as f:
    f.write(b'not an index')
  with caplog.at_level('WARNING'):
    assert checkpoint_check.resumable(str(tmp_path)) == first
  assert f'{second}.index' in caplog.text


def test_no_readable_checkpoint_is_one_error_naming_the_files(tmp_path):
  (only,) = _save_checkpoints(str(tmp_path), [5])
  _cut_in_half(f'{only}.data-00000-of-00001')
  with pytest.raises(ValueError, match=(
      r'cannot be resumed: no checkpoint listed in .*checkpoint reads whole: '
      r'.*model\.ckpt-5\.data-00000-of-00001 \(Read less bytes than '
      r'requested\)\. Move the damaged files away')):
    checkpoint_check.resumable(str(tmp_path))


def test_whole_checkpoints_are_left_alone(tmp_path):
  assert checkpoint_check.resumable(str(tmp_path / 'new')) is None
  paths = _save_checkpoints(str(tmp_path), [1, 2])
  assert checkpoint_check.resumable(str(tmp_path)) == paths[-1]
  state = tf.train.get_checkpoint_state(str(tmp_path))
  assert list(state.all_model_checkpoint_paths) == paths
