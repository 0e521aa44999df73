"""Where a training step's time goes: a few traced steps of one process.

`make_hook(at_step, count, path)` traces `count` consecutive steps from
global step `at_step` on (`RunOptions.FULL_TRACE`) and writes what each op
did, per device, to `path` (JSON). `summarise(path)` reads it back:

* the step's wall time (from `before_run` to `after_run`);
* per device, the time some op ran (the union of the ops' intervals);
* the collectives' time (ops whose type names a collective: mostly waiting
  for the other tasks to reach them);
* the op types that took longest, summed over devices.

Every figure is the median over the traced steps. Tracing slows a step, so
these steps are not timed by the benchmark's window.
"""

import json
import statistics
import time
from typing import Dict, List


def make_hook(at_step: int, count: int, path: str):
  """A SessionRunHook tracing `count` steps from global step `at_step`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1

  class TraceHook(tf1.train.SessionRunHook):
    """Traces a few steps, then writes them as JSON."""

    def begin(self):
      self._step_tensor = tf1.train.get_global_step()
      self._steps: List[dict] = []
      self._tracing = False
      self._started = 0.0

    def before_run(self, run_context):
      self._started = time.perf_counter()
      if not self._tracing:
        return tf1.train.SessionRunArgs(self._step_tensor)
      return tf1.train.SessionRunArgs(
          self._step_tensor,
          options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE))

    def after_run(self, run_context, run_values):
      wall = time.perf_counter() - self._started
      if self._tracing and len(self._steps) < count:
        self._steps.append(_step_record(run_values.run_metadata, wall))
        if len(self._steps) == count:
          with open(path, 'w') as f:
            json.dump(self._steps, f)
      elif int(run_values.results) >= at_step:
        self._tracing = True

  return TraceHook()


def _step_record(run_metadata, wall: float) -> dict:
  ops = []
  for device in run_metadata.step_stats.dev_stats:
    for node in device.node_stats:
      kind = node.timeline_label.split('=')[-1].split('(')[0].strip() or (
          node.node_name)
      ops.append((device.device, node.node_name, kind,
                  node.all_start_micros,
                  node.all_start_micros + node.all_end_rel_micros))
  return {'wall': wall, 'ops': ops}


def _union_ms(intervals) -> float:
  total, end = 0, None
  for start, stop in sorted(intervals):
    if end is None or start > end:
      total += stop - start
      end = stop
    elif stop > end:
      total += stop - end
      end = stop
  return total / 1000


def _short_device(device: str) -> str:
  parts = device.split('/')
  return '/'.join(p for p in parts if p.startswith(('job:', 'device:',
                                                    'task:')))


def summarise(path: str, top: int = 8) -> Dict:
  """Median figures over the traced steps written to `path`."""
  with open(path) as f:
    steps = json.load(f)
  walls = [s['wall'] * 1000 for s in steps]
  busy: Dict[str, List[float]] = {}
  collective, kinds, counts = [], {}, []
  for step in steps:
    per_device: Dict[str, list] = {}
    by_kind: Dict[str, float] = {}
    for device, _, kind, start, stop in step['ops']:
      per_device.setdefault(_short_device(device), []).append((start, stop))
      by_kind[kind] = by_kind.get(kind, 0.0) + (stop - start) / 1000
    for device, intervals in per_device.items():
      busy.setdefault(device, []).append(_union_ms(intervals))
    collective.append(sum(ms for kind, ms in by_kind.items()
                          if 'Collective' in kind))
    for kind, ms in by_kind.items():
      kinds.setdefault(kind, []).append(ms)
    counts.append(len(step['ops']))
  longest = sorted(kinds.items(), key=lambda item: -sum(item[1]))[:top]
  return {
      'wall_ms': statistics.median(walls),
      'ops': statistics.median(counts),
      'busy_ms': {d: statistics.median(v) for d, v in sorted(busy.items())},
      'collective_ms': statistics.median(collective),
      'longest': [(kind, sum(v) / len(steps)) for kind, v in longest]}


def format_summary(name: str, summary: Dict) -> str:
  """A few lines for the benchmark's output."""
  lines = [f'{name}: step {summary["wall_ms"]:.1f} ms wall, '
           f'{summary["ops"]:.0f} ops, collectives '
           f'{summary["collective_ms"]:.1f} ms (summed over their ops)']
  for device, ms in summary['busy_ms'].items():
    lines.append(f'  {device}: busy {ms:.1f} ms')
  lines.append('  longest op types (ms per step, summed over devices): ' +
               ', '.join(f'{kind} {ms:.1f}' for kind, ms in
                         summary['longest']))
  return '\n'.join(lines)
