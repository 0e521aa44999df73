"""The run's machine-readable log: JSON lines in <job dir>/run_log.jsonl.

One JSON object a line, appended as the run goes (a restarted run appends
after the last one's):
  {"event": "options", ...}   the run's options, towers and task;
  {"event": "progress", ...}  a training progress line: step, loss,
                              examples_per_sec;
  {"event": "trained", ...}   training's end: steps and steady examples/sec;
  {"event": "eval", ...}      an evaluation: step and metrics;
  {"event": "final", ...}     the final metrics and the export path.
Every object also has "time" (seconds since the epoch). Each line is written
whole in one write and flushed, so that a reader never meets half a line
(a killed run leaves whole lines behind).
"""

import json
import time
from typing import Any, Dict, Optional

import numpy as np
import tensorflow as tf

FILE_NAME = 'run_log.jsonl'


def _plain(value: Any) -> Any:
  """numpy scalars and arrays, and bytes, as JSON can hold them."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, bytes):
    return value.decode('utf-8', 'replace')
  if isinstance(value, tuple):
    return list(value)
  raise TypeError(f'{type(value).__name__} is not JSON serializable')


class RunLog:
  """Appends records to one JSON-lines file.

  Args:
    path: The file; any path tf.io.gfile takes. Cloud Storage objects cannot
      be appended to: there each record rewrites the object whole.
  """

  def __init__(self, path: str):
    self.path = path

  def write(self, event: str, **fields: Any) -> None:
    """Appends {"event": event, "time": now, **fields} as one line."""
    record = {'event': event, 'time': round(time.time(), 3), **fields}
    line = json.dumps(record, default=_plain, sort_keys=False) + '\n'
    if '://' in self.path:
      old = (tf.io.gfile.GFile(self.path).read()
             if tf.io.gfile.exists(self.path) else '')
      with tf.io.gfile.GFile(self.path, 'w') as f:
        f.write(old + line)
      return
    # One write() of a line opened for appending: a concurrent writer (a
    # cluster's evaluator) cannot split it.
    with open(self.path, 'a', encoding='utf-8') as f:
      f.write(line)
      f.flush()


def metrics_record(metrics: Dict[str, Any]) -> Dict[str, Any]:
  """Eval results as JSON numbers: global_step an int, the others floats."""
  return {k: int(v) if k == 'global_step' else float(v)
          for k, v in metrics.items()
          if np.ndim(v) == 0 and np.asarray(v).dtype.kind in 'biuf'}


class EvalRecorder(tf.estimator.Exporter):
  """Writes an 'eval' record after every evaluation; exports nothing.

  Estimator calls exporters with each evaluation's results (locally and in
  a cluster's evaluator).
  """

  def __init__(self, run_log: RunLog):
    self._log = run_log

  @property
  def name(self) -> str:
    return 'run_log'

  def export(self, estimator, export_path, checkpoint_path,
             eval_result: Dict[str, Any],
             is_the_final_export: bool) -> Optional[str]:
    del estimator, export_path, is_the_final_export  # Nothing is exported.
    metrics = metrics_record(eval_result)
    self._log.write('eval', step=metrics.get('global_step'),
                    checkpoint=checkpoint_path, metrics=metrics)
    return None
