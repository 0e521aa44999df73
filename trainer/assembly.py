"""What a `TaskOptions` names: its data source and its model's params.

Shared by `trainer.train` (which trains the model) and `trainer.predict`
(which rebuilds it from the options a run saved as `trainer_config.json`).
"""

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional
import uuid

import tensorflow as tf

import input_fns
from trainer import options as options_lib
from trainer.options import OptionError
from trainer.options import TaskOptions

CONFIG_FILE = 'trainer_config.json'
# The input formats that read files; the others make their data.
FILE_FORMATS = ('csv', 'tfrecord', 'image_folder')


def build_data(options: TaskOptions, kind: Optional[str]) -> input_fns.Data:
  """The data source the options name, checked before any training.

  Raises:
    ValueError: files are missing or the source does not fit the model.
  """
  fmt = input_format(options)
  view = _digits_view(options, fmt, kind)
  if fmt == 'digits':
    return input_fns.digits(view=view)
  if fmt == 'synthetic_images':
    return input_fns.synthetic_images(
        image_shape=(*options.image_size, options.image_channels))
  if fmt == 'synthetic_tabular':
    return input_fns.synthetic_tabular()
  if not options.train_files:
    raise OptionError(f'--input-format={fmt} needs --train-files.')
  if fmt == 'csv':
    return input_fns.csv_data(
        options.train_files, options.eval_files or options.train_files,
        label_column=options.label_column, columns=options.columns,
        header=options.columns is None,
        categorical_columns=options.categorical_columns,
        defaults=options_lib.typed_column_defaults(options),
        label_vocabulary=options.label_vocabulary,
        n_classes=options.n_classes, skip_malformed=options.skip_malformed,
        allow_non_finite=options.allow_non_finite)
  if fmt == 'tfrecord':
    return _tfrecord_data(options, kind)
  if fmt == 'image_folder':
    return input_fns.image_folder_data(
        options.train_files[0],
        options.eval_files[0] if options.eval_files else None,
        image_size=tuple(options.image_size),
        channels=options.image_channels)
  raise ValueError(f'Unknown --input-format={fmt!r}.')


def _digits_view(options: TaskOptions, fmt: str, kind: Optional[str]) -> str:
  """--data-view, or the view the model reads; checked.

  Raises:
    OptionError: --data-view with other data, or one the model cannot read.
  """
  if options.data_view is None:
    return 'image' if kind == 'image' else 'tabular'
  if fmt != 'digits':
    raise OptionError(f'--data-view chooses how the embedded digits are read; '
                      f'--input-format={fmt} has one view: drop --data-view.')
  if kind not in (None, options.data_view):
    raise OptionError(f'--data-view={options.data_view} does not fit '
                      f'--model={options.model}, which reads {kind} features.')
  return options.data_view


def missing_feature_hint(error: Exception, features: Any) -> str:
  """For a model_fn's KeyError on its features: the keys they do have.

  A user's model_fn written for images fails on the digits' default
  (tabular) view with a bare `KeyError: 'image'`.
  """
  if (not isinstance(error, KeyError) or not isinstance(features, dict) or
      not error.args or error.args[0] in features):
    return ''
  hint = (f'. The features are {sorted(features)} (docs/writing_model_fns.md '
          'lists them per input format)')
  if error.args[0] == 'image' and 'pixels' in features:
    hint += "; --data-view=image gives the digits as features['image']"
  return hint + '.'


def evaluates_on_training_files(options: TaskOptions) -> bool:
  """Whether evaluation reads the training examples themselves.

  True for CSV and TFRecord files without --eval-files. An image folder
  without them holds out a fifth of each class; the made-up sources have
  eval data of their own.
  """
  return (not options.eval_files and bool(options.train_files) and
          input_format(options) in ('csv', 'tfrecord'))


def input_format(options: TaskOptions) -> str:
  """--input-format, or the one the training files' names imply.

  Raises:
    OptionError: the names imply none.
  """
  return options.input_format or _guess_format(options.train_files)


def _guess_format(train_files: List[str]) -> str:
  if not train_files:
    return 'digits'
  first = train_files[0].lower()
  if first.endswith(('.csv', '.csv*', '.txt')):
    return 'csv'
  if '.tfrecord' in first or first.endswith('.tfr'):
    return 'tfrecord'
  raise OptionError(
      f'Cannot tell the format of --train-files={train_files[0]!r} from its '
      'name; pass --input-format (csv, tfrecord or image_folder).')


def _tfrecord_data(options: TaskOptions, kind: Optional[str]):
  if options.n_classes is None:
    raise OptionError('--input-format=tfrecord needs --n-classes.')
  if kind == 'image':
    spec = {'image': tf.io.FixedLenFeature([], tf.string),
            options.label_column: tf.io.FixedLenFeature([], tf.int64)}
    return input_fns.tfrecord_data(
        options.train_files, options.eval_files or options.train_files,
        feature_spec=spec, label_key=options.label_column,
        n_classes=options.n_classes, image_key='image',
        image_shape=(*options.image_size, options.image_channels),
        allow_non_finite=options.allow_non_finite)
  if not options.columns:
    raise OptionError('Tabular --input-format=tfrecord needs --columns naming '
                     'the numeric feature keys of the tf.Examples.')
  spec = {name: tf.io.FixedLenFeature([], tf.float32)
          for name in options.columns}
  spec.update({name: tf.io.FixedLenFeature([], tf.string)
               for name in options.categorical_columns})
  spec[options.label_column] = tf.io.FixedLenFeature([], tf.int64)
  return input_fns.tfrecord_data(
      options.train_files, options.eval_files or options.train_files,
      feature_spec=spec, label_key=options.label_column,
      n_classes=options.n_classes,
      allow_non_finite=options.allow_non_finite)


def model_params(options: TaskOptions, data: input_fns.Data) -> Dict[str, Any]:
  """The params every model_fn reads: the data's shape, then the options'."""
  params = {'n_classes': data.n_classes,
            'feature_columns': data.feature_columns,
            'image_shape': data.image_shape,
            **options_lib.model_params(options)}
  if options.label_vocabulary:  # Predictions name the classes.
    params['label_vocabulary'] = list(options.label_vocabulary)
  return params


def save_options(model_dir: str, options: TaskOptions) -> None:
  """Writes the options atomically: a half-written file is never read.

  The temporary name is unique to this process, so tasks sharing a job dir
  never rename each other's file.
  """
  tf.io.gfile.makedirs(model_dir)
  path = os.path.join(model_dir, CONFIG_FILE)
  temp = f'{path}.tmp-{os.getpid()}-{uuid.uuid4().hex}'
  with tf.io.gfile.GFile(temp, 'w') as f:
    json.dump(dataclasses.asdict(options), f, indent=2, sort_keys=True)
  tf.io.gfile.rename(temp, path, overwrite=True)


def load_options(job_dir: str) -> TaskOptions:
  """The TaskOptions a training run saved in job_dir.

  Raises:
    ValueError: job_dir holds no trainer_config.json.
  """
  path = os.path.join(job_dir, CONFIG_FILE)
  if not tf.io.gfile.exists(path):
    raise ValueError(f'{path} does not exist: --job-dir must be a directory '
                     'written by trainer.task (for a sweep trial, its trial '
                     'subdirectory).')
  with tf.io.gfile.GFile(path) as f:
    return options_lib.from_saved(json.load(f))
