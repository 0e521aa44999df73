"""`python -m trainer.cluster`: a TF_CONFIG cluster on this machine.

    python -m trainer.cluster --job-dir=runs/c --workers=1 --ps=1 -- \
        --train-steps=2000 --cpu-towers=2

Starts a chief, `--workers` more workers, `--ps` parameter servers and an
evaluator, each `python -m trainer.task` with the flags after `--` and its
own TF_CONFIG, exactly as Vertex AI or a Kubeflow TFJob would; logs go to
<job-dir>/logs/<task>.log. The tasks share this machine's cores: each gets
thread pools of its share (core_share), unless the flags after `--` say
otherwise. With `--ps=0` the chief and workers train
synchronously (see docs/cluster.md). It is for trying a cluster on one
machine and for the tests: TensorFlow's distributed runtime does the real
work.

Every process is stopped on exit, on Ctrl-C and when one task fails for good
(after `--max-restarts`). The whole cluster runs in a private network
namespace with only a loopback interface, because TensorFlow's servers listen
on all interfaces.
"""

import os
import signal
import sys
from typing import Tuple

from absl import flags
from absl import logging

from trainer import cli
from trainer import core_share
from trainer.cluster import launch as cluster_launch
from trainer.cluster import private_network

cli.define(flags.DEFINE_string, 'job-dir', None,
           'Output directory shared by all tasks.')
cli.define(flags.DEFINE_integer, 'workers', 1, 'Workers besides the chief.',
           lower_bound=0)
cli.define(flags.DEFINE_integer, 'ps', 1,
           'Parameter servers. With them the workers train asynchronously; '
           'with 0 the chief and workers train synchronously (each step one '
           'global batch, gradients all-reduced).', lower_bound=0)
cli.define(flags.DEFINE_boolean, 'evaluator', True, 'Run an evaluator task.')
cli.define(flags.DEFINE_integer, 'max-restarts', 0,
           'Times each task may be restarted after dying. With --ps=0 (a '
           'synchronous cluster) a chief or worker that dies restarts all '
           'of them, and this counts those restarts.', lower_bound=0)
cli.define(flags.DEFINE_float, 'grace-secs', 10.0,
           'Seconds a task gets after SIGTERM before SIGKILL.',
           lower_bound=0.0)


def _task_args(argv, pools: Tuple[int, int]):
  """Flags for every task: the shared job dir, each task's share of the
  cores (`pools`: intra-op and inter-op threads, before the user's flags,
  which override them), then those after `--`."""
  extra = list(argv[1:])
  for arg in extra:
    if arg.startswith(('--job-dir', '--job_dir')):
      raise ValueError('Give --job-dir to trainer.cluster, not after --.')
  return [f'--job-dir={cli.value("job-dir")}',
          *core_share.pool_flags(*pools).values(), *extra]


def run(argv) -> None:
  """Builds the cluster spec and supervises the tasks.

  Raises:
    ValueError: bad flags.
    cluster_launch.ClusterFailed: a task failed for good.
  """
  job_dir = cli.value('job-dir')
  private_network.bring_up_loopback()
  log_dir = os.path.join(job_dir, 'logs')
  os.makedirs(log_dir, exist_ok=True)
  spec = cluster_launch.cluster_spec(cli.value('workers'), cli.value('ps'))
  tasks = cluster_launch.make_tasks(spec, cli.value('evaluator'), log_dir)
  logging.info('Cluster %s (%s) in network namespace with interfaces %s',
               spec, _mode(spec), private_network.interfaces())
  training_tasks = 1 + cli.value('workers')
  cores = core_share.machine_cores()
  pools = core_share.pool_sizes(training_tasks, cores)
  logging.info('%d training task(s) share %d core(s): by default each task '
               'runs %d intra-op and %d inter-op thread(s) '
               '(--intra-op-threads and --inter-op-threads after -- choose '
               'others).', training_tasks, cores, *pools)
  supervisor = cluster_launch.Supervisor(
      tasks, _task_args(argv, pools),
      cli.value('max-restarts'),
      os.path.join(log_dir, 'cluster.json'), cli.value('grace-secs'),
      restart_together=cluster_launch.is_synchronous(spec), echo=True)
  supervisor.run()


def _mode(spec) -> str:
  """How the cluster's tasks train, in words for the log."""
  if cluster_launch.is_synchronous(spec):
    return 'sync: the chief and workers all-reduce each global batch'
  if spec.get('ps'):
    return 'async: the chief and workers update the ps\'s variables'
  return 'one training task'


_received = []


def _raise_interrupt(signum, frame):
  """Stops the supervisor once; later signals must not cut the stop short."""
  del frame
  if _received:
    return
  _received.append(signum)
  raise KeyboardInterrupt


def main(argv):
  if not private_network.inside():
    try:
      sys.exit(private_network.reexec_inside(['-m', 'trainer.cluster',
                                              *sys.argv[1:]]))
    except private_network.PrivateNetworkError as e:
      raise cli.Failure(
          f'cannot make a private network namespace ({e}); TensorFlow '
          'servers listen on all interfaces, so the launcher will not start '
          'them outside one.') from e
  # SIGTERM (from the outer launcher, or a job scheduler) and SIGHUP stop the
  # tasks the way Ctrl-C does. A terminal's Ctrl-C arrives twice (from the
  # terminal and forwarded by the outer launcher): only the first counts.
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, _raise_interrupt)
  try:
    run(argv)
  except ValueError as e:
    raise cli.UsageError(str(e)) from e
  except cluster_launch.ClusterFailed as e:
    raise cli.Failure(str(e)) from e
  except KeyboardInterrupt:
    signum = _received[0] if _received else signal.SIGINT
    sys.stderr.write(f'cluster: interrupted by {signal.Signals(signum).name}; '
                     'every task was stopped.\n')
    sys.exit(128 + signum)
  print(f'cluster: done; logs in {os.path.join(cli.value("job-dir"), "logs")}',
        flush=True)


def run_main() -> None:
  """The `python -m trainer.cluster` entry point."""
  flags.mark_flag_as_required('job-dir')
  cli.run(main, 'cluster', passthrough=True,
          hint='trainer flags go after --.')
