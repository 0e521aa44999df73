"""What the tasks of a synchronous cluster must have been started with alike.

`replicate_model_fn(task_agreement=...)` compares these values across the
tasks before the first step (estimator_towers.task_agreement). They are the
options that change what is trained -- the model and its sizes, the
optimizer, batch size, steps, seed, data schema and vocabularies, precision
-- and the training files with their sizes. What may differ per task is
left out: its devices and threads, its timeouts and logging, and what only
the chief does (evaluation, checkpoints, export, the tuning metric).
"""

import dataclasses
from typing import Dict, List

import tensorflow as tf

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
    Flag -> value, plus 'training files' -> [name, bytes] of each file the
    training globs match (another file of the same schema trains silently
    otherwise).
  """
  shared = {}
  for field in dataclasses.fields(options_lib.TaskOptions):
    if field.name not in PER_TASK:
      shared[f'--{options_lib.flag_name(field)}'] = getattr(options,
                                                            field.name)
  shared['training files'] = _files_and_sizes(options.train_files)
  return shared


def _files_and_sizes(patterns: List[str]) -> List[List[object]]:
  found = []
  for pattern in patterns or []:
    for name in sorted(tf.io.gfile.glob(pattern)):
      found.append([name, tf.io.gfile.stat(name).length])
  return found
