"""One optimizer update from the gradients of every tower.

The user's model_fn calls `optimizer.minimize(loss)` (or `compute_gradients`
then `apply_gradients`) once per tower, on the tower's share of the batch.
Wrapping the optimizer, as `TowerOptimizer` once required, is not needed:
while the towers are built, the two base-class methods of
`tf.compat.v1.train.Optimizer` are routed here.

* Towers before the last record their loss. They get zero gradients back
  (only their shapes matter: the update they feed is discarded) and a no-op
  for `apply_gradients`.
* The last tower's `compute_gradients` differentiates the weighted sum of all
  towers' losses - the global-batch loss of one device - in one call, with
  each gradient op colocated with its forward op, so every tower
  differentiates on its own device. The user's code then transforms these
  gradients (clipping, ...) as on one device, and its `apply_gradients`
  performs the one real update, creating slots under one-device names and
  advancing `global_step` once.

A model_fn may call the optimizer several times (e.g. a GAN's two losses):
calls are matched by their order within each tower.
"""

import contextlib
import threading
from typing import Callable, Dict, Iterator, List, Optional

import tensorflow as tf

tf1 = tf.compat.v1
_Optimizer = tf1.train.Optimizer


class OneUpdate:
  """Collects towers' optimizer calls and performs them as one update.

  Args:
    num_towers: How many towers call the model_fn.
    weigh: Given the towers' losses of one optimizer call, returns one scalar
      weight per tower such that the weighted sum is the global-batch loss.
    unshared: A context factory inside which new variables (slots) may be
      created in any tower; see `VariableSharing.unshared`.
  """

  def __init__(self, num_towers: int,
               weigh: Callable[[List[tf.Tensor]], List[tf.Tensor]],
               unshared: Callable[[], contextlib.AbstractContextManager]):
    self._num_towers = num_towers
    self._weigh = weigh
    self._unshared = unshared
    # Ops the model_fn made the optimizer calls depend on, per tower.
    self.call_dependencies: List[List[tf.Operation]] = [
        [] for _ in range(num_towers)]
    self._losses: Dict[int, Dict[int, tf.Tensor]] = {}
    self._tower: Optional[int] = None
    self._tower_name_scope = ''
    self._counts = {'compute': [0] * num_towers, 'apply': [0] * num_towers}
    self._graph = None
    self._thread = None
    self.applying = False

  @contextlib.contextmanager
  def routing(self) -> Iterator[None]:
    """Routes optimizer calls made in this graph and thread to this object."""
    self._graph = tf1.get_default_graph()
    self._thread = threading.get_ident()
    compute, apply = _Optimizer.compute_gradients, _Optimizer.apply_gradients
    outer = self

    def routed_compute(opt, loss, *args, **kwargs):
      if not outer._owns_call():
        return compute(opt, loss, *args, **kwargs)
      return outer._compute(compute, opt, loss, *args, **kwargs)

    def routed_apply(opt, grads_and_vars, *args, **kwargs):
      if not outer._owns_call():
        return apply(opt, grads_and_vars, *args, **kwargs)
      return outer._apply(apply, opt, grads_and_vars, *args, **kwargs)

    _Optimizer.compute_gradients = routed_compute
    _Optimizer.apply_gradients = routed_apply
    overriding = _overriding_subclasses()
    for cls in overriding:
      cls.apply_gradients = _refusing(cls, cls.__dict__['apply_gradients'],
                                      outer._owns_call)
    try:
      yield
    finally:
      _Optimizer.compute_gradients = compute
      _Optimizer.apply_gradients = apply
      for cls, method in overriding.items():
        cls.apply_gradients = method

  @contextlib.contextmanager
  def tower(self, index: int, name_scope: str) -> Iterator[None]:
    """Marks the optimizer calls made inside as tower `index`'s."""
    self._tower, self._tower_name_scope = index, name_scope
    try:
      yield
    finally:
      self._tower = None

  def _owns_call(self) -> bool:
    return (self._tower is not None and not self.applying and
            threading.get_ident() == self._thread and
            tf1.get_default_graph() is self._graph)

  def _compute(self, compute, opt, loss, var_list=None,
               gate_gradients=_Optimizer.GATE_OP, aggregation_method=None,
               colocate_gradients_with_ops=False, grad_loss=None):
    del colocate_gradients_with_ops  # Always colocated: see module doc.
    tower = self._tower
    call = self._counts['compute'][tower]
    self._counts['compute'][tower] += 1
    self._record_dependencies(tower)
    if callable(loss):
      raise TypeError(
          'replicate_model_fn needs the loss as a Tensor in graph mode; '
          f'compute_gradients got the callable {loss!r}.')
    self._losses.setdefault(call, {})[tower] = loss
    if tower < self._num_towers - 1:
      return [(_zeros_like(v), v) for v in _variables(var_list)]
    missing = [t for t in range(self._num_towers)
               if t not in self._losses[call]]
    if missing:
      raise ValueError(
          f'Optimizer call {call + 1} of the last tower has no counterpart in '
          f'towers {missing}: every tower must call the optimizer the same '
          'number of times.')
    self.applying = True
    try:
      # Under the user's own name scope, not the last tower's: the backward
      # pass spans every tower (each op on its tower's device).
      with tf1.get_default_graph().name_scope(self._unprefixed_scope()), \
          self._unshared():
        total = self._global_loss(call)
        return compute(opt, total, var_list=var_list,
                       gate_gradients=gate_gradients,
                       aggregation_method=aggregation_method,
                       colocate_gradients_with_ops=True, grad_loss=grad_loss)
    finally:
      self.applying = False

  def _global_loss(self, call: int) -> tf.Tensor:
    losses = [self._losses[call][t] for t in range(self._num_towers)]
    with tf.name_scope('global_loss'):
      weights = self._weigh(losses)
      return tf.add_n([
          loss * tf.cast(weight, loss.dtype)
          for loss, weight in zip(losses, weights)])

  def _record_dependencies(self, tower: int) -> None:
    """Remembers the control dependencies around a tower's optimizer call.

    An earlier tower's update is discarded, so what the model_fn made it
    wait for (asserts on the tower's shard, side effects) must run anyway.
    """
    graph = tf1.get_default_graph()
    # Private, but the only record of the enclosing control_dependencies.
    for controller in graph._control_dependencies_stack:  # pylint: disable=protected-access
      self.call_dependencies[tower].extend(controller.control_inputs)

  def _apply(self, apply, opt, grads_and_vars, global_step=None, name=None):
    tower = self._tower
    self._counts['apply'][tower] += 1
    self._record_dependencies(tower)
    if self._counts['apply'][tower] > self._counts['compute'][tower]:
      raise ValueError(
          'apply_gradients was called with gradients that did not come from '
          'Optimizer.compute_gradients. Under replicate_model_fn compute them '
          'with optimizer.compute_gradients(loss) (or call '
          'optimizer.minimize(loss)), so that they are the gradients of the '
          'whole batch.')
    if tower < self._num_towers - 1:
      return tf.no_op(name='update_in_last_tower')
    self.applying = True
    try:
      # Under the name scope the one-device model_fn would have used, so
      # slot and non-slot variables get checkpoint-compatible names.
      with tf1.get_default_graph().name_scope(self._unprefixed_scope()):
        with self._unshared():
          return apply(opt, grads_and_vars, global_step=global_step, name=name)
    finally:
      self.applying = False

  def _unprefixed_scope(self) -> str:
    scope = tf1.get_default_graph().get_name_scope()
    prefix = self._tower_name_scope
    if prefix and (scope == prefix or scope.startswith(prefix + '/')):
      scope = scope[len(prefix) + 1:]
    return scope + '/' if scope else ''

  def check_tower(self, index: int) -> None:
    """Fails when tower `index` did not use the optimizer like tower 0."""
    computed = self._counts['compute'][index]
    applied = self._counts['apply'][index]
    if index == 0 and computed == 0:
      raise ValueError(
          'In TRAIN mode, replicate_model_fn needs the train_op built by a '
          'tf.compat.v1.train.Optimizer: call optimizer.minimize(loss, '
          'global_step=...) or compute_gradients then apply_gradients. The '
          'model_fn made no such call.')
    if computed != self._counts['compute'][0]:
      raise ValueError(
          f'Tower {index} called Optimizer.compute_gradients {computed} times '
          f'but tower 0 called it {self._counts["compute"][0]} times; every '
          'tower must build the same model.')
    if applied != computed:
      raise ValueError(
          f'Tower {index} called compute_gradients {computed} times but '
          f'apply_gradients {applied} times. Apply the gradients through the '
          'same optimizer (optimizer.apply_gradients) so that the towers make '
          'one update.')


def _overriding_subclasses() -> Dict[type, Callable]:
  """Optimizer classes with their own apply_gradients, and that method.

  Such optimizers (SyncReplicasOptimizer, loss-scaling or cross-shard
  wrappers) do their own aggregation around the update; called once per
  tower they would wait for each other or scale twice.
  """
  found, pending = {}, list(_Optimizer.__subclasses__())
  while pending:
    cls = pending.pop()
    pending.extend(cls.__subclasses__())
    if 'apply_gradients' in cls.__dict__:
      found[cls] = cls.__dict__['apply_gradients']
  return found


def _refusing(cls: type, method: Callable, owns_call: Callable[[], bool]):
  """`method`, failing clearly when called while towers are built."""

  def apply_gradients(opt, *args, **kwargs):
    if owns_call():
      raise ValueError(
          f'{cls.__name__} overrides Optimizer.apply_gradients to aggregate '
          'or transform the update itself, which replicate_model_fn cannot '
          'make into one update of the towers (SyncReplicasOptimizer would '
          'wait forever). Use the optimizer it wraps directly: the towers '
          'already aggregate the whole batch; for loss scaling, scale the '
          'loss in the model_fn. Or use RunConfig(train_distribute=...).')
    return method(opt, *args, **kwargs)

  return apply_gradients


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
