"""Malformed TF_CONFIG fails before any server starts, naming the problem."""

import json
import os
import subprocess
import sys

import pytest

from cli_helpers import ROOT, run_module
from trainer import cluster_config
from trainer.cluster import private_network

CLUSTER = {'chief': ['127.0.0.1:2222'], 'worker': ['127.0.0.1:2223'],
           'ps': ['127.0.0.1:2224']}


def _env(cluster, task):
  return {'TF_CONFIG': json.dumps({'cluster': cluster, 'task': task})}


@pytest.mark.fast
@pytest.mark.parametrize('cluster,task', [
    (CLUSTER, {'type': 'chief', 'index': 0}),
    (CLUSTER, {'type': 'worker', 'index': 0}),
    (CLUSTER, {'type': 'ps', 'index': 0}),
    (CLUSTER, {'type': 'evaluator', 'index': 0}),
    ({'master': ['h:1'], 'worker': ['h:2']}, {'type': 'master', 'index': 0}),
    ({}, {}),
    ({}, {'trial': '3'}),
])
def test_valid_configs_pass(cluster, task):
  assert cluster_config.check_tf_config(_env(cluster, task)) is not None


@pytest.mark.fast
@pytest.mark.parametrize('tf_config,match', [
    ('{"cluster": ', 'not valid JSON'),
    ('["chief"]', 'must be a JSON object'),
    (json.dumps({'cluster': CLUSTER, 'task': {'type': 'trainer', 'index': 0}}),
     "unknown task type 'trainer'"),
    (json.dumps({'cluster': CLUSTER, 'task': {'type': 'worker', 'index': 1}}),
     r"index 1 is out of range: cluster\['worker'\] has 1"),
    (json.dumps({'cluster': CLUSTER, 'task': {'type': 'worker', 'index': -1}}),
     'index must be an int >= 0'),
    (json.dumps({'cluster': {'worker': ['h:1'], 'ps': ['h:2']},
                 'task': {'type': 'worker', 'index': 0}}),
     'no "chief"'),
    (json.dumps({'cluster': {**CLUSTER, 'master': ['h:9']},
                 'task': {'type': 'chief', 'index': 0}}),
     'both "chief" and "master"'),
    (json.dumps({'cluster': {**CLUSTER, 'chief': ['h:1', 'h:2']},
                 'task': {'type': 'chief', 'index': 0}}),
     'exactly one address'),
    (json.dumps({'cluster': {**CLUSTER, 'trainers': ['h:1']},
                 'task': {'type': 'chief', 'index': 0}}),
     "unknown job 'trainers'"),
    (json.dumps({'cluster': CLUSTER, 'task': {}}), 'needs a "type"'),
    (json.dumps({'cluster': {}, 'task': {'type': 'master', 'index': 0}}),
     "cluster has no 'master' job"),
    (json.dumps({'cluster': CLUSTER, 'task': {'type': 'evaluator',
                                              'index': 2}}),
     'one evaluator'),
    (json.dumps({'cluster': {**CLUSTER, 'worker': [2223]},
                 'task': {'type': 'chief', 'index': 0}}),
     r"cluster\['worker'\]\[0\] is 2223; each address must be a "
     '"host:port" string'),
    (json.dumps({'cluster': {**CLUSTER, 'ps': [None]},
                 'task': {'type': 'chief', 'index': 0}}),
     r"cluster\['ps'\]\[0\] is null"),
])
def test_malformed_configs_are_named(tf_config, match):
  with pytest.raises(ValueError, match=match):
    cluster_config.check_tf_config({'TF_CONFIG': tf_config})


@pytest.mark.cli
def test_task_refuses_malformed_tf_config_before_starting(tmp_path):
  bad = json.dumps({'cluster': CLUSTER, 'task': {'type': 'worker',
                                                 'index': 4}})
  result = run_module('trainer.task', f'--job-dir={tmp_path / "job"}',
                      env={'TF_CONFIG': bad}, check=False, timeout=120)
  assert result.returncode == 1
  assert 'index 4 is out of range' in result.stderr
  assert 'Started server' not in result.stderr
  assert not (tmp_path / 'job').exists()


@pytest.mark.fast
def test_a_cluster_task_outside_a_private_network_warns_once(caplog):
  config = {'cluster': CLUSTER, 'task': {'type': 'worker', 'index': 0}}
  with caplog.at_level('WARNING'):
    cluster_config.warn_if_exposed(config, private_network=False)
  assert caplog.text.count('without authentication') == 1
  assert 'worker:0' in caplog.text and 'docs/cluster.md' in caplog.text
  caplog.clear()
  with caplog.at_level('WARNING'):
    cluster_config.warn_if_exposed(config, private_network=True)
    cluster_config.warn_if_exposed({'cluster': {}, 'task': {}},
                                   private_network=False)
  assert 'without authentication' not in caplog.text


@pytest.mark.cli
def test_unshare_refused_says_how_to_get_a_private_network():
  # A stand-in for `unshare` refused by the kernel, as for an unprivileged
  # user without user namespaces.
  refused = [sys.executable, '-c', 'import sys; sys.stderr.write('
             '"unshare: unshare failed: Operation not permitted\\n"); '
             'sys.exit(1)']
  with pytest.raises(private_network.PrivateNetworkError,
                     match='Operation not permitted. Run the launcher as root'):
    private_network.check_unshare_works(refused)


# Runs in a network namespace of its own: it holds a port on loopback and
# starts a chief whose TF_CONFIG address is that port.
_TAKEN_PORT_SCRIPT = '''
import json, os, socket, subprocess, sys
from trainer.cluster import private_network
private_network.bring_up_loopback()
with socket.socket() as taken:
  taken.bind(('127.0.0.1', 0))
  taken.listen()
  address = '127.0.0.1:%d' % taken.getsockname()[1]
  cluster = {'chief': [address],
             'worker': ['127.0.0.1:%d' % private_network.free_port()]}
  # The worker's file of the cluster check (trainer/cluster_rendezvous.py),
  # as a worker that started would write it: the chief compares it and goes
  # on to its server at once, instead of waiting 30 s for the worker.
  folder = os.path.join(sys.argv[1], 'tf_config')
  os.makedirs(folder)
  with open(os.path.join(folder, 'worker-0.json'), 'w') as f:
    json.dump({'task': 'worker:0', 'cluster': cluster}, f)
  task = {'type': 'chief', 'index': 0}
  env = {**os.environ, 'TRAINER_PRIVATE_NETWORK': '1',
         'TF_CONFIG': json.dumps({'cluster': cluster, 'task': task})}
  task = subprocess.run(
      [sys.executable, '-m', 'trainer.task', '--job-dir=' + sys.argv[1],
       '--train-steps=5'], env=env, capture_output=True, text=True,
      timeout=300, stdin=subprocess.DEVNULL)
print(json.dumps({'code': task.returncode, 'stderr': task.stderr,
                  'address': address}))
'''


@pytest.mark.cli
def test_a_taken_port_is_one_line_naming_the_task_and_address(tmp_path):
  command = private_network.unshare_command() + [
      '--', sys.executable, '-c', _TAKEN_PORT_SCRIPT, str(tmp_path / 'job')]
  env = {**os.environ, 'PYTHONPATH': ROOT, 'TF_CPP_MIN_LOG_LEVEL': '3'}
  ran = subprocess.run(command, cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=360, stdin=subprocess.DEVNULL)
  assert ran.returncode == 0, ran.stderr[-3000:]
  task = json.loads(ran.stdout.splitlines()[-1])
  stderr = task['stderr']
  assert task['code'] == 1, stderr[-3000:]
  assert 'Traceback' not in stderr
  assert stderr.strip().splitlines()[-1] == (
      f'task: error: chief:0 could not start its gRPC server on '
      f'{task["address"]} (its address in TF_CONFIG): port '
      f'{task["address"].rsplit(":", 1)[1]} is in use on this machine (the '
      'server listens on every interface), perhaps by a task of an earlier '
      'run that is still alive. Stop that process or give this task a free '
      'port in TF_CONFIG.')
