"""A pytest plugin that runs tensorflow/estimator's own tests on towers.

Loaded with `-p towers_plugin` (tests/upstream on PYTHONPATH) by
run_upstream.py. With ET_TOWERS=N (N >= 2) every `tf.estimator.Estimator`
built in the process, subclasses included, gets its model_fn wrapped by
`replicate_model_fn(model_fn, devices=[N CPUs], aggregation=ET_AGGREGATION)`
and every session it opens gets N virtual CPU devices. ET_TOWERS unset or 0
runs the tests unwrapped (the baseline). Nothing in the library is changed:
the patches are on tensorflow-estimator's Estimator, in this process only.

Per test, the junit xml gets two properties: `wrapped_calls` (calls of a
replicated model_fn) and `tower_builds` (calls that built towers, i.e. not
the eager or serving shortcuts that run the model_fn as written).
"""

import os
import threading

import pytest
import tensorflow as tf
from tensorflow_estimator.python.estimator import estimator as estimator_lib
from tensorflow_estimator.python.estimator import util as function_utils

from estimator_towers import replicate as replicate_lib

TOWERS = int(os.environ.get('ET_TOWERS', '0') or 0)
AGGREGATION = os.environ.get('ET_AGGREGATION', 'global_loss')

_counts = {'wrapped_calls': 0, 'tower_builds': 0}
_nesting = threading.local()  # depth: replicated calls under way


def _count(key):
  _counts[key] += 1


def _wrap(model_fn):
  """`model_fn` replicated on TOWERS CPUs, counting its calls."""
  # None or a non-callable: Estimator's own check must refuse it.
  if not callable(model_fn) or getattr(model_fn, '_towers_harness', False):
    return model_fn
  replicated = replicate_lib.replicate_model_fn(
      model_fn, devices=[f'/cpu:{i}' for i in range(TOWERS)],
      aggregation=AGGREGATION)

  accepted = set(function_utils.fn_args(model_fn))

  def counted(*args, **kwargs):
    depth = getattr(_nesting, 'depth', 0)
    if depth:
      # An Estimator around another's model_fn (tf.estimator.add_metrics):
      # the outer one replicates, the inner one runs as written in each
      # tower, as a user who wraps one Estimator gets.
      return model_fn(*args, **{k: v for k, v in kwargs.items()
                                if k in accepted})
    _count('wrapped_calls')
    _nesting.depth = depth + 1
    try:
      return replicated(*args, **kwargs)
    finally:
      _nesting.depth = depth

  # Estimator reads the arguments off the signature the wrapper presents.
  counted.__signature__ = replicated.__signature__
  counted.__name__ = getattr(model_fn, '__name__', 'model_fn')
  counted._towers_harness = True
  return counted


def _with_cpus(session_config):
  """A copy of `session_config` with TOWERS virtual CPU devices."""
  config = tf.compat.v1.ConfigProto()
  if session_config is not None:
    config.CopyFrom(session_config)
  config.device_count['CPU'] = TOWERS
  return config


def _patch_estimator():
  """Wraps every Estimator's model_fn and gives its sessions TOWERS CPUs."""
  original_init = estimator_lib.Estimator.__init__
  original_overwrite = estimator_lib.maybe_overwrite_model_dir_and_session_config

  def init(self, model_fn, *args, **kwargs):
    original_init(self, _wrap(model_fn), *args, **kwargs)

  def overwrite(config, model_dir):
    config = original_overwrite(config, model_dir)
    return config.replace(session_config=_with_cpus(config.session_config))

  estimator_lib.Estimator.__init__ = init
  estimator_lib.maybe_overwrite_model_dir_and_session_config = overwrite

  original_build = replicate_lib._TowerBuilder.build

  def build(self, *args, **kwargs):
    _count('tower_builds')
    return original_build(self, *args, **kwargs)

  replicate_lib._TowerBuilder.build = build


def _virtual_cpus():
  """Sessions opened without a config (tests' own) get TOWERS CPUs too."""
  cpu, = tf.config.list_physical_devices('CPU')
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * TOWERS)


if TOWERS >= 2:
  _virtual_cpus()
  _patch_estimator()


def pytest_runtest_setup(item):
  del item
  for key in _counts:
    _counts[key] = 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
  # Appended before the teardown report is made: junitxml writes it.
  for key, value in _counts.items():
    item.user_properties.append((key, value))


def pytest_report_header(config):
  del config
  if TOWERS >= 2:
    return f'towers_plugin: {TOWERS} towers, aggregation={AGGREGATION}'
  return 'towers_plugin: unwrapped (baseline)'
