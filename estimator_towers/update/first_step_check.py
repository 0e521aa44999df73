"""Checks a training loss the graph walk cannot prove against one device.

`batch_mixing` refuses a loss that mixes its shard's examples when it can
prove it from the graph. Past an op it does not know (a `tf.py_function` or
`tf.numpy_function` of the batch, a `tf.scan` over its rows, a `tf.function`
body) it proves nothing, and such a loss trained each tower on its own shard
silently: the weights drifted from one device's from the first step on.

For such a loss the model_fn is called once more, on the whole batch, with
the towers' variables and with its optimizer calls discarded
(`discarding_updates`): that copy computes the loss one device would. Before
the first step, `FirstStepCheck` runs the input, the towers' forward passes
and the copy once, without any update, and raises when the losses differ;
otherwise it feeds the batch it read to the first step, so the step trains
on that batch as it would have. No weight has changed when it raises.

What the check cannot do it says in the log and leaves out: a loss that
waits for a write or a random draw (the extra forward pass would run it
again, or draw other numbers), features a hook may feed, and a step that
would read the input pipeline past the fed batch. A loss drawn at random
(dropout, in a while loop or a tf.function too, a candidate sampler, a
tf.random.Generator) is not compared: the copy would draw other numbers.
Only the first batch is compared, by the losses' values: a loss that
differs on a batch of another size only (a last partial batch), by less
than 1e-4 of itself (a small mixing term beside a large loss), or in its
gradients only (`c - tf.stop_gradient(c)`) is not caught. A py_function in
the loss runs once more on the first batch, and one that draws with
np.random fails the check: pass check_first_batch=False.
"""

import contextlib
import threading
from typing import Dict, Iterable, Iterator, List, Mapping, Optional

from absl import logging
import tensorflow as tf

from estimator_towers.merge import prediction_audit
from estimator_towers.towers import tower_effects
from estimator_towers.update import gradient_routing as calls
from estimator_towers.update import one_update

tf1 = tf.compat.v1

# Ops that take values from the input pipeline: the first step must not run
# them again past the batch the check read and feeds back.
INPUT_OPS = frozenset([
    'IteratorGetNext', 'IteratorGetNextSync', 'IteratorGetNextAsOptional',
    'QueueDequeue', 'QueueDequeueV2', 'QueueDequeueMany',
    'QueueDequeueManyV2', 'QueueDequeueUpTo', 'QueueDequeueUpToV2',
    'ReaderRead', 'ReaderReadV2', 'ReaderReadUpTo', 'ReaderReadUpToV2'])
# A placeholder needs a hook's feed (the check's run has none); one with a
# default may get one, and then the check must not feed what it feeds.
_NEEDS_FEED = frozenset(['Placeholder'])
_MAY_BE_FED = frozenset(['Placeholder', 'PlaceholderWithDefault'])


@contextlib.contextmanager
def discarding_updates() -> Iterator[List[tf.Tensor]]:
  """Inside, optimizer calls build no update and record their loss.

  A gradient call returns zeros and an update or apply call a no-op, as for
  a tower before the last (one_update): the copy of the model_fn built
  inside only computes its losses. Gradients with respect to tensors are
  the model's own and are computed.

  Yields:
    The losses of the optimizer calls made inside, in call order.
  """
  losses = []
  graph, thread = tf1.get_default_graph(), threading.get_ident()

  def handle(call: calls.Call):
    if (tf1.get_default_graph() is not graph or
        threading.get_ident() != thread):
      return call.run()
    if call.name == 'gradients' and (
        calls.variables_of_gradients_call(call) is None):
      return call.run()
    if call.kind == calls.APPLY:
      return tf.no_op(name='update_discarded')
    losses.append(one_update.loss_of(call))
    return one_update.placeholder(call)

  with calls.routed(handle):
    yield losses


def refusal(fetched: Iterable[tf.Tensor], step: Iterable,
            inputs: List[tf.Tensor]) -> Optional[str]:
  """Why the check cannot run before the first step; None if it can.

  Args:
    fetched: What the check's run computes (losses and inputs).
    step: What the first step runs (train_op, loss, summaries).
    inputs: The features' and labels' tensors fed back to the first step.
  """
  if not inputs:
    return 'the model_fn gets no features or labels to feed back'
  graph = inputs[0].graph
  for tensor in inputs:
    if not graph.is_feedable(tensor):
      return f'the input {tensor.name} cannot be fed'
  for op in _closure([t.op for t in fetched], frozenset()):
    why = _repeats(op)
    if why:
      return f'its run would {why} ({op.type} {op.name})'
  for op in _closure([t.op for t in inputs], frozenset()):
    if op.type in _MAY_BE_FED:
      return (f'the features or labels come from {op.type} {op.name}, '
              'which another hook may feed')
  fed = frozenset(t.name for t in inputs)
  for op in _closure([getattr(s, 'op', s) for s in step], fed):
    if op.type in INPUT_OPS:
      return (f'the first step reads the input pipeline ({op.type} '
              f'{op.name}) past the features and labels')
  return None


def _repeats(op: tf.Operation) -> Optional[str]:
  """What running `op` once more before the first step would change."""
  if op.type in tower_effects.WRITES or op.type.startswith(
      tower_effects.APPLIES) or (op.type in tower_effects.CALLS and
                                 tower_effects.calls_write(op)):
    return 'write a variable'
  if tower_effects.draws(op):
    return 'draw random numbers again'
  if op.type in _NEEDS_FEED:
    return 'need a value fed by another hook'
  return None


def _closure(ops: List[tf.Operation],
             fed: frozenset) -> Iterator[tf.Operation]:
  """Every op running `ops` runs, but upstream of the `fed` tensors."""
  pending, seen = list(ops), set()
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    yield op
    pending.extend(t.op for t in op.inputs if t.name not in fed)
    pending.extend(op.control_inputs)


class FirstStepCheck(tf1.train.SessionRunHook):
  """Compares training losses with one device's before the first step.

  Args:
    inputs: The features' and labels' tensors (composites flattened).
    merged: {name: the towers' merged loss}.
    one_device: {name: the same loss of the model_fn run once on the whole
      batch}.
    unproven: {name: the op the walk could not follow}, for messages.
  """

  def __init__(self, inputs: List[tf.Tensor], merged: Dict[str, tf.Tensor],
               one_device: Dict[str, tf.Tensor],
               unproven: Mapping[str, tf.Operation]):
    self._inputs = list(inputs)
    self._merged = merged
    self._one_device = one_device
    self._unproven = dict(unproven)
    self._checked = False

  def before_run(self, run_context):
    if self._checked:
      return None
    self._checked = True
    # The session under the hooks: this run is not a step.
    batch, merged, one_device = run_context.session.run(
        (self._inputs, self._merged, self._one_device))
    for name in sorted(merged):
      found = prediction_audit.difference(merged[name], one_device[name],
                                          self._merged[name].dtype)
      if found:
        op = self._unproven[name]
        raise ValueError(
            f"The training {name} is not one device's: on the first batch "
            f'{found}. It is computed through {op.type} {op.name!r}, which '
            'replicate_model_fn cannot follow, so it compared the first '
            'batch with the model_fn run once on the whole batch, before '
            'any update. ' + prediction_audit.LOSS_ADVICE + ' (A loss that '
            'draws random numbers where the wrapper cannot see them, such '
            'as np.random in a py_function, differs by its draws alone: '
            'pass check_first_batch=False.)')
    logging.info('First training batch: the towers\' %s equal one '
                 "device's.", ', '.join(sorted(merged)))
    return tf1.train.SessionRunArgs(
        fetches=None, feed_dict=dict(zip(self._inputs, batch)))


def skipped(why: str, names: Iterable[str]) -> None:
  """Says in the log that the losses `names` go unchecked, and why."""
  logging.warning(
      'replicate_model_fn cannot check the training %s against one device '
      'on the first batch: %s. It is computed through an op the wrapper '
      'cannot follow; if it picks, orders or pairs the rows of its batch, '
      'the towers train differently from one device.',
      ', '.join(sorted(names)), why)

