"""`python -m trainer.task`: train, evaluate and export one model.

Runs locally, under `gcloud ai-platform local train --module-name
trainer.task --package-path trainer`, as a Cloud / Vertex AI job and as one
trial of a hyperparameter sweep. With no data flags it trains the default DNN
on the embedded digits data set. `--helpfull` lists every flag.

This module only parses flags; `trainer.train` does the work.
"""

import sys

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

from trainer import cli
from trainer import data_errors
from trainer import environment
from trainer import preemption
from trainer import train

cli.define_task_flags()


class UsageError(ValueError):
  """A flag value that parses but makes no sense."""


def _ints(name, values):
  try:
    return [int(v) for v in values]
  except ValueError as e:
    raise UsageError(f'--{name} takes integers, got {values!r}.') from e


def _pairs(name, values):
  """NAME=VALUE flag values as a dict."""
  out = {}
  for item in values:
    key, sep, value = item.partition('=')
    if not sep or not key:
      raise UsageError(f'--{name}={item!r} must look like NAME=VALUE.')
    out[key] = value
  return out


def _categorical(values):
  """NAME=v1|v2 (vocabulary) or NAME=hash:N (hash buckets)."""
  columns = {}
  for key, spec in _pairs('categorical-column', values).items():
    if spec.startswith('hash:'):
      buckets = _ints('categorical-column', [spec[5:]])[0]
      if buckets < 2:
        raise UsageError(f'--categorical-column={key}={spec}: use at least 2 '
                         'hash buckets.')
      columns[key] = buckets
    elif spec:
      columns[key] = spec.split('|')
    else:
      raise UsageError(f'--categorical-column={key}= needs a vocabulary '
                       '(a|b|c) or hash:N.')
  return columns


def options_from_flags() -> train.TaskOptions:
  """TaskOptions from the parsed flags.

  Raises:
    UsageError: a flag value that cannot be used.
  """
  v = cli.value
  image_size = _ints('image-size', v('image-size'))
  if len(image_size) != 2 or min(image_size) < 1:
    raise UsageError(f'--image-size takes HEIGHT,WIDTH, got {v("image-size")}.')
  hidden = _ints('hidden-units', v('hidden-units')) if v('hidden-units') \
      else None
  if hidden is not None and min(hidden) < 1:
    raise UsageError(f'--hidden-units must be positive, got {hidden}.')
  fraction = v('gpu-memory-fraction')
  if fraction is not None and not 0 < fraction <= 1:
    raise UsageError(f'--gpu-memory-fraction must be in (0, 1], got {fraction}.')
  return train.TaskOptions(
      job_dir=v('job-dir'), model=v('model'),
      train_files=cli.split_multi(v('train-files')),
      eval_files=cli.split_multi(v('eval-files')),
      input_format=v('input-format'), label_column=v('label-column'),
      columns=v('columns'), categorical_columns=_categorical(
          v('categorical-column')),
      column_defaults=_pairs('column-default', v('column-default')),
      label_vocabulary=v('label-vocabulary'), n_classes=v('n-classes'),
      skip_malformed=v('skip-malformed'),
      allow_non_finite=v('allow-non-finite'), image_size=tuple(image_size),
      image_channels=v('image-channels'), train_steps=v('train-steps'),
      num_epochs=v('num-epochs'),
      eval_steps=v('eval-steps'), train_batch_size=v('train-batch-size'),
      eval_batch_size=v('eval-batch-size'), learning_rate=v('learning-rate'),
      optimizer=v('optimizer'), hidden_units=hidden,
      first_layer_size=v('first-layer-size'), num_layers=v('num-layers'),
      scale_factor=v('scale-factor'), dropout=v('dropout'),
      resnet_depth=v('resnet-depth'),
      keras_application=v('keras-application'),
      tf_random_seed=v('tf-random-seed'), num_gpus=v('num-gpus'),
      gpu_ids=_ints('gpu-ids', v('gpu-ids')) if v('gpu-ids') else None,
      cpu_towers=v('cpu-towers'), gpu_memory_fraction=fraction,
      allow_growth=v('allow-growth'),
      inter_op_threads=v('inter-op-threads'),
      intra_op_threads=v('intra-op-threads'),
      save_checkpoints_steps=v('save-checkpoints-steps'),
      log_step_count_steps=v('log-step-count-steps'),
      keep_checkpoint_max=v('keep-checkpoint-max'),
      export_format=v('export-format'), export_best=v('export-best'),
      hypertune_metric=v('hypertune-metric'),
      hypertune_summary_tag=v('hypertune-summary-tag'))


def main(argv):
  environment.quiet_python_logs(flags.FLAGS['verbosity'].present,
                                logging.get_verbosity())
  if len(argv) > 1:
    sys.stderr.write(f'task: error: unexpected arguments {argv[1:]}\n')
    sys.exit(2)
  try:
    options = options_from_flags()
  except UsageError as e:
    sys.stderr.write(f'task: error: {e}\n')
    sys.exit(2)
  try:
    # SIGTERM, Ctrl-C and SIGHUP save a checkpoint instead of a traceback.
    with preemption.sigterm_handled():
      result = train.run(options)
  except (ValueError, TypeError) as e:
    # Errors that explain a bad input or model; their messages say the fix.
    # The traceback stays available with --verbosity=debug.
    logging.debug('Traceback of the error below:', exc_info=True)
    logging.error('%s', e)
    sys.stderr.write(f'task: error: {e}\n')
    sys.exit(1)
  except tf.errors.InvalidArgumentError as e:
    message = data_errors.cli_message(e)
    if message is None:
      raise  # Not a data check: TensorFlow's own error, traceback and all.
    logging.error('%s', message)
    sys.stderr.write(f'task: error: {message}\n')
    sys.exit(1)
  except tf.compat.v1.train.NanLossDuringTrainingError:
    message = ('the loss became nan during training; nothing more was saved '
               'or exported. Look for nan/inf in the data (allowed only with '
               '--allow-non-finite) or lower --learning-rate.')
    logging.error('%s', message)
    sys.stderr.write(f'task: error: {message}\n')
    sys.exit(1)
  except preemption.Preempted as e:
    sys.stderr.write(f'task: stopped: {e} Re-run the same command to '
                     'resume.\n')
    sys.exit(e.exit_code)
  print(_summary_line(result), flush=True)


def _summary_line(result) -> str:
  """The task's last line: eval metrics, or what this cluster task did."""
  where = f' task={result["task"]}' if result['task'] else ''
  if result['metrics'] is None:
    return f'done:{where} towers={result["towers"]} model_dir={result["model_dir"]}'
  metrics = ' '.join(f'{k}={float(v):.4f}' if k != 'global_step' else
                     f'{k}={int(v)}' for k, v in sorted(result['metrics'].items()))
  return (f'eval: {metrics}{where} towers={result["towers"]} '
          f'export={result["export_dir"]}')


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_or_exit)
