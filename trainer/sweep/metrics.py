"""Reading a trial's cloudml-hypertune metric file.

After every evaluation a trial rewrites its metric file
(`CLOUD_ML_HP_METRIC_FILE`) with one JSON object a line, newest last:
`{"timestamp": ..., "trial": "3", "<tag>": "0.91", "global_step": "200",
"checkpoint_path": ...}`. The library truncates and rewrites the whole file
each time, so a reader polling it may catch it half written: a last line
without its newline is left for the next poll.
"""

import dataclasses
import json
import math
import os
from typing import List


@dataclasses.dataclass(frozen=True)
class Report:
  """One reported value of the tuning metric."""
  step: int
  value: float


def read_reports(path: str, tag: str, final: bool) -> List[Report]:
  """The reports of `tag` in a metric file, in the order written.

  Args:
    path: The metric file; a missing file has no reports yet.
    tag: The metric tag (hyperparameterMetricTag); lines without it are
      other metrics and are skipped.
    final: The trial has exited, so the file is complete: an unterminated
      last line is read too instead of being left for the next poll.

  Returns:
    The reports, oldest first.

  Raises:
    ValueError: a complete line is not a JSON object, or its value or step
      is not a number (the message names the file and line).
  """
  try:
    with open(path, encoding='utf-8') as f:
      text = f.read()
  except FileNotFoundError:
    return []
  lines = text.split('\n')
  # split() leaves the part after the last newline: empty when the file
  # ends cleanly, a half-written line while the trial is rewriting it.
  if not final:
    lines = lines[:-1]
  reports = []
  for number, line in enumerate(lines, start=1):
    if line.strip():
      report = _parse_line(path, number, line, tag)
      if report is not None:
        reports.append(report)
  return reports


def _parse_line(path: str, number: int, line: str, tag: str):
  where = f'metric file {path} line {number}'
  try:
    entry = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f'{where} is not JSON ({e}): {line[:200]!r}') from e
  if not isinstance(entry, dict):
    raise ValueError(f'{where} is not a JSON object: {line[:200]!r}')
  if tag not in entry:
    return None
  try:
    value = float(entry[tag])
    step = int(float(entry.get('global_step') or 0))
  except (TypeError, ValueError) as e:
    raise ValueError(f'{where}: {tag}={entry[tag]!r} / global_step='
                     f'{entry.get("global_step")!r} are not numbers.') from e
  return Report(step=step, value=value)


def is_number(value: float) -> bool:
  """False for NaN and infinities, which cannot rank a trial."""
  return math.isfinite(value)


def metric_file(trial_dir: str) -> str:
  """Where a trial's metric file goes: <trial dir>/hypertune/metrics."""
  return os.path.join(trial_dir, 'hypertune', 'metrics')
