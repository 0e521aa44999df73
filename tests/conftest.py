"""Shared fixtures: small data and one CSV training run; no helpers.

Helpers live in tests/helpers.py and tests/cli_helpers.py; tests import them
from there, never from this file. Test tiers (markers) are described in
tests/README.md.
"""

import collections

import numpy as np
import pytest

from cli_helpers import CSV_FLAGS, run_module, write_tabular_csv
import helpers
from helpers import NUM_EXAMPLES, NUM_FEATURES

# tests/upstream runs tensorflow/estimator's own tests on towers, on demand
# (tests/upstream/run_upstream.py); the suite never collects it.
collect_ignore = ['upstream']

TIERS = ('fast', 'training', 'cli', 'cluster')
# A rough cost of one test per tier, in the fast tier's units: enough to
# tell a file of cluster launches from a file of graph checks.
_TIER_COST = {'fast': 1, 'training': 3, 'cli': 10, 'cluster': 40}


def pytest_collection_modifyitems(items):
  """Checks the tiers, then puts the costliest test files first.

  Args:
    items: The collected tests, reordered in place.

  Raises:
    pytest.UsageError: A test has no tier or several: it would silently
      drop out of `-m "fast or training"`.
  """
  tiers = {item: [t for t in TIERS if item.get_closest_marker(t)]
           for item in items}
  wrong = [f'{item.nodeid}: {found or "no tier"}'
           for item, found in tiers.items() if len(found) != 1]
  if wrong:
    raise pytest.UsageError('each test needs exactly one tier marker '
                            f'{TIERS} (tests/README.md):\n' + '\n'.join(wrong))
  # pytest-xdist hands whole files to its workers in this order: a costly
  # file left for the end would run alone while the other workers idle.
  cost = collections.Counter()
  for item, (tier,) in tiers.items():
    cost[item.path] += _TIER_COST[tier]
  items.sort(key=lambda item: -cost[item.path])  # Stable: a file stays whole.


@pytest.fixture(scope='module', autouse=True)
def _graph_rewrites(request):
  """Grappler's rewrites in `helpers.run_config` for files so marked.

  Module-scoped and autouse: set before the file's own module fixtures
  build their Estimators.
  """
  helpers.graph_rewrites = (
      request.node.get_closest_marker('graph_rewrites') is not None)
  yield
  helpers.graph_rewrites = False


@pytest.fixture(scope='session')
def data():
  """A fixed binary classification problem: (x float32 [48, 5], y int32)."""
  rng = np.random.RandomState(0)
  x = rng.randn(NUM_EXAMPLES, NUM_FEATURES).astype(np.float32)
  y = (x[:, 0] - 0.5 * x[:, 1] + 0.3 * rng.randn(NUM_EXAMPLES) > 0)
  return x, y.astype(np.int32)


@pytest.fixture(scope='session')
def csv_files(tmp_path_factory):
  root = tmp_path_factory.mktemp('csv')
  return (write_tabular_csv(root / 'train.csv', 400, seed=1),
          write_tabular_csv(root / 'eval.csv', 101, seed=2))


@pytest.fixture(scope='session')
def trained(tmp_path_factory, csv_files):
  """One CSV training run: (job_dir, completed process)."""
  job_dir = tmp_path_factory.mktemp('job')
  result = run_module('trainer.task', f'--job-dir={job_dir}',
                      f'--train-files={csv_files[0]}',
                      f'--eval-files={csv_files[1]}', '--train-steps=120',
                      '--export-best', *CSV_FLAGS)
  return job_dir, result
