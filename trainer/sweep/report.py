"""What the sweep tells its user: progress lines, a table and a CSV.

The CSV, <job-dir>/sweep_results.csv, has one row per trial that ran:
trial, one column per parameter, objective, status, duration_sec, job_dir,
exit_code, log, error. It is written whole or not at all (a temporary file
renamed over the old one), and only when the sweep ends.
"""

import csv
import io
import os
import tempfile
from typing import Any, Dict, List, Optional, Sequence

import optuna
from optuna.trial import FrozenTrial

from trainer.sweep import config as sweep_config
from trainer.sweep import study as sweep_study
from trainer.sweep.config import SweepConfig

RESULTS_FILE = 'sweep_results.csv'


def objective(trial: FrozenTrial) -> Optional[float]:
  """The trial's objective: its value, or a pruned trial's last report."""
  if trial.state == optuna.trial.TrialState.COMPLETE:
    return trial.value
  if sweep_study.status(trial) == sweep_study.PRUNED:
    return trial.user_attrs.get(sweep_study.LAST_VALUE_ATTR)
  return None


def rows(trials: Sequence[FrozenTrial],
         config: SweepConfig) -> List[Dict[str, Any]]:
  """One row per trial that ran (not the queued ones), in trial order."""
  out = []
  for trial in sorted(trials, key=lambda t: t.number):
    status = sweep_study.status(trial)
    if status == sweep_study.WAITING:
      continue
    attrs = trial.user_attrs
    values = attrs.get(sweep_study.VALUES_ATTR, {})
    row = {'trial': sweep_study.trial_id_of(trial.number)}
    row.update({spec.name: values.get(spec.name, '')
                for spec in config.params})
    value = objective(trial)
    duration = attrs.get(sweep_study.DURATION_ATTR)
    row.update({
        'objective': _blank_none(value),
        'status': status,
        'duration_sec': '' if duration is None else round(duration, 1),
        'job_dir': attrs.get(sweep_study.TRIAL_DIR_ATTR, ''),
        'exit_code': _blank_none(attrs.get(sweep_study.EXIT_CODE_ATTR)),
        'log': attrs.get(sweep_study.LOG_ATTR, ''),
        'error': _blank_none(attrs.get(sweep_study.ERROR_ATTR)),
    })
    out.append(row)
  return out


def _blank_none(value: Any) -> Any:
  return '' if value is None else value


def header(config: SweepConfig) -> List[str]:
  """The CSV's columns: trial, one per parameter, then the rest."""
  first, *rest = sweep_config.RESULT_COLUMNS
  return [first] + [spec.name for spec in config.params] + rest


def write_csv(job_dir: str, table: List[Dict[str, Any]],
              config: SweepConfig) -> str:
  """Writes the rows to <job-dir>/sweep_results.csv atomically.

  Returns:
    The CSV's path.
  """
  text = io.StringIO()
  writer = csv.DictWriter(text, fieldnames=header(config))
  writer.writeheader()
  writer.writerows(table)
  path = os.path.join(job_dir, RESULTS_FILE)
  handle, temp = tempfile.mkstemp(dir=job_dir, prefix='.' + RESULTS_FILE,
                                  suffix='.tmp')
  try:
    with os.fdopen(handle, 'w', newline='', encoding='utf-8') as f:
      f.write(text.getvalue())
      f.flush()
      os.fsync(f.fileno())
    os.replace(temp, path)
  except BaseException:
    os.unlink(temp)  # Leave no half-written copy behind.
    raise
  return path


def format_table(table: List[Dict[str, Any]], config: SweepConfig) -> str:
  """The rows as an aligned text table (without paths and errors)."""
  names = ['trial'] + [spec.name for spec in config.params] + [
      'objective', 'status', 'duration_sec']
  cells = [names] + [[_cell(row[name]) for name in names] for row in table]
  widths = [max(len(line[i]) for line in cells) for i in range(len(names))]
  return '\n'.join('  '.join(cell.ljust(width)
                             for cell, width in zip(line, widths)).rstrip()
                   for line in cells)


def _cell(value: Any) -> str:
  if isinstance(value, float):
    return f'{value:.6g}'
  return str(value)


def describe_values(values: Dict[str, Any]) -> str:
  """'learning-rate=0.5 num-layers=2'."""
  return ' '.join(f'{name}={_cell(value)}' for name, value in values.items())


def best_line(study: optuna.Study, config: SweepConfig) -> Optional[str]:
  """'trial 3: accuracy=0.96 (learning-rate=0.5)', or None before any."""
  complete = [t for t in study.get_trials(deepcopy=False)
              if t.state == optuna.trial.TrialState.COMPLETE]
  if not complete:
    return None
  best = study.best_trial
  values = best.user_attrs.get(sweep_study.VALUES_ATTR, {})
  return (f'trial {sweep_study.trial_id_of(best.number)}: '
          f'{config.metric_tag}={_cell(best.value)} '
          f'({describe_values(values)})')


def progress_line(trial: FrozenTrial, study: optuna.Study,
                  config: SweepConfig, running: int) -> str:
  """One line after a trial ends: it, the counts so far and the best."""
  status = sweep_study.status(trial)
  value = objective(trial)
  what = f'{config.metric_tag}={_cell(value)}' if value is not None \
      else trial.user_attrs.get(sweep_study.ERROR_ATTR, '')
  duration = trial.user_attrs.get(sweep_study.DURATION_ATTR)
  took = f' in {duration:.1f} s' if duration is not None else ''
  trials = study.get_trials(deepcopy=False)
  counts = {s: len(sweep_study.with_status(trials, s))
            for s in (sweep_study.COMPLETE, sweep_study.FAILED,
                      sweep_study.PRUNED)}
  done = sum(counts.values())
  best = best_line(study, config) or 'none yet'
  return (f'sweep: trial {sweep_study.trial_id_of(trial.number)} {status}: '
          f'{what}{took} | {done}/{config.trial_budget} done '
          f'({counts["complete"]} complete, {counts["failed"]} failed, '
          f'{counts["pruned"]} pruned), {running} running | best {best}')
