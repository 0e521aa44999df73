"""Throughput of a loopback cluster: 1 ps with 1 vs 2 training workers.

    .venv/bin/python bench/bench_cluster.py [--rounds=3] [--steps=6000]

Each configuration runs `python -m trainer.cluster` (chief + `workers - 1`
more workers + 1 ps, no evaluator) at the same per-worker batch, every task
limited to one thread per pool. The chief logs cluster-wide examples/sec
(global steps x per-worker batch); the median of its steady-state lines is
the figure. Configurations alternate within each round, so machine noise hits
both alike; the ratio is what to read. No thresholds: this only prints.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RATE = re.compile(r'examples/sec=(\d+)')


def run_cluster(workers: int, steps: int, batch: int) -> float:
  """Median steady-state examples/sec of one cluster run."""
  job_dir = tempfile.mkdtemp(prefix='bench_cluster_')
  try:
    task_flags = [f'--train-steps={steps}', f'--train-batch-size={batch}',
                  '--hidden-units=256,256', '--save-checkpoints-steps=100000',
                  '--inter-op-threads=1', '--intra-op-threads=1']
    env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT}
    env.pop('TF_CONFIG', None)
    subprocess.run(
        [sys.executable, '-m', 'trainer.cluster', f'--job-dir={job_dir}',
         f'--workers={workers - 1}', '--ps=1', '--noevaluator', '--',
         *task_flags], cwd=ROOT, env=env, check=True, capture_output=True,
        stdin=subprocess.DEVNULL)
    with open(os.path.join(job_dir, 'logs', 'chief-0.log')) as f:
      rates = [int(m.group(1)) for m in _RATE.finditer(f.read())]
    steady = rates[2:] or rates  # The first lines include warm-up.
    return statistics.median(steady)
  finally:
    shutil.rmtree(job_dir, ignore_errors=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=6000)
  parser.add_argument('--batch', type=int, default=64,
                      help='Per-worker batch.')
  args = parser.parse_args()
  results = {1: [], 2: []}
  for round_index in range(args.rounds):
    order = (1, 2) if round_index % 2 == 0 else (2, 1)
    for workers in order:
      start = time.time()
      rate = run_cluster(workers, args.steps, args.batch)
      results[workers].append(rate)
      print(f'round {round_index + 1}: {workers} worker(s): {rate:.0f} '
            f'examples/sec ({time.time() - start:.0f} s run)', flush=True)
  one, two = (statistics.median(results[w]) for w in (1, 2))
  print(f'\n1 ps, per-worker batch {args.batch}, 1 thread per pool per task')
  print(f'{"workers":>8} {"examples/sec (median)":>22} {"ratio":>7}')
  print(f'{1:>8} {one:>22.0f} {1.0:>7.2f}')
  print(f'{2:>8} {two:>22.0f} {two / one:>7.2f}')


if __name__ == '__main__':
  main()
