"""Patches made while towers are built stay with their owner (patching.py).

The owner is the thread and default graph that opened the Patcher: another
thread or graph building a model at the same time must see the original
methods, and every patch is undone, in order, also on errors.
"""

import json
import subprocess
import sys
import threading

import pytest
import tensorflow as tf

from cli_helpers import ROOT
import estimator_towers
from estimator_towers.cluster import cluster_server
from estimator_towers.update import gradient_routing
from estimator_towers.graph import patching

tf1 = tf.compat.v1


class _Target:

  def method(self):
    return 'original'


_ORIGINAL = _Target.__dict__['method']


def _patch(patcher, result):
  patcher.set(_Target, 'method', patcher.guard(lambda self: result,
                                               _Target.__dict__['method']))


def _in_thread(function):
  """What `function()` returns (or raises) when run in another thread."""
  out = {}

  def run():
    try:
      out['value'] = function()
    except Exception as e:  # pylint: disable=broad-except
      out['error'] = e

  thread = threading.Thread(target=run)
  thread.start()
  thread.join()
  if 'error' in out:
    raise out['error']
  return out['value']


@pytest.mark.fast
def test_only_the_owner_thread_and_graph_see_the_patch():
  with tf.Graph().as_default():
    with patching.Patcher() as patcher:
      _patch(patcher, 'patched')
      assert _Target().method() == 'patched'
      assert _in_thread(lambda: _Target().method()) == 'original'
      with tf.Graph().as_default():
        assert _Target().method() == 'original'

      # A function graph inside the owner graph (a tf.cond branch) is the
      # owner's.
      @tf.function
      def inside():
        assert _Target().method() == 'patched'
        return tf.constant(0)

      inside.get_concrete_function()
  assert _Target.__dict__['method'] is _ORIGINAL


@pytest.mark.fast
def test_an_exception_restores_replaced_and_absent_attributes():
  with pytest.raises(ZeroDivisionError):
    with patching.Patcher() as patcher:
      _patch(patcher, 'patched')
      patcher.set(_Target, 'added', 1)
      1 / 0  # pylint: disable=pointless-statement
  assert _Target.__dict__['method'] is _ORIGINAL
  assert 'added' not in vars(_Target)
  assert not patching.is_patched(_Target, 'method')


@pytest.mark.fast
def test_patches_nest():
  outer_graph = tf.Graph()
  with outer_graph.as_default(), patching.Patcher() as outer:
    _patch(outer, 'outer')
    with patching.Patcher() as inner:
      _patch(inner, 'inner')
      assert _Target().method() == 'inner'
    assert _Target().method() == 'outer'
    # A patch of another graph, opened inside: each graph sees its own.
    with tf.Graph().as_default(), patching.Patcher() as other:
      _patch(other, 'other graph')
      assert _Target().method() == 'other graph'
      with outer_graph.as_default():
        assert _Target().method() == 'outer'
    assert _Target().method() == 'outer'
  assert _Target().method() == 'original'
  assert _Target.__dict__['method'] is _ORIGINAL


@pytest.mark.fast
def test_another_thread_cannot_patch_what_is_patched():
  with patching.Patcher() as patcher:
    _patch(patcher, 'patched')

    def patch_too():
      with patching.Patcher() as other:
        _patch(other, 'other')

    with pytest.raises(patching.PatchConflictError, match='already patched'):
      _in_thread(patch_too)
    assert _Target().method() == 'patched'
    with pytest.raises(patching.PatchConflictError):
      patching.replace_for_process(_Target, 'method', lambda self: 'forever')
  _in_thread(patch_too)  # Free again once restored.
  assert _Target.__dict__['method'] is _ORIGINAL


@pytest.mark.fast
def test_gradients_of_another_thread_are_not_routed():
  calls = []

  def handler(call):
    calls.append(threading.get_ident())
    return call.run()

  def gradients():
    with tf.Graph().as_default():
      x = tf.constant(2.0)
      return tf1.gradients(x * x, [x])

  with tf.Graph().as_default():
    with gradient_routing.routed(handler):
      _in_thread(gradients)
      assert not calls
      x = tf.constant(2.0)
      tf1.gradients(x * x, [x])
  assert calls == [threading.get_ident()]
  assert tf1.gradients is gradient_routing.TF1_GRADIENTS


@pytest.mark.fast
def test_make_run_config_installs_the_cluster_server_for_a_cluster(
    monkeypatch):
  executor = cluster_server._executor  # pylint: disable=protected-access
  monkeypatch.setattr(executor, '_start_std_server',
                      cluster_server._original)  # pylint: disable=protected-access
  monkeypatch.delenv('TF_CONFIG', raising=False)
  estimator_towers.make_run_config(cpu_devices=2)
  assert executor._start_std_server is cluster_server._original  # pylint: disable=protected-access
  monkeypatch.setenv('TF_CONFIG', json.dumps({
      'cluster': {'chief': ['localhost:2222'], 'worker': ['localhost:2223']},
      'task': {'type': 'worker', 'index': 0}}))
  estimator_towers.make_run_config(cpu_devices=2)
  assert executor._start_std_server is cluster_server._start_std_server  # pylint: disable=protected-access


_IMPORT_PROBE = """
from tensorflow_estimator.python.estimator import training
before = dict(vars(training._TrainingExecutor))
import estimator_towers
after = dict(vars(training._TrainingExecutor))
changed = sorted(k for k in set(before) | set(after)
                 if before.get(k) is not after.get(k))
assert not changed, changed
print('unchanged')
"""


@pytest.mark.cli
def test_importing_the_library_leaves_tensorflow_estimator_alone():
  result = subprocess.run([sys.executable, '-c', _IMPORT_PROBE], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip().endswith('unchanged')
