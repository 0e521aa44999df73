"""tests/preloaded.py: a forked `python -m` is the process a fresh one is."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

import preloaded
from trainer.cluster import private_network

_PROBE = '''
import json, os, sys, time
print(json.dumps({'argv': sys.argv[1:], 'path0': sys.path[0],
                  'cwd': os.getcwd(), 'name': __name__,
                  'probe': os.environ.get('PROBE'),
                  'in_path': os.environ['EXTRA'] in sys.path}))
print('to stderr', file=sys.stderr)
if sys.argv[1:] == ['wait']:
  time.sleep(600)
sys.exit(int(sys.argv[1]) if sys.argv[1:] != ['wait'] else 0)
'''


@pytest.fixture
def probe(tmp_path):
  (tmp_path / 'probe_module.py').write_text(_PROBE)
  extra = tmp_path / 'extra'
  extra.mkdir()
  env = {**os.environ, 'PROBE': 'seen', 'EXTRA': str(extra),
         'PYTHONPATH': os.pathsep.join([str(tmp_path), str(extra)])}
  env.pop('PYTHONUNBUFFERED', None)
  return env, str(tmp_path)


@pytest.mark.cli
def test_a_forked_module_sees_what_python_m_gives_it(probe):
  env, cwd = probe
  fresh = subprocess.run([sys.executable, '-m', 'probe_module', '3'],
                         cwd=cwd, env=env, capture_output=True, text=True)
  forked = preloaded.Process('probe_module', ['3'], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
  out, err = forked.communicate(timeout=120)
  assert forked.returncode == fresh.returncode == 3
  assert json.loads(out) == json.loads(fresh.stdout) == {
      'argv': ['3'], 'path0': cwd, 'cwd': cwd, 'name': '__main__',
      'probe': 'seen', 'in_path': True}
  assert err == 'to stderr\n' and fresh.stderr.endswith('to stderr\n')
  assert forked.pid != os.getpid()


_NET_PROBE = '''
import json, os, socket
print(json.dumps({'namespace': os.readlink('/proc/self/ns/net'),
                  'interfaces': [name for _, name in socket.if_nameindex()]}))
'''


@pytest.mark.cli
def test_a_private_network_is_what_unshare_net_gives(probe):
  # The synchronous pair launchers run so (tests/test_task_sync.py).
  env, cwd = probe
  (pathlib.Path(cwd) / 'net_probe.py').write_text(_NET_PROBE)
  private_network.check_unshare_works()
  fresh = subprocess.run(
      private_network.unshare_command() + [
          '--', sys.executable, '-m', 'net_probe'],
      cwd=cwd, env=env, capture_output=True, text=True, check=True)
  forked = preloaded.Process('net_probe', [], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, private_network=True)
  out, _ = forked.communicate(timeout=120)
  assert forked.returncode == 0
  ours = os.readlink('/proc/self/ns/net')
  seen = [json.loads(out), json.loads(fresh.stdout)]
  assert [s['interfaces'] for s in seen] == [['lo'], ['lo']]
  assert len({ours, *(s['namespace'] for s in seen)}) == 3


@pytest.mark.cli
def test_a_forked_module_is_signalled_and_waited_as_popen(probe):
  env, cwd = probe
  process = preloaded.Process('probe_module', ['wait'], cwd=cwd, env=env,
                              stdout=subprocess.DEVNULL)
  assert process.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    process.wait(timeout=0.2)
  process.send_signal(signal.SIGTERM)
  assert process.wait(timeout=120) == -signal.SIGTERM
  assert process.poll() == -signal.SIGTERM


@pytest.mark.fast
@pytest.mark.parametrize('args,expected', [
    (['--cpu-towers=2'], ('2', '0', None)),
    (['--cpu-towers=1'], ('2', None, None)),
    (['--cpu-towers=2', '--mixed-precision=bfloat16'], ('2', '1', None)),
])
def test_servers_differ_by_what_tensorflow_reads_at_import(args, expected):
  env = {'TF_CPP_MIN_LOG_LEVEL': '2'}
  assert preloaded.import_time_key('trainer.task', args, env) == expected
  assert env == {'TF_CPP_MIN_LOG_LEVEL': '2'}  # The caller's is untouched.


@pytest.mark.cli
def test_a_broken_request_leaves_the_server_serving(probe):
  env, cwd = probe
  server = preloaded._server_for('probe_module', [], env)  # pylint: disable=protected-access
  broken = server.connect()
  broken.sendall(b'no descriptors, no json\n')
  broken.close()
  process = preloaded.Process('probe_module', ['3'], cwd=pathlib.Path(cwd),
                              env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
  assert process.wait(timeout=120) == 3
  with open(server.log) as log:
    assert 'dropped a request' in log.read()
