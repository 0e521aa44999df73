"""Checking TF_CONFIG before any server starts.

RunConfig accepts some broken cluster descriptions and fails later, inside
the distributed runtime, with messages about gRPC channels. The task calls
`check_tf_config` first, so a typo in a job manifest fails at once, saying
what is wrong.
"""

import json
import os
from typing import Any, Dict, Optional

from absl import logging

TASK_TYPES = ('chief', 'master', 'worker', 'ps', 'evaluator')


def _fail(message: str) -> None:
  raise ValueError(f'TF_CONFIG: {message}')


def load_tf_config(environ=None) -> Optional[Dict[str, Any]]:
  """TF_CONFIG as a dict, or None when it is unset or empty.

  Raises:
    ValueError: TF_CONFIG is not a JSON object.
  """
  environ = os.environ if environ is None else environ
  raw = environ.get('TF_CONFIG', '').strip()
  if not raw:
    return None
  try:
    config = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f'TF_CONFIG is not valid JSON ({e}): {raw[:200]!r}') from e
  if not isinstance(config, dict):
    _fail(f'must be a JSON object, got {raw[:200]!r}')
  return config


def check_tf_config(environ=None) -> Optional[Dict[str, Any]]:
  """Validates the cluster and task of TF_CONFIG.

  Returns:
    The parsed TF_CONFIG, or None when unset.

  Raises:
    ValueError: bad JSON, an unknown task type, an index out of range, a
      cluster with workers or ps but no chief/master, or both chief and
      master.
  """
  config = load_tf_config(environ)
  if config is None:
    return None
  cluster = config.get('cluster') or {}
  task = config.get('task') or {}
  if not isinstance(cluster, dict) or not isinstance(task, dict):
    _fail('"cluster" and "task" must be JSON objects.')
  for job, addresses in cluster.items():
    if job not in TASK_TYPES or job == 'evaluator':
      _fail(f'unknown job {job!r} in "cluster"; use chief (or master), '
            'worker and ps (the evaluator is not part of the cluster).')
    if not isinstance(addresses, list) or not addresses:
      _fail(f'cluster[{job!r}] must be a non-empty list of host:port.')
    for i, address in enumerate(addresses):
      if not isinstance(address, str) or ':' not in address:
        _fail(f'cluster[{job!r}][{i}] is {json.dumps(address)}; each address '
              'must be a "host:port" string.')
  _check_leader(cluster)
  _check_task(cluster, task)
  return config


def _check_leader(cluster: Dict[str, Any]) -> None:
  if 'chief' in cluster and 'master' in cluster:
    _fail('the cluster has both "chief" and "master"; they are two names '
          'for the same task: keep one.')
  leader = 'chief' if 'chief' in cluster else 'master'
  if cluster and leader not in cluster and (
      'worker' in cluster or 'ps' in cluster):
    _fail('the cluster has no "chief" (or "master") task; add one: it '
          'initialises the variables and writes the checkpoints.')
  if leader in cluster and len(cluster[leader]) != 1:
    _fail(f'cluster[{leader!r}] must list exactly one address, got '
          f'{len(cluster[leader])}.')


def _check_task(cluster: Dict[str, Any], task: Dict[str, Any]) -> None:
  task_type = task.get('type')
  if task_type is None:
    if cluster:
      _fail('"task" needs a "type" (chief, worker, ps or evaluator) when '
            'a cluster is given.')
    return
  if task_type not in TASK_TYPES:
    _fail(f'unknown task type {task_type!r}; use one of {TASK_TYPES}.')
  index = task.get('index', 0)
  if isinstance(index, bool) or not isinstance(index, int) or index < 0:
    _fail(f'task index must be an int >= 0, got {index!r}.')
  if task_type == 'evaluator':
    if index != 0:
      _fail(f'there is one evaluator; its index must be 0, got {index}.')
    return
  if task_type not in cluster:
    _fail(f'the task is a {task_type!r} but the cluster has no '
          f'{task_type!r} job: {sorted(cluster)}.')
  if index >= len(cluster[task_type]):
    _fail(f'task index {index} is out of range: cluster[{task_type!r}] has '
          f'{len(cluster[task_type])} address(es).')


def warn_if_exposed(config: Optional[Dict[str, Any]],
                    private_network: bool) -> None:
  """Warns once that a cluster task serves unauthenticated gRPC.

  With a cluster in TF_CONFIG, TensorFlow starts a gRPC server on the task's
  port, listening on every interface, with no authentication: whoever can
  reach it can run graphs in the process. `python -m trainer.cluster` runs
  its tasks in a private network namespace; a hand-run task is not.

  Args:
    config: The parsed TF_CONFIG, or None.
    private_network: Whether this process runs in such a private network.
  """
  cluster = (config or {}).get('cluster') or {}
  if not cluster or private_network:
    return
  task = (config.get('task') or {})
  logging.warning(
      'TF_CONFIG describes a cluster, so this task (%s:%s) starts '
      'TensorFlow\'s gRPC server: it listens on all network interfaces, '
      'without authentication, and anyone who can reach its port can run '
      'code in this process. Run cluster tasks only on a private network (a '
      'VPC without public ingress, a Kubernetes NetworkPolicy, or python -m '
      'trainer.cluster locally); see docs/cluster.md.',
      task.get('type'), task.get('index', 0))


def server_start_failure(message: str,
                         config: Optional[Dict[str, Any]]) -> Optional[str]:
  """Explains TensorFlow's "Could not start gRPC server" in one line.

  TensorFlow raises it with no address or task when the task's port cannot
  be bound, mostly because another process (often a task of an earlier run
  still alive) holds it.

  Args:
    message: The TensorFlow error's message.
    config: The checked TF_CONFIG, or None.

  Returns:
    The explanation, or None when the message is another error.
  """
  task = (config or {}).get('task') or {}
  addresses = ((config or {}).get('cluster') or {}).get(task.get('type'))
  if 'Could not start gRPC server' not in message or not addresses:
    return None
  index = task.get('index', 0)
  address = addresses[index]
  port = address.rsplit(':', 1)[-1]
  return (f'{task["type"]}:{index} could not start its gRPC server on '
          f'{address} (its address in TF_CONFIG): port {port} is in use on '
          'this machine (the server listens on every interface), perhaps by '
          'a task of an earlier run that is still alive. Stop that process '
          'or give this task a free port in TF_CONFIG.')


def single_machine(config: Optional[Dict[str, Any]],
                   environ=None) -> Optional[Dict[str, Any]]:
  """TF_CONFIG without its cluster when the cluster is this task alone.

  Vertex AI gives a single-replica job a TF_CONFIG with one `chief` and
  nothing else. As a cluster, that task would train and never evaluate,
  export or report the tuning metric (the evaluator's jobs); as what it is,
  one machine, it does all of them. Writes the result back to TF_CONFIG,
  which RunConfig reads, keeping the trial and job fields.

  Args:
    config: The checked TF_CONFIG, or None.
    environ: The environment to update; os.environ by default.

  Returns:
    The TF_CONFIG to run with.
  """
  environ = os.environ if environ is None else environ
  cluster = (config or {}).get('cluster') or {}
  task = (config or {}).get('task') or {}
  alone = (len(cluster) == 1 and task.get('type') in cluster and
           len(cluster[task['type']]) == 1 and
           task['type'] in ('chief', 'master') and
           not _evaluator_pool(environ))
  if not alone:
    return config
  logging.info('TF_CONFIG names a cluster of this %s alone: running as one '
               'machine (training, evaluation, export).', task['type'])
  local = {k: v for k, v in config.items() if k not in ('cluster', 'task')}
  if 'trial' in task:
    local['task'] = {'trial': task['trial']}
  environ['TF_CONFIG'] = json.dumps(local)
  return local


def _evaluator_pool(environ) -> bool:
  """Whether Vertex AI's CLUSTER_SPEC lists an evaluator (worker pool 3).

  TF_CONFIG never names the evaluator: a chief alone in it may still have
  one, which then evaluates, exports and reports.
  """
  try:
    spec = json.loads(environ.get('CLUSTER_SPEC', '') or 'null')
  except json.JSONDecodeError:
    return False
  cluster = spec.get('cluster') if isinstance(spec, dict) else None
  return isinstance(cluster, dict) and bool(cluster.get('workerpool3'))


# Vertex AI's worker pools, in CLUSTER_SPEC's names, as TF_CONFIG task types.
_POOLS = {'workerpool0': 'chief', 'workerpool1': 'worker',
          'workerpool2': 'ps', 'workerpool3': 'evaluator'}


def adopt_cluster_spec(environ=None) -> None:
  """Writes TF_CONFIG from Vertex AI's CLUSTER_SPEC when TF_CONFIG is unset.

  Vertex sets CLUSTER_SPEC for every custom job, TF_CONFIG only for
  TensorFlow ones (e.g. not for custom containers it does not recognise).
  Pool 0 is the chief, 1 the workers, 2 the parameter servers, 3 the
  evaluator (which TF_CONFIG's cluster leaves out).

  Raises:
    ValueError: CLUSTER_SPEC is not valid JSON or names an unknown pool.
  """
  environ = os.environ if environ is None else environ
  raw = environ.get('CLUSTER_SPEC', '').strip()
  if not raw or environ.get('TF_CONFIG', '').strip():
    return
  try:
    spec = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f'CLUSTER_SPEC is not valid JSON ({e}).') from e
  if not isinstance(spec, dict):
    raise ValueError('CLUSTER_SPEC must be a JSON object.')
  cluster, task = spec.get('cluster') or {}, dict(spec.get('task') or {})
  unknown = sorted(set(cluster) - set(_POOLS))
  if unknown or task.get('type') not in _POOLS:
    raise ValueError(f'CLUSTER_SPEC names pools {unknown or [task.get("type")]}'
                     f'; Vertex AI pools are {sorted(_POOLS)}.')
  task['type'] = _POOLS[task['type']]
  config = {'cluster': {_POOLS[pool]: addresses
                        for pool, addresses in cluster.items()
                        if pool != 'workerpool3'},
            'task': task, 'environment': spec.get('environment', 'cloud')}
  environ['TF_CONFIG'] = json.dumps(config)
