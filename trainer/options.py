"""The options of `python -m trainer.task`: one field, one flag.

Each `TaskOptions` field declares its flag (kind, help, bounds), its default,
how the flag's text becomes the option's value, and whether it is a model
hyperparameter (`params[...]` of every model_fn) or part of the architecture
(a job dir's checkpoints only resume with the same value). Adding an option
is adding a field here: the flag, its underscore spelling, the conversion,
`params`, the saved `trainer_config.json` and the architecture check follow.
"""

import dataclasses
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import flags

# TensorFlow-free: the entry points define and check these flags before
# they load TensorFlow (aggregation_for imports the library when called).
from estimator_towers.choices import AGGREGATIONS
from estimator_towers.choices import BATCH_NORMS
from estimator_towers.choices import MIXED_PRECISIONS
from estimator_towers.choices import RANDOM_OPS
from trainer import cli
from trainer import hptuning
from trainer import stop_at as stop_at_lib

_FORMATS = ['digits', 'csv', 'tfrecord', 'image_folder', 'synthetic_images',
            'synthetic_tabular']
_OPTIMIZERS = ['sgd', 'momentum', 'adam', 'adagrad', 'rmsprop']


class OptionError(ValueError):
  """Options that cannot be used together, whatever the data: a usage error.

  The command line exits 2 on it (1 on other ValueErrors: the data, files,
  model or environment failed the run).
  """


# Conversions from a flag's parsed value to the option's value. Each takes
# the flag name (for its message) and raises cli.UsageError.

def _ints(name: str, values: Optional[Sequence[str]]) -> Optional[List[int]]:
  """Integers from a list flag; None when it is unset or empty."""
  if not values:
    return None
  try:
    return [int(v) for v in values]
  except ValueError as e:
    raise cli.UsageError(f'--{name} takes integers, got {values!r}.') from e


def _positive_ints(name: str, values) -> Optional[List[int]]:
  ints = _ints(name, values)
  if ints is not None and min(ints) < 1:
    raise cli.UsageError(f'--{name} must be positive, got {ints}.')
  return ints


def _image_size(name: str, values) -> Tuple[int, int]:
  size = _ints(name, values) or []
  if len(size) != 2 or min(size) < 1:
    raise cli.UsageError(f'--{name} takes HEIGHT,WIDTH, got {values}.')
  return tuple(size)


def _step_range(name: str, values) -> Optional[List[int]]:
  steps = _ints(name, values)
  if steps is not None and (len(steps) != 2 or steps[0] < 0 or
                            steps[1] < steps[0]):
    raise cli.UsageError(f'--{name} takes FIRST,LAST steps with '
                         f'0 <= FIRST <= LAST, got {values}.')
  return steps


def _stop_at(name: str, value: Optional[str]) -> Optional[str]:
  """The --stop-at text, once it parses (kept as text in the config)."""
  if value is not None:
    stop_at_lib.parse(value, name)
  return value


def _files(name: str, values) -> List[str]:
  del name
  return cli.split_multi(values)


def _pairs(name: str, values) -> Dict[str, str]:
  """NAME=VALUE flag values as a dict."""
  out = {}
  for item in values:
    key, sep, value = item.partition('=')
    if not sep or not key:
      raise cli.UsageError(f'--{name}={item!r} must look like NAME=VALUE.')
    if key in out:  # A silent overwrite would drop one of the two.
      raise cli.UsageError(f'--{name}: {key}= is given twice ({key}='
                           f'{out[key]} and {item}); give it once.')
    out[key] = value
  return out


def _categorical(name: str, values) -> Dict[str, Any]:
  """NAME=v1|v2 (vocabulary) or NAME=hash:N (hash buckets)."""
  columns = {}
  for key, spec in _pairs(name, values).items():
    if spec.startswith('hash:'):
      buckets = _ints(name, [spec[5:]])[0]
      if buckets < 2:
        raise cli.UsageError(f'--{name}={key}={spec}: use at least 2 hash '
                             'buckets.')
      columns[key] = buckets
    elif spec:
      columns[key] = spec.split('|')
    else:
      raise cli.UsageError(f'--{name}={key}= needs a vocabulary (a|b|c) or '
                           'hash:N.')
  return columns


def _option(define: Callable, default: Any, help_text: str, *,
            flag_default: Any = None, parse: Optional[Callable] = None,
            flag: Optional[str] = None, param: bool = False,
            architecture: bool = False, replaces: Tuple[str, ...] = (),
            check: Optional[Tuple[Callable[[Any], bool], str]] = None,
            **flag_args) -> Any:
  """A dataclass field that declares its flag.

  Args:
    define: absl's DEFINE_* function of the flag.
    default: The option's default; also the flag's unless `flag_default`.
    help_text: The flag's help.
    flag_default: The flag's default where it is spelled otherwise.
    parse: (flag name, flag value) -> option value.
    flag: The flag's name, if not the field's name with hyphens.
    param: Pass the option to every model_fn as `params[<field name>]`.
    architecture: A job dir trained with another value cannot resume.
    replaces: Flags this option makes meaningless; giving both is refused.
    check: (predicate, message): an absl validator of the flag's value.
    **flag_args: More arguments of `define` (bounds, enum values).
  """
  metadata = {'define': define, 'help': help_text, 'parse': parse,
              'flag': flag, 'param': param, 'architecture': architecture,
              'check': check, 'flag_args': flag_args, 'replaces': replaces,
              'flag_default': default if flag_default is None
                              else flag_default}
  if isinstance(default, (list, dict)):
    return dataclasses.field(default_factory=lambda: type(default)(default),
                             metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


_STRING, _INT, _FLOAT, _BOOL = (flags.DEFINE_string, flags.DEFINE_integer,
                                flags.DEFINE_float, flags.DEFINE_boolean)
_ENUM, _LIST, _MULTI = (flags.DEFINE_enum, flags.DEFINE_list,
                        flags.DEFINE_multi_string)


@dataclasses.dataclass
class TaskOptions:
  """Everything `trainer.train.run` needs; one field per task flag."""
  # Where things go.
  job_dir: Optional[str] = _option(
      _STRING, None, 'Output directory (checkpoints, summaries, exports); any '
      'path tf.io.gfile accepts. Default: AIP_CHECKPOINT_DIR on Vertex AI, '
      'else a new directory under ./runs.')
  run_log: Optional[str] = _option(
      _STRING, None, 'Where the run appends its machine-readable log, one '
      'JSON object a line: its options, progress (step, loss, examples/sec), '
      'each evaluation, and the final metrics and export. Default: '
      'run_log.jsonl in the job dir.')
  # Data.
  train_files: List[str] = _option(
      _MULTI, [], 'Training file globs: --train-files a.csv b.csv, or '
      'repeat the flag, or separate with commas (a name with a space: '
      'repeat the flag or use commas).',
      parse=_files)
  eval_files: List[str] = _option(
      _MULTI, [], 'Evaluation file globs: --eval-files a.csv b.csv, or '
      'repeat the flag, or separate with commas (a name with a space: '
      'repeat the flag or use commas).',
      parse=_files)
  input_format: Optional[str] = _option(
      _ENUM, None, 'Data source. Default: csv/tfrecord from the file suffix, '
      'or the embedded digits data set when no files are given.',
      enum_values=_FORMATS, architecture=True)
  data_view: Optional[str] = _option(
      _ENUM, None, 'How the embedded digits reach the model_fn: tabular '
      "(features['pixels'], float32 [batch, 64]) or image (features['image'], "
      'float32 [batch, 8, 8, 1]). Default: the view the --model reads '
      '(tabular for your own model_fn).', enum_values=['tabular', 'image'],
      architecture=True)
  label_column: str = _option(
      _STRING, 'label', 'CSV column / tf.Example key holding the class label.',
      architecture=True)
  columns: Optional[List[str]] = _option(
      _LIST, None, 'Feature names: CSV columns in file order (for files '
      'without a header row), or the numeric tf.Example keys of tabular '
      'TFRecords.', architecture=True)
  categorical_columns: Dict[str, Any] = _option(
      _MULTI, {}, 'A categorical CSV column: NAME=\'v1|v2|v3\' (vocabulary; '
      'quote it: a shell pipes at |) or NAME=hash:N. Repeat for more. Other '
      'columns are numeric.',
      flag='categorical-column', flag_default=[], parse=_categorical,
      architecture=True)
  column_defaults: Dict[str, str] = _option(
      _MULTI, {}, 'NAME=VALUE used where a CSV field is empty: a number '
      'for a numeric column, text for a --categorical-column. Repeat for '
      'more.', flag='column-default', flag_default=[], parse=_pairs)
  label_vocabulary: Optional[List[str]] = _option(
      _LIST, None, 'String labels in class-id order; default: labels are '
      'integer ids.', architecture=True)
  n_classes: Optional[int] = _option(
      _INT, None, 'Number of classes (needed for integer labels of csv and '
      'tfrecord).', lower_bound=2, architecture=True)
  skip_malformed: bool = _option(
      _BOOL, False, 'Skip (and count) malformed CSV rows instead of failing.')
  allow_non_finite: bool = _option(
      _BOOL, False, 'Accept nan and inf feature values in CSV and TFRecord '
      'input (by default they stop training with an error naming the file '
      'and row).')
  image_size: Tuple[int, int] = _option(
      _LIST, (32, 32), 'HEIGHT,WIDTH images are resized to (image_folder, '
      'tfrecord images).', flag_default=['32', '32'], parse=_image_size,
      architecture=True)
  image_channels: int = _option(_INT, 3, 'Image channels.', lower_bound=1,
                                architecture=True)
  # Training.
  model: str = _option(
      _STRING, 'dnn', 'A model_fn name from model_fns (linear, dnn, '
      'wide_deep, cifar_cnn, resnet, keras_app) or your own as '
      'package.module:function.',
      architecture=True)
  train_steps: int = _option(_INT, 1000, 'Total training steps.',
                             lower_bound=1)
  num_epochs: Optional[int] = _option(
      _INT, None, 'Passes over the training data; training stops after them '
      'or at --train-steps, whichever comes first. Default: only '
      '--train-steps.', lower_bound=1)
  eval_steps: Optional[int] = _option(
      _INT, None, 'Evaluation steps; default: the whole evaluation set.',
      lower_bound=1)
  train_batch_size: int = _option(
      _INT, 128, 'GLOBAL training batch, split across the towers.',
      lower_bound=1)
  eval_batch_size: int = _option(_INT, 256, 'Evaluation batch.',
                                 lower_bound=1)
  learning_rate: float = _option(_FLOAT, 0.01, 'Learning rate.',
                                 lower_bound=0.0, param=True)
  optimizer: str = _option(_ENUM, 'adam', 'Optimizer.',
                           enum_values=_OPTIMIZERS, param=True)
  hidden_units: Optional[List[int]] = _option(
      _LIST, None, 'DNN layer sizes, e.g. 128,64 (overrides '
      '--first-layer-size, --num-layers and --scale-factor).',
      parse=_positive_ints, param=True, architecture=True,
      replaces=('first-layer-size', 'num-layers', 'scale-factor'))
  first_layer_size: int = _option(_INT, 128, 'DNN first layer size.',
                                  lower_bound=1, param=True, architecture=True)
  num_layers: int = _option(_INT, 2, 'DNN hidden layers.', lower_bound=1,
                            param=True, architecture=True)
  scale_factor: float = _option(
      _FLOAT, 0.5, 'Each DNN layer is this times the previous one.',
      lower_bound=0.0, param=True, architecture=True)
  embedding_size: Optional[int] = _option(
      _INT, None, 'wide_deep: dimensions of the embedding of each categorical '
      'column in its DNN part (as the census sample\'s flag). Default: one-hot '
      'up to 16 values, else about the fourth root of the values.',
      lower_bound=1, param=True, architecture=True)
  dropout: float = _option(_FLOAT, 0.0, 'Dropout rate in training.',
                           lower_bound=0.0, upper_bound=0.99, param=True)
  resnet_depth: int = _option(_INT, 20, 'ResNet depth (6n+2).', param=True,
                              architecture=True)
  keras_application: str = _option(
      _STRING, 'MobileNetV2', 'tf.keras.applications model for '
      '--model=keras_app.', param=True, architecture=True)
  tf_random_seed: Optional[int] = _option(_INT, None,
                                          'Graph-level random seed.')
  warm_start_from: Optional[str] = _option(
      _STRING, None, 'Start from the trainable weights of this checkpoint '
      '(a job dir or a checkpoint path) instead of initialising them; the '
      'optimizer and step start afresh. Only in a job dir without '
      'checkpoints (or with --clean); a rerun of the same job resumes. '
      "In a cluster only the chief reads it (the workers take the chief's "
      'weights).')
  stop_at: Optional[str] = _option(
      _STRING, None, "Stop training once an evaluation reaches a target, "
      "e.g. 'accuracy>=0.97' or 'loss<0.2' (quote it: a shell redirects at "
      '>). Checked after each checkpoint\'s evaluation; local runs only.',
      parse=_stop_at)
  # Devices.
  num_gpus: Optional[int] = _option(
      _INT, None, 'GPUs to use; default: every GPU TensorFlow sees.',
      lower_bound=0)
  gpu_ids: Optional[List[int]] = _option(
      _LIST, None, 'Which GPUs to use, e.g. 0,2.', parse=_ints)
  aggregation: Optional[str] = _option(
      _ENUM, None, 'How the towers\' gradients become one update: '
      'global_loss (variables on one device), round_robin (variables spread '
      'over the towers\' devices) or all_reduce (a copy per device, '
      'gradients all-reduced). Checkpoints are the same for all; see '
      'docs/aggregation.md. Default: all_reduce in a TF_CONFIG cluster of '
      'training tasks without ps tasks (synchronous training, the only '
      'kind it allows), else global_loss.', enum_values=list(AGGREGATIONS))
  random_ops: str = _option(
      _ENUM, 'per_tower', 'How the towers draw random numbers (dropout, '
      'noise): per_tower (each tower its own; faster) or one_device (what '
      'one device draws on the global batch with the same --tf-random-seed, '
      'so towers train exactly as one device; each tower draws the whole '
      'batch\'s numbers). See README, '
      '"Things to know".', enum_values=list(RANDOM_OPS))
  micro_batches: int = _option(
      _INT, 1, 'Train each tower\'s share of a batch as this many '
      'micro-batches, one after another in one step: the same update as '
      'the whole batch at once, with the activations of one micro-batch '
      'in memory at a time (no batch norm in training). See '
      'docs/writing_model_fns.md.',
      lower_bound=1)
  batch_norm: str = _option(
      _ENUM, 'global', 'How batch norm normalises in training on several '
      'towers: global (with the whole global batch\'s mean and variance, '
      'exchanged between the towers, and between the tasks of a synchronous '
      'cluster, at each batch-norm layer: one device\'s model) or per_tower '
      '(with each tower\'s shard\'s own: cheaper, another model). The moving '
      'statistics get one global update either way.',
      enum_values=list(BATCH_NORMS))
  sync_timeout_secs: float = _option(
      _FLOAT, 300.0, 'In a synchronous cluster (no ps tasks): how long a '
      'task waits for the others (at the start, at each step) before it '
      'fails with one line instead of hanging; see docs/cluster.md.',
      check=(lambda v: v > 0, 'must be a positive number of seconds'))
  cpu_towers: Optional[int] = _option(
      _INT, None, 'Train on this many virtual CPU devices (for machines '
      'without GPUs).', lower_bound=1)
  gpu_memory_fraction: Optional[float] = _option(
      _FLOAT, None, 'Share of each GPU\'s memory to use, in (0, 1].',
      check=(lambda v: v is None or 0 < v <= 1, 'must be in (0, 1]'))
  allow_growth: bool = _option(_BOOL, True, 'Allocate GPU memory as needed.')
  inter_op_threads: int = _option(
      _INT, 0, 'Threads running independent ops; 0 lets TensorFlow choose.',
      lower_bound=0)
  intra_op_threads: int = _option(
      _INT, 0, 'Threads inside one op; 0 lets TensorFlow choose.',
      lower_bound=0)
  mixed_precision: Optional[str] = _option(
      _ENUM, None, 'Train in mixed precision: float16 (GPU towers; loss '
      'scaled dynamically) or bfloat16 (CPU towers, oneDNN). Numbers then '
      'match one device only within that precision\'s rounding.',
      enum_values=list(MIXED_PRECISIONS))
  xla: bool = _option(_BOOL, False, 'Compile the training graph with the '
                      'XLA JIT.')
  # Checkpoints and export.
  save_checkpoints_steps: int = _option(
      _INT, 500, 'Checkpoint (and evaluate) every this many steps.',
      lower_bound=1)
  log_step_count_steps: int = _option(
      _INT, 100, 'Every this many steps: a progress line, and '
      'global_step/sec and examples/sec summaries for TensorBoard.',
      lower_bound=1)
  keep_checkpoint_max: int = _option(_INT, 5, 'Checkpoints to keep.',
                                     lower_bound=1)
  profile_steps: Optional[List[int]] = _option(
      _LIST, None, 'FIRST,LAST: trace training steps FIRST to LAST with '
      'TensorFlow\'s profiler into the job dir (plugins/profile), for '
      'TensorBoard\'s Profile tab. Chief or local run only.',
      parse=_step_range)
  export_format: str = _option(
      _ENUM, 'json', 'Serving input of the exported SavedModel (any case: '
      'JSON, CSV, EXAMPLE as the census sample passes them).',
      enum_values=['json', 'csv', 'example'], case_sensitive=False)
  export_best: bool = _option(
      _BOOL, False, 'Also export the best model on the tuning metric.')
  # Hyperparameter tuning.
  hypertune_metric: Optional[str] = _option(
      _STRING, None, 'Eval metric reported for tuning; default: the one '
      'CLOUD_ML_HP_METRIC_TAG names (a tag that names none is refused), '
      'else accuracy.')
  hypertune_summary_tag: str = _option(
      _STRING, hptuning.DEFAULT_SUMMARY_TAG, 'Summary tag the tuning metric '
      'is written under.')


# Census-sample flags that have no meaning here: each is refused with the
# flag that does its job (after parsing, so that the line says so instead of
# "unknown flag").
_REFUSED = {
    'eval-delay-secs': 'evaluation follows the checkpoints here: set when '
                       'with --save-checkpoints-steps',
    'min-eval-frequency': 'each checkpoint is evaluated here: set how often '
                          'with --save-checkpoints-steps',
}

JOB_DIR_TOPIC = 'Job dir and run log'
# --help's topics: each starts at its field and runs to the next one's.
_TOPIC_STARTS = {
    'job_dir': JOB_DIR_TOPIC,
    'train_files': 'Data',
    'model': 'Model and training',
    'num_gpus': 'Devices',
    'save_checkpoints_steps': 'Checkpoints, export and profiling',
    'hypertune_metric': 'Hyperparameter tuning',
}
REFUSED_TOPIC = 'Census-sample flags not taken'

_defined = False


def flag_name(field: dataclasses.Field) -> str:
  """The flag of an options field: its name with hyphens, or as declared."""
  return field.metadata['flag'] or field.name.replace('_', '-')


def define_flags() -> None:
  """Defines every task flag, with its underscore spelling (idempotent).

  A flag of the same name defined elsewhere (another entry point imported
  into the same process) fails loudly with absl's DuplicateFlagError.
  """
  global _defined
  if _defined:
    return
  _defined = True
  topic = None
  for field in dataclasses.fields(TaskOptions):
    meta = field.metadata
    topic = _TOPIC_STARTS.get(field.name, topic)
    cli.define(meta['define'], flag_name(field), meta['flag_default'],
               meta['help'], topic=topic, **meta['flag_args'])
    if meta['check']:
      flags.register_validator(flag_name(field), *meta['check'])
  for name, instead in _REFUSED.items():
    cli.define(_STRING, name, None, f'Not taken: {instead}.',
               topic=REFUSED_TOPIC)


def from_flags() -> TaskOptions:
  """The options the parsed flags give.

  Raises:
    cli.UsageError: a flag value that parses but cannot be used, or two flags
      of which one would be silently ignored.
  """
  _check_replaced_flags()
  for name, instead in _REFUSED.items():
    if flags.FLAGS[name].present:
      raise cli.UsageError(f'--{name} is not taken: {instead}.')
  values = {}
  for field in dataclasses.fields(TaskOptions):
    name = flag_name(field)
    value = flags.FLAGS[name].value
    parse = field.metadata['parse']
    values[field.name] = parse(name, value) if parse else value
  _check_embedding_size(values)
  return TaskOptions(**values)


def _check_embedding_size(values: Dict[str, Any]) -> None:
  """Refuses --embedding-size for a ready-made model that ignores it.

  A sweep over it would otherwise train the same model in every trial. A
  user's model_fn (package.module:function) may read it from params.
  """
  model = values['model']
  if (values['embedding_size'] is not None and ':' not in model and
      model != 'wide_deep'):
    raise cli.UsageError(f'--embedding-size sizes the embeddings of '
                         f'--model=wide_deep; --model={model} would ignore '
                         'it. Drop it, or use --model=wide_deep.')


def _check_replaced_flags() -> None:
  """Refuses e.g. --hidden-units with --first-layer-size, which it ignores.

  Otherwise a sweep of --first-layer-size with a fixed --hidden-units would
  train the same model in every trial.
  """
  for field in dataclasses.fields(TaskOptions):
    name = flag_name(field)
    if not flags.FLAGS[name].present:
      continue
    for replaced in field.metadata['replaces']:
      if flags.FLAGS[replaced].present:
        raise cli.UsageError(f'--{name} sets every layer, so --{replaced} '
                             f'would be ignored; give one of them.')


def aggregation_for(options: TaskOptions, config) -> str:
  """--aggregation, or its default for the task's cluster; checked.

  A TF_CONFIG cluster of several training tasks (chief and workers) and no
  ps task trains synchronously, which needs 'all_reduce'; so that is its
  default. Every task of the cluster, the evaluator too, decides the same.

  Args:
    options: The task's options.
    config: The Estimator's RunConfig (its TF_CONFIG cluster).

  Returns:
    The aggregation to pass to replicate_model_fn.

  Raises:
    OptionError: the aggregation cannot train in this cluster
      (strategies.check_tasks says why), or --micro-batches is not a
      positive int.
  """
  # pylint: disable=g-import-not-at-top
  from estimator_towers.update import micro_batches as micro_batches_lib
  from estimator_towers.aggregation.strategies import check_tasks
  from estimator_towers.run_config import session_device_counts
  from estimator_towers.cluster.task_sync import is_sync_cluster
  # pylint: enable=g-import-not-at-top
  aggregation = options.aggregation
  if aggregation is None:
    sync = ((config.num_worker_replicas or 1) > 1 and
            not config.num_ps_replicas)
    aggregation = 'all_reduce' if sync else 'global_loss'
  try:
    check_tasks(aggregation, config)
  except ValueError as e:
    # Only a given --aggregation can fail: the defaults always fit.
    raise OptionError(re.sub(r"aggregation='(\w+)'", r'--aggregation=\1',
                             str(e))) from e
  try:
    micro_batches_lib.check(options.micro_batches, aggregation)
  except ValueError as e:
    raise OptionError(re.sub(
        r"aggregation='(\w+)'", r'--aggregation=\1',
        str(e).replace('micro_batches=', '--micro-batches='))) from e
  if (options.xla and is_sync_cluster(config) and
      not session_device_counts(config.session_config)[0]):
    # Seen on virtual CPU towers: a ~160-line traceback in every task
    # ('Multiple CPU devices') where one process trains with --xla.
    raise OptionError(
        '--xla cannot compile the steps of a synchronous cluster (chief and '
        'workers without ps) on CPU towers; drop --xla there, or train with '
        '--xla in one process.')
  return aggregation


# make_run_config's arguments that are task options of the same name.
_RUN_CONFIG_FLAG_FIELDS = ('num_gpus', 'gpu_ids', 'mixed_precision', 'xla',
                           'gpu_memory_fraction', 'allow_growth',
                           'inter_op_threads', 'intra_op_threads')
# make_run_config's arguments that a flag of another name sets.
_RUN_CONFIG_ARGUMENTS = {'cpu_devices': 'cpu_towers'}
# Its remedy no flag offers: the task asks for devices the machine has.
_FALLBACK = re.compile(r',? or pass fallback_to_available_gpus=True to [^.;]*')


def in_flag_terms(message: str) -> str:
  """A model_fn's or make_run_config's error spelt in the task's flags.

  The model_fns name what they were given (`params['resnet_depth']`),
  make_run_config its arguments (`num_gpus=5`, `mixed_precision='float16'`);
  a command-line user set them as `--resnet-depth`, `--num-gpus`.
  """
  fields = {f.name: f for f in dataclasses.fields(TaskOptions)}
  for field in fields.values():
    if field.metadata['param']:
      message = message.replace(f"params['{field.name}']",
                                f'--{flag_name(field)}')
  message = _FALLBACK.sub('', message)
  names = {name: name for name in _RUN_CONFIG_FLAG_FIELDS}
  names.update(_RUN_CONFIG_ARGUMENTS)
  pattern = re.compile(r"(?<![\w.'\[-])(" + '|'.join(names) + r')(?==)')
  return pattern.sub(lambda m: '--' + flag_name(fields[names[m.group(1)]]),
                     message)


def typed_column_defaults(options: TaskOptions) -> Dict[str, Any]:
  """--column-default values converted by their column's type.

  A flag's value is text; a numeric column's default is a number (an int
  where it reads as one), a --categorical-column's stays a string.

  Raises:
    OptionError: a numeric column's default is not a number.
  """
  typed = {}
  for name, value in options.column_defaults.items():
    if name in options.categorical_columns or not isinstance(value, str):
      typed[name] = value
      continue
    try:
      typed[name] = int(value)
    except ValueError:
      try:
        typed[name] = float(value)
      except ValueError:
        raise OptionError(
            f'--column-default={name}={value}: {name} is a numeric column, '
            f'so its default must be a number (or declare it with '
            f'--categorical-column={name}=...).') from None
  return typed


def from_saved(saved: Dict[str, Any]) -> TaskOptions:
  """Options from a saved trainer_config.json (unknown keys ignored)."""
  known = {f.name for f in dataclasses.fields(TaskOptions)}
  options = TaskOptions(**{k: v for k, v in saved.items() if k in known})
  options.image_size = tuple(options.image_size)
  return options


def model_params(options: TaskOptions) -> Dict[str, Any]:
  """The options every model_fn gets in `params` (unset ones left out)."""
  params = {f.name: getattr(options, f.name)
            for f in dataclasses.fields(TaskOptions) if f.metadata['param']}
  return {k: v for k, v in params.items() if v is not None and v != []}


def architecture_flags() -> Dict[str, str]:
  """Field name -> flag name of the options that shape the model."""
  return {f.name: flag_name(f) for f in dataclasses.fields(TaskOptions)
          if f.metadata['architecture']}
