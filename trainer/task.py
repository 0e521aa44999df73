"""`python -m trainer.task`: train, evaluate and export one model.

Runs locally, under `gcloud ai-platform local train --module-name
trainer.task --package-path trainer`, as a Cloud / Vertex AI job and as one
trial of a hyperparameter sweep. With no data flags it trains the default DNN
on the embedded digits data set. `--help` lists its flags by topic;
`--helpfull` adds absl's and TensorFlow's.

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

# No TensorFlow before the flags parse: a bad command line gets its one
# line without the seconds TensorFlow takes to load. main imports the rest.
from trainer import cli
from trainer import options as options_lib

options_lib.define_flags()
# Not a TaskOptions field: it says what to do with the options, and a
# trainer_config.json saved with it would mean nothing.
cli.define(flags.DEFINE_boolean, 'dry-run', False,
           'Check the options, data, model and tuning metric, then exit '
           'without training or writing anything (trainer.sweep does this '
           'before its first trial).', topic='Before training')
cli.define(flags.DEFINE_boolean, 'clean', False,
           'Empty the job dir before training, to start afresh instead of '
           'resuming (a local run). Only a directory this trainer wrote (it '
           'holds trainer_config.json) or an empty one is emptied.',
           topic=options_lib.JOB_DIR_TOPIC)
# --help lists them (absl registers them under cli, which defines them).
flags.adopt_module_key_flags(cli)


def main(argv):
  del argv  # cli.run has refused any left-over arguments.
  options = options_lib.from_flags()
  # pylint: disable=g-import-not-at-top
  # They load TensorFlow.
  from trainer import disk_space, faults, preemption, train
  environment.quiet_python_logs(flags.FLAGS['verbosity'].present,
                                logging.get_verbosity())
  disk_space.summary_writer_failures_in_one_line()
  # The writers are closed after a failure is phrased: phrasing a full
  # disk frees it first.
  with _summaries_flushed(), faults.handled('task'):
    if cli.value('dry-run'):
      print(f'dry run: the options check out; the tuning metric is '
            f'{train.check(options)}.', flush=True)
      return
    # SIGTERM, Ctrl-C and SIGHUP save a checkpoint instead of a traceback.
    with preemption.sigterm_handled():
      result = train.run(options, clean=cli.value('clean'))
  if result.skipped:
    print(result.skipped, flush=True)
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
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.compat.v1.summary.FileWriterCache.clear()


def _summary_line(result: 'train.RunResult') -> str:
  """The task's last line: eval metrics, or what this cluster task did."""
  where = f' task={result.task}' if result.task else ''
  if result.metrics is None:
    return (f'done:{where} towers={result.towers} '
            f'model_dir={result.model_dir}')
  metrics = ' '.join(f'{k}={float(v):.4f}' if k != 'global_step' else
                     f'{k}={int(v)}' for k, v in sorted(result.metrics.items()))
  return (f'eval: {metrics}{where} towers={result.towers} '
          f'export={result.export_dir}')


if __name__ == '__main__':
  cli.run(main, 'task')
