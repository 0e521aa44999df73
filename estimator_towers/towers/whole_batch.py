"""Every tower's rows of a tensor, for a loss whose negatives are the batch.

A loss that takes each example's negatives from the whole batch (SimCLR's
NT-Xent, logits `z1 @ z2^T` over the batch; two-tower retrieval with
in-batch negatives) is not the sum of per-shard losses: a tower would see
only its shard's examples as negatives. `whole_batch(z2)` inside a tower
returns the concatenation of every tower's real rows of `z2`, in input
order (tower 0's first), and the tower's row offset in it, so the model_fn
writes

  rows, offset = estimator_towers.whole_batch(z2)
  logits = tf.matmul(z1, rows, transpose_b=True)            # [shard, batch]
  labels = tf.one_hot(offset + tf.range(tf.shape(z1)[0]), tf.shape(rows)[0])

and trains what one device trains on the global batch (`offset` is 0 and
`rows` is `z2` on one device). The rows are exchanged as batch norm's
moments are (collectives.exchange): each tower puts its rows at its offset
into zeros of the global batch's rows and one all-sum per call gives every
tower the whole; the gradient sums every tower's upstream gradient and each
tower keeps its rows'. An idle tower (its shard a padding copy) adds no row.
Tower 0 picks the keys of its k-th call, and the k-th call of every later
tower reuses them, so every tower must make the same calls, outside
`tf.cond`, `tf.while_loop` and `tf.function`.

Micro-batches (built as towers run one after another) and synchronous
clusters (whose tasks would have to exchange too) are refused.
"""

import collections
import contextlib
import threading
from typing import List, Optional, Sequence

import tensorflow as tf

from estimator_towers.collectives import collective_keys
from estimator_towers.collectives import exchange as exchange_lib

tf1 = tf.compat.v1

WholeBatch = collections.namedtuple('WholeBatch', ['rows', 'offset'])
WholeBatch.__doc__ = """What `whole_batch` returns.

Attributes:
  rows: Every tower's rows of the tensor, in input order.
  offset: Where this tower's rows begin in `rows` (an int32 scalar).
"""

_state = threading.local()


def whole_batch(tensor) -> WholeBatch:
  """Every tower's rows of `tensor`, and where this tower's begin.

  Inside `replicate_model_fn`'s towers, the concatenation of every tower's
  real rows of `tensor` along its first dimension, in input order; the
  gradient with respect to it reaches each tower's rows. Outside (one
  device, or a model_fn not replicated), `tensor` itself and offset 0.

  Args:
    tensor: A tensor whose first dimension is the tower's examples (a
      shard's rows), with a known rank.

  Returns:
    A `WholeBatch(rows, offset)`.

  Raises:
    ValueError: the tensor's rank is unknown or 0, the call is inside
      control flow or another graph, a tower makes other calls than tower 0,
      or the towers cannot exchange (micro_batches > 1, a synchronous
      cluster).
  """
  exchange = getattr(_state, 'exchange', None)
  tensor = tf.convert_to_tensor(tensor)
  if exchange is None:
    return WholeBatch(tensor, tf.constant(0, tf.int32))
  return exchange.gather(tensor)


class TowerRows:
  """The exchanges of `whole_batch` calls of one model_fn call's towers.

  Args:
    devices: The tower devices, in tower order (distinct).
    sizes: Each tower's number of real examples (int32 [num_towers]).
    placement: The tower builder's strategies.Strategy.
    refusal: Why the towers cannot exchange (a sentence), or None.
  """

  def __init__(self, devices: Sequence[str], sizes: tf.Tensor, placement,
               refusal: Optional[str] = None):
    self._devices = list(devices)
    self._sizes = sizes
    self._placement = placement
    self._refusal = refusal
    self._graph = tf1.get_default_graph()
    self._keys = collective_keys.of_graph(self._graph)
    self._group = self._keys.local_group(self._devices)
    self._calls: List[exchange_lib.Keys] = []  # Tower 0's, in order.
    self._tower = 0
    self._position = 0

  @contextlib.contextmanager
  def tower(self, index: int):
    """Makes `whole_batch` exchange tower `index`'s rows inside.

    Raises:
      ValueError: on exit, the tower made another number of calls than
        tower 0 (their collectives would never pair up).
    """
    previous = getattr(_state, 'exchange', None)
    _state.exchange = self
    self._tower, self._position = index, 0
    try:
      yield
    finally:
      _state.exchange = previous
    if index > 0 and self._position != len(self._calls):
      raise ValueError(
          f'Tower {index} calls whole_batch {self._position} times, tower 0 '
          f'{len(self._calls)} times. Every tower must build the same model: '
          'each call exchanges rows between all towers.')

  def gather(self, tensor: tf.Tensor) -> WholeBatch:
    """Every tower's real rows of `tensor` and this tower's offset."""
    self._check(tensor)
    index = self._tower
    with tf.name_scope('whole_batch'):
      sizes = tf.cast(self._sizes, tf.int32)
      offset = tf.reduce_sum(sizes[:index])
      total = tf.reduce_sum(sizes)
      if len(self._devices) == 1:
        return WholeBatch(tensor, offset)
      keys = self._keys_of_call()
      own = tensor[:sizes[index]]  # An idle tower's padding copy: none.
      after = total - offset - sizes[index]
      paddings = tf.concat([[[offset, after]], tf.zeros(
          [tensor.shape.rank - 1, 2], tf.int32)], 0)
      rows = exchange_lib.summed(
          own, keys, self._devices[index], self._placement,
          place=lambda part: tf.pad(part, paddings),
          take=lambda summed: summed[offset:offset + sizes[index]])
      rows.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
      return WholeBatch(rows, offset)

  def _check(self, tensor: tf.Tensor) -> None:
    """Refuses what the exchange cannot make exact or would hang."""
    if self._refusal:
      raise ValueError(f'whole_batch is not available here: {self._refusal}')
    if not tensor.shape.rank:
      raise ValueError(
          f'whole_batch({tensor.name}) needs a tensor whose first dimension '
          f'is the examples and whose rank is known; its shape is '
          f'{tensor.shape}.')
    if not exchange_lib.in_step(self._graph):
      raise ValueError(
          f'whole_batch({tensor.name}) is called inside a tf.cond, '
          'tf.while_loop or tf.function. Its rows are exchanged by a '
          'collective every tower must run in every step; call it outside '
          'control flow.')

  def _keys_of_call(self) -> exchange_lib.Keys:
    """The keys of the current tower's next call: tower 0 picks them."""
    position = self._position
    self._position += 1
    if self._tower == 0:
      self._calls.append(exchange_lib.Keys(
          self._group, len(self._devices), self._keys.local_instance(),
          self._keys.local_instance()))
    if position >= len(self._calls):
      raise ValueError(
          f'Tower {self._tower} calls whole_batch more often than tower 0 '
          f'({position + 1} times). Every tower must build the same model.')
    return self._calls[position]
