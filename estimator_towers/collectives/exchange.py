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

Each member of an exchange is its own collective op, which completes only
when every member runs. A fetch that needs one tower's result alone (a
hook's `end()` reading tower 0's logits, `session.run(tower0_tensor)`)
would make TensorFlow prune the other towers' members, and the member it
kept would wait forever. So each member's result passes through a join op
(an identity), and once the towers and the one update are built,
`join_members` gives every join a control input from every other
in-process member of its exchange: whatever needs one member's result runs
them all. The members of an exchange across the tasks of a synchronous
cluster live in other processes; nothing joins them (a fetch there still
waits for the other tasks to make it too).
"""

import collections
import dataclasses
import itertools
import weakref
from typing import Callable, NamedTuple

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


class _Member(NamedTuple):
  """One member of an exchange: its collective op and the join after it."""
  collective: tf.Operation
  join: tf.Operation


# graph -> {(group key, instance key): {device: [_Member, in build order]}},
# the members `join_members` has not joined yet.
_pending = weakref.WeakKeyDictionary()


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
      total = collective_ops.all_reduce(value, keys.size, keys.group, key,
                                        'Add', 'Id')
      joined = tf.identity(total, name='joined')
    _record(keys.group, key, device, _Member(total.op, joined.op))
    return joined

  @tf.custom_gradient
  def exchange(part):
    def gradient(upstream):
      return take(all_sum(upstream, keys.backward))
    return all_sum(place(part), keys.forward), gradient

  return exchange(own)


def _record(group: int, instance: int, device: str, member: _Member) -> None:
  """Keeps `member` of exchange (group, instance) for `join_members`."""
  graph = member.collective.graph
  if graph not in _pending:
    _pending[graph] = collections.defaultdict(
        lambda: collections.defaultdict(list))
  _pending[graph][group, instance][device].append(member)


def join_members(graph: tf.Graph) -> int:
  """Makes each member of each exchange of `graph` run all its members.

  Call it once the exchanges are built: the towers' forward ones and the
  backward ones the one update's gradients built. Each member's join op
  gets a control input from every other member's collective op, so a
  fetch of any tower's result downstream of an exchange runs every member
  instead of waiting forever for pruned ones.

  Members pair up per device in build order: the n-th collective of an
  instance key on one device with the n-th on every other (a second
  `tf.gradients` through the same exchanges builds a second set of
  backward members under the same key; the two sets stay apart).

  No cycle arises. Before this pass a tower's ops depend only on its own
  shard, the variables and the results of its own exchanges: a member
  sends its own part only, the towers' models do not read each other's
  tensors, and the orderings between towers the library adds (shared
  table accesses) join the same ops of the same model. Number the
  exchanges in the order they run in a tower (forward ones in build
  order, then backward ones from the loss backwards); tower 0 picks the
  keys of its k-th exchange and every tower's k-th reuses them, so the
  members of one exchange have the same number in every tower. A member
  of exchange k depends only on its tower's joins of exchanges below k;
  the edges added here make join k depend on the members of exchange k
  alone. By induction on k, no member of exchange k depends on a join of
  exchange k or later, so no added edge closes a loop. (Were one to, the
  session would refuse the graph as cyclic when it runs, not hang.)

  Args:
    graph: The towers' graph.

  Returns:
    How many control edges were added: n (n - 1) per exchange of n
    in-process members (none for an exchange with the other tasks, whose
    only in-process member is this task's).
  """
  added = 0
  for by_device in _pending.pop(graph, {}).values():
    for members in itertools.zip_longest(*by_device.values()):
      members = [m for m in members if m is not None]
      for member in members:
        others = [m.collective for m in members if m is not member]
        # Private, but the way to add an input to a built op; the session
        # has not run the graph yet.
        member.join._add_control_inputs(others)  # pylint: disable=protected-access
        added += len(others)
  return added
