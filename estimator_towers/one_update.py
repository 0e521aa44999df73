"""One optimizer update from the gradients of every tower.

The user's model_fn calls `optimizer.minimize(loss)` (or `compute_gradients`
then `apply_gradients`) once per tower, on the tower's share of the batch.
Wrapping the optimizer, as `TowerOptimizer` once required, is not needed:
while the towers are built, the base-class gradient and apply methods of
`tf.compat.v1.train.Optimizer` and of Keras's legacy optimizers (which the
TF2 canned Estimators, heads and `model_to_estimator` use) are routed here.

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

With the 'all_reduce' aggregation (`replicas` given), the last tower's call
instead differentiates each tower's weighted loss w.r.t. that tower's copies
and all-reduces the gradients, and `apply_gradients` updates every copy; see
replicas.py.

Loss-scale optimizers, which wrap another one, are routed at their own
(outermost) call instead: see loss_scaling.py.
"""

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import tensorflow as tf

from estimator_towers import loss_scaling

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
    replicas: For the 'all_reduce' aggregation, the towers' copies of the
      variables (a `replicas.Replicas`); None for one shared set.
    automatic_loss_scale: Wrap the optimizers in a dynamic loss scale (the
      float16 rewrite is on); see loss_scaling.AutomaticScaling.
  """

  def __init__(self, num_towers: int,
               weigh: Callable[[List[tf.Tensor]], List[tf.Tensor]],
               unshared: Callable[[], contextlib.AbstractContextManager],
               replicas=None, automatic_loss_scale: bool = False):
    self._num_towers = num_towers
    self._scaling = (loss_scaling.AutomaticScaling() if automatic_loss_scale
                     else None)
    self._weigh = weigh
    self._unshared = unshared
    self._replicas = replicas
    # Ops the model_fn made the optimizer calls depend on, per tower.
    self.call_dependencies: List[List[tf.Operation]] = [
        [] for _ in range(num_towers)]
    self._losses: Dict[int, Dict[int, tf.Tensor]] = {}
    self._scopes: Dict[tuple, str] = {}
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
      return outer._compute(outer._scaled(compute, 'compute_gradients'), opt,
                            loss, *args, **kwargs)

    def routed_apply(opt, grads_and_vars, *args, **kwargs):
      if not outer._owns_call():
        return apply(opt, grads_and_vars, *args, **kwargs)
      return outer._apply(outer._scaled(apply, 'apply_gradients'), opt,
                          grads_and_vars, *args, **kwargs)

    patches = {(_Optimizer, 'compute_gradients'): routed_compute,
               (_Optimizer, 'apply_gradients'): routed_apply}
    patches.update(self._keras_patches())
    bases = [(_Optimizer, ('apply_gradients',))]
    if _keras_legacy_optimizer() is not None:
      bases.append((_keras_legacy_optimizer(),
                    ('apply_gradients', 'get_gradients', '_compute_gradients')))
    for base, names in bases:
      for (cls, name), method in _overriding_subclasses(base, names).items():
        patches[(cls, name)] = _refusing(cls, name, method, outer._owns_call)
    patches.update(self._loss_scale_patches())
    originals = {key: key[0].__dict__[key[1]] for key in patches}
    for (cls, name), method in patches.items():
      setattr(cls, name, method)
    try:
      yield
    finally:
      for (cls, name), method in originals.items():
        setattr(cls, name, method)

  def _keras_patches(self) -> Dict[tuple, Callable]:
    """Routes the legacy Keras optimizers the TF2 Estimators use.

    Their graph-mode path is `get_updates` = `get_gradients` then
    `apply_gradients`; `minimize` goes through `_compute_gradients`.
    """
    keras_optimizer = _keras_legacy_optimizer()
    if keras_optimizer is None:
      return {}
    get_gradients = keras_optimizer.get_gradients
    compute = keras_optimizer._compute_gradients  # pylint: disable=protected-access
    apply = keras_optimizer.apply_gradients
    outer = self

    def routed_get_gradients(opt, loss, params):
      if not outer._owns_call():
        return get_gradients(opt, loss, params)
      if outer._scaling is not None:
        return outer._get_gradients(outer._scaling.method('get_gradients'),
                                    opt, loss, params)
      params = tf.nest.flatten(params)
      return outer._gradients(
          loss, lambda: [_zeros_like(v) for v in params],
          lambda total: _keras_gradients(opt, total, params, None, True),
          params, lambda l, vs: _keras_gradients(opt, l, vs, None, True),
          lambda grads: grads)

    def routed_compute(opt, loss, var_list, grad_loss=None, tape=None):
      if not outer._owns_call():
        return compute(opt, loss, var_list, grad_loss=grad_loss, tape=tape)
      del tape  # Graph mode: tf.gradients sees every tower's ops.
      if outer._scaling is not None:
        raise ValueError(
            'The float16 rewrite is on (mixed_precision=\'float16\'), but '
            f'{type(opt).__name__}.minimize cannot be loss-scaled in graph '
            'mode; call optimizer.get_updates(loss, params) instead (as the '
            'TF2 canned Estimators do).')
      loss = loss() if callable(loss) else loss
      variables = tf.nest.flatten(var_list() if callable(var_list)
                                  else var_list)
      return outer._gradients(
          loss, lambda: [(_zeros_like(v), v) for v in variables],
          lambda total: list(zip(_keras_gradients(
              opt, total, variables, grad_loss, False), variables)),
          variables,
          lambda l, vs: _keras_gradients(opt, l, vs, grad_loss, False),
          lambda grads: list(zip(grads, variables)))

    def routed_apply(opt, grads_and_vars, *args, **kwargs):
      if not outer._owns_call():
        return apply(opt, grads_and_vars, *args, **kwargs)
      return outer._apply(outer._scaled(apply, 'apply_gradients'), opt,
                          grads_and_vars, *args, **kwargs)

    return {(keras_optimizer, 'get_gradients'): routed_get_gradients,
            (keras_optimizer, '_compute_gradients'): routed_compute,
            (keras_optimizer, 'apply_gradients'): routed_apply}

  def _loss_scale_patches(self) -> Dict[tuple, Callable]:
    """Routes a loss-scale wrapper's outermost calls; see loss_scaling.py.

    Its own method runs once, in the last tower, on the global-batch loss
    (or gradients); the calls it makes to the optimizer it wraps then pass
    through, since `applying` is set.
    """
    outer = self
    patches = {}
    for cls, names in loss_scaling.loss_scale_wrappers().items():
      for name in names:
        method = cls.__dict__[name]
        if name == 'compute_gradients':
          routed = _routed(method, outer._owns_call, outer._compute)
        elif name == 'apply_gradients':
          routed = _routed(method, outer._owns_call, outer._apply)
        else:  # Keras's get_gradients.
          routed = _routed(method, outer._owns_call, outer._get_gradients)
        patches[(cls, name)] = routed
    return patches

  def _scaled(self, method: Callable, name: str) -> Callable:
    """`method`, or its loss-scaled version when scaling is automatic."""
    return method if self._scaling is None else self._scaling.method(name)

  def _get_gradients(self, get_gradients, opt, loss, params):
    """A Keras loss-scale wrapper's get_gradients, as one call."""
    params = tf.nest.flatten(params)
    return self._gradients(
        loss, lambda: [_zeros_like(v) for v in params],
        lambda total: get_gradients(opt, total, params), params,
        lambda l, vs: get_gradients(opt, l, vs), lambda grads: grads)

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
    if callable(loss):
      raise TypeError(
          'replicate_model_fn needs the loss as a Tensor in graph mode; '
          f'compute_gradients got the callable {loss!r}.')
    variables = _variables(var_list)

    def per_tower(tower_loss, tower_variables):
      return [g for g, _ in compute(
          opt, tower_loss, var_list=tower_variables,
          gate_gradients=gate_gradients,
          aggregation_method=aggregation_method,
          colocate_gradients_with_ops=True, grad_loss=grad_loss)]

    return self._gradients(
        loss, lambda: [(_zeros_like(v), v) for v in variables],
        lambda total: compute(
            opt, total, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=True, grad_loss=grad_loss),
        variables, per_tower, lambda grads: list(zip(grads, variables)))

  def _gradients(self, loss: tf.Tensor, placeholder: Callable[[], Any],
                 differentiate: Callable[[tf.Tensor], Any],
                 variables: List, per_tower: Callable[[tf.Tensor, List], List],
                 pack: Callable[[List], Any]) -> Any:
    """One tower's gradient call.

    Args:
      loss: The tower's loss.
      placeholder: Returns what an earlier tower gets back: zeros shaped
        like the gradients (the update they would feed is not made).
      differentiate: Given the global-batch loss, returns the gradients in
        the form the optimizer's method returns them.
      variables: The variables the call differentiates with respect to.
      per_tower: (loss, variables) -> a gradient (or None) per variable;
        used by the all_reduce aggregation, once per tower.
      pack: Puts such a list of gradients in the form the optimizer's method
        returns.

    Returns:
      The placeholder for earlier towers; the global-batch gradients for
      the last tower.
    """
    tower = self._tower
    call = self._counts['compute'][tower]
    self._counts['compute'][tower] += 1
    self._record_call(tower, ('compute', call))
    self._losses.setdefault(call, {})[tower] = loss
    if tower < self._num_towers - 1:
      return placeholder()
    missing = [t for t in range(self._num_towers)
               if t not in self._losses[call]]
    if missing:
      raise ValueError(
          f'Optimizer call {call + 1} of the last tower has no counterpart in '
          f'towers {missing}: every tower must call the optimizer the same '
          'number of times.')
    self.applying = True
    try:
      # Under tower 0's name scope, the one-device one: the backward pass
      # spans every tower (each op on its tower's device).
      with self._first_tower_scope(('compute', call)), self._unshared():
        if self._replicas is not None:
          return pack(self._replicas.gradients(
              self._weighted_losses(call), variables, per_tower))
        return differentiate(self._global_loss(call))
    finally:
      self.applying = False

  def _global_loss(self, call: int) -> tf.Tensor:
    losses = [self._losses[call][t] for t in range(self._num_towers)]
    with tf.name_scope('global_loss'):
      weights = self._weigh(losses)
      return tf.add_n([
          loss * tf.cast(weight, loss.dtype)
          for loss, weight in zip(losses, weights)])

  def _weighted_losses(self, call: int) -> List[tf.Tensor]:
    """Each tower's loss times its weight, on the tower's device."""
    losses = [self._losses[call][t] for t in range(self._num_towers)]
    with tf.name_scope('weighted_losses'):
      weights = self._weigh(losses)
      return self._replicas.on_tower_devices(
          lambda t: losses[t] * tf.cast(weights[t], losses[t].dtype))

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

  def _apply(self, apply, opt, grads_and_vars, *args, **kwargs):
    tower = self._tower
    call = self._counts['apply'][tower]
    self._counts['apply'][tower] += 1
    self._record_call(tower, ('apply', call))
    if self._counts['apply'][tower] > self._counts['compute'][tower]:
      raise ValueError(
          'apply_gradients was called with gradients that did not come from '
          'the optimizer\'s own gradient method. Under replicate_model_fn '
          'compute them with optimizer.compute_gradients(loss) (Keras: '
          'optimizer.get_gradients, or call minimize / get_updates), so that '
          'they are the gradients of the whole batch.')
    if tower < self._num_towers - 1:
      return tf.no_op(name='update_in_last_tower')
    self.applying = True
    try:
      # Under the name scope the one-device model_fn used, so slot and
      # non-slot variables get checkpoint-compatible names.
      with self._first_tower_scope(('apply', call)), self._unshared():
        if self._replicas is None:
          return apply(opt, grads_and_vars, *args, **kwargs)
        graph = tf1.get_default_graph()
        first = _next_op_id(graph)
        with self._replicas.local_slots():
          # One call for every copy: slots, Adam's powers, Keras's
          # iterations and global_step advance once.
          op = apply(opt, self._replicas.expand(grads_and_vars), *args,
                     **kwargs)
        unused = self._replicas.unused_sums()
        if unused:
          op = tf.group(op, *unused)
        self._replicas.applied(opt, first, _next_op_id(graph))
        return op
    finally:
      self.applying = False

  def check_tower(self, index: int) -> None:
    """Fails when tower `index` did not use the optimizer like tower 0."""
    computed = self._counts['compute'][index]
    applied = self._counts['apply'][index]
    if index == 0 and computed == 0:
      raise ValueError(
          'In TRAIN mode, replicate_model_fn needs the train_op built by a '
          'tf.compat.v1.train.Optimizer (minimize, or compute_gradients then '
          'apply_gradients) or a tf.keras.optimizers.legacy optimizer '
          '(get_updates, minimize, or get_gradients then apply_gradients). '
          'The model_fn made no such call. The new tf.keras.optimizers '
          '(non-legacy) do not run in graph mode: use '
          'tf.keras.optimizers.legacy.')
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


def _next_op_id(graph: tf.Graph) -> int:
  # Private, but the only way to tell the update's ops from the model_fn's.
  return max(graph._nodes_by_id, default=0) + 1  # pylint: disable=protected-access


def _overriding_subclasses(base: type, names: Sequence[str]
                           ) -> Dict[tuple, Callable]:
  """Subclasses of `base` with their own version of a method in `names`.

  Returns:
    {(class, method name): the class's method}.

  Such optimizers (SyncReplicasOptimizer, Keras's LossScaleOptimizer,
  cross-shard wrappers) do their own aggregation or scaling around the
  update; called once per tower they would wait for each other or scale
  twice.
  """
  found, pending = {}, list(base.__subclasses__())
  while pending:
    cls = pending.pop()
    pending.extend(cls.__subclasses__())
    for name in names:
      if name in cls.__dict__:
        found[(cls, name)] = cls.__dict__[name]
  return found


def _routed(method: Callable, owns_call: Callable[[], bool],
            route: Callable) -> Callable:
  """`method`, handed to `route` when a tower's outermost call makes it."""

  def routed(opt, *args, **kwargs):
    if not owns_call():
      return method(opt, *args, **kwargs)
    return route(method, opt, *args, **kwargs)

  return routed


def _refusing(cls: type, name: str, method: Callable,
              owns_call: Callable[[], bool]):
  """`method`, failing clearly when called while towers are built."""

  def refusing(opt, *args, **kwargs):
    if owns_call():
      raise ValueError(
          f'{cls.__name__} overrides {name} to aggregate, scale or transform '
          'the update itself, which replicate_model_fn cannot make into one '
          'update of the towers (SyncReplicasOptimizer would wait forever). '
          'Use the optimizer it wraps directly: the towers already aggregate '
          'the whole batch. (Loss-scale optimizers work through their '
          'minimize/compute_gradients/apply_gradients, Keras ones through '
          'get_updates/get_gradients/apply_gradients.) Or use '
          'RunConfig(train_distribute=...).')
    return method(opt, *args, **kwargs)

  return refusing


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


def _keras_legacy_optimizer():
  """The base class of Keras's legacy optimizers, if Keras is installed."""
  try:
    return tf.keras.optimizers.legacy.Optimizer
  except (AttributeError, ImportError):
    return None


def _keras_gradients(opt, total: tf.Tensor, variables: List, grad_loss,
                     require_all: bool) -> List[Optional[tf.Tensor]]:
  """Keras's gradients of `total`, each computed on its forward op's device."""
  # Private, but the name Keras gives its gradient scope.
  with tf.name_scope(opt._name + '/gradients'):  # pylint: disable=protected-access
    grads = tf1.gradients(total, variables, grad_ys=grad_loss,
                          colocate_gradients_with_ops=True)
  if require_all:
    for grad, variable in zip(grads, variables):
      if grad is None:
        raise ValueError(
            f'Variable {variable.name} has no gradient: the loss does not '
            'depend on it through differentiable ops.')
  return grads
