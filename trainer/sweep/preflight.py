"""Before the first trial: does trainer.task accept the sweep's settings?

A trial refuses a hyperparameterMetricTag that names none of its model's
evaluation results (see trainer.hptuning.tuning_metric), and so does every
other trial: a sweep would fail them one by one. The sweep runs the trainer
once with `--dry-run` and the trial's tag instead, which checks the fixed
flags, the data, the model and the metric in seconds, and stops with the
trainer's own message.
"""

import os
import subprocess
import sys
from typing import Mapping, Sequence

# Only this trainer is known to take --dry-run; another --module-name is
# left to its trials.
CHECKED_MODULE = 'trainer.task'
# The trial's Cloud variables: the dry run is no trial and reports nothing.
_TRIAL_ONLY = ('TF_CONFIG', 'CLOUD_ML_TRIAL_ID', 'CLOUD_ML_HP_METRIC_FILE',
               'AIP_MODEL_DIR', 'AIP_CHECKPOINT_DIR',
               'AIP_TENSORBOARD_LOG_DIR')


def check(module: str, job_dir: str, fixed_flags: Sequence[str],
          metric_tag: str, environ: Mapping[str, str],
          timeout_secs: float = 600) -> None:
  """Runs `python -m trainer.task --dry-run` with the trials' tag and flags.

  Args:
    module: The sweep's --module-name; other modules are not checked.
    job_dir: The sweep's job dir (the dry run writes nothing there).
    fixed_flags: The trainer flags every trial gets.
    metric_tag: hyperparameterMetricTag.
    environ: The environment trials start from.
    timeout_secs: How long the check may take.

  Raises:
    ValueError: the trainer refuses; the message is its own error line.
  """
  if module != CHECKED_MODULE:
    return
  env = {k: v for k, v in environ.items() if k not in _TRIAL_ONLY}
  env['CLOUD_ML_HP_METRIC_TAG'] = metric_tag
  command = [sys.executable, '-m', module, f'--job-dir={job_dir}',
             *fixed_flags, '--dry-run']
  result = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=timeout_secs, stdin=subprocess.DEVNULL,
                          check=False)
  if result.returncode == 0:
    return
  lines = result.stderr.strip().splitlines()
  errors = [l for l in lines if l.startswith('task: error: ')]
  reason = (errors[-1][len('task: error: '):] if errors else
            f'exit {result.returncode}: {lines[-1] if lines else ""}')
  raise ValueError(f'{module} refuses the sweep\'s settings (checked with '
                   f'--dry-run before any trial): {reason}')
