"""`python -m trainer.check`: does a model_fn train the same on towers?

    python -m trainer.check                  # the default DNN on the digits
    python -m trainer.check --model=mypkg.mymodel:model_fn \
        --train-files=data/train.csv --label-column=label --n-classes=2

Trains `--check-steps` steps of the model on one device and on the towers
(`--num-gpus` GPUs, else `--cpu-towers` virtual CPUs; 2 towers by default)
from one start checkpoint, on the same batches, then prints every
variable's difference (worst first), the eval metrics of both runs side by
side, the expected sources of difference the towered graph shows, and a
one-line verdict (see estimator_towers.equivalence). The data, model and
device flags are those of trainer.task; its training-length, checkpoint
and export flags play no part.

Exit status: 0 when everything matches within `--rtol`/`--atol`, and when
every difference has an expected source (dropout, batch norm, reduced
precision; a warning line says so); 1 when a difference has none, or the
run fails; 2 for bad flags.

This module only parses flags; equivalence.compare does the work.
"""

import os
import sys

from trainer import environment

if __name__ == '__main__':
  # TensorFlow reads these variables once, when the imports below load it.
  environment.configure(sys.argv)
  # The default towers are virtual CPUs without --cpu-towers saying so:
  # their evaluation may give a tower an empty shard, which oneDNN's
  # convolution mishandles (see environment.configure).
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
from absl import logging

# No TensorFlow before the flags parse and the tower count checks out (as
# trainer.task): main imports the rest.
from trainer import cli
from trainer import options as options_lib

options_lib.define_flags()
cli.define(flags.DEFINE_integer, 'check-steps', 5,
           'Training steps of each run (one device, towers).', lower_bound=1)
cli.define(flags.DEFINE_float, 'rtol', 1e-4,
           'Relative tolerance of every comparison.', lower_bound=0.0)
cli.define(flags.DEFINE_float, 'atol', 1e-5,
           'Absolute tolerance of every comparison.', lower_bound=0.0)
cli.define(flags.DEFINE_integer, 'max-rows', 20,
           'Variables shown, worst first (a "... N more" line follows).',
           lower_bound=1)
# --help lists them (absl registers them under cli, which defines them).
flags.adopt_module_key_flags(cli)

_DEFAULT_TOWERS = 2


def main(argv):
  del argv  # cli.run has refused any left-over arguments.
  options = options_lib.from_flags()
  num_towers, device_type = towers(options)
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  import model_fns
  from estimator_towers import equivalence
  from trainer import assembly
  from trainer import faults
  environment.quiet_python_logs(flags.FLAGS['verbosity'].present,
                                logging.get_verbosity())
  seed = options.tf_random_seed or 0
  # Keras initializers without a seed draw from Python's and numpy's
  # generators, which the graph-level seed does not reach: seeded, the
  # same command checks the same start (as trainer.train seeds them).
  tf.keras.utils.set_random_seed(seed)
  with faults.handled('check'):
    data = assembly.build_data(options, model_fns.model_kind(options.model))
    report = equivalence.compare(
        model_fns.get_model_fn(options.model),
        data.train_input_fn(options.train_batch_size,
                            seed=options.tf_random_seed or 0),
        num_towers=num_towers, steps=cli.value('check-steps'),
        params=assembly.model_params(options, data),
        model_dir=options.job_dir, tf_random_seed=seed,
        rtol=cli.value('rtol'), atol=cli.value('atol'),
        eval_input_fn=data.eval_input_fn(options.eval_batch_size),
        eval_steps=options.eval_steps, device_type=device_type,
        aggregation=options.aggregation or 'global_loss',
        random_ops=options.random_ops, batch_norm=options.batch_norm,
        micro_batches=options.micro_batches)
  # Ends with the verdict; a warning line before it when EXPLAINED.
  print(report.format(max_rows=cli.value('max-rows')), flush=True)
  if report.verdict == equivalence.FAILURE:
    sys.exit(cli.EXIT_FAILED)


def towers(options: options_lib.TaskOptions):
  """(tower count, 'GPU' or 'CPU' or None for either) the flags ask for.

  Raises:
    cli.UsageError: one tower, which leaves nothing to compare.
  """
  if options.num_gpus is not None and options.cpu_towers is not None:
    raise cli.UsageError('--num-gpus and --cpu-towers both set the towers; '
                         'give one of them.')
  if options.num_gpus is not None:
    count, flag, device_type = options.num_gpus, 'num-gpus', 'GPU'
  elif options.cpu_towers is not None:
    count, flag, device_type = options.cpu_towers, 'cpu-towers', 'CPU'
  else:
    from estimator_towers.run_config import available_gpu_count  # pylint: disable=g-import-not-at-top
    return max(_DEFAULT_TOWERS, available_gpu_count()), None
  if count < 2:
    raise cli.UsageError(f'--{flag}={count}: the check compares one device '
                         f'with towers; give --{flag}=2 or more.')
  return count, device_type


if __name__ == '__main__':
  cli.run(main, 'check')
