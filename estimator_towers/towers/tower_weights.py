"""Weights that make the towers' losses add up to the global batch's loss.

loss_reduction reads how each tower's loss reduces its examples (a sum, or
a ratio of a sum by a count of the shard); this module turns that reading
into what the wrapper multiplies each tower's loss by:

* a sum: 1 per tower with examples (0 for an idle tower);
* a ratio with one divisor per tower: `D_t / sum(D)`, the tower's share of
  the whole batch's divisor (summed over the tasks of a synchronous cluster);
* several ratio terms, or a divisor known only after every tower's forward
  pass: each ratio term is rebuilt over the whole batch's divisor
  (`spread_exactly`), or weighed by the towers' shares of the examples.

`TowerWeights` is the object the tower build asks, once per loss.
"""

import contextlib
from typing import Callable, Dict, List, Optional

import tensorflow as tf

from estimator_towers.graph import op_ledger
from estimator_towers.graph import reductions as graph_reductions
from estimator_towers.towers import divisor_totals
from estimator_towers.towers import keras_masks
from estimator_towers.towers import loss_reduction

tf1 = tf.compat.v1


def exact_weights(losses: List[tf.Tensor],
                  reductions: List[loss_reduction.Reduction],
                  active: tf.Tensor, total_of=None, depends_on=None
                  ) -> Optional[List[tf.Tensor]]:
  """Tower weights that make the weighted sum the global-batch loss.

  Args:
    losses: The towers' losses.
    reductions: `analyze` of each, all SUM or all RATIO.
    active: A bool per tower: False for idle towers (their weight is 0).
    total_of: Turns this task's total divisor into the global batch's (a
      sum over the tasks of a synchronous cluster); None on one machine.
    depends_on: Per tower, its `ExampleDependence`: a divisor bounded by a
      constant (`max(S_t, 1)`) is then weighed against the whole batch's.

  Returns:
    For SUM, 1 for active towers. For RATIO with one divisor per tower,
    `D_t / sum(D)` over active towers. None when the towers' losses have
    several ratio terms each (the caller falls back to example shares).
  """
  num = len(losses)
  kind = reductions[0].kind
  if kind == loss_reduction.SUM:
    return [tf.where(active[t], tf.ones([], loss.dtype),
                     tf.zeros([], loss.dtype))
            for t, loss in enumerate(losses)]
  if any(len(r.divisors) != 1 for r in reductions):
    return None
  return _ratio_weights(reductions, active, total_of, depends_on)[2]


def _ratio_weights(reductions: List[loss_reduction.Reduction],
                   active: tf.Tensor, total_of,
                   depends_on: Optional[List] = None, term: int = 0) -> tuple:
  """`exact_weights` of one-ratio losses, and the whole batch's divisor.

  The weights (each tower's divisor over their sum) add up to 1. The
  divisor one device would divide by is their sum, or, for a divisor
  written as a sum plus or bounded by a constant (`max(sum, 1)`), that
  expression of the towers' summed sums (divisor_totals).

  Args:
    reductions: `analyze` of each tower's value.
    active: A bool per tower: False for idle towers.
    total_of: Turns this task's total into the global batch's, or None.
    depends_on: Per tower, its `ExampleDependence` (to read a divisor's
      expression); None takes the sum of the divisors.
    term: Which ratio term's divisors.

  Returns:
    (weights, divisor, shares): the shares are each tower's divisor over
    the whole batch's, which add up to 1 only when the divisor is a sum
    (`max(S_t, 1)` of towers without positives adds 1 per tower).
  """
  divisors = [r.divisors[term] for r in reductions]
  # float64 divisors are totalled in float64: weights of 1e-60 add up to 0
  # in float32, which made the weights equal (0.009 off one device).
  wide = (tf.float64 if any(d.dtype.base_dtype == tf.float64
                            for d in divisors) else tf.float32)

  def active_values(values):
    return [tf.where(active[t], tf.cast(tf.stop_gradient(v), wide),
                     tf.zeros([], wide)) for t, v in enumerate(values)]

  def summed(counts):
    total = tf.add_n(counts)
    return total if total_of is None else total_of(total)

  def narrow(values):
    return [tf.cast(v, tf.float32) for v in values]

  counts = active_values(divisors)
  live = [tf.cast(active[t], wide) for t in range(len(divisors))]
  # One sum (one collective in a cluster) for the divisors and the towers.
  total, towers = tf.unstack(summed([tf.stack([count, alive])
                                     for count, alive in zip(counts, live)]))
  # A batch whose divisor is 0 (every weight 0): the ratios are 0 (or NaN)
  # in every tower as on one device, and the terms that do not depend on
  # the examples (a regularization loss) must still add up to one device's
  # once, which weights of 0 / 0 would drop: equal weights then.
  weights = [tf.where(tf.not_equal(total, 0.0),
                      tf.math.divide_no_nan(count, total),
                      tf.math.divide_no_nan(alive, towers))
             for count, alive in zip(counts, live)]
  found = [None]
  if depends_on is not None:
    found = [_divisor_parts(d, depends) for d, depends in zip(divisors,
                                                             depends_on)]
  if any(f is None for f in found):
    return narrow(weights), total, narrow(weights)
  divisor = tf.cast(
      found[0].rebuild(summed(active_values([f.sum for f in found]))), wide)
  return narrow(weights), divisor, narrow(
      [tf.math.divide_no_nan(count, divisor) for count in counts])


def _divisor_parts(divisor: tf.Tensor, depends
                   ) -> Optional[divisor_totals.Divisor]:
  """A divisor as an expression of one sum over the examples; None for a
  count the analysis built (its sum is the divisors' sum).

  Raises:
    ValueError: a divisor the model_fn wrote is no such expression (the
      towers' divisors would not add up to one device's).
  """
  written = divisor.op.name.rsplit('/', 1)[-1].startswith(
      loss_reduction.WRITTEN_DIVISOR)
  if not written:
    return None
  inner = divisor.op.inputs[0]
  if not depends(inner):
    return None  # A count a static shape fixed.
  found = divisor_totals.parts(inner, loss_reduction.varies(depends),
                              lambda t: loss_reduction.is_plain_sum(t, depends))
  if found is None:
    raise ValueError(
        f'A loss (or metric) divides by {inner.op.name!r}, which is neither '
        'a sum over the examples (a count, a sum of weights) nor such a sum '
        'plus, or bounded by, a constant (tf.maximum(tf.reduce_sum(w), '
        "1.0)): each tower would divide by its own shard's value and no "
        'weighting of the towers gives the one-device loss. Divide by such '
        'a sum, or train on one device.')
  return found


def spread_exactly(values: List[tf.Tensor],
                   reductions: List[loss_reduction.Reduction],
                   active: List[tf.Tensor], depends_on: List
                   ) -> Optional[List[tf.Tensor]]:
  """Each value with every ratio N_k / D_k built as N_k / the batch's D_k.

  The weighted value N_t / D_t * D_t / total is built as N_t / total, so a
  tower whose D_t is 0 (a shard without positives, or whose weights are all
  0) still adds its numerator, as one device's N / D counts it. The total
  is divided by as the value divides: `tf.math.divide_no_nan` gives 0 for a
  batch whose total is 0, a plain division NaN, as on one device. Several
  ratios (BERT pretraining's two means) each get their own total.

  Args:
    values: The towers' values (e.g. a metric's adds), all RATIO.
    reductions: `analyze` of each.
    active: Per tower, whether its shard has examples.
    depends_on: Per tower, its `ExampleDependence`.

  Returns:
    The weighted values, or None when the towers' values have other
    numbers of ratio terms or cannot be rebuilt (the caller weighs them
    instead).
  """
  terms = len(reductions[0].divisors)
  if any(len(r.ratios) != terms or len(r.divisors) != terms or
         not _spreadable(v, r, d)
         for v, r, d in zip(values, reductions, depends_on)):
    return None
  parts = [_ratio_weights(reductions, active, None, depends_on, k)
           for k in range(terms)]
  spread = []
  for t, (value, reduction) in enumerate(zip(values, reductions)):
    ratios = {}
    for (_, total, _), ratio, divisor in zip(parts, reduction.ratios,
                                             reduction.divisors):
      reciprocal = (_reciprocal(ratio, total) if ratio.op.type == 'DivNoNan'
                    else tf.math.reciprocal(total))
      ratios[ratio.name] = (tf.where(active[t], reciprocal,
                                     tf.zeros_like(reciprocal)), divisor)
    # Terms that do not depend on the examples: weights adding up to 1.
    rebuilt = _spread(value, ratios, parts[0][0][t], depends_on[t], [0])
    if rebuilt is None:
      return None
    spread.append(rebuilt)
  return spread


def _reciprocal(ratio: tf.Tensor, total: tf.Tensor) -> tf.Tensor:
  """1 / the whole batch's divisor of `ratio`, 0 for a total of 0, but for
  Keras' masked mean: it divides by its elements with divide_no_nan, but
  by the valid tokens' sum plainly (a batch without one is NaN, as one
  device's)."""
  if keras_masks.masked_mean(ratio.op) is not None:
    return tf.math.reciprocal(total)
  return tf.math.reciprocal_no_nan(total)


def proportional_weights(values: List[tf.Tensor],
                         reductions: List[loss_reduction.Reduction],
                         active: List[tf.Tensor],
                         refusal: str) -> List[tf.Tensor]:
  """Tower weights for values with several ratio terms, checked at run time.

  A difference of two means over the tower's examples (a Wasserstein GAN's
  discriminator loss: mean(D(fake)) - mean(D(real))) has two divisors per
  tower. Weighing tower t by its share of the first divisor gives the
  whole batch's value exactly when every other term's divisors split over
  the towers in the same shares (two means over the shard's rows); the
  assertion checks it at run time instead of guessing.

  Args:
    values: The towers' values (all RATIO, as many terms each).
    reductions: `analyze` of each.
    active: A bool per tower: False for idle towers (their weight is 0).
    refusal: The assertion's message when the shares differ.

  Returns:
    One scalar float32 weight per tower.

  Raises:
    ValueError: the towers' values have different numbers of terms.
  """
  terms = len(reductions[0].divisors)
  if any(len(r.divisors) != terms for r in reductions):
    raise ValueError(f'The towers\' values {values[0].op.name!r} have '
                     'different numbers of terms; every tower must build one '
                     'model.')
  fractions = []
  for k in range(terms):
    counts = [tf.where(active[t],
                       tf.cast(tf.stop_gradient(r.divisors[k]), tf.float32),
                       0.0) for t, r in enumerate(reductions)]
    fractions.append(tf.math.divide_no_nan(tf.stack(counts), tf.add_n(counts)))
  checks = [tf.debugging.assert_near(f, fractions[0], atol=1e-6,
                                     message=refusal)
            for f in fractions[1:]]
  with tf.control_dependencies(checks):
    return tf.unstack(tf.identity(fractions[0]), num=len(values))


def _spread(tensor: tf.Tensor, ratios: Dict[str, tf.Tensor], weight: tf.Tensor,
            depends, budget: List[int],
            guards: Optional[Dict[str, tuple]] = None,
            sums: frozenset = frozenset()) -> Optional[tf.Tensor]:
  """`tensor * weight` with each ratio N / D computed as N / total.

  `weight` (D / total for one ratio, the tower's share of the examples for
  several) multiplies the terms that do not depend on the examples, and
  each ratio term becomes its numerator times 1 / its whole-batch divisor,
  which has no 0 / 0 when D is 0 (when every D is, 1 / total is 0: a global
  sum of no weights, which tf.compat.v1.losses make 0 too). Follows the ops
  `analyze` reads; None for any other.

  Args:
    tensor: The loss, or a part of it on the way to the ratios.
    ratios: Each ratio term's tensor name -> (1 / the whole batch's divisor
      of that term (0 for idle towers), the tower's divisor of it).
    weight: The tower's weight.
    depends: The tower's `ExampleDependence`.
    budget: Ops walked so far (a one-element list).
    guards: Each guard's tensor name -> (the kept input's position, the
      whole batch's condition): the guard is rebuilt with that condition.
    sums: The op names of a guarded SUM loss's sum terms (weighed as they
      are).

  Returns:
    The weighted tensor, or None.
  """
  budget[0] += 1
  op = tensor.op
  guards = guards or {}
  if op.name in sums:
    return tensor * tf.cast(weight, tensor.dtype)
  if tensor.name in guards:
    kept, condition = guards[tensor.name]
    inner = _spread(op.inputs[kept], ratios, weight, depends, budget, guards,
                    sums)
    if inner is None:
      return None
    zeros = tf.zeros_like(inner)
    return (tf.where(condition, inner, zeros) if kept == 1 else
            tf.where(condition, zeros, inner))
  if tensor.name in ratios:
    reciprocal, divisor = ratios[tensor.name]
    if op.type in graph_reductions.DIVIDE:
      # Keras' masked mean's own numerator is scaled by the shard's mask.
      masked = keras_masks.masked_mean(op)
      numerator = (op.inputs[0] if masked is None else
                   keras_masks.unscaled_sum(masked))
      return tf.cast(numerator * tf.cast(reciprocal, numerator.dtype),
                     tensor.dtype)
    # A mean: its count times 1 / the whole batch's.
    return tensor * tf.cast(tf.stop_gradient(divisor) * tf.cast(
        reciprocal, divisor.dtype), tensor.dtype)
  if not depends(tensor):
    return tensor * tf.cast(weight, tensor.dtype)
  if budget[0] > loss_reduction.MAX_OPS:
    return None
  spread = lambda t: _spread(t, ratios, weight, depends, budget, guards,  # pylint: disable=unnecessary-lambda-assignment
                             sums)
  if op.type in graph_reductions.DIVIDE and not depends(op.inputs[1]):
    inner = spread(op.inputs[0])
    return None if inner is None else inner / op.inputs[1]
  if op.type in loss_reduction.SCALES:
    varying = [t for t in op.inputs if depends(t)]
    fixed = [t for t in op.inputs if not depends(t)]
    inner = spread(varying[0]) if len(varying) == 1 else None
    return None if inner is None else inner * fixed[0]
  if op.type in loss_reduction.ADDS:
    inner = [spread(t) for t in op.inputs]
  elif (op.type in loss_reduction.PASS_THROUGH or
        loss_reduction.reduces_a_scalar(tensor)):
    inner = [spread(op.inputs[0])]
  else:
    inner = [None]
  if any(t is None for t in inner):
    return None
  return _rebuild(op, tensor, inner)


def _outside_control_inputs(losses: List[tf.Tensor]):
  """Where the weights of `losses` are built: outside the control inputs
  the model_fn wrapped its optimizer call in (its batch-norm updates), which
  counting examples never waits for, so the merged loss can be computed
  without running them (first_step_check). Inside a loop or a conditional
  the weights stay in its context."""
  if any(loss.op._control_flow_context is not None for loss in losses):  # pylint: disable=protected-access
    return contextlib.nullcontext()
  return tf1.get_default_graph().control_dependencies(None)


def _keeping_control_inputs(loss: tf.Tensor, rebuilt: tf.Tensor,
                            since: op_ledger.Mark) -> tf.Tensor:
  """`rebuilt`, run after what the ops of `loss` it replaced waited for.

  A model_fn may order its loss after other work: `with
  tf.control_dependencies(update_ops): loss = tf.identity(loss)` runs the
  batch-norm updates whenever the loss is. The rebuilt loss reuses the
  tensors below the ratios, not the ops above them, so their control
  inputs are carried over (the towers' moving statistics never moved).
  """
  kept = op_ledger.ancestors([rebuilt.op], since)
  waited, pending, seen = set(), [loss.op], set()
  while pending:
    op = pending.pop()
    if op in kept or op in seen or op_ledger.made_before(op, since):
      continue
    seen.add(op)
    waited.update(c for c in op.control_inputs if c not in kept)
    pending.extend(t.op for t in op.inputs)
  if not waited:
    return rebuilt
  with tf.control_dependencies(op_ledger.by_creation(waited)):
    return tf.identity(rebuilt)


def _spreadable(loss: tf.Tensor, reduction: loss_reduction.Reduction,
                depends) -> bool:
  """Whether `_spread` can rebuild `loss` around its ratio terms."""
  ratios = {r.name for r in reduction.ratios}
  guards = {g.name: g.kept for g in reduction.guards}
  sums = set(reduction.sums) if reduction.kind == loss_reduction.SUM else set()
  pending, seen = [loss], 0
  while pending:
    tensor = pending.pop()
    seen += 1
    op = tensor.op
    if tensor.name in ratios or op.name in sums or not depends(tensor):
      continue
    if seen > loss_reduction.MAX_OPS:
      return False
    if tensor.name in guards:
      pending.append(op.inputs[guards[tensor.name]])
    elif op.type in graph_reductions.DIVIDE and not depends(op.inputs[1]):
      pending.append(op.inputs[0])
    elif op.type in loss_reduction.SCALES:
      varying = [t for t in op.inputs if depends(t)]
      if len(varying) != 1:
        return False
      pending.append(varying[0])
    elif op.type in loss_reduction.ADDS:
      pending.extend(op.inputs)
    elif (op.type in loss_reduction.PASS_THROUGH or
          loss_reduction.reduces_a_scalar(tensor)):
      pending.append(op.inputs[0])
    else:
      return False
  return True


def _rebuild(op: tf.Operation, tensor: tf.Tensor, inner: List[tf.Tensor]
             ) -> tf.Tensor:
  """`op` (an addition or a pass-through) applied to new inputs."""
  if op.type in ('Add', 'AddV2'):
    return tf.add(inner[0], inner[1])  # Broadcasts, as the op did.
  if op.type == 'AddN':
    return tf.add_n(inner)
  if op.type == 'Sub':
    return inner[0] - inner[1]
  if op.type == 'Neg':
    return -inner[0]
  if op.type == 'StopGradient':
    return tf.stop_gradient(inner[0])
  return tf.reshape(tf.cast(inner[0], tensor.dtype), tf.shape(tensor))


class TowerWeights:
  """Weights the towers' losses so that they add up to the global-batch loss.

  Args:
    requested: 'auto' (read the reduction off each loss; an unreadable one
      is an error), 'mean' or 'sum' (what the user says the loss is; checked
      against the graph where it can be read).
    sizes: Each tower's number of real examples (an int32 vector).
    shards: Each tower's features and labels.
    towers: Where each tower's ops begin (an `op_ledger.TowerLedger`).
    task_group: The training tasks, whose towers share the global batch
      (a task_sync.TaskGroup in a synchronous cluster, else
      one_machine.OneMachine).
    in_advance: The weights the one update differentiates with must be
      known before any tower's forward pass (micro-batches run one after
      another, so a tower's backward pass cannot wait for a later tower's
      divisor): `terms` then weighs by the towers' shares of the examples
      (a sum: 1 each), and `checks` holds, per loss, an assertion that the
      exact weights equal those, for the update's writes to wait for.
  """

  def __init__(self, requested: str, sizes: tf.Tensor, shards: List,
               towers: op_ledger.TowerLedger, task_group,
               in_advance: bool = False):
    self._requested = requested
    self._task_group = task_group
    self._sizes = sizes
    self._shards = shards
    self._towers = towers
    self._in_advance = in_advance
    self._cache: Dict[tuple, List[tf.Tensor]] = {}
    self._kinds: Dict[tuple, str] = {}
    self._reductions: Dict[tuple, List[loss_reduction.Reduction]] = {}
    # Per loss, each ratio term's whole-batch divisor.
    self._totals: Dict[tuple, List[tf.Tensor]] = {}
    # Per one-ratio loss, each tower's divisor over the whole batch's.
    self._divisor_shares: Dict[tuple, List[tf.Tensor]] = {}
    self._advance_cache: Dict[tuple, List[tf.Tensor]] = {}
    # Per guarded loss, per tower: guard name -> (kept input, the whole
    # batch's condition).
    self._guards: Dict[tuple, List[Dict[str, tuple]]] = {}
    self.checks: List[tf.Operation] = []

  def __call__(self, losses: List[tf.Tensor]) -> List[tf.Tensor]:
    """One scalar weight per tower for these losses (one per tower).

    Raises:
      ValueError: the requested reduction contradicts the loss, or the loss
        is a sum that adds a term counted once per tower (regularization).
    """
    key = tuple(id(loss) for loss in losses)
    if key not in self._cache:
      with _outside_control_inputs(losses):
        self._cache[key] = self._weights(losses, key)
    return self._cache[key]

  def reductions_resolved(self) -> List[str]:
    """The reduction each loss weighed so far was read as, in order."""
    return list(self._kinds.values())

  def terms(self, losses: List[tf.Tensor],
            place: Optional[Callable[[Callable[[int], tf.Tensor]],
                                     List[tf.Tensor]]] = None
            ) -> List[tf.Tensor]:
    """Each tower's loss times its weight; their sum is the global loss.

    What the one update differentiates: an idle tower's term is its loss
    (of a padding copy, finite) times a zero weight.

    Args:
      losses: The towers' losses of one optimizer call.
      place: Builds [fn(t) for every tower t] where the terms must live
        (each on its tower's device, for all_reduce); None builds them in
        order under the current device.

    Returns:
      One term per tower.
    """
    if self._in_advance:
      weights = self._known_in_advance(losses)
      weighted = lambda t: losses[t] * tf.cast(weights[t], losses[t].dtype)  # pylint: disable=unnecessary-lambda-assignment
    else:
      weighted = self._weighted(losses)
    if place is None:
      return [weighted(t) for t in range(len(losses))]
    return place(weighted)

  def merged_loss(self, losses: List[tf.Tensor]) -> tf.Tensor:
    """The global-batch loss the merged spec reports, idle towers left out.

    An idle tower's loss may be NaN (the mean of nothing); `tf.where` drops
    it instead of multiplying it by zero.

    Args:
      losses: The towers' spec losses.

    Returns:
      The weighted sum.
    """
    weighted = self._weighted(losses)
    terms = []
    for i, loss in enumerate(losses):
      term = weighted(i)
      terms.append(tf.where(self._sizes[i] > 0, term, tf.zeros_like(term)))
    return tf.add_n(terms, name='tower_weighted_loss')

  def _weighted(self, losses: List[tf.Tensor]
                ) -> Callable[[int], tf.Tensor]:
    """Builds tower t's loss times its weight, as `weighted(t)`.

    For a loss of ratios N_k / D_k, each ratio's part is built as N_k /
    the whole batch's D_k: a tower whose D is 0 (every weight of its shard
    0) then adds 0, where its own N / D is 0 / 0, NaN in the loss and in
    the gradients, which a zero weight keeps. One device never divides by
    it. Terms that do not depend on the examples are weighed by `weights`
    (which add up to 1).
    """
    weights = self(losses)
    key = tuple(id(loss) for loss in losses)
    reductions = self._reductions[key]

    def weighted(t: int) -> tf.Tensor:
      weight = tf.cast(weights[t], losses[t].dtype)
      plain = losses[t] * weight
      reduction = reductions[t]
      guards = self._guards[key][t] if key in self._guards else None
      if key not in self._totals and not guards:
        return plain
      # An idle tower (a padding copy) counts for nothing: a tf.where
      # would still send its unselected branch's zero gradient through
      # N / D, so the reciprocal of the total is 0 instead.
      ratios = {ratio.name: (tf.where(self._sizes[t] > 0,
                                      _reciprocal(ratio, total), 0.0),
                             divisor)
                for ratio, divisor, total in zip(
                    reduction.ratios, reduction.divisors,
                    self._totals.get(key, []))}
      sums = frozenset(reduction.sums
                       if reduction.kind == loss_reduction.SUM else ())
      rebuilt = _spread(losses[t], ratios, weight, self._depends(t), [0],
                        guards, sums)
      if rebuilt is None and guards:  # `_weights` checked it can be.
        raise AssertionError(f'unspreadable guarded loss {losses[t].name}')
      if rebuilt is None:
        return plain
      return _keeping_control_inputs(losses[t], rebuilt,
                                     self._towers.start(t))

    return weighted

  def _depends(self, tower: int) -> 'ExampleDependence':
    return loss_reduction.ExampleDependence(self._shards[tower],
                                            self._towers.start(tower))

  def _known_in_advance(self, losses: List[tf.Tensor]) -> List[tf.Tensor]:
    """Weights from the split alone, checked against the exact ones.

    A mean's exact weights divide each tower's divisor by their sum; the
    divisor may be read off the tower's activations (`tf.size` of them), so
    a tower's weight would wait for every tower's forward pass. The shares
    of the examples equal them whenever every divisor counts the examples
    (a plain mean); a weighted mean (a weight column, a token mask) is
    caught by the check before the update writes.
    """
    key = tuple(id(loss) for loss in losses)
    if key in self._advance_cache:
      return self._advance_cache[key]
    exact = self(losses)
    if self._kinds[key] == loss_reduction.SUM:  # From the sizes only already.
      weights = exact
    else:
      # Against the whole batch's divisor: max(S_t, 1) of micro-batches
      # without positives is 1 each, proportional to nothing.
      exact = tf.stack(self._divisor_shares.get(key, exact))
      weights = self._shares()
      near = tf.reduce_all(tf.abs(exact - tf.stack(weights)) <=
                           1e-6 + 1e-5 * tf.abs(tf.stack(weights)))
      if key in self._totals:
        # A batch whose divisor is 0 (every weight 0) has only ratios of 0
        # and example-free terms, which any weights adding up to 1 count
        # once: the shares of the examples are exact then.
        near = tf.logical_or(tf.equal(self._totals[key][0], 0.0), near)
      check = tf.debugging.Assert(near, [
          f'The loss {losses[0].op.name!r} divides by a count that is '
          "not proportional to the micro-batches' numbers of examples "
          '(a weighted mean: a weight column, a token mask). With '
          'micro_batches > 1 the micro-batches run one after another, '
          'so their losses are weighed by their shares of the examples, '
          'which would not give the one-device loss: use '
          'micro_batches=1, or make the loss a sum, or a plain mean.'])
      with tf.control_dependencies([check]):
        self.checks.append(tf.no_op(name='weights_known_in_advance'))
    self._advance_cache[key] = weights
    return weights

  def _weights(self, losses: List[tf.Tensor], key: tuple
               ) -> List[tf.Tensor]:
    depends = [self._depends(t) for t in range(len(losses))]
    reductions = [loss_reduction.analyze(loss, depends[t], guards=True)
                  for t, loss in enumerate(losses)]
    kind = self._resolve(losses[0], reductions)
    if self._requested == 'auto':
      loss_reduction.warn_of_a_written_size_product(losses[0], depends[0])
    self._kinds[key] = kind
    self._reductions[key] = reductions
    active = self._sizes > 0
    if any(r.guards for r in reductions):
      self._guards[key] = self._guard_conditions(losses, reductions, depends,
                                                 active)
    if kind == loss_reduction.SUM:
      return [tf.where(active[t], tf.ones([], loss.dtype),
                       tf.zeros([], loss.dtype))
              for t, loss in enumerate(losses)]
    if not all(r.kind == loss_reduction.RATIO for r in reductions):
      if key in self._guards:
        raise ValueError(
            f'The loss {losses[0].op.name!r} is guarded by a tf.where on a '
            'sum over the examples, and what it guards is no sum or mean '
            "over them that the towers could rebuild with the whole batch's "
            'condition. Write it as a sum or mean inside one tf.where, or '
            'train on one device.')
      return self._shares()
    terms = len(reductions[0].divisors)
    if terms == 1:
      exact, total, shares = _ratio_weights(reductions, active,
                                            self._total_of, depends)
      self._totals[key] = [total]
      self._divisor_shares[key] = shares
      return exact
    if self._in_advance or any(
        len(r.divisors) != terms or len(r.ratios) != terms or
        not _spreadable(loss, r, d) for loss, r, d in zip(
            losses, reductions, depends)):
      return self._shares_checked(reductions, losses[0], depends)
    # Several ratios (a masked-LM mean plus a next-sentence mean): each
    # divided by its own whole-batch divisor, exact whatever their shares.
    self._totals[key] = [_ratio_weights(reductions, active, self._total_of,
                                        depends, term)[1]
                         for term in range(terms)]
    return self._shares()

  def _guard_conditions(self, losses: List[tf.Tensor],
                        reductions: List[loss_reduction.Reduction],
                        depends: List,
                        active: tf.Tensor) -> List[Dict[str, tuple]]:
    """Per tower, its guards with the whole batch's conditions.

    Raises:
      ValueError: the guarded loss cannot be rebuilt around its guards
        (the towers would each apply their own shard's condition).
    """
    name = losses[0].op.name
    guard = reductions[0].guards[0].name.split(':')[0]

    def refusal(why: str) -> ValueError:
      return ValueError(
          f'The loss {name!r} is guarded by tf.where ({guard!r}) on a sum '
          f'over the examples, and {why}. Under replicate_model_fn each '
          "tower's guard must take the whole batch's condition, as one "
          'device applies it. Write the loss as a sum or mean over the '
          'examples inside one tf.where, or train on one device.')

    if self._in_advance:
      raise refusal('micro_batches > 1 weighs the micro-batches before '
                    'their conditions are known')
    if any(len(r.guards) != len(reductions[0].guards) for r in reductions) or (
        not all(_spreadable(loss, r, d)
                for loss, r, d in zip(losses, reductions, depends))):
      raise refusal('its terms are combined in a way the towers cannot '
                    'rebuild')
    if len({r.kind for r in reductions}) != 1 or reductions[0].kind not in (
        loss_reduction.SUM, loss_reduction.RATIO):
      raise refusal('it is neither a sum nor a mean over the examples '
                    'inside the guard')
    conditions = []
    for k, guard in enumerate(reductions[0].guards):
      if guard.condition is None:  # The same in every tower.
        conditions.append(None)
        continue
      # In the sum's own dtype: float32 would round a float64 sum (or a
      # large int64 count) before the comparison.
      sums = []
      for t, r in enumerate(reductions):
        value = tf.stop_gradient(r.guards[k].condition.sum)
        sums.append(tf.where(active[t], value, tf.zeros_like(value)))
      conditions.append(guard.condition.rebuild(
          self._total_of(tf.add_n(sums))))
    result = []
    for t, reduction in enumerate(reductions):
      own = {}
      for guard, condition in zip(reduction.guards, conditions):
        if condition is None:
          condition = losses[t].graph.get_tensor_by_name(
              guard.name).op.inputs[0]
        own[guard.name] = (guard.kept, condition)
      result.append(own)
    return result

  def _resolve(self, loss: tf.Tensor,
               reductions: List[loss_reduction.Reduction]) -> str:
    """The reduction to weigh by: SUM or RATIO (a mean)."""
    found = reductions[0]
    kinds = {r.kind for r in reductions}
    if len(kinds) > 1:
      found = loss_reduction.Reduction(loss_reduction.UNKNOWN,
                                       detail='towers reduce differently')
    name = loss.op.name
    if found.kind == loss_reduction.SUM and found.constant_terms:
      raise ValueError(
          f'The loss {name!r} is a sum over the examples plus terms that do '
          'not depend on them (e.g. regularization). Each tower would count '
          'those terms once, so the towers cannot add up to the one-device '
          'loss. Make the loss a mean (e.g. loss_reduction='
          'tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE in a canned '
          'Estimator), or add the regularization outside the sum.')
    unsplittable = [r for r in reductions if not r.splittable]
    if unsplittable:
      raise ValueError(
          f'The loss {name!r}: {unsplittable[0].detail}. Towers weigh and '
          "add their shards' losses, and no weights add up to this one (nor "
          f'does any loss_reduction). {unsplittable[0].remedy}')
    requested = {'mean': loss_reduction.RATIO,
                 'sum': loss_reduction.SUM}.get(self._requested)
    if all(r.example_free for r in reductions):
      if requested == loss_reduction.SUM:
        raise ValueError(
            f"loss_reduction='sum', but the loss {name!r} does not depend "
            'on the examples (a loss of the weights alone, a constant): '
            'every tower computes the same value, which a sum would count '
            "once per tower. Leave loss_reduction at 'auto'.")
      # Weighed by the towers' shares of the examples, which add up to 1,
      # the towers' equal values give it once, as one device does.
      return loss_reduction.RATIO
    if found.kind == loss_reduction.UNKNOWN:
      if requested is None:
        # Guessing would train a summed loss with shrunk gradients, silently.
        raise ValueError(
            f'replicate_model_fn cannot tell how the loss {name!r} reduces '
            f'its examples ({found.detail}), so it cannot tell how the '
            "towers' losses add up. Pass loss_reduction='mean' if the loss "
            'is a mean over the batch\'s examples (the towers are then '
            "weighed by their shares of the examples, which a mean over "
            "weights or a count of positives is not: write it as "
            "tf.reduce_sum(loss * w) / tf.reduce_sum(w)), "
            "loss_reduction='sum' if it is a sum.")
      return requested
    if requested is not None and requested != found.kind:
      said = 'a sum' if found.kind == loss_reduction.SUM else 'a mean (a ratio)'
      raise ValueError(
          f"loss_reduction={self._requested!r}, but the loss {name!r} is "
          f'{said} over the examples ({found.detail}). Leave loss_reduction '
          "at 'auto', or pass the reduction the loss has.")
    return found.kind

  def _total_of(self, local: tf.Tensor) -> tf.Tensor:
    """The global batch's total of what `local` counts in this task."""
    return self._task_group.sum([local])[0]

  def _shares(self) -> List[tf.Tensor]:
    sizes = tf.cast(self._sizes, tf.float32)
    total = tf.maximum(self._total_of(tf.reduce_sum(sizes)), 1.0)
    return tf.unstack(sizes / total, num=len(self._shards))

  def _shares_checked(self, reductions: List[loss_reduction.Reduction],
                      loss: tf.Tensor, depends: List) -> List[tf.Tensor]:
    """Example shares, asserting at run time that they are exact.

    A loss with several ratio terms (two means, say) splits exactly by
    example shares only if every divisor is proportional to the examples
    (each tower's divisor over the whole batch's equals its share).
    """
    shares = self._shares()
    checks = []
    terms = len(reductions[0].divisors)
    if any(len(r.divisors) != terms for r in reductions):
      raise ValueError(f'The towers\' losses {loss.op.name!r} have different '
                       'numbers of terms; every tower must build one model.')
    active = self._sizes > 0
    for k in range(terms):
      fractions = _ratio_weights(reductions, active, self._total_of, depends,
                                 k)[2]
      checks.append(tf.debugging.assert_near(
          tf.stack(fractions), tf.stack(shares), atol=1e-6, message=(
              f'The loss {loss.op.name!r} adds several ratios whose divisors '
              'are not proportional to the towers\' numbers of examples (e.g. '
              'a sum of weighted means), so no weighting of the towers gives '
              'the one-device loss. Return one ratio (or a sum) as the loss.')))
    with tf.control_dependencies(checks):
      return [tf.identity(s) for s in shares]
