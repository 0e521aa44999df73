"""Times ResNet-20 training steps on virtual CPU towers, for the benches
that compare two ways of building the same towers (bench_write_order,
bench_batch_norm)."""

import argparse
import time
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

import estimator_towers
from model_fns.resnet import resnet_model_fn

tf1 = tf.compat.v1
PARAMS = dict(resnet_depth=20, n_classes=10, learning_rate=0.1,
              optimizer='momentum', image_shape=[32, 32, 3])


def arguments(description: str) -> argparse.ArgumentParser:
  """The options both benches take: rounds, steps, warm-up, towers, batch."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps', type=int, default=15)
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--towers', type=int, default=2)
  parser.add_argument('--batch', type=int, default=32)
  return parser


def time_steps(towers: int, batch: int, steps: int, warmup: int,
               wrapper_kwargs: Optional[Dict[str, Any]] = None,
               inspect: Callable[[tf.Graph], Any] = lambda graph: None
               ) -> Tuple[float, float, float, Any]:
  """Builds ResNet-20 on `towers` towers and times its steps.

  Args:
    towers: Virtual CPU towers.
    batch: The global batch (fixed random images, from one seed).
    steps: Steps timed, after `warmup` steps that are not.
    wrapper_kwargs: More arguments of replicate_model_fn.
    inspect: Called with the built graph; its result is returned.

  Returns:
    (graph build seconds, seconds per step, CPU seconds per step of this
    process (all threads: steadier than the wall time on a shared
    machine), inspect's result).
  """
  with tf.Graph().as_default() as graph:
    tf1.set_random_seed(1)
    tf1.train.get_or_create_global_step()
    rng = np.random.RandomState(0)
    images = tf.constant(rng.rand(batch, 32, 32, 3).astype(np.float32))
    labels = tf.constant(rng.randint(0, 10, batch).astype(np.int32))
    config = estimator_towers.make_run_config(cpu_devices=towers)
    start = time.perf_counter()
    spec = estimator_towers.replicate_model_fn(
        resnet_model_fn, **(wrapper_kwargs or {}))(
            {'image': images}, labels, tf.estimator.ModeKeys.TRAIN, PARAMS,
            config)
    built = time.perf_counter() - start
    inspected = inspect(graph)
    spec.scaffold.finalize()  # all_reduce's copies start in local_init_op.
    with tf1.Session(config=config.session_config) as session:
      session.run(spec.scaffold.init_op)
      session.run(spec.scaffold.local_init_op)
      for _ in range(warmup):
        session.run(spec.train_op)
      start, start_cpu = time.perf_counter(), time.process_time()
      for _ in range(steps):
        session.run(spec.train_op)
      per_step = (time.perf_counter() - start) / steps
      cpu_per_step = (time.process_time() - start_cpu) / steps
  return built, per_step, cpu_per_step, inspected
