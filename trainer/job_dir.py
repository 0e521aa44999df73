"""Guards for a task's job dir: one run at a time, one architecture.

Two `trainer.task` processes on one job dir would interleave their
checkpoints; a run with another architecture would meet checkpoints it
cannot (or, worse, can) restore. Both are refused with a clear error.
"""

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
from typing import Any, Dict, Iterator, Sequence

from absl import logging
import tensorflow as tf

from model_fns import hparams
from trainer import options as options_lib

LOCK_FILE = '.trainer.lock'
# Superseded by hidden_units when both runs give it.
_LAYER_SHAPE = ('first_layer_size', 'num_layers', 'scale_factor')


@contextlib.contextmanager
def locked(model_dir: str) -> Iterator[None]:
  """Holds the job dir's lock for the duration.

  Only local directories are locked (flock does not reach Cloud Storage).

  Raises:
    ValueError: another process holds the lock.
  """
  if '://' in model_dir:
    yield
    return
  try:
    tf.io.gfile.makedirs(model_dir)
    handle = open(os.path.join(model_dir, LOCK_FILE), 'a', encoding='utf-8')
  except (tf.errors.OpError, OSError) as e:
    raise ValueError(f'--job-dir {model_dir} is not a directory this task can '
                     f'write to ({getattr(e, "message", None) or e}). Choose '
                     'another --job-dir.') from e
  with handle as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise
      raise ValueError(
          f'another trainer.task is running in {model_dir}; two runs on one '
          'job dir would interleave their checkpoints. Wait for it to end '
          'or choose another --job-dir.') from e
    yield  # The lock goes with the file's close.


def clean(model_dir: str, own_files: Sequence[str]) -> None:
  """Empties a job dir this trainer wrote, for `--clean`; keeps the lock.

  Only a directory holding one of the trainer's `own_files` (or nothing) is
  emptied: a mistyped --job-dir (a home directory, a data bucket) is
  refused instead of deleted.

  Args:
    model_dir: The job dir (trial dir); the caller holds its lock.
    own_files: Names of files only the trainer writes there (its saved
      options, its run log).

  Raises:
    ValueError: the directory holds files but none of `own_files`.
  """
  if not tf.io.gfile.isdir(model_dir):
    return
  entries = [e.rstrip('/') for e in tf.io.gfile.listdir(model_dir)
             if e.rstrip('/') != LOCK_FILE]
  if entries and not set(own_files) & set(entries):
    shown = ', '.join(sorted(entries)[:5]) + (', ...' if len(entries) > 5
                                              else '')
    raise ValueError(
        f'--clean: {model_dir} holds files ({shown}) but no '
        f'{" or ".join(own_files)}, so this trainer did not write it; '
        'nothing was deleted. Check --job-dir, or remove the directory '
        'yourself.')
  for entry in entries:
    path = os.path.join(model_dir, entry)
    if tf.io.gfile.isdir(path):
      tf.io.gfile.rmtree(path)
    else:
      tf.io.gfile.remove(path)
  if entries:
    logging.info('--clean: removed %d entries of %s (checkpoints, events, '
                 'exports, run log).', len(entries), model_dir)


def check_same_architecture(model_dir: str, config_file: str,
                            options: Any) -> None:
  """Refuses to resume a job dir trained with another architecture.

  Args:
    model_dir: The job dir (trial dir) the run trains in.
    config_file: The name of the saved options file in it.
    options: The run's TaskOptions.

  A job dir whose only checkpoint is the untrained step 0 (its run failed
  before the first step, e.g. on its data) is no model to resume: that
  checkpoint is discarded, so the rerun with the fix starts afresh.

  Raises:
    ValueError: the job dir has trained checkpoints of a model built with
      other architecture options; names each difference.
  """
  path = os.path.join(model_dir, config_file)
  if (tf.train.latest_checkpoint(model_dir) is None or
      not tf.io.gfile.exists(path)):
    return
  with tf.io.gfile.GFile(path) as f:
    saved = json.load(f)
  current = json.loads(json.dumps(dataclasses.asdict(options)))
  architecture = options_lib.architecture_flags()
  names = [n for n in architecture if n in saved]
  differences = []
  if saved.get('hidden_units') or current.get('hidden_units'):
    # Either flag spelling sets the same layers: --hidden-units=128,64 is the
    # default --first-layer-size/--num-layers/--scale-factor layout.
    names = [n for n in names if n not in _LAYER_SHAPE + ('hidden_units',)]
    layers = _layers(saved), _layers(current)
    if layers[0] != layers[1]:
      differences.append(f'--{architecture["hidden_units"]}: '
                         f'{_shown(layers[0])} -> {_shown(layers[1])}')
  differences += [f'--{architecture[n]}: {_shown(saved[n])} -> '
                  f'{_shown(current[n])}'
                  for n in names if saved[n] != current[n]]
  if not differences:
    return
  if _untrained(model_dir):
    _discard_checkpoints(model_dir)
    return
  raise ValueError(
      f'{model_dir} holds checkpoints of another model ('
      + '; '.join(differences) + '). Resuming would restore weights of the '
      'old architecture or fail halfway. Use a new --job-dir, or the '
      'options the job was trained with.')


def _untrained(model_dir: str) -> bool:
  """Whether the latest checkpoint (so every one) is of global step 0."""
  checkpoint = tf.train.latest_checkpoint(model_dir)
  return int(tf.train.load_variable(checkpoint, 'global_step')) == 0


def _discard_checkpoints(model_dir: str) -> None:
  """Deletes the job dir's checkpoints (the trainer wrote them) and index."""
  state = tf.train.get_checkpoint_state(model_dir)
  for prefix in state.all_model_checkpoint_paths:
    for path in tf.io.gfile.glob(prefix + '.*'):
      tf.io.gfile.remove(path)
  tf.io.gfile.remove(os.path.join(model_dir, 'checkpoint'))
  logging.info('Discarded the untrained step-0 checkpoint in %s of a run '
               'that failed before its first step.', model_dir)


def _layers(options: Dict[str, Any]) -> Any:
  """The DNN layer sizes the options give (the options if they give none)."""
  try:
    return hparams.hidden_units(options)
  except ValueError:
    return {n: options.get(n) for n in _LAYER_SHAPE + ('hidden_units',)}


def _shown(value: Dict[str, Any]) -> str:
  return 'unset' if value is None else json.dumps(value)
