"""The trainer's run tools: profile, run log, --clean, warm start, --stop-at,
--help by topic, and trainer.cluster's echo of the chief."""

import glob
import json
import os

from absl import flags
import numpy as np
import pytest
import tensorflow as tf

from cli_helpers import CSV_FLAGS, eval_line, read_json_lines, run_module
from helpers import checkpoint_variables
from trainer import cli
from trainer import job_dir
from trainer import options
from trainer import stop_at
from trainer import warm_start
from trainer.cluster import launch

options.define_flags()
tf1 = tf.compat.v1


@pytest.fixture
def parsed():
  def parse(*args):
    cli.parse(['task', *args], 'task')
    return options.from_flags()
  yield parse
  flags.FLAGS.unparse_flags()


@pytest.mark.fast
def test_help_lists_flags_by_topic_without_their_aliases():
  short = cli.help_text()
  headings = [line for line in short.splitlines()
              if line and not line.startswith(' ') and line.endswith(':')]
  assert headings[:6] == ['Job dir and run log:', 'Data:',
                          'Model and training:', 'Devices:',
                          'Checkpoints, export and profiling:',
                          'Hyperparameter tuning:']
  data = short.split('\nData:\n')[1].split('\n\n')[0]
  assert '--train-files:' in data and '--job-dir' not in data
  full = cli.help_text(full=True)
  assert 'absl.logging:' in full and 'absl.logging:' not in short
  for text in (short, full):
    assert 'Alias for' not in text and '--job_dir:' not in text
    assert 'other spellings' not in text
    assert 'underscore spelling (--job_dir)' in text


@pytest.mark.fast
def test_stop_at_and_profile_steps_parse_or_say_the_form(parsed):
  assert stop_at.parse('accuracy >= 0.97') == stop_at.Target(
      'accuracy', '>=', 0.97)
  assert stop_at.parse('loss<0.2').reached(0.1)
  assert not stop_at.parse('loss<0.2').reached(0.2)
  for text in ('accuracy=0.9', 'accuracy>=high', 'accuracy'):
    with pytest.raises(cli.UsageError, match='METRIC>=VALUE'):
      parsed(f'--stop-at={text}')
    flags.FLAGS.unparse_flags()
  with pytest.raises(ValueError, match="no 'acc'; it reports accuracy, loss"):
    stop_at.check_metric(stop_at.parse('acc>0.5'), ['loss', 'accuracy'])
  assert parsed('--profile-steps=3,5').profile_steps == [3, 5]
  flags.FLAGS.unparse_flags()
  with pytest.raises(cli.UsageError, match='FIRST,LAST'):
    parsed('--profile-steps=5,3')


@pytest.mark.fast
def test_clean_empties_only_a_directory_the_trainer_wrote(tmp_path):
  own = ('trainer_config.json', 'run_log.jsonl')
  trained = tmp_path / 'trained'
  (trained / 'eval').mkdir(parents=True)
  for name in ('trainer_config.json', 'checkpoint', 'eval/events',
               job_dir.LOCK_FILE):
    (trained / name).write_text('x')
  job_dir.clean(str(trained), own)
  assert os.listdir(trained) == [job_dir.LOCK_FILE]  # Held by the run.
  other = tmp_path / 'home'
  other.mkdir()
  (other / 'thesis.tex').write_text('x')
  with pytest.raises(ValueError, match=r'thesis\.tex.*nothing was deleted'):
    job_dir.clean(str(other), own)
  assert os.listdir(other) == ['thesis.tex']


def _save_checkpoint(directory, step):
  with tf.Graph().as_default():
    tf1.get_variable('w', [2], initializer=tf1.zeros_initializer())
    global_step = tf1.train.get_or_create_global_step()
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      session.run(global_step.assign(step))
      return tf1.train.Saver().save(session, os.path.join(directory, 'ckpt'),
                                    global_step=step)


@pytest.mark.fast
@pytest.mark.parametrize('task, reads', [('chief', True), ('worker', False)])
def test_only_the_chief_reads_the_warm_start_checkpoint(
    tmp_path, monkeypatch, parsed, csv_files, task, reads):
  # A worker's machine may not hold it (its variables are the chief's):
  # a synchronous worker refused, and the chief waited out its timeouts.
  from trainer import assembly  # pylint: disable=g-import-not-at-top
  from trainer import train  # pylint: disable=g-import-not-at-top
  import model_fns  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('TF_CONFIG', json.dumps({
      'cluster': {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']},
      'task': {'type': task, 'index': 0}}))
  opts = parsed(f'--job-dir={tmp_path}', f'--train-files={csv_files[0]}',
                f'--warm-start-from={tmp_path / "nowhere"}', *CSV_FLAGS)
  config = train.create_run_config(opts, str(tmp_path))
  data = assembly.build_data(opts, model_fns.model_kind(opts.model))
  if reads:
    with pytest.raises(ValueError, match='no such checkpoint'):
      train.create_estimator(opts, config, data, 'all_reduce', 2)
  else:
    estimator = train.create_estimator(opts, config, data, 'all_reduce', 2)
    assert estimator._warm_start_settings is None  # pylint: disable=protected-access


@pytest.mark.fast
def test_warm_start_needs_a_checkpoint_and_a_job_dir_it_will_not_ignore(
    tmp_path):
  source, job = tmp_path / 'source', tmp_path / 'job'
  source.mkdir()
  with pytest.raises(ValueError, match='holds no checkpoint'):
    warm_start.settings(str(source))
  with pytest.raises(ValueError, match='no such checkpoint'):
    warm_start.settings(str(tmp_path / 'nothing'))
  path = _save_checkpoint(str(source), 7)
  assert warm_start.settings(str(source)).ckpt_to_initialize_from == path
  job.mkdir()
  warm_start.check_job_dir(str(job), 'trainer_config.json', str(source))
  _save_checkpoint(str(job), 3)
  with pytest.raises(ValueError, match='already has checkpoints.*--clean'):
    warm_start.check_job_dir(str(job), 'trainer_config.json', str(source))
  # The same job restarted: its checkpoints are its own warm-started ones.
  (job / 'trainer_config.json').write_text(
      json.dumps({'warm_start_from': str(source)}))
  warm_start.check_job_dir(str(job), 'trainer_config.json', str(source))


@pytest.mark.fast
def test_cluster_echo_prints_the_chiefs_progress_and_last_line(tmp_path):
  log = tmp_path / 'chief-0.log'
  task = launch.Task('chief', 0, {}, str(log))
  printed = []
  echo = launch.LogEcho(task, printed.append)
  echo.poll()  # No log yet.
  with open(log, 'w') as f:
    f.write('=== 10:00:00 starting chief:0 (restart 0) ===\n'
            'I1126 10:00:01.0 1 step_logging.py:92] step 100: loss=0.5 '
            'examples/sec=900\n'
            'W1126 10:00:01.0 1 train.py:1] something else\n'
            'eval: accuracy=0.9')  # Not whole yet.
  echo.poll()
  assert printed == ['chief:0: step 100: loss=0.5 examples/sec=900']
  with open(log, 'a') as f:
    f.write('000 global_step=600 export=/e\n')
  echo.poll()
  assert printed[1:] == ['chief:0: eval: accuracy=0.9000 global_step=600 '
                         'export=/e']


@pytest.mark.cli
def test_warm_start_stop_at_profile_run_log_and_clean_in_a_run(
    trained, csv_files, tmp_path):
  source = trained[0]
  job = tmp_path / 'job'
  # As docs/quickstart.md shows them; a learning rate of 1e-9 keeps the
  # warm-started weights as they were, to float32 precision (a positive
  # rate is required).
  command = (f'--job-dir={job}', f'--train-files={csv_files[0]}',
             f'--eval-files={csv_files[1]}', *CSV_FLAGS,
             f'--warm-start-from={source}', '--learning-rate=1e-9',
             '--stop-at=accuracy>=0.8', '--profile-steps=2,3',
             '--save-checkpoints-steps=5', '--log-step-count-steps=2',
             '--train-steps=400')
  first = run_module('trainer.task', *command)
  # The warm-started model met the target at its first evaluation (step 5);
  # the step that read it was the last.
  assert eval_line(first)['global_step'] == '6'
  weights = {k: v for k, v in checkpoint_variables(source).items()
             if k.startswith(('hidden', 'logits')) and 'Adam' not in k}
  ours = checkpoint_variables(job)
  for name, value in weights.items():
    np.testing.assert_allclose(ours[name], value, atol=1e-6, err_msg=name)
  assert glob.glob(str(job / 'plugins' / 'profile' / '*' / '*.xplane.pb'))
  records = read_json_lines(job / 'run_log.jsonl')
  events = [r['event'] for r in records]
  assert events[0] == 'options' and events[-1] == 'final'
  assert {'progress', 'eval', 'trained'} <= set(events)
  assert records[0]['options']['warm_start_from'] == str(source)
  assert [r['step'] for r in records if r['event'] == 'eval'][0] == 5
  final = records[-1]
  assert final['metrics']['global_step'] == 6
  assert final['export_dir'] == eval_line(first)['export']
  # --clean starts afresh (the warm start again); without it the run would
  # resume at step 6 and append to the log.
  again = run_module('trainer.task', *command, '--clean')
  assert eval_line(again)['global_step'] == '6'
  events = [r['event'] for r in read_json_lines(job / 'run_log.jsonl')]
  assert events.count('options') == 1


@pytest.mark.fast
def test_a_checkpoint_that_does_not_fit_fails_in_one_line(tmp_path):
  source = tmp_path / 'source'
  source.mkdir()
  _save_checkpoint(str(source), 7)

  def model_fn(features, labels, mode):
    del features, labels
    extra = tf1.get_variable('not_in_checkpoint', [3])
    loss = tf.reduce_sum(tf1.get_variable('w', [2])) + tf.reduce_sum(extra)
    train_op = tf1.assign_add(tf1.train.get_or_create_global_step(), 1)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  estimator = tf.estimator.Estimator(
      model_fn, str(tmp_path / 'job'),
      warm_start_from=warm_start.settings(str(source)))
  with pytest.raises(ValueError) as raised:
    estimator.train(lambda: tf.data.Dataset.from_tensors(0.0).repeat(),
                    steps=1)
  assert warm_start.is_misfit(raised.value)
  message = str(warm_start.phrased(raised.value, str(source)))
  assert message.startswith(f'--warm-start-from={source}: the checkpoint '
                            'does not fit the model (')
  assert 'not_in_checkpoint' in message and '{' not in message
  assert '\n' not in message
