"""The tasks of a cluster compare their TF_CONFIG clusters before any server
starts.

Each task's TensorFlow server trusts its own TF_CONFIG. When the tasks were
given different clusters -- another number of workers on one machine, the
leader called `master` in one and `chief` in another -- the distributed
runtime fails late and unreadably: a long traceback about collective groups,
or a worker that crashes in native code. The tasks already share the job
dir, so each writes its cluster there (`<model dir>/tf_config/<task>.json`)
and reads the others' before its server starts, and a difference ends every
task in one line naming both clusters.

A file that lists the same cluster is enough, however old (a task
restarted alone finds the running tasks' files and goes on at once). One
that lists another cluster fails the task only while it is fresh: a task
rewrites its own every second while it waits and for `wait_secs` after
(for the tasks starting later), and a file left by an earlier start of the
job (older than `FRESH_SECS` by the file system's clock) is not held
against this one -- a job restarted with a corrected cluster must not fail
on the files of the wrong one. The wait is bounded: a task that does not show up in time (not started yet, or
a job dir the machines do not share) is not compared, and the collectives'
own start-up checks take over.
"""

import atexit
import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from absl import logging
import tensorflow as tf

FOLDER = 'tf_config'
FRESH_SECS = 10.0
_BEAT_SECS = 1.0
_POLL_SECS = 0.2
# How long the exit waits for a write in progress (a remote job dir may
# stall): a bound, so that a hung file system cannot hold the task forever.
_STOP_SECS = 60.0


def _name(task_type: str, index: int) -> str:
  return f'{task_type}:{index}'


def _members(cluster: Dict[str, List[str]]) -> List[str]:
  return [_name(job, i) for job, addresses in sorted(cluster.items())
          for i in range(len(addresses))]


def _path(folder: str, member: str) -> str:
  # The leader has one file under either name: a task that calls it
  # `master` must find the one that calls itself `chief`.
  member = member.replace('master:', 'chief:')
  return os.path.join(folder, member.replace(':', '-') + '.json')


def _describe(cluster: Dict[str, List[str]]) -> str:
  return ', '.join(f'{job}={addresses}' for job, addresses
                   in sorted(cluster.items()))


class _Files:
  """This task's file and the reading of the others', in one folder."""

  def __init__(self, folder: str, me: str, cluster: Dict[str, List[str]]):
    self._folder, self._me = folder, me
    self._text = json.dumps({'task': me, 'cluster': cluster},
                            sort_keys=True)
    tf.io.gfile.makedirs(folder)

  def beat(self) -> float:
    """(Re)writes this task's file whole; returns its modification time."""
    path = _path(self._folder, self._me)
    partial = f'{path}.{os.getpid()}.tmp'
    with tf.io.gfile.GFile(partial, 'w') as f:
      f.write(self._text)
    tf.io.gfile.rename(partial, path, overwrite=True)
    return self.mtime(self._me)

  def mtime(self, member: str) -> Optional[float]:
    try:
      return tf.io.gfile.stat(_path(self._folder, member)).mtime_nsec / 1e9
    except tf.errors.NotFoundError:
      return None

  def read(self, member: str) -> Optional[Tuple[Dict[str, Any], float]]:
    """The other task's record (its name for itself and its cluster) and
    when it was written; None while it is missing or being replaced."""
    # The time is taken before and after the reading: a file replaced in
    # between would pair an earlier start's cluster with this start's time.
    written = self.mtime(member)
    try:
      with tf.io.gfile.GFile(_path(self._folder, member)) as f:
        record = json.loads(f.read())
    except (tf.errors.NotFoundError, ValueError):
      return None  # Gone or being replaced: read again at the next poll.
    if written is None or self.mtime(member) != written:
      return None
    return (record, written) if {'task', 'cluster'} <= set(record) else None


def check_same_cluster(model_dir: str, tf_config: Optional[Dict[str, Any]],
                       wait_secs: float = 30.0,
                       sleep: Callable[[float], None] = time.sleep) -> None:
  """Fails when another task of the cluster was given another cluster.

  Args:
    model_dir: The job's model dir, which the tasks share.
    tf_config: This task's checked TF_CONFIG (None or without a cluster:
      nothing to compare).
    wait_secs: How long to wait for the other tasks' files.
    sleep: Waits between polls (tests may pass a faster one).

  Raises:
    ValueError: A task's cluster differs from this task's; the message
      names both tasks and both clusters.
  """
  cluster = (tf_config or {}).get('cluster') or {}
  task = (tf_config or {}).get('task') or {}
  if not cluster or task.get('type') in (None, 'evaluator'):
    return
  me = _name(task['type'], task.get('index', 0))
  files = _Files(os.path.join(model_dir, FOLDER), me, cluster)
  pending = [m for m in _members(cluster) if m != me]
  deadline = time.monotonic() + wait_secs
  last_beat, mine = time.monotonic(), files.beat()
  while pending:
    for member in list(pending):
      found = files.read(member)
      if found is None:
        continue
      theirs, written = found
      if theirs['cluster'] != cluster:
        if written < mine - FRESH_SECS:
          continue  # An earlier start's: wait for this start's file.
        raise ValueError(
            f'TF_CONFIG differs between the tasks: {theirs["task"]} has the '
            f'cluster {_describe(theirs["cluster"])}, {me} has '
            f'{_describe(cluster)}. Give every task the same cluster (the '
            'same jobs, the leader named alike, the same addresses in the '
            'same order) and start them all again.')
      pending.remove(member)
    if not pending:
      break
    if time.monotonic() > deadline:
      logging.warning(
          'TF_CONFIG not compared with %s: no file of theirs appeared in '
          '%s within %.0f s (not started yet, or a job dir the machines do '
          'not share).', ', '.join(pending), os.path.join(model_dir, FOLDER),
          wait_secs)
      return
    sleep(_POLL_SECS)
    if time.monotonic() - last_beat >= _BEAT_SECS:
      last_beat = time.monotonic()
      mine = files.beat()
  _keep_beating(files, wait_secs)


def leader_wrote(model_dir: str, cluster: Dict[str, List[str]]) -> bool:
  """Whether this job's leader left its file in `model_dir`, listing `cluster`.

  A task whose collectives reached a leader that never wrote here was
  pointed at another job's chief (or given another --job-dir).

  Args:
    model_dir: This task's model dir.
    cluster: This task's TF_CONFIG cluster.

  Returns:
    True when the chief's (or master's) file is there with `cluster`.
  """
  folder, leader = os.path.join(model_dir, FOLDER), _name('chief', 0)
  if not tf.io.gfile.exists(_path(folder, leader)):
    return False  # Before _Files, which would create the folder.
  found = _Files(folder, 'reader', cluster).read(leader)
  return found is not None and found[0]['cluster'] == cluster


def _keep_beating(files: _Files, secs: float) -> None:
  """Keeps this task's file fresh for `secs` more, for the tasks that
  start later and compare with it, without holding this task up.

  The thread is a daemon, so that the task need not wait `secs` to end,
  but it is stopped and joined when the interpreter exits: a daemon thread
  still inside a TensorFlow file call when the interpreter finalizes is
  unwound through TensorFlow's C++ code, which aborts the process
  (`FATAL: exception not rethrown`, SIGABRT) after it finished its work.
  """
  stop = threading.Event()

  def beat():
    end = time.monotonic() + secs
    while not stop.is_set() and time.monotonic() < end:
      try:
        files.beat()
      except tf.errors.OpError as e:  # The job dir went away: stop quietly.
        logging.info('TF_CONFIG file no longer kept fresh: %s', e)
        return
      stop.wait(_BEAT_SECS)

  thread = threading.Thread(target=beat, name='tf-config-beat', daemon=True)

  def stop_and_join():
    stop.set()
    thread.join(_STOP_SECS)
    if thread.is_alive():  # A file system that stopped answering.
      logging.warning('The TF_CONFIG file\'s last write still runs after '
                      '%.0f s; exiting anyway.', _STOP_SECS)

  atexit.register(stop_and_join)
  thread.start()
