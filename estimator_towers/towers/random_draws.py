"""Random ops drawn as one device draws them (random_ops='one_device').

With a graph-level seed (`tf_random_seed`), a stateful random op given no
seed of its own takes its op seed from a per-graph count of such ops
(`tf.compat.v1.random.get_seed` in TF 2.15; not the graph's op id): the
k-th seedless random op of a graph gets k. Tower 0 is built first, with
nothing random before it that one device lacks, so its random ops are one
device's ops with one device's seeds. Towers 1+ count on after tower 0's
and skip the initializers' random ops (they reuse tower 0's variables), so
their dropout gets other seeds; and every tower draws a mask of its own
shard's shape. So by default ('per_tower') N towers are not the
computation of one device: dropout differs (BERT with dropout 0.1 by about
5e-3 after a few steps).

With 'one_device', `OneDevice`:

* gives the k-th random op of tower i (initializers left out, which only
  tower 0 builds) the seeds of tower 0's k-th, so every tower's op is one
  device's op;
* makes each random op whose shape follows the tower's shard (a dropout
  mask, per-example noise: its first dimension is the shard's rows) draw
  the GLOBAL batch's shape and hands the tower's consumers its own rows
  [start, start + rows) of it. A first dimension of k values per example,
  laid out example by example (BERT's hidden dropout on [batch * seq_length,
  hidden]), is cut as rows [start * k, (start + rows) * k). A stateful
  kernel advances its state by the number of values it draws, so each
  tower's copy of the op stays in step with one device's over the steps;
* leaves every other random op (fixed-shape noise, initializers) drawing
  what one device draws, with one device's seeds.

Stateless random ops (`tf.random.stateless_normal`) take their seeds as
inputs, the same on every tower; one whose shape follows the shard is cut
from the global draw as well.

In a synchronous cluster every task keeps the graph seed (per_tower moves
a worker's, see task_sync.TaskGroup.own_random_seed) and draws the step's
global batch, of all tasks, keeping its towers' rows after those of the
tasks before it; one sum over the tasks per step tells both.

The cost: each tower draws the global batch's random numbers, not its
shard's (N times the random numbers of one device), plus a slice and a
check per op. When the towers' random ops cannot be matched to one
device's (another number or kind per tower, a shape whose first dimension
is not a multiple of the shard's rows, a random op inside a conditional or
tf.function, one that samples from the shard), building or running the
step fails with a message saying to use random_ops='per_tower', rather
than draw something else silently.
"""

import contextlib
from typing import Any, ContextManager, Iterator, List, NamedTuple, Set

import tensorflow as tf

from estimator_towers.choices import RANDOM_OPS
from estimator_towers.towers import loss_reduction
from estimator_towers.graph import op_ledger
from estimator_towers.towers import sharding
from estimator_towers.towers import tower_effects

tf1 = tf.compat.v1

# Random ops whose first input is the shape drawn and whose other inputs
# are per-op scalars: drawing the global shape and slicing is exact.
_SHAPE_FIRST = frozenset(['RandomUniform', 'RandomUniformInt',
                          'RandomStandardNormal', 'TruncatedNormal'])
# Stateless random ops: their seeds are inputs, the same on every tower,
# but a shard's shape draws the first rows of one device's numbers.
_STATELESS = frozenset([
    'StatelessRandomUniform', 'StatelessRandomNormal',
    'StatelessTruncatedNormal', 'StatelessRandomUniformInt',
    'StatelessRandomUniformFullInt', 'StatelessRandomUniformV2',
    'StatelessRandomNormalV2', 'StatelessTruncatedNormalV2',
    'StatelessRandomUniformIntV2', 'StatelessRandomUniformFullIntV2'])
_FIX = "Use random_ops='per_tower' (each tower draws its own numbers)."


def check(random_ops: Any) -> None:
  """Validates the `random_ops` argument of replicate_model_fn.

  Raises:
    ValueError: `random_ops` is not one of `RANDOM_OPS`.
  """
  if not isinstance(random_ops, str) or random_ops not in RANDOM_OPS:
    raise ValueError(f'random_ops={random_ops!r}; use one of {RANDOM_OPS}.')


def make(random_ops: str, task_group):
  """The random-op policy of one model_fn call.

  Args:
    random_ops: 'per_tower' or 'one_device' (see `check`).
    task_group: The tasks training together (task_sync.TaskGroup or
      one_machine.OneMachine).

  Returns:
    `PerTower` or `OneDevice`.
  """
  if random_ops == 'per_tower':
    return PerTower(task_group)
  return OneDevice(task_group)


class PerTower:
  """Each tower draws its own random numbers (the default, faster).

  Args:
    task_group: The tasks training together.
  """

  def __init__(self, task_group):
    self._task_group = task_group

  def seeds(self) -> ContextManager[None]:
    """Around the towers' build: in a synchronous cluster each task moves
    its graph seed, so that the workers do not repeat the chief's draws."""
    return self._task_group.own_random_seed()

  def split(self, sizes: tf.Tensor, padded: bool) -> None:
    """Nothing to prepare."""
    del sizes, padded

  def shard(self, structure: Any) -> Any:
    """A tower's features or labels, as they are."""
    return structure

  @contextlib.contextmanager
  def tower(self, index: int, shard: Any,
            since: op_ledger.Mark) -> Iterator[None]:
    """Builds the tower as it is."""
    del index, shard, since
    yield


class _Draw(NamedTuple):
  """What tower 0 drew with a random op: one device's op."""
  name: str
  type: str
  seed: int
  seed2: int
  batch_shaped: bool


class OneDevice:
  """Makes every tower's random ops draw what one device's draw.

  `split` once the batch is split (`shard` on each shard), then `tower`
  around each tower's build, in order.
  """

  def __init__(self, task_group):
    self._graph = tf1.get_default_graph()
    self._task_group = task_group
    self._first: List[_Draw] = []
    self._batch = self._starts = self._rows = None

  def seeds(self) -> ContextManager[None]:
    """Around the towers' build: every task keeps the graph seed, so that
    all draw one device's numbers and keep their own rows."""
    return contextlib.nullcontext()

  def split(self, sizes: tf.Tensor, padded: bool) -> None:
    """Takes the towers' shard sizes (`sharding.shard_sizes`).

    In a synchronous cluster the towers' rows are this task's part of the
    step's global batch, which follows the parts of the tasks before it
    (the chief's first, then the workers' by index): one sum over the
    tasks of a vector holding each task's rows at its index tells the
    global batch and where this task's part starts.

    Args:
      sizes: Each tower's real examples.
      padded: Whether an idle tower trains on a copy of row 0.
    """
    group = self._task_group
    with tf.name_scope('one_device_draws'):
      rows = tf.reduce_sum(sizes)
      # float32: collectives sum floats on every device; counts of rows
      # stay exact far beyond any batch.
      each = group.sum([tf.cast(rows, tf.float32) * tf.one_hot(
          group.index, group.size)])[0]
      each = tf.cast(tf.round(each), tf.int32)
      self._batch = tf.reduce_sum(each)
      self._starts, self._rows = sharding.shard_rows(sizes, padded)
      self._starts += tf.reduce_sum(each[:group.index])

  def shard(self, structure: Any) -> Any:
    """A tower's features or labels, their batch dimension made unknown
    while the graph is built.

    A batch of static size gives static shards, and then `tf.shape(x)` of
    a shard is a constant: a dropout mask's shape would look like a fixed
    shape and could not be told from one. Unknown, it depends on the shard.
    """
    return sharding.map_leaves(_unknown_rows, structure)

  @contextlib.contextmanager
  def tower(self, index: int, shard: Any,
            since: op_ledger.Mark) -> Iterator[None]:
    """Around tower `index`'s build: its random ops become one device's.

    Args:
      index: The tower, in build order.
      shard: The tower's features and labels.
      since: The mark taken before the tower's build.

    Raises:
      ValueError: the tower's random ops do not match tower 0's one to
        one, or one cannot be drawn globally.
    """
    with op_ledger.region(self._graph) as built:
      yield
    self._match(index, built, loss_reduction.ExampleDependence(shard, since))

  def _match(self, index: int, built: op_ledger.Region,
             on_shard: loss_reduction.ExampleDependence) -> None:
    _refuse_draws_in_functions(self._graph, built, index)
    _refuse_other_draws(self._graph, built, index)
    initializers = _initializer_ops(self._graph, built)
    draws = [t.op for t in tower_effects.random_draws(self._graph, built)
             if t.op.name not in initializers]
    shaped = [_batch_shaped(op, on_shard, index) for op in draws]
    if index == 0:
      self._first = [
          _Draw(op.name, op.type, op.get_attr('seed'), op.get_attr('seed2'),
                s) for op, s in zip(draws, shaped)]
    else:
      self._check_same_draws(index, draws, shaped)
      for op, first in zip(draws, self._first):
        # Tower 0's seeds are one device's (see the module docstring).
        op._set_attr('seed', tf1.AttrValue(i=first.seed))  # pylint: disable=protected-access
        op._set_attr('seed2', tf1.AttrValue(i=first.seed2))  # pylint: disable=protected-access
    stateless = [op for op in self._graph.get_operations()
                 if op.type in _STATELESS and built.contains(op)]
    shaped += [_batch_shaped(op, on_shard, index) for op in stateless]
    for op, s in zip(draws + stateless, shaped):
      if s:
        self._draw_global(op, index)

  def _check_same_draws(self, index: int, draws: List[tf.Operation],
                        shaped: List[bool]) -> None:
    mine = [_Draw(op.name, op.type, 0, 0, s) for op, s in zip(draws, shaped)]
    if [(d.type, d.batch_shaped) for d in mine] == [
        (d.type, d.batch_shaped) for d in self._first]:
      return
    at = next((k for k, (a, b) in enumerate(zip(mine, self._first))
               if (a.type, a.batch_shaped) != (b.type, b.batch_shaped)),
              min(len(mine), len(self._first)))
    raise ValueError(
        f"random_ops='one_device': tower {index} creates {len(mine)} random "
        f'ops, tower 0 (one device) {len(self._first)}; they must match one '
        'to one, in order, to draw what one device draws. The first that '
        f'differs, number {at}: {_describe(mine[at:at + 1])} in tower '
        f'{index}, {_describe(self._first[at:at + 1])} in tower 0 (does the '
        'model_fn draw depending on tower_context()?). ' + _FIX)

  def _draw_global(self, op: tf.Operation, index: int) -> None:
    """Makes `op` draw the global batch's shape; its consumers get the
    tower's rows."""
    out = op.outputs[0]
    consumers = [(c, i) for c in out.consumers()
                 for i, t in enumerate(c.inputs) if t.name == out.name]
    shape = op.inputs[0]
    graph = op.graph
    with graph.name_scope(None), graph.control_dependencies(None), (
        graph.device(op.device)), graph.name_scope(
            f'{op.name}/one_device_rows'):
      rows = tf.cast(self._rows[index], shape.dtype)
      start = tf.cast(self._starts[index], shape.dtype)
      # Values per example along the first dimension: 1 for [rows, ...],
      # the sequence length for BERT's [rows * seq_length, hidden].
      per_row = shape[0] // tf.maximum(rows, 1)
      # Assert, not assert_equal: a third of the ops, for every random op.
      matches = tf.debugging.Assert(tf.equal(shape[0], per_row * rows), [
          f"random_ops='one_device': random op {op.name} of tower {index} "
          "has a first dimension that is not a multiple of the tower's "
          "rows of the batch, so its draw cannot be cut from one "
          "device's. " + _FIX])
      # An empty batch draws one row: an idle tower trains on a copy of
      # row 0 (weighted by zero).
      drawn_rows = tf.maximum(tf.cast(self._batch, shape.dtype),
                              start + rows)
      op._update_input(0, tf.concat([[drawn_rows * per_row], shape[1:]], 0))  # pylint: disable=protected-access
      with tf.control_dependencies([matches]):
        own = tf.identity(out[start * per_row:(start + rows) * per_row],
                          name='own_rows')
    for consumer, position in consumers:
      consumer._update_input(position, own)  # pylint: disable=protected-access


def _unknown_rows(leaf: Any) -> Any:
  if (not isinstance(leaf, tf.Tensor) or leaf.shape.rank is None or
      sharding.is_per_batch(leaf)):
    return leaf
  return tf1.placeholder_with_default(leaf, [None, *leaf.shape[1:]])


def _batch_shaped(op: tf.Operation, on_shard, index: int) -> bool:
  """Whether the random op's shape follows the tower's shard.

  Raises:
    ValueError: it depends on the shard in a way no global draw gives.
  """
  depends = [on_shard(t) for t in op.inputs]
  if not any(depends):
    return False
  if op.type in _SHAPE_FIRST | _STATELESS and not any(depends[1:]):
    if op._get_control_flow_context() is not None:  # pylint: disable=protected-access
      raise ValueError(
          f"random_ops='one_device': random op {op.name} of tower {index} "
          'is inside a tf.compat.v1 while loop or conditional, where its '
          'draws cannot be cut from one device\'s. ' + _FIX)
    return True
  raise ValueError(
      f"random_ops='one_device': random op {op.name} ({op.type}) of tower "
      f"{index} takes the tower's shard as an input other than its shape "
      '(e.g. logits to sample from, values to shuffle), so its draws '
      'cannot be cut from one device\'s. ' + _FIX)


def _refuse_draws_in_functions(graph: tf.Graph, built: op_ledger.Region,
                               index: int) -> None:
  """Refuses random ops inside a tower's conditionals and tf.functions,
  which the rewrite cannot reach."""
  for op in graph.get_operations():
    if op.type in tower_effects.CALLS and built.contains(op):
      inside = tower_effects.draws_in_functions(op)
      if inside:
        raise ValueError(
            f"random_ops='one_device': {op.type} {op.name} of tower "
            f'{index} draws random numbers inside its function '
            f'({", ".join(inside)}), where they cannot be made one '
            "device's. " + _FIX)


def _refuse_other_draws(graph: tf.Graph, built: op_ledger.Region,
                        index: int) -> None:
  """Refuses draws the rewrite does not know: candidate samplers (nce_loss,
  sampled softmax) and tf.random.Generator ops, which drew per tower."""
  for op in graph.get_operations():
    if op.type in tower_effects.OTHER_DRAWS and built.contains(op):
      raise ValueError(
          f"random_ops='one_device': {op.type} {op.name} of tower {index} "
          'draws random numbers (a candidate sampler such as nce_loss or '
          "sampled_softmax_loss uses, or a tf.random.Generator's op) that "
          "cannot be made one device's. " + _FIX)


def _initializer_ops(graph: tf.Graph, built: op_ledger.Region) -> Set[str]:
  """Names of the ops `built` made to compute variables' initial values
  (only the tower that creates a variable builds them)."""
  variables = (graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES) +
               graph.get_collection(tf1.GraphKeys.LOCAL_VARIABLES))
  pending = [v.initial_value.op for v in variables
             if built.contains(v.op)]
  found = set()
  while pending:
    op = pending.pop()
    if op.name in found or not built.contains(op):
      continue
    found.add(op.name)
    pending.extend(t.op for t in op.inputs)
  return found


def _describe(draws: List[_Draw]) -> str:
  return ', '.join(f'{d.name} ({d.type}{", batch-shaped" * d.batch_shaped})'
                   for d in draws) or 'none'

