"""Vertex AI's output locations: the copy of the model into AIP_MODEL_DIR."""

import os

import pytest
import tensorflow as tf

from trainer import vertex

pytestmark = pytest.mark.fast


def _files(root):
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, names in os.walk(root) for f in names)


@pytest.fixture
def export_dir(tmp_path):
  """A small SavedModel standing for the trainer's final export."""
  module = tf.Module()
  module.v = tf.Variable(3.0)
  module.f = tf.function(lambda: module.v * 2, input_signature=[])
  path = str(tmp_path / 'export' / '123')
  tf.saved_model.save(module, path)
  return path


def test_the_model_lands_at_the_root_of_aip_model_dir(tmp_path, export_dir):
  target = str(tmp_path / 'model')
  assert vertex.copy_model(export_dir, {'AIP_MODEL_DIR': target + '/'}) == (
      target)
  assert _files(target) == _files(export_dir)
  assert float(tf.saved_model.load(target).f()) == 6.0


def test_an_earlier_models_files_do_not_stay_mixed_in(tmp_path, export_dir):
  target = tmp_path / 'model'
  (target / 'variables').mkdir(parents=True)
  (target / 'assets').mkdir()
  for stale in ('saved_model.pb', 'variables/variables.data-00001-of-00002',
                'assets/old_vocabulary.txt'):
    (target / stale).write_text('from an earlier model')
  vertex.copy_model(export_dir, {'AIP_MODEL_DIR': str(target)})
  assert _files(str(target)) == _files(export_dir)


def test_a_copy_cut_short_leaves_no_loadable_model(tmp_path, export_dir):
  target = tmp_path / 'model'
  target.mkdir()
  (target / 'saved_model.pb').write_text('an earlier model')
  # A file that cannot be read makes the copy fail half-way.
  os.symlink(str(tmp_path / 'gone'),
             os.path.join(export_dir, 'variables', 'broken'))
  with pytest.raises(tf.errors.NotFoundError):
    vertex.copy_model(export_dir, {'AIP_MODEL_DIR': str(target)})
  assert not (target / 'saved_model.pb').exists()


def test_nothing_is_copied_without_aip_model_dir(export_dir):
  assert vertex.copy_model(export_dir, {}) is None
