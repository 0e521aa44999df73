"""`python -m trainer.task` for tests, forked from a preloaded interpreter.

Every process a test starts used to pay for importing TensorFlow first:
about 5 s of one core, more than most of these tests' own work, and about a
third of the whole suite's CPU time. A *server* process imports TensorFlow
once (and nothing of this project: no flags, no session, no thread pool),
then forks one child per request. The child is a real process: its own pid,
exit status, signals, files and session; the test waits on it and signals it
as it would a `subprocess.Popen`. It runs the module exactly as `python -m`
does (`runpy`, `sys.argv`, `sys.path[0]` = the working directory, the
requested environment), on the requested stdin/stdout/stderr.

What differs from a fresh interpreter is only what happens at import time,
which the child skips:

* TensorFlow read `TF_CPP_MIN_LOG_LEVEL` and `TF_ENABLE_ONEDNN_OPTS` when it
  was imported. So there is one server per value of those (as the module's
  `trainer.environment.configure` would set them from the arguments), and
  TensorFlow's import-time notices go to the server's stderr, not the
  child's.
* Modules the server imported are already in `sys.modules`.

Tests of import-time behaviour (`test_imports.py`, `test_quiet.py`,
`test_console.py`) therefore start plain interpreters, as does every test
of a module that does not load TensorFlow (the sweep, the cluster
launcher): only modules in `PRELOADED_MODULES` are forked.

A request may ask for a network namespace of the child's own (what `unshare
--net` gives): the synchronous pair launchers (tests/sync_cluster_pair.py,
tests/sync_fault_cluster.py) run so, and fork their tasks from themselves.

Protocol: the client connects to the server's Unix socket and sends one
JSON request with its stdin, stdout and stderr descriptors (SCM_RIGHTS); the
server forks, answers {"pid": ...}, and later {"returncode": ...} as
`subprocess` reports it (negative for a signal). A client that goes away
before its child ended gets the child killed; the server ends (and kills
what is left) when the process that started it closes the server's stdin.
"""

import atexit
import ctypes
import io
import json
import os
import runpy
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, Optional, Sequence

# Light (no TensorFlow); named `network` beside the `private_network` flag.
from trainer.cluster import private_network as network  # pylint: disable=g-import-not-at-top,wrong-import-position

PIPE, DEVNULL, STDOUT = subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT

# Modules whose run loads TensorFlow: worth a fork.
PRELOADED_MODULES = frozenset(['trainer.task', 'trainer.predict',
                               'trainer.check', 'tests.raise_handled',
                               'tests.sync_cluster_pair',
                               'tests.sync_fault_cluster'])
# Environment variables TensorFlow reads once, at import.
IMPORT_TIME_VARIABLES = ('TF_CPP_MIN_LOG_LEVEL', 'TF_ENABLE_ONEDNN_OPTS',
                         'CUDA_VISIBLE_DEVICES')
_CONFIGURED = frozenset(['trainer.task', 'trainer.predict', 'trainer.check'])
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The server ----------------------------------------------------------------


def _serve(path: str) -> dict:
  """Forks a child per request; returns (in a child only) its request."""
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(64)
  wake_read, wake_write = os.pipe()
  os.set_blocking(wake_write, False)
  signal.set_wakeup_fd(wake_write)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  selector = selectors.DefaultSelector()
  selector.register(listener, selectors.EVENT_READ, 'accept')
  selector.register(wake_read, selectors.EVENT_READ, 'child')
  selector.register(sys.stdin, selectors.EVENT_READ, 'parent')
  children: Dict[int, socket.socket] = {}  # pid -> its client's connection
  while True:
    for key, _ in selector.select():
      if key.data == 'parent':
        _end(children)
      elif key.data == 'child':
        os.read(wake_read, 4096)
        _reap(children, selector)
      elif key.data == 'accept':
        connection, _ = listener.accept()
        connection.settimeout(10)  # A client that stalls mid-request.
        try:
          request = _receive(connection)
        except (OSError, EOFError, ValueError) as error:
          print(f'preloaded: dropped a request: {error!r}', file=sys.stderr,
                flush=True)
          connection.close()
          continue
        connection.settimeout(None)
        pid = os.fork()
        if pid == 0:
          signal.set_wakeup_fd(-1)
          signal.signal(signal.SIGCHLD, signal.SIG_DFL)
          selector.close()
          for open_socket in (listener, connection, *children.values()):
            open_socket.close()
          os.close(wake_read)
          os.close(wake_write)
          return request
        for descriptor in request['fds']:
          os.close(descriptor)
        children[pid] = connection
        selector.register(connection, selectors.EVENT_READ, pid)
        try:
          connection.sendall(json.dumps({'pid': pid}).encode() + b'\n')
        except OSError:
          _kill(pid)  # Its client is gone; _reap forgets it.
      else:  # The client closed its connection before its child ended.
        _kill(key.data)
        _reap(children, selector)
    _reap(children, selector)


def _receive(connection: socket.socket) -> dict:
  data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
  if len(fds) != 3:
    for descriptor in fds:
      os.close(descriptor)
    raise ValueError(f'a request with {len(fds)} descriptors, not 3')
  while not data.endswith(b'\n'):
    more = connection.recv(1 << 20)
    if not more:
      raise EOFError('the client went away mid-request')
    data += more
  request = json.loads(data)
  request['fds'] = fds
  return request


def _reap(children: Dict[int, socket.socket], selector) -> None:
  while children:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    connection = children.pop(pid, None)
    if connection is None:
      continue
    selector.unregister(connection)
    code = os.waitstatus_to_exitcode(status)
    try:
      connection.sendall(json.dumps({'returncode': code}).encode() + b'\n')
    except OSError:
      pass  # The client is gone; nobody waits for this status.
    connection.close()


def _kill(pid: int) -> None:
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _end(children: Dict[int, socket.socket]) -> None:
  for pid in children:
    _kill(pid)
  os._exit(0)  # pylint: disable=protected-access


def _become(request: dict) -> None:
  """Turns this forked child into `python -m module` as requested."""
  network.die_with_parent()  # Not left running if the server dies.
  if os.getppid() != request['server']:
    os._exit(1)  # pylint: disable=protected-access  # It already died.
  if request['new_session']:
    os.setsid()
  for target, descriptor in enumerate(request['fds']):
    os.dup2(descriptor, target)
  for descriptor in set(request['fds']):
    if descriptor > 2:
      os.close(descriptor)
  if request['private_network']:
    _enter_private_network()  # After the dup2s: a failure is on its stderr.
  os.chdir(request['cwd'])
  os.environ.clear()
  os.environ.update(request['env'])
  extra = [p for p in request['env'].get('PYTHONPATH', '').split(os.pathsep)
           if p and p not in sys.path]
  sys.path[:1] = [request['cwd'], *extra]
  unbuffered = bool(request['env'].get('PYTHONUNBUFFERED'))
  for name, descriptor in (('stdout', 1), ('stderr', 2)):
    getattr(sys, name).flush()
    stream = _text_stream(descriptor, unbuffered or name == 'stderr')
    setattr(sys, name, stream)
    setattr(sys, f'__{name}__', stream)
  sys.stdin = sys.__stdin__ = io.TextIOWrapper(
      io.BufferedReader(io.FileIO(0, 'r', closefd=False)))
  import numpy  # pylint: disable=g-import-not-at-top
  numpy.random.seed()  # As a fresh process: not the server's state.
  sys.argv = ['-m', *request['args']]


def _enter_private_network() -> None:
  """A network namespace of this process's own, as `unshare --net` gives.

  Unprivileged, a user namespace maps this user to root in it first, as
  `unshare --user --map-root-user` does (private_network.unshare_command).
  The forked child has one thread, as a new user namespace requires.
  """
  uid, gid = os.geteuid(), os.getegid()
  flags = _CLONE_NEWNET if uid == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.unshare(flags) != 0:
    error = ctypes.get_errno()
    raise OSError(error, f'unshare: {os.strerror(error)}')
  if uid != 0:
    for name, text in (('setgroups', 'deny'), ('uid_map', f'0 {uid} 1'),
                       ('gid_map', f'0 {gid} 1')):
      with open(f'/proc/self/{name}', 'w') as f:
        f.write(text)


def _text_stream(descriptor: int, write_through: bool) -> io.TextIOWrapper:
  raw = io.FileIO(descriptor, 'w', closefd=False)
  binary = raw if write_through else io.BufferedWriter(raw)
  return io.TextIOWrapper(binary, encoding='utf-8', errors='backslashreplace'
                          if descriptor == 2 else 'strict',
                          line_buffering=raw.isatty(),
                          write_through=write_through)


def _server_main(path: str) -> None:
  # pylint: disable=g-import-not-at-top,unused-import
  import numpy
  import tensorflow
  import tensorflow_estimator
  server = os.getpid()
  request = _serve(path)
  request['server'] = server
  _become(request)
  runpy.run_module(request['module'], run_name='__main__', alter_sys=True)


# The client -----------------------------------------------------------------


class _Server:
  """One server process and its socket."""

  def __init__(self, key: tuple):
    self.directory = tempfile.mkdtemp(prefix='preloaded-')
    self.path = os.path.join(self.directory, 'socket')
    # No PYTHONPATH: each child's sys.path is built from its own request.
    env = {k: v for k, v in os.environ.items()
           if k not in IMPORT_TIME_VARIABLES and k != 'PYTHONPATH'}
    env.update({k: v for k, v in zip(IMPORT_TIME_VARIABLES, key)
                if v is not None})
    self.log = os.path.join(self.directory, 'server.log')
    with open(self.log, 'w') as log:
      self.process = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), self.path], env=env,
          cwd=_ROOT, stdin=subprocess.PIPE, stdout=log, stderr=log)

  def connect(self) -> socket.socket:
    deadline = time.monotonic() + 300
    while True:
      if self.process.poll() is not None:
        with open(self.log) as log:
          raise RuntimeError(f'the preloaded server exited '
                             f'({self.process.returncode}):\n'
                             f'{log.read()[-3000:]}')
      try:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.path)
        return connection
      except (FileNotFoundError, ConnectionRefusedError):
        connection.close()
        if time.monotonic() > deadline:
          raise
        time.sleep(0.1)

  def stop(self) -> None:
    try:
      self.process.stdin.close()
      self.process.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
      self.process.kill()
      self.process.wait()
    finally:
      shutil.rmtree(self.directory, ignore_errors=True)


_servers: Dict[tuple, _Server] = {}
_servers_lock = threading.Lock()


_CREATOR = os.getpid()


@atexit.register
def _stop_servers() -> None:
  if os.getpid() != _CREATOR:
    return  # A fork of the process that started them.
  for server in _servers.values():
    server.stop()
  _servers.clear()


def import_time_key(module: str, args: Sequence[str], env: dict) -> tuple:
  """The values of `IMPORT_TIME_VARIABLES` the module's run imports with.

  The entry points set some of them from their arguments before importing
  TensorFlow (`trainer.environment.configure`).
  """
  effective = dict(env)
  if module in _CONFIGURED:
    from trainer import environment  # pylint: disable=g-import-not-at-top
    environment.configure([module, *args], environ=effective)
  return tuple(effective.get(name) for name in IMPORT_TIME_VARIABLES)


def _server_for(module: str, args: Sequence[str], env: dict) -> _Server:
  key = import_time_key(module, args, env)
  with _servers_lock:
    if key in _servers and _servers[key].process.poll() is not None:
      _servers.pop(key).stop()  # Died: the next request starts another.
    if key not in _servers:
      _servers[key] = _Server(key)
    return _servers[key]


class Process:
  """A forked `python -m module`, used as a `subprocess.Popen`."""

  def __init__(self, module: str, args: Sequence[str], *, cwd: str,
               env: dict, stdin=DEVNULL, stdout=None, stderr=None,
               text: bool = False, start_new_session: bool = False,
               private_network: bool = False):
    self.args = [sys.executable, '-m', module, *args]
    self.returncode: Optional[int] = None
    self.stdout = self.stderr = None
    self._text = text
    sent, to_close = [], []

    def descriptor(spec, default, mode):
      if spec is None:
        return default
      if spec == DEVNULL:
        fd = os.open(os.devnull, mode)
        to_close.append(fd)
        return fd
      if spec == PIPE:
        read, write = os.pipe()
        to_close.append(write if mode == os.O_WRONLY else read)
        return (read, write)
      return spec if isinstance(spec, int) else spec.fileno()

    stdin_fd = descriptor(stdin, 0, os.O_RDONLY)
    if isinstance(stdin_fd, tuple):
      raise ValueError('stdin=PIPE is not supported')
    out = descriptor(stdout, 1, os.O_WRONLY)
    if isinstance(out, tuple):
      self.stdout = self._reader(out[0])
      out = out[1]
    if stderr == STDOUT:
      err = out
    else:
      err = descriptor(stderr, 2, os.O_WRONLY)
      if isinstance(err, tuple):
        self.stderr = self._reader(err[0])
        err = err[1]
    sent = [stdin_fd, out, err]
    try:
      request = json.dumps({
          'module': module, 'args': [os.fspath(a) for a in args],
          'cwd': os.fspath(cwd),
          'env': {k: os.fspath(v) for k, v in env.items()},
          'new_session': start_new_session,
          'private_network': private_network}).encode() + b'\n'
      server = _server_for(module, args, env)
      self._connection = server.connect()
      socket.send_fds(self._connection, [request], sent)
    finally:
      for fd in to_close:
        os.close(fd)
    self._buffer = b''
    reply = self._reply(120)
    if reply is None:
      raise RuntimeError(f'the preloaded server did not start {self.args}; '
                         f'see {server.log}')
    self.pid = reply['pid']

  def _reader(self, fd: int):
    return open(fd, 'rb', closefd=True)

  def _reply(self, timeout: Optional[float]) -> Optional[dict]:
    """The server's next message; None if `timeout` seconds passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while b'\n' not in self._buffer:
      left = None if deadline is None else max(0, deadline - time.monotonic())
      if not select.select([self._connection], [], [], left)[0]:
        return None
      data = self._connection.recv(4096)
      if not data:
        raise RuntimeError(f'the preloaded server lost process {self.args}')
      self._buffer += data
    line, _, self._buffer = self._buffer.partition(b'\n')
    return json.loads(line)

  def poll(self) -> Optional[int]:
    if self.returncode is None:
      self._finish(self._reply(0))
    return self.returncode

  def wait(self, timeout: Optional[float] = None) -> int:
    if self.returncode is None:
      self._finish(self._reply(timeout))
      if self.returncode is None:
        raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def _finish(self, reply: Optional[dict]) -> None:
    if reply is not None:
      self.returncode = reply['returncode']
      self._connection.close()

  def communicate(self, timeout: Optional[float] = None):
    """Reads stdout and stderr to their end, then waits (as Popen does)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    streams = [s for s in (self.stdout, self.stderr) if s is not None]
    chunks = {id(s): [] for s in streams}
    selector = selectors.DefaultSelector()
    for stream in streams:
      selector.register(stream.fileno(), selectors.EVENT_READ, stream)
    while selector.get_map():
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left <= 0:
        raise subprocess.TimeoutExpired(self.args, timeout)
      for key, _ in selector.select(left):
        data = os.read(key.fd, 1 << 16)
        if data:
          chunks[id(key.data)].append(data)
        else:
          selector.unregister(key.fd)
    selector.close()
    results = []
    for stream in (self.stdout, self.stderr):
      if stream is None:
        results.append(None)
        continue
      data = b''.join(chunks[id(stream)])
      stream.close()
      if self._text:  # Universal newlines, as subprocess's text mode.
        data = io.TextIOWrapper(io.BytesIO(data), encoding='utf-8',
                                errors='replace').read()
      results.append(data)
    left = None if deadline is None else max(0, deadline - time.monotonic())
    self.wait(left)
    return tuple(results)

  def send_signal(self, signum: int) -> None:
    try:
      running = self.poll() is None
    except RuntimeError:  # The server is gone; the child may not be yet.
      running = True
    if running:
      try:
        os.kill(self.pid, signum)
      except ProcessLookupError:
        pass

  def terminate(self) -> None:
    self.send_signal(signal.SIGTERM)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    for stream in (self.stdout, self.stderr):
      if stream is not None:
        stream.close()
    self.wait()


def start(module: str, args: Sequence[str], *, cwd: str, env: dict,
          private_network: bool = False,
          **kwargs) -> 'Process | subprocess.Popen':
  """`python -m module args`: forked if the module loads TensorFlow.

  With `private_network`, the process runs in a network namespace of its
  own, as under `unshare --net` (its loopback is down until it brings it
  up: private_network.bring_up_loopback).
  """
  args = [str(a) for a in args]
  if module in PRELOADED_MODULES:
    return Process(module, args, cwd=cwd, env=env,
                   private_network=private_network, **kwargs)
  prefix = []
  if private_network:
    prefix = network.unshare_command() + ['--']
  return subprocess.Popen([*prefix, sys.executable, '-m', module, *args],
                          cwd=cwd, env=env, **kwargs)


def run(module: str, args: Sequence[str], *, cwd: str, env: dict,
        timeout: Optional[float] = None, stdin=DEVNULL,
        private_network: bool = False) -> subprocess.CompletedProcess:
  """As `subprocess.run(..., capture_output=True, text=True)`."""
  process = start(module, args, cwd=cwd, env=env, stdin=stdin, stdout=PIPE,
                  stderr=PIPE, text=True, private_network=private_network)
  try:
    stdout, stderr = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
    raise
  return subprocess.CompletedProcess(process.args, process.returncode,
                                     stdout, stderr)


if __name__ == '__main__':
  _server_main(sys.argv[1])
