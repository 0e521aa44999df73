"""Running the trainer's command-line tools as real processes in tests."""

import csv
import json
import os
import time

import numpy as np

import preloaded

CSV_FLAGS = ('--label-column=label', '--categorical-column=colour=red|green|blue',
             '--model=dnn', '--hidden-units=16,8', '--learning-rate=0.05',
             '--train-batch-size=32', '--eval-batch-size=50',
             '--save-checkpoints-steps=40', '--cpu-towers=2', '--n-classes=2')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(module, *args, env=None, check=True, timeout=300):
  """Runs `python -m module args` from the project root; returns the result.

  Modules that load TensorFlow run forked from a preloaded interpreter
  (tests/preloaded.py): a real process that skips TensorFlow's import.
  """
  full_env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2',
              'PYTHONPATH': ROOT, **(env or {})}
  full_env.pop('TF_CONFIG', None) if 'TF_CONFIG' not in (env or {}) else None
  result = preloaded.run(module, args, cwd=ROOT, env=full_env,
                         timeout=timeout)
  if check and result.returncode != 0:
    raise AssertionError(f'{module} {args} exited {result.returncode}:\n'
                         f'{result.stderr[-3000:]}')
  return result


def is_task_flag(arg):
  """Whether `--name[=value]` sets a flag of trainer.task (once defined)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  name = arg[2:].partition('=')[0]
  if name in flags.FLAGS:
    return True
  return (name.startswith('no') and name[2:] in flags.FLAGS and
          flags.FLAGS[name[2:]].boolean)


def eval_line(result):
  """The metrics of the task's final 'eval:' line as a dict."""
  line = [l for l in result.stdout.splitlines() if l.startswith('eval:')][-1]
  pairs = dict(item.split('=', 1) for item in line.split()[1:])
  return pairs


def write_tabular_csv(path, rows=160, seed=0, header=True, extra_lines=()):
  """A learnable CSV: label = 1 when x1 + (colour == 'red') > 0.5."""
  rng = np.random.RandomState(seed)
  with open(path, 'w', newline='') as f:
    out = csv.writer(f)
    if header:
      out.writerow(['x1', 'x2', 'colour', 'label'])
    for _ in range(rows):
      x1, x2 = rng.randn(2)
      colour = rng.choice(['red', 'green', 'blue'])
      label = int(x1 + (colour == 'red') > 0.5)
      out.writerow([f'{x1:.4f}', f'{x2:.4f}', colour, label])
    for line in extra_lines:
      f.write(line + '\n')
  return str(path)


def read_json_lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def wait_until(condition, timeout, what, process=None, output=lambda: ''):
  """Polls `condition` until it is truthy; returns its value.

  Raises:
    AssertionError: `timeout` seconds passed, or `process` exited first
      (with the tail of `output()` in the message).
  """
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if process is not None and process.poll() is not None:
      raise AssertionError(f'the process exited ({process.returncode}) while '
                           f'waiting for {what}:\n{output()[-3000:]}')
    found = condition()
    if found:
      return found
    time.sleep(0.3)
  raise AssertionError(f'timed out waiting for {what}')
