"""Trial ids, per-trial directories and tuning-metric reports."""

import json
import os
import re

import pytest
import tensorflow as tf

from trainer import hptuning
from trainer import hypertune_reporter


@pytest.mark.fast
@pytest.mark.parametrize('raw,expected', [
    ('7', '7'), ('trial-3_b.x', 'trial-3_b.x'), ('../../etc', '_.._etc'),
    ('..', 'trial'), ('/abs/path', '_abs_path'), ('a b\nc', 'a_b_c'),
    ('x' * 100, 'x' * 64)])
def test_sanitize_trial_id_stays_one_safe_component(raw, expected):
  cleaned = hptuning.sanitize_trial_id(raw)
  assert cleaned == expected
  assert os.path.dirname(os.path.normpath(os.path.join('job', cleaned))) == \
      'job'


@pytest.mark.fast
def test_trial_id_from_tf_config_then_env():
  assert hptuning.trial_id({}) is None
  assert hptuning.trial_id({'CLOUD_ML_TRIAL_ID': '5'}) == '5'
  both = {'TF_CONFIG': json.dumps({'task': {'trial': '9'}}),
          'CLOUD_ML_TRIAL_ID': '5'}
  assert hptuning.trial_id(both) == '9'
  assert hptuning.trial_id({'TF_CONFIG': json.dumps({'task': {}})}) is None


@pytest.mark.fast
@pytest.mark.parametrize('value,match', [('{not json', 'not valid JSON'),
                                         ('[1, 2]', 'JSON object')])
def test_malformed_tf_config_is_named(value, match):
  with pytest.raises(ValueError, match=match):
    hptuning.trial_id({'TF_CONFIG': value})


@pytest.mark.fast
def test_trial_dir_only_for_trials():
  assert hptuning.trial_dir('/j', None) == '/j'
  assert hptuning.trial_dir('/j', '3') == '/j/3'


def _set_tag(monkeypatch, tag):
  if tag is None:
    monkeypatch.delenv('CLOUD_ML_HP_METRIC_TAG', raising=False)
  else:
    monkeypatch.setenv('CLOUD_ML_HP_METRIC_TAG', tag)


@pytest.mark.fast
@pytest.mark.parametrize('tag,flag,expected', [
    (None, None, 'accuracy'),
    (hptuning.DEFAULT_SUMMARY_TAG, None, 'accuracy'),
    ('loss', None, 'loss'),  # Was the accuracy, reported under `loss`.
    ('auc', None, 'auc'),
    ('my_tag', 'loss', 'loss'),  # The flag maps a tag that names no metric.
    ('loss', 'accuracy', 'accuracy'),
])
def test_tuning_metric_is_the_one_the_tag_names(monkeypatch, tag, flag,
                                                expected):
  _set_tag(monkeypatch, tag)
  assert hptuning.tuning_metric(flag, ['accuracy', 'auc', 'loss'],
                                'dnn') == expected


@pytest.mark.fast
@pytest.mark.parametrize('tag,flag,message', [
    ('val_rmse', None, 'CLOUD_ML_HP_METRIC_TAG=val_rmse (hyperparameterMetric'
     'Tag) is not an evaluation result of --model=dnn, which reports '
     'accuracy, loss;'),
    ('loss', 'rmse', '--hypertune-metric=rmse is not an evaluation result'),
    (None, None, 'does not report accuracy'),
])
def test_tuning_metric_that_names_no_result_is_refused(monkeypatch, tag, flag,
                                                       message):
  _set_tag(monkeypatch, tag)
  reported = ['loss'] if message.startswith('does') else ['accuracy', 'loss']
  with pytest.raises(ValueError, match=re.escape(message)):
    hptuning.tuning_metric(flag, reported, 'dnn')


@pytest.mark.fast
def test_goal_follows_the_metric_name():
  assert hptuning.goal_for('loss') == 'MINIMIZE'
  assert hptuning.goal_for('mean_error') == 'MINIMIZE'
  assert hptuning.goal_for('accuracy') == 'MAXIMIZE'


class _FakeEstimator:
  """Stands in only for eval_dir(); the reporter needs nothing else."""

  def __init__(self, directory):
    self._dir = directory

  def eval_dir(self):
    return self._dir


@pytest.mark.training
def test_reporter_writes_summary_and_metric_file(tmp_path, monkeypatch):
  metric_file = tmp_path / 'hp' / 'metrics'
  monkeypatch.setenv('CLOUD_ML_HP_METRIC_FILE', str(metric_file))
  monkeypatch.setenv('CLOUD_ML_HP_METRIC_TAG', 'custom/tag')
  reporter = hypertune_reporter.HypertuneReporter('accuracy')
  eval_dir = str(tmp_path / 'eval')
  for step, value in ((10, 0.5), (20, 0.75)):
    reporter.export(_FakeEstimator(eval_dir), None, f'ckpt-{step}',
                    {'accuracy': value, 'global_step': step}, False)
  reports = [json.loads(l) for l in metric_file.read_text().splitlines()]
  assert [(r['custom/tag'], r['global_step']) for r in reports] == [
      ('0.5', '10'), ('0.75', '20')]
  values = [(e.step, v.simple_value)
            for path in tf.io.gfile.glob(f'{eval_dir}/events.*')
            for e in tf.compat.v1.train.summary_iterator(path)
            for v in e.summary.value if v.tag == 'custom/tag']
  assert values == [(10, 0.5), (20, 0.75)]


@pytest.mark.training
def test_reporter_names_the_metrics_there_are(tmp_path):
  reporter = hypertune_reporter.HypertuneReporter('auc', report_file=False)
  with pytest.raises(ValueError, match=r"'auc'.*\['accuracy', 'loss'\]"):
    reporter.export(_FakeEstimator(str(tmp_path)), None, None,
                    {'accuracy': 1.0, 'loss': 0.1}, False)
