"""Running a process tree in a network namespace of its own.

TensorFlow's gRPC servers listen on every interface (`*:port`) whatever
address the cluster spec gives them. The local cluster launcher therefore
re-executes itself in a fresh network namespace, which has only a loopback
interface: its servers are reachable from this machine's own processes in
that namespace and from nowhere else, and they vanish with it.
"""

import ctypes
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from typing import List, Sequence

_MARKER = 'TRAINER_PRIVATE_NETWORK'
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> None:
  """Asks the kernel to send `signum` to this process when its parent dies.

  For `preexec_fn`: children of a launcher that is killed outright (SIGKILL
  gives it no chance to clean up) then die too instead of lingering.
  """
  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl(_PR_SET_PDEATHSIG, signum)


class PrivateNetworkError(RuntimeError):
  """A private network namespace could not be made."""


def inside() -> bool:
  """True in a process started by `reexec_inside`."""
  return os.environ.get(_MARKER) == '1'


def unshare_command() -> List[str]:
  """The `unshare` invocation that gives a new network namespace.

  Raises:
    PrivateNetworkError: util-linux's unshare is not installed.
  """
  unshare = shutil.which('unshare')
  if unshare is None:
    raise PrivateNetworkError(
        'the `unshare` command (util-linux) is not installed.')
  if os.geteuid() == 0:
    return [unshare, '--net']
  # Unprivileged: a user namespace maps us to root inside, which may then
  # create the network namespace.
  return [unshare, '--user', '--map-root-user', '--net']


def check_unshare_works(command: Sequence[str] = ()) -> None:
  """Tries the namespace once, so that a refusal says how to get one.

  Args:
    command: The unshare invocation to try; default `unshare_command()`.

  Raises:
    PrivateNetworkError: unshare failed (e.g. "Operation not permitted").
  """
  command = list(command) or unshare_command()
  try:
    probe = subprocess.run(command + ['--', 'true'], capture_output=True,
                           text=True, timeout=30, stdin=subprocess.DEVNULL)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise PrivateNetworkError(f'running {command[0]} failed: {e}') from e
  if probe.returncode != 0:
    said = probe.stderr.strip().splitlines()[-1:] or ['no message']
    raise PrivateNetworkError(
        f'`{" ".join(command)}` failed: {said[0]}. Run the launcher as root '
        '(e.g. in a container), or allow unprivileged user namespaces '
        '(sysctl kernel.unprivileged_userns_clone=1 and '
        'user.max_user_namespaces > 0), or use a real cluster on a private '
        'network (see docs/cluster.md)')


def reexec_inside(argv: Sequence[str]) -> int:
  """Runs `python -m <this module's caller> argv` in a new namespace.

  Args:
    argv: The arguments after the interpreter, e.g. ['-m', 'trainer.cluster',
      '--job-dir=...'].

  Returns:
    The child's exit code.

  Raises:
    PrivateNetworkError: the namespace could not be created.
  """
  check_unshare_works()
  command = unshare_command() + ['--', sys.executable, *argv]
  env = {**os.environ, _MARKER: '1'}
  try:
    child = subprocess.Popen(
        command, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
  except OSError as e:
    raise PrivateNetworkError(f'running {command[0]} failed: {e}') from e

  def forward(signum, frame):
    del frame
    child.send_signal(signum)

  # The launcher inside does the cleaning up; pass it our signals.
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, forward)
  return child.wait()


def bring_up_loopback() -> None:
  """Sets `lo` up; a new network namespace starts with it down.

  Raises:
    PrivateNetworkError: the interface flags could not be changed.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack('16sH', b'lo', 0)
    try:
      flags = struct.unpack('16sH', fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
      if not flags & _IFF_UP:
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack('16sH', b'lo',
                                                  flags | _IFF_UP))
    except OSError as e:
      raise PrivateNetworkError(f'cannot bring up loopback: {e}') from e


def free_port() -> int:
  """A TCP port free on 127.0.0.1 right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def interfaces() -> List[str]:
  """Names of this namespace's network interfaces."""
  return [name for _, name in socket.if_nameindex()]
