"""One optimizer update from the gradients of every tower.

The user's model_fn turns its loss into an update once per tower, on the
tower's share of the batch: `optimizer.minimize(loss)`, `compute_gradients`
then `apply_gradients`, `tf.gradients(loss, variables)` then an optimizer's
`apply_gradients`, Keras's `get_updates`, or an optimizer subclass that
overrides any of these with its own code. Wrapping the optimizer is not
needed: while the towers are built, those calls come here (see
gradient_routing), and the OUTERMOST such call of each tower is routed:

* Towers before the last record their loss. A gradient call gets zeros back
  (only their shapes matter: the update they feed is discarded), an update
  call a no-op.
* The last tower's call is made with the weighted sum of all towers' losses
  - the global-batch loss of one device - in place of its own loss, or, for
  `apply_gradients`, with the global-batch gradients an earlier routed call
  returned. So a transformation between the calls (clipping by global norm)
  sees one device's gradients, and an overriding `minimize` that checks its
  loss sees one device's loss. Calls made inside it (a wrapper delegating to
  the optimizer it wraps, the base methods an override calls) run with what
  they are given, under the same rules: gradients are computed with each
  gradient op colocated with its forward op, so every tower differentiates
  on its own device, and `apply_gradients` performs the one real update,
  creating slots under one-device names and advancing `global_step` once.

A model_fn may make several such calls (e.g. a GAN's two losses): calls are
matched by their order within each tower. Gradients the routing returned
must not feed back into a tower's loss or predictions (a penalty on the
weights' gradient): earlier towers hold zeros there, so that is an error.

What a gradient or update call does with the variables is the aggregation
strategy's gradient path (see aggregation/strategies.py): with one shared
set, a gradient call differentiates the global loss once and an update runs
as made; with the 'all_reduce' copies, a gradient call differentiates each
tower's part w.r.t. its copies and all-reduces the gradients, and the base
`apply_gradients` updates every copy (see aggregation/replicas.py).

Loss-scale optimizers are such wrappers. When the session's float16 rewrite
is on, the last tower's outermost call is made on a loss-scale wrapper of
the model_fn's optimizer instead; see loss_scaling.py.
"""

import contextlib
import logging
import threading
from typing import (Any, Callable, Dict, Iterator, List, NamedTuple,
                    Optional, Set, Tuple)

import tensorflow as tf

from estimator_towers.update import gradient_routing as calls
from estimator_towers.update import loss_scaling
from estimator_towers.graph import control_gate
from estimator_towers.graph import op_ledger
from estimator_towers.graph import stand_ins as stand_ins_lib
from estimator_towers.update import write_order

# A named logger, not absl's functions: their first call in a script
# configures the root logger, after which every TensorFlow record prints
# twice (through TensorFlow's own handler and the root's).
_log = logging.getLogger(__name__)

tf1 = tf.compat.v1
_SUMMARY_OPS = frozenset(['ScalarSummary', 'HistogramSummary',
                          'WriteScalarSummary', 'WriteHistogramSummary',
                          'WriteSummary'])
# The optimizers' gradient methods: their gradients must be applied through
# an optimizer (tf.gradients' may be used otherwise).
_OPTIMIZER_GRADIENT_METHODS = ('compute_gradients', 'get_gradients',
                               '_compute_gradients')


class OneUpdate:
  """Collects towers' optimizer calls and performs them as one update.

  Args:
    num_towers: How many towers call the model_fn.
    weights: The towers' loss weights (a tower_weights.TowerWeights),
      whose weighted terms add up to the global-batch loss.
    unshared: A context factory inside which new variables (slots) may be
      created in any tower; see `VariableSharing.unshared`.
    path: The aggregation strategy's gradient path: one shared set of
      variables (strategies.SharedVariables) or a copy per tower device
      (replica_path.ReplicaPath); see `strategies.Strategy.gradient_path`.
    has_rows: Whether this task's batch has any example (a bool scalar),
      for the gradients summed over the tasks of a cluster.
    training: False in EVAL and PREDICT: `tf.gradients` then stays each
      tower's own (what it computes may be an output; no update runs).
    automatic_loss_scale: Wrap the optimizers in a dynamic loss scale (the
      float16 rewrite is on); see loss_scaling.AutomaticScaling.
  """

  def __init__(self, num_towers: int,
               weights,
               unshared: Callable[[], contextlib.AbstractContextManager],
               path, has_rows: tf.Tensor, training: bool = True,
               automatic_loss_scale: bool = False):
    self._num_towers = num_towers
    self._training = training
    self._scaling = (loss_scaling.AutomaticScaling() if automatic_loss_scale
                     else None)
    self._weights = weights
    self._has_rows = has_rows
    self._unshared = unshared
    self._path = path
    # Ops the model_fn made the optimizer calls depend on, per tower.
    self.call_dependencies: List[List[tf.Operation]] = [
        [] for _ in range(num_towers)]
    self._losses: Dict[int, Dict[int, tf.Tensor]] = {}
    self._scopes: Dict[tuple, str] = {}
    self._tower: Optional[int] = None
    # Per tower: loss-taking calls, applies, optimizer gradient calls.
    self._counts = {key: [0] * num_towers
                    for key in ('losses', 'apply', 'optimizer_gradients')}
    self._routed_outputs: List[List[tf.Operation]] = [
        [] for _ in range(num_towers)]
    self._graph = None
    self._thread = None
    # The global loss of the call being made, and its per-tower terms.
    self._total: Optional[tf.Tensor] = None
    self._terms: List[tf.Tensor] = []
    self.applying = False
    # The ops of the last tower's routed calls: the one update, whose
    # writes are not a tower's writes from its shard.
    self._update_regions: List[op_ledger.Region] = []
    # The ops of the gradients and global losses built there: values of the
    # whole batch, though they read the last tower's activations.
    self._whole_batch_regions: List[op_ledger.Region] = []
    # The last tower's updates (minimize, get_updates, apply_gradients):
    # their results and regions.
    self._updates: List[Tuple[Any, op_ledger.Region]] = []
    # What earlier towers' update calls returned in place of the update.
    self.stand_ins = stand_ins_lib.StandIns()

  @contextlib.contextmanager
  def routing(self) -> Iterator[None]:
    """Routes optimizer calls made in this graph and thread to this object."""
    self._graph = tf1.get_default_graph()
    self._thread = threading.get_ident()
    with calls.routed(self._handle):
      yield

  @contextlib.contextmanager
  def tower(self, index: int, name_scope: str) -> Iterator[None]:
    """Marks the optimizer calls made inside as tower `index`'s."""
    del name_scope  # Tower 0's scope is recorded per call instead.
    self._tower = index
    try:
      yield
    finally:
      self._tower = None

  def _handle(self, call: calls.Call) -> Any:
    if self._tower is None or threading.get_ident() != self._thread:
      return call.run()
    graph = tf1.get_default_graph()
    if graph is not self._graph:
      if not self.applying and self._training:
        _refuse_nested_call(call, graph, self._graph)
      return call.run()
    if call.name == 'gradients':
      if not self._training:
        return call.run()
      variables = calls.variables_of_gradients_call(call)
      if variables is None:
        return call.run()  # Gradients w.r.t. tensors: the tower's own.
    refused = calls.refusal(call)
    if refused:
      raise ValueError(refused)
    if self.applying:
      return self._inner(call)
    if call.kind == calls.APPLY:
      return self._outer_apply(call)
    return self._outer_loss_call(call)

  # --------------------------------------------------------------------------
  # The outermost call of a tower.

  def _outer_loss_call(self, call: calls.Call) -> Any:
    """minimize, get_updates or a gradient call, as the towers' one call."""
    tower = self._tower
    loss = loss_of(call)
    index = self._counts['losses'][tower]
    self._counts['losses'][tower] += 1
    if call.kind == calls.UPDATE:
      self._counts['apply'][tower] += 1
    elif call.name in _OPTIMIZER_GRADIENT_METHODS:
      self._counts['optimizer_gradients'][tower] += 1
    key = ('loss', index)
    self._record_call(tower, key)
    self._losses.setdefault(index, {})[tower] = loss
    if tower < self._num_towers - 1:
      result = placeholder(call)
      if call.kind == calls.GRADIENTS:
        self._routed_outputs[tower].extend(_ops_of(result))
      else:
        for op in _operations_of(result):
          self.stand_ins.add(key, op)
      return result
    missing = [t for t in range(self._num_towers)
               if t not in self._losses[index]]
    if missing:
      raise ValueError(
          f'Optimizer call {index + 1} of the last tower has no counterpart '
          f'in towers {missing}: every tower must call the optimizer the '
          'same number of times.')
    with self._global_phase(key):
      total = self._global_loss(index)
      if self._scaled(call):
        result = self._scaling.run(call, {0: total})
      elif call.kind == calls.UPDATE:
        result = self._update(call, {0: total})
      else:
        result = (call.run({0: total}) if call.overriding
                  else self._differentiate(call, total))
      if call.kind == calls.GRADIENTS:
        self._routed_outputs[tower].extend(_ops_of(result))
    if call.kind == calls.UPDATE:
      self._add_update(key, result)
    return result

  def _outer_apply(self, call: calls.Call) -> Any:
    tower = self._tower
    index = self._counts['apply'][tower]
    self._counts['apply'][tower] += 1
    key = ('apply', index)
    self._record_call(tower, key)
    if self._counts['apply'][tower] > self._counts['losses'][tower]:
      raise ValueError(
          f'{call.qualified_name} was called more often than the model_fn '
          'computed gradients: replicate_model_fn pairs each '
          'apply_gradients with one gradient call of its own, so gradients '
          'must come from optimizer.compute_gradients(loss) or '
          'tf.gradients(loss, variables) (Keras: optimizer.get_gradients, or '
          'call minimize / get_updates), and one gradient call cannot be '
          'split over several apply_gradients (e.g. layer-wise learning '
          'rates with two optimizers). Make one compute_gradients per '
          'optimizer (each with its var_list), or use one optimizer and '
          'scale the gradients of each variable before apply_gradients.')
    if tower < self._num_towers - 1:
      stand_in = tf.no_op(name='update_in_last_tower')
      self.stand_ins.add(key, stand_in)
      return stand_in
    with self._global_phase(key):
      if self._scaled(call):
        result = self._scaling.run(call)
      else:
        result = self._update(call)
    self._add_update(key, result)
    return result

  def _add_update(self, key: tuple, result) -> None:
    """Records the last tower's update for the call `key`."""
    self._updates.append((result, self._update_regions[-1]))
    self.stand_ins.set_real(key, _operations_of(result))

  def _scaled(self, call: calls.Call) -> bool:
    """Whether the last tower makes `call` on a loss-scale wrapper (whose
    methods come back here as inner calls)."""
    return self._scaling is not None and self._scaling.wraps(call)

  @contextlib.contextmanager
  def _global_phase(self, key: tuple) -> Iterator[None]:
    """The last tower's call: the one update, built once for every tower.

    Under tower 0's name scope, the one-device one: the backward pass spans
    every tower (each op on its tower's device), and slot and non-slot
    variables get checkpoint-compatible names.
    """
    self.applying = True
    try:
      # The model_fn's control inputs (its batch-norm updates) reach the
      # whole backward pass of every tower: through one op, not each.
      with control_gate.gated('update_control_inputs'), (
          op_ledger.region()) as update:
        self._update_regions.append(update)
        with self._first_tower_scope(key), self._unshared():
          yield
    finally:
      self.applying = False

  def update_op_names(self) -> Set[str]:
    """Names of the ops the last tower's routed calls created (the one
    update), which write variables once, from the whole batch."""
    graph = self._graph or tf1.get_default_graph()
    return {op.name for op in graph.get_operations()
            if op_ledger.in_any(op, self._update_regions)}

  def routed_gradients(self) -> Set[str]:
    """Names of the ops that give the towers' gradient calls their
    results: the last tower's whole-batch gradients, earlier towers' zeros
    (which only stand in: what earlier towers compute from them never
    runs)."""
    return {op.name for ops in self._routed_outputs for op in ops}

  def tower_losses(self) -> List[List[tf.Tensor]]:
    """Per optimizer call, in call order, each tower's loss."""
    return [[self._losses[call][t] for t in range(self._num_towers)]
            for call in sorted(self._losses)]

  def result_ops(self) -> List[tf.Operation]:
    """The ops that end the one update: what its optimizer calls returned."""
    return [op for result, _ in self._updates
            for op in _operations_of(result)]

  @contextlib.contextmanager
  def _whole_batch(self) -> Iterator[None]:
    """Marks the ops made inside as the whole batch's values."""
    with op_ledger.region() as whole_batch:
      self._whole_batch_regions.append(whole_batch)
      yield

  def check_batch_free_update(self, depends_on_shard: Callable[
      [tf.Tensor], bool]) -> None:
    """Fails when the one update reads the last tower's shard.

    The last tower builds the update for the whole batch, but a value it
    computes from its batch (a learning rate scaled by `tf.shape(x)[0]`,
    gradients divided by it) sees its share of the batch only.

    Args:
      depends_on_shard: Whether a tensor depends on the last tower's shard
        (a `loss_reduction.ExampleDependence` that stops at the one
        update's ops).

    Raises:
      ValueError: An input of the update depends on the last tower's shard.
    """
    if self._num_towers < 2:
      return
    for result, update in self._updates:
      pending, seen = _operations_of(result), set()
      while pending:
        op = pending.pop()
        if op.name in seen or op_ledger.in_any(op, self._whole_batch_regions):
          continue
        seen.add(op.name)
        if not update.contains(op):
          continue
        pending.extend(op.control_inputs)
        for tensor in op.inputs:
          if update.contains(tensor.op) or not depends_on_shard(tensor):
            pending.append(tensor.op)
            continue
          raise ValueError(
              f'The optimizer update reads {tensor.name} (in op {op.name}), '
              "which the model_fn computed from the tower's batch (e.g. "
              'from tf.shape(features)[0]). Under replicate_model_fn the '
              'last tower builds the one update of the whole batch, and '
              "there this value sees only that tower's share of the batch, "
              'not the whole batch. Use the static global batch size (from '
              'params or a Python constant) instead, or fold the scaling '
              'into the loss, which the wrapper weighs exactly.')

  # --------------------------------------------------------------------------
  # Calls made inside the last tower's outermost call, and the call itself.

  def _inner(self, call: calls.Call) -> Any:
    if call.kind == calls.GRADIENTS:
      if call.overriding:
        return call.run()
      return self._differentiate(call, loss_of(call))
    return self._update(call)

  def _differentiate(self, call: calls.Call, loss: tf.Tensor) -> Any:
    """A base gradient method's result for `loss`, on the towers' devices."""
    parts = _gradient_parts(call)
    with self._whole_batch():
      return self._path.differentiate(loss, parts, self._tower_terms,
                                      self._has_rows)

  def _tower_terms(self, loss: tf.Tensor) -> List[tf.Tensor]:
    """Per tower, a loss whose gradient w.r.t. the tower's copies is its
    part of `loss`'s gradient (asked by the all_reduce path).

    Each tower's weighted loss is differentiated w.r.t. its own copies only,
    as one device differentiates its loss once per variable. A loss derived
    from the global one (scaled by a wrapper) weighs each term by its
    derivative w.r.t. that term, which the chain rule asks for.
    """
    if loss is self._total:
      return self._terms
    slopes = calls.TF1_GRADIENTS(loss, self._terms)
    if all(slope is None for slope in slopes):
      return [loss] * self._num_towers  # Not of the towers' loss.
    return self._path.on_tower_devices(
        lambda t: self._terms[t] * tf.stop_gradient(slopes[t])
        if slopes[t] is not None else tf.zeros_like(self._terms[t]))

  def _update(self, call: calls.Call,
              replace: Optional[Dict[int, Any]] = None) -> Any:
    """An update call (minimize, get_updates, apply_gradients) made once."""
    return self._path.update(call, dict(replace or {}))

  # --------------------------------------------------------------------------
  # Bookkeeping.

  def _global_loss(self, call: int) -> tf.Tensor:
    """The weighted sum of the towers' losses of optimizer call `call`."""
    losses = [self._losses[call][t] for t in range(self._num_towers)]
    with tf.name_scope('global_loss'), self._whole_batch():
      self._terms = self._path.weighted_terms(self._weights, losses)
      self._total = tf.add_n(self._terms)
      return self._total

  def _record_call(self, tower: int, call: tuple) -> None:
    """Remembers the context of a tower's optimizer call.

    An earlier tower's update is discarded, so what the model_fn made it
    wait for (asserts on the tower's shard, side effects) must run anyway;
    and tower 0's name scope is the one-device one, under which the last
    tower builds the update (slot names in checkpoints depend on it).
    """
    graph = tf1.get_default_graph()
    if tower == 0:
      self._scopes[call] = graph.get_name_scope()
    # Private, but the only record of the enclosing control_dependencies.
    for controller in graph._control_dependencies_stack:  # pylint: disable=protected-access
      self.call_dependencies[tower].extend(controller.control_inputs)

  def _first_tower_scope(self, call: tuple):
    scope = self._scopes.get(call, '')
    return tf1.get_default_graph().name_scope(scope + '/' if scope else '')

  def check_tower(self, index: int,
                  spec: Optional[tf.estimator.EstimatorSpec] = None) -> None:
    """Fails when tower `index` did not use the optimizer like tower 0.

    Args:
      index: The tower.
      spec: Its EstimatorSpec, whose loss and predictions must not depend on
        the gradients the routing returned.

    Raises:
      ValueError: The tower made no routed call, not as many as tower 0,
        left an optimizer's gradients unapplied, or built its loss or
        predictions from routed gradients.
    """
    losses = self._counts['losses'][index]
    applied = self._counts['apply'][index]
    gradients = self._counts['optimizer_gradients'][index]
    written = (_trainable_variables_written(spec.train_op)
               if index == 0 and losses == 0 and spec is not None else [])
    if written:
      # An update the routing did not see: each tower's write would come
      # from its own shard, the last one's winning.
      raise ValueError(
          f'The train_op writes the trainable variables {written} without '
          'an optimizer call replicate_model_fn can combine, so each tower '
          "would write them from its own shard alone, not from the batch's "
          "(e.g. canned KMeans' centre updates from per-cluster sums, "
          'GradientTape gradients assigned by hand). Build the update with '
          'a tf.compat.v1.train.Optimizer (minimize, or compute_gradients '
          'or tf.gradients(loss, variables) then apply_gradients) or a '
          'tf.keras.optimizers.legacy optimizer (get_updates, minimize, or '
          'get_gradients then apply_gradients), or a subclass of either that '
          'overrides these methods (not methods replaced on the instance, '
          'such as a mock; the new tf.keras.optimizers apply GradientTape '
          'gradients the towers cannot combine), or train this model on '
          'one device. A train_op that only updates other state '
          '(global_step.assign_add(1), counters) needs no optimizer.')
    if (losses, applied) != (self._counts['losses'][0],
                             self._counts['apply'][0]):
      raise ValueError(
          f'Tower {index} made {losses} gradient or minimize calls and '
          f'{applied} updates, but tower 0 made '
          f'{self._counts["losses"][0]} and {self._counts["apply"][0]}; '
          'every tower must build the same model.')
    if applied < gradients:
      raise ValueError(
          f'Tower {index} called the optimizer\'s compute_gradients (or '
          f'get_gradients) {gradients} times but apply_gradients {applied} '
          'times. Apply the gradients through the same optimizer '
          '(optimizer.apply_gradients) so that the towers make one update.')
    if spec is not None:
      self._check_no_feedback(index, spec)

  def _check_no_feedback(self, index: int, spec) -> None:
    """Fails when routed gradients flow into the tower's loss or outputs."""
    tainted, pending = set(), list(self._routed_outputs[index])
    while pending:
      op = pending.pop()
      if op in tainted:
        continue
      tainted.add(op)
      for output in op.outputs:
        pending.extend(output.consumers())
    if not tainted:
      return
    if index == 0 and any(op.type in _SUMMARY_OPS for op in tainted):
      _log.warning(
          'A summary of tower 0 reads gradients of the loss w.r.t. '
          'variables; under replicate_model_fn they are the whole batch\'s '
          'only in the last tower, so TensorBoard shows zeros for them.')
    targets = [('the loss', spec.loss)]
    targets += [('a prediction', t) for t in tf.nest.flatten(spec.predictions)]
    targets += [('the loss given to an optimizer call', losses[index])
                for losses in self._losses.values() if index in losses]
    for what, tensor in targets:
      if isinstance(tensor, tf.Tensor) and tensor.op in tainted:
        raise ValueError(
            f'In tower {index}, {what} ({tensor.name}) depends on gradients '
            'of the loss with respect to variables (compute_gradients or '
            'tf.gradients). Under replicate_model_fn those are the whole '
            'batch\'s gradients, known only once every tower is built '
            '(earlier towers get zeros), so a loss built from them (a '
            'penalty on the weights\' gradient, a perturbation along it) '
            'cannot be split over towers. Gradients with respect to inputs '
            '(per example, as in a WGAN-GP penalty) are fine; train this '
            'model_fn on one device.')


def _refuse_nested_call(call: calls.Call, graph: tf.Graph,
                        towers_graph: tf.Graph) -> None:
  """Refuses a TRAIN optimizer call of the model_fn inside its `tf.cond`,
  `tf.while_loop` or `tf.function` (a graph nested in the towers' graph).

  Such a call cannot be routed: a tower's branch or loop body is its own
  function, whose result the last tower cannot combine with the others'.
  Run as it is, each tower would update from its own shard (under
  'global_loss' the last one's update wins; under 'all_reduce' one copy
  drifts or the all-reduce hangs), so it is refused under every aggregation.

  Args:
    call: The optimizer call, made in `graph`.
    graph: The graph the call is made in.
    towers_graph: The graph the towers are built in.

  Raises:
    ValueError: `graph` is nested in `towers_graph` and the call is not a
      `tf.gradients` w.r.t. tensors.
  """
  outer = graph
  while outer is not None and outer is not towers_graph:
    outer = getattr(outer, 'outer_graph', None)
  if outer is None:
    return  # Another graph altogether: not the towers' business.
  if call.name == 'gradients' and (
      calls.variables_of_gradients_call(call) is None):
    return  # Gradients w.r.t. tensors: the tower's own.
  raise ValueError(
      f'The model_fn calls {call.qualified_name} inside a tf.cond, '
      f'tf.while_loop or tf.function (in {graph.name}). replicate_model_fn '
      "turns each tower's optimizer calls into one update of the whole "
      'batch only when they are made in the model_fn itself: inside control '
      "flow each tower would update from its own shard alone, under every "
      'aggregation. Make the call outside the tf.cond, tf.while_loop or '
      'tf.function (e.g. compute the loss inside and return it, then '
      'minimize it outside; several inner steps become several calls '
      'in a Python loop), or train this model_fn on one device without '
      'replicate_model_fn.')


def _trainable_variables_written(train_op) -> List[str]:
  """The trainable variables the ops `train_op` runs write, by name."""
  if train_op is None:
    return []
  trainable = {v.op.name for v in (
      tf1.trainable_variables() +
      tf1.get_collection(tf1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))}
  written, seen, pending = set(), set(), [getattr(train_op, 'op', train_op)]
  while pending:
    op = pending.pop()
    if op in seen:
      continue
    seen.add(op)
    if write_order.writes(op):
      written.update(trainable & set(write_order.variables_taken(op)))
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  return sorted(written)


def loss_of(call: calls.Call) -> tf.Tensor:
  """The loss an optimizer or gradients call differentiates."""
  loss = call.get(0)
  if call.name == 'gradients':
    return tf.nest.flatten(loss)[0]
  if callable(loss):
    if not call.keras:
      raise TypeError(
          'replicate_model_fn needs the loss as a Tensor in graph mode; '
          f'{call.qualified_name} got the callable {loss!r}.')
    loss = loss()
  return loss


def _operations_of(result) -> List[tf.Operation]:
  return [getattr(item, 'op', item) for item in tf.nest.flatten(result)
          if isinstance(item, (tf.Tensor, tf.Operation))]


def _gradient_variables(call: calls.Call) -> List:
  """The variables a gradient call differentiates with respect to."""
  var_list = call.get(1)
  if callable(var_list):
    var_list = var_list()
  if call.name == 'compute_gradients':
    return _variables(var_list)
  return tf.nest.flatten(var_list)


def placeholder(call: calls.Call) -> Any:
  """What an earlier tower's call returns: zeros shaped like the gradients,
  or a no-op for an update (the update they would feed is not made)."""
  if call.kind == calls.UPDATE:
    op = tf.no_op(name='update_in_last_tower')
    return [op] if call.name == 'get_updates' else op
  variables = _gradient_variables(call)
  if call.name in ('compute_gradients', '_compute_gradients'):
    return [(_zeros_like(v), v) for v in variables]
  return [_zeros_like(v) for v in variables]


def _ops_of(result) -> List[tf.Operation]:
  ops = []
  for item in tf.nest.flatten(result, expand_composites=True):
    if isinstance(item, tf.Tensor):
      ops.append(item.op)
  return ops


class GradientParts(NamedTuple):
  """How a base gradient method computes the towers' gradients.

  Attributes:
    variables: The variables it differentiates with respect to.
    per_tower: (loss, variables) -> one gradient (or None) each, on the
      forward ops' devices.
    pack: A list of such gradients -> the method's result.
    direct: loss -> the method's result for one set of variables.
  """
  variables: List
  per_tower: Callable[[tf.Tensor, List], List[Optional[tf.Tensor]]]
  pack: Callable[[List], Any]
  direct: Callable[[tf.Tensor], Any]


def _gradient_parts(call: calls.Call) -> GradientParts:
  """The parts of the base gradient method `call` (see GradientParts)."""
  variables = _gradient_variables(call)
  opt = call.optimizer
  if call.name == 'compute_gradients':
    options = dict(
        gate_gradients=call.argument('gate_gradients'),
        aggregation_method=call.argument('aggregation_method'),
        colocate_gradients_with_ops=True,
        grad_loss=call.argument('grad_loss'))
    var_list = call.argument('var_list')

    def compute(loss, var_list):
      return call.run({0: loss, 'var_list': var_list, **options})

    return GradientParts(
        variables,
        lambda loss, vs: [g for g, _ in compute(loss, vs)],
        lambda grads: list(zip(grads, variables)),
        lambda loss: compute(loss, var_list))
  if call.name == 'gradients':
    options = {'grad_ys': call.argument('grad_ys'),
               'gate_gradients': call.argument('gate_gradients'),
               'aggregation_method': call.argument('aggregation_method'),
               'unconnected_gradients': call.argument(
                   'unconnected_gradients')}

    def differentiate(loss, vs):
      return calls.TF1_GRADIENTS(loss, vs, colocate_gradients_with_ops=True,
                                   **options)

    return GradientParts(variables, differentiate, list,
                         lambda loss: differentiate(loss, variables))
  require_all = call.name == 'get_gradients'
  grad_loss = None if require_all else call.argument('grad_loss')

  def keras(loss, vs):
    return _keras_gradients(opt, loss, vs, grad_loss, require_all)

  if require_all:
    return GradientParts(variables, keras, list,
                         lambda loss: keras(loss, variables))
  pair = lambda grads: list(zip(grads, variables))  # pylint: disable=unnecessary-lambda-assignment
  return GradientParts(variables, keras, pair,
                       lambda loss: pair(keras(loss, variables)))


def _variables(var_list) -> List[tf.Variable]:
  if var_list is None:
    var_list = (tf1.trainable_variables() +
                tf1.get_collection(tf1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
  seen, unique = set(), []
  for v in tf.nest.flatten(var_list):
    if id(v) not in seen:
      seen.add(id(v))
      unique.append(v)
  return unique


def _zeros_like(variable) -> tf.Tensor:
  shape = variable.shape
  if shape.is_fully_defined():
    return tf.zeros(shape, variable.dtype.base_dtype)
  return tf.zeros_like(variable)


def _keras_gradients(opt, total: tf.Tensor, variables: List, grad_loss,
                     require_all: bool) -> List[Optional[tf.Tensor]]:
  """Keras's gradients of `total`, each computed on its forward op's device."""
  # Private, but the name Keras gives its gradient scope.
  with tf.name_scope(opt._name + '/gradients'):  # pylint: disable=protected-access
    grads = calls.TF1_GRADIENTS(total, variables, grad_ys=grad_loss,
                                  colocate_gradients_with_ops=True)
  if require_all:
    for grad, variable in zip(grads, variables):
      if grad is None:
        raise ValueError(
            f'Variable {variable.name} has no gradient: the loss does not '
            'depend on it through differentiable ops.')
  return grads
