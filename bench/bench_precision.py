"""Training speed of `--xla` and `--mixed-precision=bfloat16` on CPU towers.

Runs `python -m trainer.task` on virtual CPU towers for two models, each as
plain float32, with `--xla`, and with `--mixed-precision=bfloat16`:

  mlp        --model=dnn on the embedded digits (the default job)
  cifar_cnn  --model=cifar_cnn on synthetic 32x32x3 images

A measurement is one task process; its figure is the median of the
examples/sec the task logs (every 50 MLP or 10 CNN steps), the first two
reports (graph build, XLA compilation, warm-up) left out. Rounds are
INTERLEAVED: each round runs every variant of a model once in a shuffled
order, so that the ratios printed (xla / plain, bfloat16 / plain, per
round, then their median) compare runs made moments apart on a shared machine.

No GPU path is measured (float16 needs GPU towers). No timing is asserted.

  .venv/bin/python bench/bench_precision.py            # ~15 min, loaded
  .venv/bin/python bench/bench_precision.py --quick    # smoke run
"""

import argparse
import random
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

_MODELS = {
    'mlp': ['--model=dnn'],
    'cifar_cnn': ['--model=cifar_cnn', '--input-format=synthetic_images'],
}
# (steps, log every) per model: the CNN runs ~100x fewer examples/sec. XLA
# compiles during the first report (and sometimes the second).
_STEPS = {'mlp': (300, 50), 'cifar_cnn': (40, 10)}
_VARIANTS = {
    'plain': [],
    'xla': ['--xla'],
    'bfloat16': ['--mixed-precision=bfloat16'],
}
_RATE = re.compile(r'examples/sec=([0-9.]+)')


def _rate(model: str, variant: str, args) -> float:
  """Median examples/sec of one task run, first two reports left out."""
  steps, log_every = _STEPS[model]
  if args.quick:
    steps, log_every = steps // 2, log_every // 2
  with tempfile.TemporaryDirectory() as job_dir:
    command = [sys.executable, '-m', 'trainer.task', f'--job-dir={job_dir}',
               f'--cpu-towers={args.towers}', '--num-gpus=0',
               f'--train-steps={steps}', '--eval-steps=1',
               f'--log-step-count-steps={log_every}',
               f'--save-checkpoints-steps={steps}',
               f'--train-batch-size={args.batch}', '--verbosity=info',
               *_MODELS[model], *_VARIANTS[variant]]
    result = subprocess.run(command, capture_output=True, text=True,
                            check=False)
  if result.returncode != 0:
    raise RuntimeError(f'{model}/{variant} failed:\n{result.stderr[-2000:]}')
  rates = [float(r) for r in _RATE.findall(result.stderr + result.stdout)]
  if len(rates) < 3:
    raise RuntimeError(f'{model}/{variant}: too few rate reports {rates}.')
  return statistics.median(rates[2:])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--towers', type=int, default=2)
  parser.add_argument('--batch', type=int, default=128)
  args = parser.parse_args()
  if args.quick:
    args.rounds = 1
  print(f'{args.towers} virtual CPU towers, global batch {args.batch}, '
        f'steps per run {_STEPS}, {args.rounds} interleaved rounds')
  for model in _MODELS:
    rates: Dict[str, List[float]] = {v: [] for v in _VARIANTS}
    for _ in range(args.rounds):
      order = list(_VARIANTS)
      random.shuffle(order)
      for variant in order:
        rates[variant].append(_rate(model, variant, args))
    for variant, values in rates.items():
      ratios = [v / p for v, p in zip(values, rates['plain'])]
      print(f'{model:10s} {variant:9s} examples/sec median '
            f'{statistics.median(values):8.0f}  per round '
            f'{[round(v) for v in values]}  vs plain x'
            f'{statistics.median(ratios):.2f} {[round(r, 2) for r in ratios]}')


if __name__ == '__main__':
  main()
