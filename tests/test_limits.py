"""A batch that cannot fit in memory is refused before the OOM killer acts."""

import pytest
import tensorflow as tf

from cli_helpers import run_module
from trainer import limits

GIB = 2**30


@pytest.mark.fast
def test_absurd_batch_is_refused_with_the_largest_that_fits():
  with pytest.raises(ValueError, match=r'--train-batch-size=100000000 needs '
                     r'about 14.9 GiB .* 8.0 GiB; use at most about 26843545'):
    limits.check_batch_size('train-batch-size', 10**8, 10, 8 * GIB)


@pytest.mark.fast
def test_ordinary_batches_pass_and_unknown_memory_skips():
  limits.check_batch_size('train-batch-size', 4096, 3000, 8 * GIB)
  limits.check_batch_size('train-batch-size', 10**12, 10, None)


@pytest.mark.fast
def test_floats_per_example_counts_dense_features_and_hidden_units():
  signature = {'x': tf.TensorSpec([5], tf.float32),
               'image': tf.TensorSpec([4, 4, 3], tf.float32),
               'tags': tf.SparseTensorSpec([None], tf.string)}
  assert limits.floats_per_example(signature, [16, 8]) == 5 + 48 + 1 + 24


@pytest.mark.cli
def test_task_refuses_an_absurd_batch_before_touching_the_job_dir(tmp_path):
  job_dir = tmp_path / 'job'
  result = run_module('trainer.task', f'--job-dir={job_dir}',
                      '--train-batch-size=1000000000', check=False)
  assert result.returncode == 1, result.stderr[-2000:]
  assert '--train-batch-size=1000000000 needs about' in result.stderr
  assert not job_dir.exists()
