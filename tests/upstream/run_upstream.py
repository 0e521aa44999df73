"""Runs tensorflow/estimator's own test files on towers and tabulates them.

Usage (from the checkout, after exporting tensorflow/estimator v2.15.0 to
SRC, e.g. `git --git-dir=MIRROR archive v2.15.0 | tar -x -C SRC`):

  .venv/bin/python tests/upstream/run_upstream.py run --src SRC --out OUT \
      --towers 0                        # the unwrapped baseline
  .venv/bin/python tests/upstream/run_upstream.py run --src SRC --out OUT \
      --towers 2 --aggregation global_loss
  .venv/bin/python tests/upstream/run_upstream.py table --out OUT

`run` runs each test file in its own pytest process (towers_plugin loaded,
see there) and writes OUT/<config>/<file>.xml; `table` reads every
configuration found in OUT and prints, per file, the tests passed unwrapped
and, per configuration, passed / failed / passed with towers built, counted
over the tests that pass unwrapped.
"""

import argparse
import collections
import glob
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PACKAGE = 'tensorflow_estimator/python/estimator'
# The files issue 29 names, relative to PACKAGE; globs allowed.
FILES = (
    'estimator_test.py', 'keras_test.py', 'canned/rnn_test.py',
    'canned/kmeans_test.py', 'extenders_test.py', 'training_test.py',
    'canned/saved_model_estimator_test.py', 'object_checkpointing_test.py',
    'hooks/hooks_test.py', 'canned/timeseries/*_test.py',
    'canned/v1/dnn_test_fc_v1_v1.py', 'head/binary_class_head_test.py',
    'head/multi_class_head_test.py', 'head/multi_label_head_test.py',
    'tpu/tpu_estimator_*_test.py')
BASELINE = 'unwrapped'


def config_name(towers: int, aggregation: str) -> str:
  """The directory name of one configuration."""
  return BASELINE if towers < 2 else f'{towers}_{aggregation}'


def test_files(src: str) -> list:
  """The test files under `src`, relative to it, in a fixed order."""
  found = []
  for pattern in FILES:
    matches = sorted(glob.glob(os.path.join(src, PACKAGE, pattern)))
    if not matches:
      raise SystemExit(f'no test file matches {pattern} under {src}')
    found += [os.path.relpath(m, src) for m in matches]
  return found


def run(src: str, out: str, towers: int, aggregation: str, timeout: int,
        only: list) -> None:
  """Runs every file of one configuration; one pytest process per file."""
  target = os.path.join(out, config_name(towers, aggregation))
  os.makedirs(target, exist_ok=True)
  env = dict(os.environ, ET_TOWERS=str(towers), ET_AGGREGATION=aggregation,
             PYTHONPATH=os.pathsep.join([HERE, ROOT]))
  for path in test_files(src):
    if only and not any(o in path for o in only):
      continue
    xml = os.path.join(target, path.replace('/', '__') + '.xml')
    # importlib mode: the tests import the installed tensorflow_estimator
    # (the library under test), not the export's copy of it.
    command = [sys.executable, '-m', 'pytest', path, '-c', os.devnull,
               '--rootdir', src, '--import-mode=importlib',
               '-p', 'towers_plugin', '-p', 'no:cacheprovider', '-n', '0',
               '-q', f'--timeout={timeout}', f'--junitxml={xml}']
    start = time.time()
    result = subprocess.run(command, cwd=src, env=env, capture_output=True,
                            text=True)
    with open(xml + '.log', 'w') as f:
      f.write(result.stdout + result.stderr)
    tail = (result.stdout.strip().splitlines() or ['(no output)'])[-1]
    print(f'{path}: {tail} [{time.time() - start:.0f} s]', flush=True)


def read_results(xml: str) -> dict:
  """{test id: (outcome, tower_builds, message)} of one junit xml."""
  results = {}
  for case in ET.parse(xml).iter('testcase'):
    test = f"{case.get('classname')}::{case.get('name')}"
    bad = case.find('failure')
    bad = case.find('error') if bad is None else bad
    if case.find('skipped') is not None:
      outcome = 'skipped'
    elif bad is not None:
      outcome = 'failed'
    else:
      outcome = 'passed'
    builds = sum(int(p.get('value')) for p in case.iter('property')
                 if p.get('name') == 'tower_builds')
    message = '' if bad is None else (bad.get('message') or '').split('\n')[0]
    # A teardown error adds a second entry: the worse outcome wins.
    if results.get(test, ('passed',))[0] != 'failed':
      results[test] = (outcome, builds, message)
  return results


def collect(out: str) -> dict:
  """{config: {file: {test: (outcome, builds, message)}}} of the runs."""
  runs = collections.defaultdict(dict)
  for xml in sorted(glob.glob(os.path.join(out, '*', '*.xml'))):
    config = os.path.basename(os.path.dirname(xml))
    name = os.path.basename(xml)[:-len('.xml')]
    name = name.replace('__', '/')[len(PACKAGE) + 1:]
    runs[config][name] = read_results(xml)
  return runs


def table(out: str) -> str:
  """The markdown table: per file, unwrapped passes and each configuration's
  passed / failed / passed-with-towers-built over those tests. The total
  row covers the files every configuration ran."""
  runs = collect(out)
  configs = sorted(c for c in runs if c != BASELINE)
  head = ['file', 'unwrapped passed'] + [
      f'{c}: passed / failed / towers built' for c in configs]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  totals = collections.Counter()
  for name, base in sorted(runs[BASELINE].items()):
    passing = [t for t, (o, *_) in base.items() if o == 'passed']
    row = [name, str(len(passing))]
    everywhere = all(name in runs[c] for c in configs)
    totals['base'] += len(passing) if everywhere else 0
    for c in configs:
      if name not in runs[c]:
        row.append('not run')
        continue
      got = runs[c][name]
      ok = [t for t in passing if got.get(t, ('missing',))[0] == 'passed']
      built = [t for t in ok if got[t][1] > 0]
      counts = (len(ok), len(passing) - len(ok), len(built))
      row.append('%d / %d / %d' % counts)
      if everywhere:
        totals[c] = tuple(map(sum, zip(totals[c] or (0, 0, 0), counts)))
    lines.append('| ' + ' | '.join(row) + ' |')
  lines.append('| **total (files run everywhere)** | ' + ' | '.join(
      [str(totals['base'])] + ['%d / %d / %d' % (totals[c] or (0, 0, 0))
                               for c in configs]) + ' |')
  return '\n'.join(lines)


def failures(out: str, config: str) -> list:
  """Tests that pass unwrapped and not in `config`: 'file::test: message'."""
  runs = collect(out)
  lost = []
  for name, base in sorted(runs[BASELINE].items()):
    if name not in runs[config]:
      continue  # Not run in that configuration (yet).
    got = runs[config][name]
    for test, (outcome, *_) in base.items():
      result = got.get(test, ('missing', 0, ''))
      if outcome == 'passed' and result[0] != 'passed':
        lost.append(f'{name}::{test}: {result[0]}: {result[2][:300]}')
  return lost


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  sub = parser.add_subparsers(dest='command', required=True)
  run_args = sub.add_parser('run')
  run_args.add_argument('--src', required=True)
  run_args.add_argument('--out', required=True)
  run_args.add_argument('--towers', type=int, default=0)
  run_args.add_argument('--aggregation', default='global_loss')
  run_args.add_argument('--timeout', type=int, default=600,
                        help='per test, in seconds')
  run_args.add_argument('--only', nargs='*', default=[],
                        help='run only files whose path contains one of these')
  table_args = sub.add_parser('table')
  table_args.add_argument('--out', required=True)
  table_args.add_argument('--failures', metavar='CONFIG',
                          help='list the tests that pass unwrapped, not here')
  args = parser.parse_args()
  if args.command == 'run':
    run(args.src, args.out, args.towers, args.aggregation, args.timeout,
        args.only)
  elif args.failures:
    print('\n'.join(failures(args.out, args.failures)))
  else:
    print(table(args.out))


if __name__ == '__main__':
  main()
