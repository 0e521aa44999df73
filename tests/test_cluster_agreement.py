"""What trainer.task asks the tasks of a synchronous cluster to share."""

import dataclasses

import pytest

from trainer import assembly
from trainer import cluster_agreement
from trainer import options as options_lib

pytestmark = pytest.mark.fast


def test_training_options_and_files_are_shared_device_counts_are_not(
    tmp_path):
  data = tmp_path / 'train.csv'
  data.write_text('x,label\n1,0\n')
  options = options_lib.TaskOptions(
      job_dir=str(tmp_path), train_files=[str(tmp_path / '*.csv')],
      learning_rate=0.2, cpu_towers=2, train_batch_size=64)
  shared = cluster_agreement.values(options)
  assert shared['--learning-rate'] == 0.2
  assert shared['--train-batch-size'] == 64
  [(name, size, digest)] = shared['training files']
  assert (name, size) == (str(data), len('x,label\n1,0\n'))
  data.write_text('x,label\n1,1\n')  # Another row of the same length.
  assert cluster_agreement.values(options)['training files'] != [
      [name, size, digest]]
  for per_task in ('--cpu-towers', '--job-dir', '--num-gpus',
                   '--sync-timeout-secs', '--eval-files'):
    assert per_task not in shared


def test_an_evaluator_with_other_options_than_the_chief_is_named(tmp_path):
  chief = options_lib.TaskOptions(job_dir=str(tmp_path),
                                  label_vocabulary=['no', 'yes'],
                                  cpu_towers=4)
  evaluator = dataclasses.replace(chief, cpu_towers=1)
  hook = cluster_agreement.EvaluatorCheckHook(str(tmp_path), evaluator)
  hook.begin()  # Before the chief saved its options: nothing to compare.
  assembly.save_options(str(tmp_path), chief)
  hook.begin()  # Only per-task options differ.
  reversed_labels = dataclasses.replace(evaluator,
                                        label_vocabulary=['yes', 'no'])
  with pytest.raises(ValueError) as error:
    cluster_agreement.EvaluatorCheckHook(str(tmp_path),
                                         reversed_labels).begin()
  assert str(error.value).startswith(
      "the evaluator has --label-vocabulary=['yes', 'no'], but the chief "
      "trains with --label-vocabulary=['no', 'yes']")



def test_layer_sizes_compare_as_built_not_as_given(tmp_path):
  defaults = options_lib.TaskOptions(job_dir=str(tmp_path))
  explicit = dataclasses.replace(defaults, hidden_units=[128, 64])
  assert cluster_agreement.values(defaults)['--hidden-units'] == [128, 64]
  assert (cluster_agreement.values(explicit) ==
          cluster_agreement.values(defaults))
  smaller = dataclasses.replace(defaults, first_layer_size=64)
  assert cluster_agreement.values(smaller)['--hidden-units'] == [64, 32]


def test_the_evaluators_check_reads_no_training_file(tmp_path, monkeypatch):
  # It runs before every evaluation: stating the files read up to 64 MiB
  # twice each time, for a value it does not compare.
  chief = options_lib.TaskOptions(job_dir=str(tmp_path),
                                  train_files=[str(tmp_path / '*.csv')])
  assembly.save_options(str(tmp_path), chief)

  def read(patterns):
    raise AssertionError(f'read {patterns}')

  monkeypatch.setattr(cluster_agreement.file_fingerprints, 'of_patterns',
                      read)
  assert cluster_agreement.chief_difference(str(tmp_path), chief) is None
