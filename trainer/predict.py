"""`python -m trainer.predict`: batch prediction spread over the towers.

    python -m trainer.predict --job-dir=runs/x --predict-files='data/*.csv' \
        --output=predictions.csv --cpu-towers=4

Rebuilds the model a `trainer.task` run saved in `--job-dir` (its
trainer_config.json and latest checkpoint) -- or, with `--saved-model`,
runs an exported SavedModel, imported once per tower -- splits every batch
across the towers (the last batch may be short) and writes one row per
input, in input order: CSV with an id column, or TFRecord tf.Examples. The output is written
to a temporary file and renamed when complete, so a failed run leaves no
file that looks whole.
"""

import csv
import dataclasses
import os
import sys
from typing import Dict, Iterable, List, Optional

from trainer import environment

if __name__ == '__main__':
  # TensorFlow reads these variables once, when the imports below load it.
  environment.configure(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

import model_fns
from input_fns import data as data_lib
from estimator_towers.replicate import replicate_model_fn
from estimator_towers.run_config import make_run_config
from estimator_towers.run_config import session_device_counts
from estimator_towers.merge.saved_model_towers import SavedModelTowers
from trainer import assembly
from trainer import cli
from trainer import faults
from trainer import progress as progress_lib
from trainer.options import OptionError

cli.define(flags.DEFINE_string, 'job-dir', None,
           'Directory a trainer.task run wrote (the trial directory for a '
           'sweep trial).')
cli.define(flags.DEFINE_multi_string, 'predict-files', [], 'Input file globs.')
cli.define(flags.DEFINE_string, 'output', None,
           'Output file (.csv or .tfrecord).')
cli.define(flags.DEFINE_integer, 'batch-size', 256,
           'Global batch, split across towers.', lower_bound=1)
cli.define(flags.DEFINE_integer, 'cpu-towers', None,
           'Virtual CPU devices to spread over.', lower_bound=1)
cli.define(flags.DEFINE_integer, 'num-gpus', None,
           'GPUs to spread over; default: all.', lower_bound=0)
cli.define(flags.DEFINE_string, 'checkpoint', None,
           'A checkpoint path; default: latest.')
cli.define(flags.DEFINE_string, 'saved-model', None,
           'Predict with this exported SavedModel (json serving input) '
           'instead of the job dir\'s checkpoint; --job-dir still says how '
           'to read the input files.')
cli.define(flags.DEFINE_boolean, 'skip-malformed', None,
           'Leave out malformed rows (counted on stdout; they get no '
           'prediction) or, with --noskip-malformed, stop at the first. '
           'Default: as the run in --job-dir was trained.')
# --help lists them (absl registers them under cli, which defines them).
flags.adopt_module_key_flags(cli)


def predict(job_dir: str, predict_files: List[str], output: str,
            batch_size: int = 256, cpu_towers=None, num_gpus=None,
            checkpoint=None, saved_model=None,
            skip_malformed: Optional[bool] = None) -> int:
  """Predicts every example of predict_files into output.

  Args:
    skip_malformed: Whether malformed rows are left out (and counted) or
      stop the run; None: as the run in job_dir was trained.

  Returns:
    How many rows were written.

  Raises:
    ValueError: bad arguments, no checkpoint, or an unknown output suffix.
  """
  if not output or not output.endswith(('.csv', '.tfrecord')):
    raise OptionError(f'--output={output!r} must end in .csv or .tfrecord.')
  if not predict_files:
    raise OptionError('--predict-files is required.')
  directory = os.path.dirname(output)
  if directory and not tf.io.gfile.isdir(directory):
    raise ValueError(f'--output={output}: the directory {directory} does not '
                     'exist; create it first.')
  options = assembly.load_options(job_dir)
  _check_readable(assembly.input_format(options), predict_files, job_dir)
  options = dataclasses.replace(options, eval_files=predict_files)
  if skip_malformed is not None:
    options = dataclasses.replace(options, skip_malformed=skip_malformed)
  data = assembly.build_data(options, model_fns.model_kind(options.model))
  ids = data.example_ids()
  if not ids:  # --skip-malformed left none.
    raise ValueError(f'--predict-files={",".join(predict_files)}: every row '
                     'is malformed (skipped by --skip-malformed); nothing to '
                     'predict.')
  _report_skipped(data)
  config = _local_run_config(job_dir, cpu_towers, num_gpus)
  if saved_model:
    return _predict_saved_model(saved_model, data, ids, config, batch_size,
                                output)
  checkpoint = checkpoint or tf.train.latest_checkpoint(job_dir)
  if not checkpoint:
    raise ValueError(f'No checkpoint in {job_dir}; train it first.')
  print(f'predicting {len(ids)} rows with checkpoint {checkpoint}', flush=True)
  estimator = tf.estimator.Estimator(
      replicate_model_fn(model_fns.get_model_fn(options.model)),
      config=config, params=assembly.model_params(options, data))
  rows = estimator.predict(data.predict_input_fn(batch_size),
                           checkpoint_path=checkpoint)
  return _write_atomically(output, ids, rows)


def _local_run_config(job_dir: str, cpu_towers, num_gpus):
  """A RunConfig of this machine alone, whatever TF_CONFIG says.

  On a cluster node TF_CONFIG stays set after training; a RunConfig read
  from it would open the session on the task's gRPC address, where nothing
  listens any more, and predict would wait forever.
  """
  tf_config = os.environ.pop('TF_CONFIG', None)
  if tf_config:
    logging.warning('trainer.predict runs on this machine; it ignores '
                    'TF_CONFIG.')
  try:
    return make_run_config(job_dir, cpu_devices=cpu_towers,
                           num_gpus=num_gpus)
  finally:
    if tf_config is not None:
      os.environ['TF_CONFIG'] = tf_config


def _report_skipped(data) -> None:
  """Prints how many rows --skip-malformed leaves without a prediction."""
  if not getattr(data, 'skip_malformed', False):
    return
  rows, malformed = data.row_counts(data_lib.EVAL)
  if malformed:
    print(f'skipped {len(malformed)} of {rows} rows of --predict-files as '
          f'malformed; they get no prediction (the first: {malformed[0]}). '
          'Pass --noskip-malformed to stop at the first instead.', flush=True)


def _check_readable(input_format: str, predict_files: List[str],
                    job_dir: str) -> None:
  """Refuses files the job's input format would not read.

  A job trained on the embedded digits (or synthetic data) reads no files:
  it predicted its own eval set, whatever --predict-files said.

  Raises:
    OptionError: the format reads no files, or one image folder only.
  """
  if input_format not in assembly.FILE_FORMATS:
    raise OptionError(
        f'--job-dir={job_dir} was trained on --input-format={input_format}, '
        f'which reads no files, so --predict-files={",".join(predict_files)} '
        'would be ignored. Predict files with a job trained on files of '
        'their layout (csv, tfrecord or image_folder).')
  if input_format == 'image_folder' and len(predict_files) != 1:
    raise OptionError(
        f'--predict-files={",".join(predict_files)}: a job trained on '
        '--input-format=image_folder reads one folder of class subfolders; '
        'give one.')


def _predict_saved_model(export_dir, data, ids, config, batch_size,
                         output) -> int:
  """Runs the SavedModel over the towers of `config`."""
  if not tf.io.gfile.exists(os.path.join(export_dir, 'saved_model.pb')):
    raise ValueError(f'--saved-model={export_dir} holds no saved_model.pb.')
  print(f'predicting {len(ids)} rows with the SavedModel {export_dir}',
        flush=True)
  num_gpus, num_cpus = session_device_counts(config.session_config)
  devices = ([f'/device:GPU:{i}' for i in range(num_gpus)] if num_gpus else
             [f'/device:CPU:{i}' for i in range(num_cpus)])
  towers = SavedModelTowers(export_dir, devices, config.session_config)
  try:
    batches = (
        {k: v.numpy() for k, v in features.items()}
        for features in data.predict_input_fn(batch_size)())
    return _write_atomically(output, ids, towers.predict(batches))
  finally:
    towers.close()


def _paired(ids: List[str], rows: Iterable[Dict[str, np.ndarray]]):
  """(id, row) pairs; fails if the model gives more or fewer rows than ids."""
  count = 0
  for row in rows:
    if count == len(ids):
      raise ValueError(f'The model gave more predictions than the {len(ids)} '
                       'inputs.')
    yield ids[count], row
    count += 1
  if count != len(ids):
    raise ValueError(f'The model gave {count} predictions for {len(ids)} '
                     'inputs.')


def _write_atomically(output: str, ids: List[str],
                      rows: Iterable[Dict[str, np.ndarray]]) -> int:
  temp = output + '.incomplete'
  try:
    writer = _write_csv if output.endswith('.csv') else _write_tfrecord
    progress = progress_lib.Progress('predicted', 'rows', len(ids))
    count = writer(temp, progress_lib.counted(_paired(ids, rows), progress))
  except BaseException:
    if tf.io.gfile.exists(temp):
      tf.io.gfile.remove(temp)
    raise
  tf.io.gfile.rename(temp, output, overwrite=True)
  return count


def _write_csv(path, pairs) -> int:
  count = 0
  with tf.io.gfile.GFile(path, 'w') as f:
    out = None
    for example_id, row in pairs:
      probabilities = np.asarray(row['probabilities'])
      # A --label-vocabulary names the class too, as canned heads do.
      named = ['class'] if 'classes' in row else []
      if out is None:
        out = csv.writer(f)
        out.writerow(['id', 'class_id'] + named +
                     [f'probability_{i}' for i in range(len(probabilities))])
      out.writerow([example_id, int(row['class_ids'])] +
                   [_text(row['classes']) for _ in named] +
                   [f'{p:.6g}' for p in probabilities])
      count += 1
  return count


def _text(value) -> str:
  return value.decode() if isinstance(value, bytes) else str(value)


def _write_tfrecord(path, pairs) -> int:
  count = 0
  with tf.io.TFRecordWriter(path) as writer:
    for example_id, row in pairs:
      feature = {
          'id': tf.train.Feature(bytes_list=tf.train.BytesList(
              value=[example_id.encode()])),
          'class_id': tf.train.Feature(int64_list=tf.train.Int64List(
              value=[int(row['class_ids'])])),
          'probabilities': tf.train.Feature(float_list=tf.train.FloatList(
              value=np.asarray(row['probabilities']).tolist())),
      }
      if 'classes' in row:
        feature['class'] = tf.train.Feature(bytes_list=tf.train.BytesList(
            value=[_text(row['classes']).encode()]))
      writer.write(tf.train.Example(features=tf.train.Features(
          feature=feature)).SerializeToString())
      count += 1
  return count


def main(argv):
  del argv  # cli.run has refused any left-over arguments.
  environment.quiet_python_logs(flags.FLAGS['verbosity'].present,
                                logging.get_verbosity())
  with faults.handled('predict', eval_files='--predict-files'):
    count = predict(cli.value('job-dir'),
                    cli.split_multi(cli.value('predict-files')),
                    cli.value('output'), cli.value('batch-size'),
                    cli.value('cpu-towers'), cli.value('num-gpus'),
                    cli.value('checkpoint'), cli.value('saved-model'),
                    cli.value('skip-malformed'))
  print(f'wrote {count} predictions to {cli.value("output")}', flush=True)


if __name__ == '__main__':
  flags.mark_flags_as_required(['job-dir', 'output'])
  cli.run(main, 'predict')
