"""`python -m trainer.task`: train, evaluate and export one model.

Runs locally, under `gcloud ai-platform local train --module-name
trainer.task --package-path trainer`, as a Cloud / Vertex AI job and as one
trial of a hyperparameter sweep. With no data flags it trains the default DNN
on the embedded digits data set. `--helpfull` lists every flag.

This module only parses flags; `trainer.train` does the work.
"""

import contextlib
import sys

from trainer import environment

if __name__ == '__main__':
  # TensorFlow reads these variables once, when the imports below load it.
  environment.configure(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
from absl import logging
import tensorflow as tf

from trainer import cli
from trainer import cluster_config
from trainer import data_errors
from trainer import options as options_lib
from trainer import preemption
from trainer import sync_errors
from trainer import train

options_lib.define_flags()
# Not a TaskOptions field: it says what to do with the options, and a
# trainer_config.json saved with it would mean nothing.
cli.define(flags.DEFINE_boolean, 'dry-run', False,
           'Check the options, data, model and tuning metric, then exit '
           'without training or writing anything (trainer.sweep does this '
           'before its first trial).')
# --help lists them (absl registers them under cli, which defines them).
flags.adopt_module_key_flags(cli)


def main(argv):
  del argv  # cli.run has refused any left-over arguments.
  environment.quiet_python_logs(flags.FLAGS['verbosity'].present,
                                logging.get_verbosity())
  options = options_lib.from_flags()
  try:
    if cli.value('dry-run'):
      print(f'dry run: the options check out; the tuning metric is '
            f'{train.check(options)}.', flush=True)
      return
    # SIGTERM, Ctrl-C and SIGHUP save a checkpoint instead of a traceback.
    with preemption.sigterm_handled(), _summaries_flushed():
      result = train.run(options)
  except options_lib.OptionError as e:
    raise cli.UsageError(str(e)) from e
  except (ValueError, TypeError) as e:
    # Errors that explain a bad input or model; their messages say the fix.
    # The traceback stays available with --verbosity=debug.
    logging.debug('Traceback of the error below:', exc_info=True)
    raise cli.Failure(data_errors.in_flag_terms(
        options_lib.in_flag_terms(str(e)))) from e
  except tf.errors.InvalidArgumentError as e:
    message = data_errors.cli_message(e)
    if message is None:
      raise  # Not a data check: TensorFlow's own error, traceback and all.
    raise cli.Failure(message) from e
  except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
          tf.errors.UnknownError, tf.errors.FailedPreconditionError) as e:
    # A peer of a synchronous cluster died, stopped, restarted alone or
    # ended early.
    message = sync_errors.cli_message(e, cluster_config.load_tf_config())
    if message is None:
      raise
    logging.debug('Traceback of the error below:', exc_info=True)
    raise cli.Failure(message) from e
  except tf.compat.v1.train.NanLossDuringTrainingError as e:
    raise cli.Failure(
        'the loss became nan during training; nothing more was saved or '
        'exported. Look for nan/inf in the data (allowed only with '
        '--allow-non-finite) or lower --learning-rate.') from e
  except preemption.Preempted as e:
    sys.stderr.write(f'task: stopped: {e} Re-run the same command to '
                     'resume.\n')
    sys.exit(e.exit_code)
  if result['skipped']:
    print(result['skipped'], flush=True)
  print(_summary_line(result), flush=True)


@contextlib.contextmanager
def _summaries_flushed():
  """Closes the cached summary writers, however the run ends.

  The process's exit skips Python's last garbage collection (trainer.cli),
  which might otherwise be what flushes a writer's last events.
  """
  try:
    yield
  finally:
    tf.compat.v1.summary.FileWriterCache.clear()


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
  cli.run(main, 'task')
