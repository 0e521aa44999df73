"""Command-line flags of `python -m trainer.task`, spelled as Cloud spells them.

Cloud trainer packages take hyphenated flags (`--job-dir`, `--train-files`);
the underscore spellings (`--job_dir`) are accepted too. A bad command line
ends with a one-line message and exit code 2, as argparse-based trainers do.
"""

import re
import sys
from typing import Callable, List, Sequence

from absl import flags

FLAGS = flags.FLAGS

# Where the flag names below live, to rewrite underscore spellings.
_HYPHENATED: List[str] = []
_task_flags_defined = False


def define(kind: Callable, name: str, *args, **kwargs) -> None:
  """Defines a flag with `kind` (e.g. flags.DEFINE_string).

  Hyphenated names are recorded so that their underscore spellings are
  accepted too.
  """
  kind(name, *args, **kwargs)
  if '-' in name:
    _HYPHENATED.append(name)


def define_task_flags() -> None:
  """Defines every flag of `trainer.task` (idempotent per process).

  A flag of the same name defined elsewhere (another entry point imported
  into the same process) fails loudly with absl's DuplicateFlagError rather
  than leaving the task's flags undefined.
  """
  global _task_flags_defined
  if _task_flags_defined:
    return
  _task_flags_defined = True
  d = define
  # Where things go.
  d(flags.DEFINE_string, 'job-dir', None,
    'Output directory (checkpoints, summaries, exports); any path tf.io.gfile '
    'accepts. Default: a new directory under ./runs.')
  # Data.
  d(flags.DEFINE_multi_string, 'train-files', [],
    'Training file globs (repeat the flag, or separate with commas or '
    'spaces).')
  d(flags.DEFINE_multi_string, 'eval-files', [],
    'Evaluation file globs (repeat the flag, or separate with commas or '
    'spaces).')
  d(flags.DEFINE_enum, 'input-format', None,
    ['digits', 'csv', 'tfrecord', 'image_folder', 'synthetic_images',
     'synthetic_tabular'],
    'Data source. Default: csv/tfrecord from the file suffix, or the embedded '
    'digits data set when no files are given.')
  d(flags.DEFINE_string, 'label-column', 'label',
    'CSV column / tf.Example key holding the class label.')
  d(flags.DEFINE_list, 'columns', None,
    'Feature names: CSV columns in file order (for files without a header '
    'row), or the numeric tf.Example keys of tabular TFRecords.')
  d(flags.DEFINE_multi_string, 'categorical-column', [],
    'A categorical CSV column: NAME=v1|v2|v3 (vocabulary) or NAME=hash:N. '
    'Repeat for more. Other columns are numeric.')
  d(flags.DEFINE_multi_string, 'column-default', [],
    'NAME=VALUE used where a CSV field is empty. Repeat for more.')
  d(flags.DEFINE_list, 'label-vocabulary', None,
    'String labels in class-id order; default: labels are integer ids.')
  d(flags.DEFINE_integer, 'n-classes', None,
    'Number of classes (needed for integer labels of csv and tfrecord).',
    lower_bound=2)
  d(flags.DEFINE_boolean, 'skip-malformed', False,
    'Skip (and count) malformed CSV rows instead of failing.')
  d(flags.DEFINE_boolean, 'allow-non-finite', False,
    'Accept nan and inf feature values in CSV and TFRecord input (by default '
    'they stop training with an error naming the file and row).')
  d(flags.DEFINE_list, 'image-size', ['32', '32'],
    'HEIGHT,WIDTH images are resized to (image_folder, tfrecord images).')
  d(flags.DEFINE_integer, 'image-channels', 3, 'Image channels.',
    lower_bound=1)
  # Training.
  d(flags.DEFINE_string, 'model', 'dnn',
    'A model_fn name from model_fns (linear, dnn, cifar_cnn, resnet, '
    'keras_app) or your own as package.module:function.')
  d(flags.DEFINE_integer, 'train-steps', 1000, 'Total training steps.',
    lower_bound=1)
  d(flags.DEFINE_integer, 'num-epochs', None,
    'Passes over the training data; training stops after them or at '
    '--train-steps, whichever comes first. Default: only --train-steps.',
    lower_bound=1)
  d(flags.DEFINE_integer, 'eval-steps', None,
    'Evaluation steps; default: the whole evaluation set.', lower_bound=1)
  d(flags.DEFINE_integer, 'train-batch-size', 128,
    'GLOBAL training batch, split across the towers.', lower_bound=1)
  d(flags.DEFINE_integer, 'eval-batch-size', 256, 'Evaluation batch.',
    lower_bound=1)
  d(flags.DEFINE_float, 'learning-rate', 0.01, 'Learning rate.',
    lower_bound=0.0)
  d(flags.DEFINE_enum, 'optimizer', 'adam',
    ['sgd', 'momentum', 'adam', 'adagrad', 'rmsprop'], 'Optimizer.')
  d(flags.DEFINE_list, 'hidden-units', None,
    'DNN layer sizes, e.g. 128,64 (overrides --first-layer-size).')
  d(flags.DEFINE_integer, 'first-layer-size', 128, 'DNN first layer size.',
    lower_bound=1)
  d(flags.DEFINE_integer, 'num-layers', 2, 'DNN hidden layers.',
    lower_bound=1)
  d(flags.DEFINE_float, 'scale-factor', 0.5,
    'Each DNN layer is this times the previous one.', lower_bound=0.0)
  d(flags.DEFINE_float, 'dropout', 0.0, 'Dropout rate in training.',
    lower_bound=0.0, upper_bound=0.99)
  d(flags.DEFINE_integer, 'resnet-depth', 20, 'ResNet depth (6n+2).')
  d(flags.DEFINE_string, 'keras-application', 'MobileNetV2',
    'tf.keras.applications model for --model=keras_app.')
  d(flags.DEFINE_integer, 'tf-random-seed', None, 'Graph-level random seed.')
  # Devices.
  d(flags.DEFINE_integer, 'num-gpus', None,
    'GPUs to use; default: every GPU TensorFlow sees.', lower_bound=0)
  d(flags.DEFINE_list, 'gpu-ids', None, 'Which GPUs to use, e.g. 0,2.')
  d(flags.DEFINE_integer, 'cpu-towers', None,
    'Train on this many virtual CPU devices (for machines without GPUs).',
    lower_bound=1)
  d(flags.DEFINE_float, 'gpu-memory-fraction', None,
    'Share of each GPU\'s memory to use, in (0, 1].')
  d(flags.DEFINE_boolean, 'allow-growth', True,
    'Allocate GPU memory as needed.')
  d(flags.DEFINE_integer, 'inter-op-threads', 0,
    'Threads running independent ops; 0 lets TensorFlow choose.',
    lower_bound=0)
  d(flags.DEFINE_integer, 'intra-op-threads', 0,
    'Threads inside one op; 0 lets TensorFlow choose.', lower_bound=0)
  # Checkpoints and export.
  d(flags.DEFINE_integer, 'save-checkpoints-steps', 500,
    'Checkpoint (and evaluate) every this many steps.', lower_bound=1)
  d(flags.DEFINE_integer, 'log-step-count-steps', 100,
    'Every this many steps: a progress line, and global_step/sec and '
    'examples/sec summaries for TensorBoard.', lower_bound=1)
  d(flags.DEFINE_integer, 'keep-checkpoint-max', 5,
    'Checkpoints to keep.', lower_bound=1)
  d(flags.DEFINE_enum, 'export-format', 'json', ['json', 'csv', 'example'],
    'Serving input of the exported SavedModel (any case: JSON, CSV, '
    'EXAMPLE as the census sample passes them).', case_sensitive=False)
  d(flags.DEFINE_boolean, 'export-best', False,
    'Also export the best model on the tuning metric.')
  # Hyperparameter tuning.
  d(flags.DEFINE_string, 'hypertune-metric', None,
    'Eval metric reported for tuning; default: accuracy.')
  d(flags.DEFINE_string, 'hypertune-summary-tag', 'training/hptuning/metric',
    'Summary tag the tuning metric is written under.')


def normalize_argv(argv: Sequence[str]) -> List[str]:
  """Rewrites --job_dir style spellings of hyphenated flags to --job-dir.

  Also accepts --no-FLAG for absl's --noFLAG negation of a boolean flag.
  """
  underscored = {name.replace('-', '_'): name for name in _HYPHENATED}
  out = [argv[0]]
  for arg in argv[1:]:
    if arg == '--':
      out.extend(argv[len(out):])
      break
    if arg.startswith('--no-') and _is_boolean(arg[5:].partition('=')[0],
                                               underscored):
      arg = '--no' + arg[5:]
    if arg.startswith('--'):
      name, sep, value = arg[2:].partition('=')
      negated = name.startswith('no') and name[2:] in underscored
      if name in underscored:
        arg = f'--{underscored[name]}{sep}{value}'
      elif negated:
        arg = f'--no{underscored[name[2:]]}{sep}{value}'
    out.append(arg)
  return out


_HELP_FLAGS = ('--help', '--helpfull', '--helpshort', '--helpxml', '-h', '-?')


def _is_boolean(name: str, underscored) -> bool:
  name = underscored.get(name, name)
  return name in FLAGS and FLAGS[name].boolean


def parse_or_exit(argv: Sequence[str]) -> List[str]:
  """absl flags parser for `app.run`: exit code 2 on a bad command line.

  Asking for help exits 0 (absl's help flags exit 1 after printing).
  """
  try:
    return FLAGS(normalize_argv(argv))
  except SystemExit as e:
    if e.code == 1 and any(a in _HELP_FLAGS for a in argv[1:]):
      sys.exit(0)
    raise
  except flags.Error as e:
    prog = argv[0].rsplit('/', 1)[-1] if argv else 'trainer'
    sys.stderr.write(f'{prog}: error: {e}\n'
                     f'Run with --helpfull to see every flag.\n')
    sys.exit(2)


def value(name: str):
  """The parsed value of a (possibly hyphenated) flag."""
  return FLAGS[name].value


def split_multi(values: Sequence[str]) -> List[str]:
  """Flattens repeated, comma- and space-separated flag values.

  The census sample passes several files in one flag value separated by
  spaces (`--train-files "a.csv b.csv"`); others use commas.
  """
  return [part for v in values for part in re.split(r'[,\s]+', v) if part]
