"""job_dir.py: the architecture check's advice."""

import re

import tensorflow as tf
import pytest

from trainer import assembly
from trainer import job_dir
from trainer import options

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1


def _checkpoint_at(model_dir, step):
  with tf.Graph().as_default():
    global_step = tf1.train.get_or_create_global_step()
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      session.run(global_step.assign(step))
      tf1.train.Saver().save(session, str(model_dir / 'model.ckpt'),
                             global_step=step)


def test_untrained_step_0_checkpoint_of_another_model_is_discarded(tmp_path):
  assembly.save_options(str(tmp_path), options.TaskOptions(num_layers=2))
  _checkpoint_at(tmp_path, 0)
  job_dir.check_same_architecture(str(tmp_path), assembly.CONFIG_FILE,
                                  options.TaskOptions(num_layers=3))
  assert tf.train.latest_checkpoint(str(tmp_path)) is None
  assert not list(tmp_path.glob('model.ckpt-0.*'))


def test_trained_checkpoint_of_another_model_is_refused(tmp_path):
  assembly.save_options(str(tmp_path), options.TaskOptions(num_layers=2))
  _checkpoint_at(tmp_path, 5)
  with pytest.raises(ValueError, match='--num-layers: 2 -> 3'):
    job_dir.check_same_architecture(str(tmp_path), assembly.CONFIG_FILE,
                                    options.TaskOptions(num_layers=3))
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith('-5')


@pytest.mark.parametrize('saved,rerun,difference', [
    # The default layout, spelt as --hidden-units: the same model.
    ({}, {'hidden_units': [128, 64]}, None),
    ({'hidden_units': [128, 64]}, {}, None),
    ({'hidden_units': [32, 16]}, {'first_layer_size': 32}, None),
    ({}, {'hidden_units': [128, 32]}, '--hidden-units: [128, 64] -> [128, 32]'),
    ({'hidden_units': [16, 8]}, {'hidden_units': [32]},
     '--hidden-units: [16, 8] -> [32]'),
])
def test_layers_are_compared_not_the_flags_that_spell_them(
    tmp_path, saved, rerun, difference):
  assembly.save_options(str(tmp_path), options.TaskOptions(**saved))
  _checkpoint_at(tmp_path, 5)
  check = lambda: job_dir.check_same_architecture(  # pylint: disable=g-long-lambda
      str(tmp_path), assembly.CONFIG_FILE, options.TaskOptions(**rerun))
  if difference is None:
    check()
  else:
    with pytest.raises(ValueError, match=re.escape(f'({difference})')):
      check()
