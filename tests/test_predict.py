"""`python -m trainer.predict`: one row per input, in order, over towers."""

import csv
import json

import numpy as np
import pytest
import tensorflow as tf

from cli_helpers import CSV_FLAGS, eval_line, run_module, write_tabular_csv
from trainer import assembly
from trainer.options import TaskOptions

pytestmark = pytest.mark.cli


def _rows(path):
  with open(path) as f:
    return list(csv.reader(f))


# (towers, batch size) of the checkpoint-mode runs. 101 inputs: batches of
# 25 leave a final batch of 1 for 3 towers; batches of 2 on 4 towers always
# leave idle towers; one tower is the reference the others must match.
_CHECKPOINT_RUNS = ((3, 25), (4, 2), (1, 7))


@pytest.fixture(scope='module')
def predicted(trained, csv_files, tmp_path_factory):
  """The CSV job's predictions of its eval file, each run once per module.

  Returns:
    {(towers, batch): (output path, completed process)} for
    `_CHECKPOINT_RUNS`, and {'saved': ...} for a --saved-model run on 3
    towers (batches of 10).
  """
  job_dir, result = trained
  root = tmp_path_factory.mktemp('predicted')
  runs = {(towers, batch): (f'--batch-size={batch}', f'--cpu-towers={towers}')
          for towers, batch in _CHECKPOINT_RUNS}
  runs['saved'] = ('--batch-size=10', '--cpu-towers=3',
                   f'--saved-model={eval_line(result)["export"]}')
  out = {}
  for i, (run, args) in enumerate(runs.items()):
    path = root / f'predictions{i}.csv'
    out[run] = (path, run_module(
        'trainer.predict', f'--job-dir={job_dir}',
        f'--predict-files={csv_files[1]}', f'--output={path}', *args))
  return out


def _probabilities(rows):
  """The numbers after each data row's id (class id, probabilities)."""
  return np.array([[float(v) for v in r[1:]] for r in rows[1:]])


@pytest.mark.parametrize('towers,batch', [(3, 25), (4, 2)])
def test_csv_predictions_in_input_order(trained, csv_files, predicted, towers,
                                        batch):
  job_dir, _ = trained
  out, result = predicted[towers, batch]
  assert 'wrote 101 predictions' in result.stdout
  checkpoint = tf.train.latest_checkpoint(str(job_dir))
  assert f'predicting 101 rows with checkpoint {checkpoint}\n' in result.stdout
  # TensorFlow's deprecation notices and INFO chatter stay out, as in the task.
  assert 'deprecat' not in result.stderr.lower(), result.stderr[-2000:]
  assert len(result.stderr.splitlines()) <= 3, result.stderr[-2000:]
  header, *rows = _rows(out)
  assert header == ['id', 'class_id', 'probability_0', 'probability_1']
  # Line 1 is the header, so the n-th data row is line n + 1.
  assert [r[0] for r in rows] == [f'{csv_files[1]}:{i + 2}' for i in range(101)]
  probabilities = np.array([[float(p) for p in r[2:]] for r in rows])
  np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
  labels = [int(r[-1]) for r in _rows(csv_files[1])[1:]]
  accuracy = np.mean([int(r[1]) == y for r, y in zip(rows, labels)])
  assert accuracy > 0.8


@pytest.mark.parametrize('towers,batch', [(4, 2), (3, 25)])
def test_predictions_do_not_depend_on_the_tower_count(predicted, towers,
                                                      batch):
  one_tower = _probabilities(_rows(predicted[1, 7][0]))
  np.testing.assert_allclose(
      _probabilities(_rows(predicted[towers, batch][0])), one_tower,
      rtol=1e-5, atol=1e-6,
      err_msg=f'{towers} towers (batches of {batch}) vs 1 (batches of 7)')


def test_tfrecord_output(trained, csv_files, tmp_path):
  job_dir, _ = trained
  out = tmp_path / 'predictions.tfrecord'
  # As on a node of the synchronous cluster that trained the job: its
  # TF_CONFIG is still set (predict waited forever on the task's address).
  tf_config = json.dumps({'cluster': {'chief': ['127.0.0.1:9'],
                                      'worker': ['127.0.0.1:10']},
                          'task': {'type': 'worker', 'index': 0}})
  run_module('trainer.predict', f'--job-dir={job_dir}',
             f'--predict-files={csv_files[1]}', f'--output={out}',
             '--cpu-towers=2', env={'TF_CONFIG': tf_config}, timeout=120)
  records = list(tf.compat.v1.io.tf_record_iterator(str(out)))
  assert len(records) == 101
  first = tf.train.Example.FromString(records[0]).features.feature
  assert first['id'].bytes_list.value[0].decode().endswith(':2')
  assert len(first['probabilities'].float_list.value) == 2


def test_malformed_rows_are_counted_or_stop_the_run(trained, tmp_path):
  job_dir, _ = trained
  rows = write_tabular_csv(tmp_path / 'rows.csv', rows=12,
                           extra_lines=['0.1,0.2,red', '0.3,x,blue,1'])
  out = tmp_path / 'p.csv'
  skipped = run_module('trainer.predict', f'--job-dir={job_dir}',
                       f'--predict-files={rows}', f'--output={out}',
                       '--cpu-towers=2', '--skip-malformed')
  assert ('skipped 2 of 14 rows of --predict-files as malformed; they get '
          f'no prediction (the first: {rows}:14: ') in skipped.stdout
  assert 'wrote 12 predictions' in skipped.stdout
  assert len(_rows(out)) == 13
  # The job was trained without --skip-malformed: so is predict by default.
  stopped = run_module('trainer.predict', f'--job-dir={job_dir}',
                       f'--predict-files={rows}', f'--output={tmp_path / "q.csv"}',
                       '--cpu-towers=2', check=False)
  assert stopped.returncode == 1
  assert f'{rows}:14' in stopped.stderr and '--skip-malformed' in (
      stopped.stderr)
  assert not (tmp_path / 'q.csv').exists()


@pytest.mark.parametrize('args,code,message', [
    (['--output=out.json'], 2, 'must end in .csv or .tfrecord'),
    (['--output=out.csv', '--job-dir=/nonexistent/job'], 1,
     'trainer_config.json does not exist'),
    (['--output=/nonexistent/dir/out.csv'], 1, 'does not exist; create it'),
    (['--output=out.csv', '--predict-files=/nonexistent/*.csv'], 1,
     "predict: error: --predict-files: the glob '/nonexistent/*.csv' matches "
     'no file'),
])
def test_bad_arguments_fail_clearly(trained, csv_files, tmp_path, args, code,
                                    message):
  job_dir, _ = trained
  result = run_module('trainer.predict', f'--job-dir={job_dir}',
                      f'--predict-files={csv_files[1]}', *args, check=False)
  assert result.returncode == code, result.stderr[-2000:]
  assert message in result.stderr
  assert not list(tmp_path.iterdir())  # No partial output.


def test_files_a_digits_job_cannot_read_are_refused(csv_files, tmp_path):
  # The job predicted the 360 digits of its eval set, whatever the files
  # (a CSV, or a glob that matches nothing).
  job_dir = tmp_path / 'digits_job'
  assembly.save_options(str(job_dir), TaskOptions())
  files = csv_files[1]
  out = tmp_path / 'out.csv'
  result = run_module('trainer.predict', f'--job-dir={job_dir}',
                      f'--predict-files={files}', f'--output={out}',
                      check=False)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1] == (
      f'predict: error: --job-dir={job_dir} was trained on '
      f'--input-format=digits, which reads no files, so --predict-files='
      f'{files} would be ignored. Predict files with a job trained on files '
      'of their layout (csv, tfrecord or image_folder).')
  assert 'Traceback' not in result.stderr
  assert not out.exists()


def test_saved_model_mode_equals_checkpoint_mode(predicted):
  # Both on 3 towers; batch sizes 10 and 25 (the predictions do not depend
  # on the batching: test_predictions_do_not_depend_on_the_tower_count).
  saved = _rows(predicted['saved'][0])
  checkpoint = _rows(predicted[3, 25][0])
  assert [r[0] for r in saved] == [r[0] for r in checkpoint]
  np.testing.assert_allclose(_probabilities(saved), _probabilities(checkpoint),
                             rtol=1e-5, atol=1e-6)


def test_bad_rows_in_predict_files_are_one_clear_error(trained, csv_files,
                                                       tmp_path):
  job_dir, _ = trained
  bad = tmp_path / 'bad.csv'
  bad.write_text(open(csv_files[1]).read() + '0.5,nan,red,1\n')
  out = tmp_path / 'predictions.csv'
  result = run_module('trainer.predict', f'--job-dir={job_dir}',
                      f'--predict-files={bad}', f'--output={out}',
                      check=False)
  assert result.returncode == 1, result.stderr[-2000:]
  assert 'bad.csv:103' in result.stderr and 'not a finite' in result.stderr
  assert 'Traceback' not in result.stderr
  assert not out.exists()  # Nothing half-written.


def test_missing_output_is_a_usage_error(trained, csv_files):
  job_dir, _ = trained
  result = run_module('trainer.predict', f'--job-dir={job_dir}',
                      f'--predict-files={csv_files[1]}', check=False)
  assert result.returncode == 2
  assert 'Flag --output must have a value' in result.stderr


def test_a_label_vocabulary_names_the_predicted_classes(tmp_path):
  # As a canned head with label_vocabulary: predictions.csv and the
  # SavedModel's classification signature give the label names.
  rows = write_tabular_csv(tmp_path / 'numbers.csv', rows=120)
  named = tmp_path / 'named.csv'
  with open(rows) as source, open(named, 'w') as out:
    for i, line in enumerate(source):
      *fields, label = line.rstrip('\n').split(',')
      out.write(','.join(fields + [label if i == 0 else
                                   ('no', 'yes')[int(label)]]) + '\n')
  job = tmp_path / 'job'
  flags = [f for f in CSV_FLAGS if not f.startswith('--n-classes')]
  run_module('trainer.task', f'--job-dir={job}', f'--train-files={named}',
             '--train-steps=30', '--label-vocabulary=no,yes',
             # tf.Example input: TF Serving's Classify API needs it.
             '--export-format=example', *flags)
  out = tmp_path / 'p.csv'
  run_module('trainer.predict', f'--job-dir={job}',
             f'--predict-files={named}', f'--output={out}', '--cpu-towers=2')
  header, *predicted = _rows(out)
  assert header[:3] == ['id', 'class_id', 'class']
  assert {r[2] for r in predicted} <= {'no', 'yes'}
  assert all(r[2] == ('no', 'yes')[int(r[1])] for r in predicted)
  (export,) = (job / 'export' / 'final').iterdir()
  signature = tf.saved_model.load(str(export)).signatures['classification']
  assert sorted(signature.structured_outputs) == ['classes', 'scores']

