"""What the tasks' statement of their training files costs at start-up.

    .venv/bin/python bench/bench_file_fingerprints.py

Every task of a synchronous cluster states what its training files hold
(trainer/file_fingerprints.py) before the first step. This times that
statement against reading the same files once through (what one epoch of
input reads at least), side by side in one run, for data sets of the
shapes users train on: one large CSV, many CSV shards, an image folder of
many small files. Files are written to a temporary directory first (the
page cache then holds them: both columns read from memory, so the ratio is
the CPU share, not the disk's). No thresholds: this only prints.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer import file_fingerprints  # pylint: disable=wrong-import-position

_MB = 1 << 20


def _write(root, name, sizes):
  """Writes files of `sizes` bytes under root/name; returns the pattern."""
  folder = os.path.join(root, name)
  os.makedirs(folder)
  rng = os.urandom
  for i, size in enumerate(sizes):
    sub = os.path.join(folder, f'class_{i % 10}')
    os.makedirs(sub, exist_ok=True)
    with open(os.path.join(sub, f'part-{i:06d}'), 'wb') as f:
      f.write(rng(size))
  return folder


def _read_all(folder):
  total = 0
  for parent, _, files in os.walk(folder):
    for name in files:
      with open(os.path.join(parent, name), 'rb') as f:
        while True:
          chunk = f.read(_MB)
          if not chunk:
            break
          total += len(chunk)
  return total


def _timed(fn, rounds):
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=5)
  args = parser.parse_args(argv)
  shapes = {
      'one CSV of 256 MB': [256 * _MB],
      '64 shards of 8 MB': [8 * _MB] * 64,
      '10000 images of 100 KB': [100 << 10] * 10000,
  }
  root = tempfile.mkdtemp(prefix='bench_fingerprints_')
  try:
    print(f'{"data set":>24} {"files":>6} {"MB":>6} {"statement s":>12} '
          f'{"read once s":>12} {"statement/read":>15}')
    for name, sizes in shapes.items():
      folder = _write(root, name.replace(' ', '_'), sizes)
      _read_all(folder)  # Into the page cache.
      stated = _timed(lambda: file_fingerprints.of_patterns([folder]),  # pylint: disable=cell-var-from-loop
                      args.rounds)
      read = _timed(lambda: _read_all(folder), args.rounds)  # pylint: disable=cell-var-from-loop
      print(f'{name:>24} {len(sizes):>6} {sum(sizes) / _MB:>6.0f} '
            f'{stated:>12.3f} {read:>12.3f} {stated / read:>15.3f}',
            flush=True)
      shutil.rmtree(folder)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
