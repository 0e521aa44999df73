"""What the tasks of a synchronous cluster must have been started with alike.

`replicate_model_fn(task_agreement=...)` compares these values across the
tasks before the first step (estimator_towers.cluster.task_agreement). They are the
options that change what is trained -- the model and its sizes, the
optimizer, batch size, steps, seed, data schema and vocabularies, precision
-- and what the training files hold (file_fingerprints). What may differ
per task is left out: its devices and threads, its timeouts and logging,
and what only the chief does (evaluation, checkpoints, export, the tuning
metric).

The evaluator takes no part in the training collectives; it compares its
options with the ones the chief saved in the job dir instead
(`EvaluatorCheckHook`).
"""

import dataclasses
import os
from typing import Dict, Optional

import tensorflow as tf

from model_fns import hparams
from trainer import assembly
from trainer import file_fingerprints
from trainer import options as options_lib

# Options that may differ from task to task.
PER_TASK = frozenset([
    'job_dir', 'num_gpus', 'gpu_ids', 'cpu_towers', 'gpu_memory_fraction',
    'allow_growth', 'inter_op_threads', 'intra_op_threads',
    'sync_timeout_secs', 'log_step_count_steps', 'save_checkpoints_steps',
    'keep_checkpoint_max', 'eval_files', 'eval_steps', 'eval_batch_size',
    'export_format', 'export_best', 'hypertune_metric',
    'hypertune_summary_tag'])


def values(options: options_lib.TaskOptions) -> Dict[str, object]:
  """The flags (as `--name`) every task must share, and their values.

  Args:
    options: This task's options.

  Returns:
    Flag -> value, plus 'training files' -> the files the training
    patterns match, with sizes and digests of a sample of them
    (file_fingerprints: another file of the same schema trains silently
    otherwise).
  """
  shared = _flags(options)
  shared['training files'] = file_fingerprints.of_patterns(
      options.train_files)
  return shared


def _flags(options: options_lib.TaskOptions) -> Dict[str, object]:
  """`values` without the training files."""
  shared = {}
  for field in dataclasses.fields(options_lib.TaskOptions):
    if field.name not in PER_TASK:
      shared[f'--{options_lib.flag_name(field)}'] = getattr(options,
                                                            field.name)
  _resolve_layer_sizes(shared, options)
  return shared


def _resolve_layer_sizes(shared: Dict[str, object],
                         options: options_lib.TaskOptions) -> None:
  """Compares the DNN's layer sizes, not how they were given: one task's
  --hidden-units=128,64 builds the model another's defaults build."""
  replaced = ('--first-layer-size', '--num-layers', '--scale-factor')
  shared['--hidden-units'] = hparams.hidden_units({
      'hidden_units': options.hidden_units,
      'first_layer_size': options.first_layer_size,
      'num_layers': options.num_layers,
      'scale_factor': options.scale_factor})
  for flag in replaced:
    shared.pop(flag)


def chief_difference(model_dir: str,
                     options: options_lib.TaskOptions) -> Optional[str]:
  """How the evaluator's options differ from those the chief trains with.

  Args:
    model_dir: The job's model dir, where the chief saved its options.
    options: The evaluator's options.

  Returns:
    A line naming the first difference, or None (also when the chief has
    not saved its options yet).
  """
  if not tf.io.gfile.exists(os.path.join(model_dir, assembly.CONFIG_FILE)):
    return None
  # Not the training files: the evaluator reads others, and stating them
  # would read up to 64 MiB twice before every evaluation.
  chief = _flags(assembly.load_options(model_dir))
  own = _flags(options)
  for name in sorted(chief):
    if own.get(name) != chief[name]:
      return (f'the evaluator has {name}={own.get(name)!r}, but the chief '
              f'trains with {name}={chief[name]!r}: it would evaluate the '
              'model with other settings than it was trained with. Start the '
              'evaluator with the chief\'s options.')
  return None


class EvaluatorCheckHook(tf.compat.v1.train.SessionRunHook):
  """Stops an evaluator started with other options than the chief's."""

  def __init__(self, model_dir: str, options: options_lib.TaskOptions):
    self._model_dir, self._options = model_dir, options

  def begin(self):
    difference = chief_difference(self._model_dir, self._options)
    if difference is not None:
      raise ValueError(difference)

