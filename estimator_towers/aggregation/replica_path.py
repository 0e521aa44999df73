"""The all_reduce strategy's gradient path in TRAIN, over replicas.Replicas.

It has the methods of `strategies.SharedVariables`, the path of one shared
set of variables, so the builder and the one update call whichever the
strategy gave them and never ask which it is. Here each tower's part of the
loss is differentiated w.r.t. the tower's copies and the gradients are
all-reduced; the base `apply_gradients` updates every copy at once, and an
overriding update (the optimizer's own code) updates the primaries, after
which each copy is set from its primary; the merged spec's scaffold keeps
the copies identical from the start.
"""

from typing import Any, Callable, Dict, List

import tensorflow as tf

from estimator_towers.aggregation import replicas as replicas_lib
from estimator_towers.graph import op_ledger
from estimator_towers.update import gradient_routing as calls


class ReplicaPath:
  """The towers' gradients to the one update of every copy.

  Args:
    replicas: The copies of the TRAIN graph being built.
  """

  def __init__(self, replicas: replicas_lib.Replicas):
    self._replicas = replicas
    self._syncing = False  # Inside an overriding update of the primaries.

  def tower_variable(self, primary, tower: int):
    """What tower `tower` uses for `primary`: its copy if trainable."""
    return self._replicas.tower_variable(primary, tower)

  def primary_name(self, name: str, tower: int) -> str:
    """`name` without tower `tower`'s copy prefix (see Replicas)."""
    return self._replicas.primary_name(name, tower)

  def primary_of(self, variable):
    """The primary a tower's copy stands for (`variable` if none)."""
    return self._replicas.primary_of(variable)

  def on_tower_devices(self, fn: Callable[[int], Any]) -> List[Any]:
    """[fn(i) built on tower i's device for every tower i]."""
    return self._replicas.on_tower_devices(fn)

  def weighted_terms(self, weights, losses: List[tf.Tensor]
                     ) -> List[tf.Tensor]:
    """The towers' weighted losses, each on its tower's device: its copies'
    gradients start there."""
    return weights.terms(losses, self._replicas.on_tower_devices)

  def differentiate(self, loss: tf.Tensor, parts,
                    tower_terms: Callable[[tf.Tensor], List[tf.Tensor]],
                    has_rows: tf.Tensor) -> Any:
    """A base gradient method's result for `loss`: each tower's term
    differentiated w.r.t. its copies, the gradients all-reduced.

    Args:
      loss: The loss to differentiate (the global loss, or one derived
        from it by a wrapper).
      parts: The call's one_update.GradientParts.
      tower_terms: loss -> per tower, a loss whose gradient w.r.t. the
        tower's copies is its part of `loss`'s gradient.
      has_rows: Whether this task's batch has any example (a bool scalar).

    Returns:
      What the gradient method returns, with tower 0's sums.
    """
    return parts.pack(self._replicas.gradients(
        tower_terms(loss), parts.variables, parts.per_tower, has_rows))

  def update(self, call: calls.Call, replace: Dict) -> Any:
    """An update call (minimize, get_updates, apply_gradients) made once
    for every copy.

    The base apply_gradients takes every copy's gradients at once; an
    overriding update (its own code) updates the primaries, after which
    each copy is set from its primary; calls made inside that one run on
    the primaries.

    Args:
      call: The update call.
      replace: Arguments to replace (the global loss, for minimize).

    Returns:
      What the call returns (or an op running it and the copies' sync).
    """
    replace = dict(replace)
    if call.kind == calls.APPLY:
      grads_and_vars = list(call.get(0))
      if call.overriding or self._syncing:
        replace[0] = [(g, self._replicas.primary_of(v))
                      for g, v in grads_and_vars]
      else:
        return self._update_every_copy(call, grads_and_vars)
    if call.overriding and not self._syncing:
      return self._update_then_sync(call, replace)
    return call.run(replace)

  def _update_every_copy(self, call: calls.Call, grads_and_vars) -> Any:
    """The base apply_gradients, once for a list holding every copy."""
    with op_ledger.region() as update:
      with self._replicas.local_slots():
        # One call for every copy: slots, Adam's powers, Keras's iterations
        # and global_step advance once.
        op = call.run({0: self._replicas.expand(grads_and_vars)})
      unused = self._replicas.unused_sums()
      if unused:
        op = tf.group(op, *unused)
    self._replicas.applied(call.optimizer, update)
    return op

  def _update_then_sync(self, call: calls.Call, replace: Dict) -> Any:
    """An overriding update of the primaries, then copies set from them.

    Its own code may create variables (slots) and write them in ways the
    copies cannot mirror, so it updates only the primaries.
    """
    with op_ledger.region() as update:
      self._syncing = True
      try:
        result = call.run(replace)
      finally:
        self._syncing = False
      synced = self._replicas.sync_written(result, update.start,
                                           call.qualified_name)
    self._replicas.applied(None, update)
    if isinstance(result, (list, tuple)):
      return [synced]
    return synced

  def finish(self, spec: tf.estimator.EstimatorSpec,
             since: op_ledger.Mark) -> tf.estimator.EstimatorSpec:
    """`spec` whose scaffold keeps the copies identical, once the model_fn
    is known to write none of them itself (Replicas.check_no_other_writes)."""
    self._replicas.check_no_other_writes(since)
    self._replicas.check_saver(spec.scaffold.saver)
    return spec._replace(scaffold=self._replicas.scaffold(spec.scaffold))
