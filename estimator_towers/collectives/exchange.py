"""One all-sum between the towers whose gradient is the all-sum back.

Towers built one after another in one graph share values at run time by a
collective: each tower places its own part into a tensor of zeros that
every tower builds alike (adding zeros is exact), and one all-sum gives
every tower the whole. The gradient of an all-sum is the all-sum of the
towers' upstream gradients, from which each tower takes its own part: both
one `tf.gradients` of the global loss (aggregation 'global_loss',
'round_robin') and per-tower gradients summed afterwards ('all_reduce')
then get one device's gradients. Batch norm's global moments
(global_batch_norm) and the towers' rows of a tensor (whole_batch) both
exchange this way.
"""

import dataclasses
from typing import Callable

import tensorflow as tf
from tensorflow.python.ops import collective_ops  # pylint: disable=g-direct-tensorflow-import


@dataclasses.dataclass
class Keys:
  """The keys of one exchange and of its gradient.

  Attributes:
    group: The collective group key of the members.
    size: How many members take part.
    forward: The instance key of the exchange.
    backward: The instance key of its gradient.
  """
  group: int
  size: int
  forward: int
  backward: int


def in_step(graph: tf.Graph) -> bool:
  """Whether an exchange built now runs in every tower's step.

  Args:
    graph: The towers' graph.

  Returns:
    False inside another graph (a `tf.function`) or a `tf.cond` or
    `tf.while_loop`, which some towers might skip: the others would wait
    for them forever.
  """
  current = tf.compat.v1.get_default_graph()
  return current is graph and (
      current._get_control_flow_context() is None)  # pylint: disable=protected-access


def summed(own: tf.Tensor, keys: Keys, device: str, placement,
           place: Callable[[tf.Tensor], tf.Tensor],
           take: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
  """The all-sum of every member's `place(own)`, differentiable.

  Args:
    own: This member's part.
    keys: The exchange's keys; every member builds it with the same ones.
    device: This member's device, where both collectives run.
    placement: The tower builder's strategies.Strategy, whose device
      function must let the collectives keep `device`.
    place: Puts `own` into the tensor of zeros every member sums (a linear
      map, the same shape on every member).
    take: The adjoint of `place`: this member's part of a summed tensor.

  Returns:
    The sum over the members, on `device`.
  """

  def all_sum(value, key):
    with placement.deferring(), tf.device(device):
      return collective_ops.all_reduce(value, keys.size, keys.group, key,
                                       'Add', 'Id')

  @tf.custom_gradient
  def exchange(part):
    def gradient(upstream):
      return take(all_sum(upstream, keys.backward))
    return all_sum(place(part), keys.forward), gradient

  return exchange(own)
