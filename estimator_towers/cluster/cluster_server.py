"""The gRPC server `tf.estimator.train_and_evaluate` starts for a cluster task.

TensorFlow-Estimator 2.15 starts each training task's in-process server from
a ConfigProto that keeps only the RunConfig's `gpu_options`. The server, not
the session, decides which devices exist and who leads collective groups,
so such a server would lose the virtual CPU devices of `make_run_config(
cpu_devices=N)` (towers on a CPU machine) and, having no group leader, could
not run the collectives of a synchronous cluster (task_sync).

`install()` makes the Estimator start the server from
`task_sync.server_config` instead: the session config's device counts,
thread pools and GPU options, plus the chief as group leader. Nothing else
about the server changes, and a RunConfig without a cluster still gets the
original server.

Nothing is installed at import (`import estimator_towers` leaves
tensorflow_estimator as it is). `make_run_config` installs it when its
RunConfig describes a cluster (TF_CONFIG): the server is started by
`train_and_evaluate` before any model_fn is built (too late for
`replicate_model_fn`), and `make_run_config` runs before it. A user of
`tf.estimator.train_and_evaluate` with `make_run_config` and
`replicate_model_fn` needs to call nothing else. Code that builds its own
RunConfig for a cluster calls `install()` itself.

tensorflow-estimator is pinned at 2.15 (its last release), whose private
`_TrainingExecutor._start_std_server` this replaces; `install` checks that the
method is there and refuses loudly otherwise.
"""

import tensorflow as tf
from tensorflow_estimator.python.estimator import training as training_lib  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.graph import patching
from estimator_towers.cluster import task_sync

_executor = training_lib._TrainingExecutor  # pylint: disable=protected-access
_original = getattr(_executor, '_start_std_server', None)


def start_server(config) -> tf.distribute.Server:
  """Starts this task's gRPC server, configured for towers and collectives.

  Args:
    config: The Estimator's RunConfig, naming a cluster and this task.

  Returns:
    The started server.
  """
  cluster = config.cluster_spec.as_dict()
  server = tf.distribute.Server(
      config.cluster_spec, job_name=config.task_type,
      task_index=config.task_id,
      config=task_sync.server_config(config.session_config, cluster),
      start=False, protocol=config.protocol)
  server.start()
  return server


def _start_std_server(self, config):
  if not config.master or not config.cluster_spec:
    # One node, or a misconfiguration the original explains.
    return _original(self, config)
  tf.compat.v1.logging.info('Start Tensorflow server (estimator_towers).')
  return start_server(config)


def install() -> None:
  """Makes train_and_evaluate start servers with `start_server`.

  For the rest of the process; installing again is a no-op.

  Raises:
    ImportError: tensorflow-estimator has no `_start_std_server` (a version
      other than the pinned 2.15).
  """
  if _original is None:
    raise ImportError(
        'tensorflow_estimator has no _TrainingExecutor._start_std_server; '
        'estimator_towers needs tensorflow-estimator 2.15 (pip install '
        '"tensorflow-estimator==2.15.*").')
  patching.replace_for_process(_executor, '_start_std_server',
                               _start_std_server)

