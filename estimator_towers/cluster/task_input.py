"""Each task's part of the global batch in a synchronous cluster.

In a TF_CONFIG cluster of training tasks without ps tasks (task_sync), the
global batch of a step is the concatenation of every task's input_fn batch,
the chief's first, then the workers' by index. `task_slice` builds that from
one pipeline: every task reads the same batches of the GLOBAL size, in the
same order, and keeps its own rows of each. Of a batch of n rows (the last,
partial batch too), task k of W keeps n // W rows, plus one if k < n % W,
starting after the rows of the tasks before it: the rows the towers of one
process would get, in the same order. So the tasks' parts add up to exactly
the one-process batch, and every task runs the same number of steps (an
input that ends, e.g. after some epochs, ends on every task at the same
step). A part may be empty (a last batch of fewer rows than tasks); the
towers then train on a zero-weighted row of zeros (see sharding).

The order must be the same on every task, so `task_slice` refuses pipelines
whose order is left to chance: a shuffle (or `Dataset.random`) without a
seed, or a parallel map or interleave with `deterministic=False`. Seeds come
from `shuffle(seed=...)` or the RunConfig's `tf_random_seed`, which the
Estimator makes the graph-level seed. Random numbers drawn inside the
pipeline's functions are refused without a seed when the pipeline chooses
rows (a filter, flat_map, interleave, take_while, group_by_window,
choose_from_datasets): a random subsample would keep other rows on each
task. A pipeline of maps alone may draw unseeded (augmentation changes
values, not which rows). Draws inside a tf.py_function are not visible.
"""

from typing import Any, Tuple

import tensorflow as tf
from tensorflow.core.framework import dataset_options_pb2  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import op_def_registry  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.towers import sharding
from estimator_towers.cluster import task_sync

# Dataset ops drawing random numbers; both seeds 0 means an unseeded op
# (tf.data turns any seeded pair into something else).
_RANDOM_DATASETS = frozenset([
    'ShuffleDataset', 'ShuffleDatasetV2', 'ShuffleDatasetV3',
    'ShuffleAndRepeatDataset', 'ShuffleAndRepeatDatasetV2',
    'RandomDataset', 'RandomDatasetV2'])


# Dataset ops whose functions decide which rows come (or in what order):
# a random number drawn there without a seed differs from task to task.
_CHOOSING_ROWS = frozenset([
    'FilterDataset', 'ParallelFilterDataset', 'FlatMapDataset',
    'InterleaveDataset', 'ParallelInterleaveDataset',
    'ParallelInterleaveDatasetV2', 'ParallelInterleaveDatasetV3',
    'ParallelInterleaveDatasetV4', 'LegacyParallelInterleaveDatasetV2',
    'TakeWhileDataset', 'GroupByWindowDataset', 'GroupByReducerDataset',
    # choose_from_datasets: the choices may be drawn in a map.
    'DirectedInterleaveDataset'])


def task_rows(batch_size: Any, num_tasks: int,
              index: int) -> Tuple[Any, Any]:
  """The rows task `index` of `num_tasks` keeps of a global batch.

  Args:
    batch_size: The batch's number of rows: an int or an int scalar Tensor.
    num_tasks: The training tasks (chief and workers).
    index: This task's place among them (the chief is 0).

  Returns:
    (start, count): rows [start, start + count), ints for an int
    `batch_size`, else Tensors.
  """
  base, extra = batch_size // num_tasks, batch_size % num_tasks
  if isinstance(batch_size, int):
    return index * base + min(index, extra), base + int(index < extra)
  start = index * base + tf.minimum(index, extra)
  return start, base + tf.cast(index < extra, base.dtype)


def task_slice(batches: tf.data.Dataset, config) -> tf.data.Dataset:
  """This task's part of each global batch, in a synchronous cluster.

  Call it in a training input_fn that takes `config` (the Estimator passes
  its RunConfig), after batching at the global batch size:

      def input_fn(config):
        batches = examples.shuffle(10_000, seed=1).batch(global_batch)
        return estimator_towers.task_slice(batches, config).prefetch(2)

  Elsewhere (one machine, a cluster with ps tasks, the evaluator, or
  `config` None) it returns `batches` unchanged.

  The cheaper order batches the records before parsing them (lines,
  serialized Examples, file names), slices, and parses the slice (a map
  over whole batches): each task then parses only its own rows. Do not
  unbatch and re-batch the slice: an empty part would vanish.

  Args:
    batches: Batches of the global batch size (the last may be smaller):
      Tensors, SparseTensors or RaggedTensors in any nest, all with the
      batch as their first dimension. Every task must build the same
      pipeline.
    config: The Estimator's RunConfig.

  Returns:
    The dataset of this task's rows of every batch.

  Raises:
    ValueError: in a synchronous cluster, the pipeline shuffles without a
      seed or runs a non-deterministic parallel map or interleave, so the
      tasks would read different batches.
  """
  if not task_sync.is_sync_cluster(config):
    return batches
  check_same_order(batches)
  num_tasks, index = config.num_worker_replicas, config.global_id_in_cluster

  def keep(element):
    leaves = tf.nest.flatten(element)
    size = _batch_size(element)
    start, count = task_rows(size, num_tasks, index)
    return tf.nest.pack_sequence_as(
        element, [sharding.slice_rows(leaf, start, count) for leaf in leaves])

  if isinstance(batches.element_spec, tuple):
    return batches.map(lambda *element: keep(element))
  return batches.map(keep)


def _batch_size(element):
  """The rows of a batch: an int if its shape tells, else a Tensor.

  Raises:
    ValueError: the leaves disagree on it or have no batch dimension (the
      dataset is not batched).
  """
  named = (sharding.named_leaves(*element) if
           isinstance(element, tuple) and len(element) == 2 else
           sharding.named_leaves(element, None))
  # A scalar here means Dataset.batch has not run yet (towers take a
  # per-batch scalar whole, but a task's slice comes from batches).
  scalars = [name for name, leaf in named if sharding.is_per_batch(leaf)]
  if scalars:
    raise ValueError(f'{scalars[0]} has no batch dimension (it is a '
                     'scalar). task_slice takes batches of the global batch '
                     'size: call it after Dataset.batch.')
  try:
    size = sharding.global_batch_size(named)
  except ValueError as e:
    raise ValueError(f'{e} task_slice takes batches of the global batch '
                     'size: call it after Dataset.batch.') from e
  static = tf.get_static_value(size)
  return size if static is None else int(static)


def check_same_order(dataset: tf.data.Dataset) -> None:
  """Fails when `dataset` may come in another order on another task.

  Inspects the dataset's ops in the graph being built (nothing in eager
  mode, where there is no graph to read).

  Raises:
    ValueError: an unseeded shuffle or random dataset, or a parallel map or
      interleave with deterministic=False.
  """
  variant = dataset._variant_tensor  # pylint: disable=protected-access
  if tf.executing_eagerly() or not hasattr(variant, 'op'):
    return
  pending, seen, ops = [variant.op], set(), []
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    ops.append(op)
    _check_op(op)
    pending.extend(t.op for t in op.inputs)
  if any(op.type in _CHOOSING_ROWS for op in ops):
    # Also a map's draw: a later filter may choose rows by it.
    for op in ops:
      _check_functions(op)


def _check_functions(op: tf.Operation) -> None:
  """Fails when a function of `op` (or one they call) draws unseeded."""
  pending = [a.func.name for a in op.node_def.attr.values()
             if a.HasField('func')]
  seen = set()
  while pending:
    name = pending.pop()
    if name in seen:
      continue
    seen.add(name)
    function = op.graph._get_function(name)  # pylint: disable=protected-access
    if function is None:
      continue
    nodes = {node.name: node for node in function.definition.node_def}
    for node in function.definition.node_def:
      if _unseeded(node, nodes):
        raise ValueError(
            f"The input pipeline's {op.type} ({op.name}) calls a function "
            f'that draws random numbers without a seed ({node.op} '
            f'{node.name!r}), and the pipeline chooses rows (a filter, '
            'flat_map, interleave, ...): each task of the synchronous '
            'cluster would choose other rows, and the global batch would '
            'repeat some examples and miss others. Set tf_random_seed in '
            'the RunConfig (or pass seed= to the op), the same on every '
            'task.')
      pending.extend(a.func.name for a in node.attr.values()
                     if a.HasField('func'))
      pending.append(node.op)  # A call of a library function by name.


def _unseeded(node, nodes) -> bool:
  """Whether a node of a function draws without a seed: a random op's
  seed attributes, or a shuffle's seed inputs (constants), both 0."""
  if 'seed' in node.attr and 'seed2' in node.attr:
    return node.attr['seed'].i == 0 and node.attr['seed2'].i == 0
  if node.op not in _RANDOM_DATASETS:
    return False
  names = [arg.name for arg in op_def_registry.get(node.op).input_arg]
  seeds = []
  for name in ('seed', 'seed2'):
    source = nodes.get(node.input[names.index(name)].split(':')[0])
    if source is None or source.op != 'Const':
      return False  # Computed: not known to be 0.
    seeds.append(int(tf.make_ndarray(source.attr['value'].tensor)))
  return seeds == [0, 0]


def _check_op(op: tf.Operation) -> None:
  if op.type in _RANDOM_DATASETS:
    names = [arg.name for arg in op.op_def.input_arg]
    seeds = [tf.get_static_value(op.inputs[names.index(name)])
             for name in ('seed', 'seed2')]
    if seeds == [0, 0]:
      raise ValueError(
          f'The input pipeline\'s {op.type} ({op.name}) has no seed, so each '
          'task of the synchronous cluster would shuffle differently and the '
          'global batch would repeat some examples and miss others. Pass '
          'shuffle(..., seed=N), or set tf_random_seed in the RunConfig, the '
          'same on every task.')
  if op.type == 'OptionsDataset':
    options = dataset_options_pb2.Options()
    options.ParseFromString(op.get_attr('serialized_options'))
    if options.HasField('deterministic') and not options.deterministic:
      raise ValueError(
          f"The input pipeline's options ({op.name}) set deterministic="
          'False, so the tasks of the synchronous cluster would read their '
          'examples in different orders. Leave tf.data.Options().'
          'deterministic unset (or True) in a synchronous cluster.')
  for attr in ('deterministic', 'sloppy'):
    try:
      value = op.get_attr(attr)
    except ValueError:
      continue
    if value in (b'false', True):
      raise ValueError(
          f'The input pipeline\'s {op.type} ({op.name}) runs with '
          'deterministic=False, so the tasks of the synchronous cluster '
          'would read their examples in different orders. Drop '
          'deterministic=False (or sloppy=True) in a synchronous cluster.')
