"""Seeing every call by which a model_fn turns its loss into an update.

While the towers are built, these calls are handed to one handler
(one_update.OneUpdate) instead of running:

* `tf.compat.v1.train.Optimizer`: `minimize`, `compute_gradients`,
  `apply_gradients`;
* Keras's legacy optimizers: `minimize`, `get_updates`, `get_gradients`,
  `_compute_gradients`, `apply_gradients`;
* the same methods of every subclass that defines its own version (a
  weight-decay Adam overriding `apply_gradients`, a test double overriding
  `minimize`, a wrapper delegating to another optimizer), whether the class
  existed before or is defined while the towers are built;
* `tf.gradients` and `tf.compat.v1.gradients`, as the public API modules
  expose them. TensorFlow's own calls to its internal gradients function
  (inside `compute_gradients`) are not seen, so nothing is routed twice.

Each call becomes a `Call`, which knows its kind (loss to gradients, loss to
update, gradients to update), its arguments and how to run the original.
"""

import contextlib
import inspect
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import tensorflow as tf

from estimator_towers.graph import patching

tf1 = tf.compat.v1

GRADIENTS = 'gradients'  # loss -> gradients
UPDATE = 'update'  # loss -> update op
APPLY = 'apply'  # gradients -> update op

_V1_METHODS = {'minimize': UPDATE, 'compute_gradients': GRADIENTS,
               'apply_gradients': APPLY}
_KERAS_METHODS = {'minimize': UPDATE, 'get_updates': UPDATE,
                  'get_gradients': GRADIENTS, '_compute_gradients': GRADIENTS,
                  'apply_gradients': APPLY}
_NEW_KERAS_METHODS = {'minimize': UPDATE, 'apply_gradients': APPLY}
# The public gradients functions, captured before any patching: the
# wrapper's own differentiation calls these.
TF1_GRADIENTS = tf1.gradients
TF2_GRADIENTS = tf.gradients


class Call:
  """One intercepted call: what it is, its arguments, how to run it.

  Attributes:
    kind: GRADIENTS, UPDATE or APPLY.
    name: The method's name ('minimize', 'apply_gradients', ...) or
      'gradients' for `tf.gradients`.
    qualified_name: e.g. 'AdamWeightDecay.apply_gradients', for messages.
    optimizer: The optimizer the method is called on; None for
      `tf.gradients`.
    overriding: Whether the method is a subclass's own version (its result
      is assumed to have the base method's form).
    keras: Whether the optimizer is a Keras legacy one.
  """

  def __init__(self, kind: str, name: str, owner: Optional[type],
               function: Callable, overriding: bool, keras: bool,
               args: tuple, kwargs: dict):
    self.kind = kind
    self.name = name
    self.qualified_name = f'{owner.__name__}.{name}' if owner else (
        'tf.gradients')
    self.optimizer = args[0] if owner else None
    self.overriding = overriding
    self.keras = keras
    self._function = function
    self._offset = 1 if owner else 0  # Skips `self`.
    self._signature = inspect.signature(function)
    self._bound = self._signature.bind(*args, **kwargs)
    self._names = list(self._signature.parameters)

  def get(self, index: int, default: Any = None) -> Any:
    """The value of the index-th argument after `self`."""
    position = index + self._offset
    if position >= len(self._names):
      return default
    name = self._names[position]
    parameter = self._signature.parameters[name]
    if parameter.kind == parameter.VAR_POSITIONAL:
      values = self._bound.arguments.get(name, ())
      return values[0] if values else default
    if parameter.kind == parameter.VAR_KEYWORD:
      return default
    if name in self._bound.arguments:
      return self._bound.arguments[name]
    if parameter.default is not parameter.empty:
      return parameter.default
    return default

  def argument(self, name: str, default: Any = None) -> Any:
    """The value of the argument called `name` (the base methods' names)."""
    if name in self._bound.arguments:
      return self._bound.arguments[name]
    parameter = self._signature.parameters.get(name)
    if parameter is not None and parameter.default is not parameter.empty:
      return parameter.default
    return default

  def run(self, replace: Optional[Dict[Any, Any]] = None) -> Any:
    """Runs the original with some arguments replaced.

    Args:
      replace: {index after self, or argument name: new value}.
    """
    bound = self._replaced(replace)
    return self._function(*bound.args, **bound.kwargs)

  def arguments(self, replace: Optional[Dict[Any, Any]] = None
                ) -> Tuple[tuple, dict]:
    """(args after self, kwargs), some replaced as in `run`: to make the
    same call on another object (a wrapper of the optimizer)."""
    bound = self._replaced(replace)
    return bound.args[self._offset:], bound.kwargs

  def _replaced(self, replace) -> inspect.BoundArguments:
    bound = inspect.BoundArguments(self._signature,
                                   dict(self._bound.arguments))
    for key, value in (replace or {}).items():
      name = key if isinstance(key, str) else self._names[key + self._offset]
      parameter = self._signature.parameters[name]
      if parameter.kind == parameter.VAR_POSITIONAL:
        value = (value,) + tuple(bound.arguments.get(name, ())[1:])
      bound.arguments[name] = value
    return bound


def keras_legacy_optimizer() -> Optional[type]:
  """The base class of Keras's legacy optimizers, if Keras is installed."""
  try:
    return tf.keras.optimizers.legacy.Optimizer
  except (AttributeError, ImportError):
    return None


def _keras_new_optimizer() -> Optional[type]:
  """The base class of the non-legacy Keras optimizers, if installed."""
  try:
    return tf.keras.optimizers.Optimizer
  except (AttributeError, ImportError):
    return None


def _bases() -> List[Tuple[type, Dict[str, str], bool]]:
  bases = [(tf1.train.Optimizer, _V1_METHODS, False)]
  keras = keras_legacy_optimizer()
  if keras is not None:
    bases.append((keras, _KERAS_METHODS, True))
  new = _keras_new_optimizer()
  if new is not None and new is not keras:
    # Only to refuse them (see `refusal`).
    bases.append((new, _NEW_KERAS_METHODS, True))
  return bases


class _Patches(patching.Patcher):
  """Routed attributes, for the graph and thread that create it."""

  def __init__(self, handler: Callable[[Call], Any]):
    super().__init__()
    self._handler = handler
    self._routed = set()

  def route_class(self, cls: type, base: type, methods: Dict[str, str],
                  keras: bool) -> None:
    """Routes the methods of `methods` that `cls` defines itself."""
    for name, kind in methods.items():
      function = cls.__dict__.get(name)
      if function is None or (cls, name) in self._routed:
        continue
      self._routed.add((cls, name))
      self.set(cls, name, self._method(cls, name, kind, function,
                                       cls is not base, keras))

  def _method(self, cls, name, kind, function, overriding, keras):
    handler = self._handler

    def routed(*args, **kwargs):
      return handler(Call(kind, name, cls, function, overriding, keras, args,
                          kwargs))

    # Another thread or graph building a model at the same time calls the
    # optimizer's own method.
    return self.guard(routed, function)

  def route_gradients_functions(self) -> None:
    """Routes `tf.gradients`/`tf.compat.v1.gradients` in every API module."""
    handler = self._handler
    for original in (TF1_GRADIENTS, TF2_GRADIENTS):

      def routed(*args, original=original, **kwargs):
        return handler(Call(GRADIENTS, 'gradients', None, original, False,
                            False, args, kwargs))

      for module in _api_modules_holding(original):
        self.set(module, 'gradients', self.guard(routed, original))


def _api_modules_holding(function) -> List[Any]:
  """The public API modules whose `gradients` is `function`."""
  return [module for module in _api_modules()
          if getattr(module, 'gradients', None) is function]


_API_MODULES = {'key': None, 'modules': []}


def _api_modules() -> List[Any]:
  """TensorFlow's public API modules loaded so far.

  Scanning sys.modules (thousands of entries) took 10 ms per model_fn
  call; the scan is redone only when a module was imported or removed
  since (sys.modules keeps insertion order: its size, or its last entry,
  changes).
  """
  last = next(reversed(sys.modules), None)
  key = (len(sys.modules), last, id(sys.modules.get(last)))
  if key != _API_MODULES['key']:
    _API_MODULES['modules'] = [
        module for name, module in list(sys.modules.items())
        if module is not None and (
            name == 'tensorflow' or name.startswith(('tensorflow._api.',
                                                     'tensorflow.compat')))]
    _API_MODULES['key'] = key
  return _API_MODULES['modules']


def _subclasses(base: type) -> Iterator[type]:
  pending, seen = list(base.__subclasses__()), set()
  while pending:
    cls = pending.pop()
    if cls in seen:
      continue
    seen.add(cls)
    pending.extend(cls.__subclasses__())
    yield cls


@contextlib.contextmanager
def routed(handler: Callable[[Call], Any]) -> Iterator[None]:
  """Inside, the calls listed in the module doc go to `handler`.

  The handler decides, for each `Call`, whether to run it (`call.run()`),
  change its arguments or return something else. Everything is put back on
  exit, also on error.
  """
  with _Patches(handler) as patches:
    for base, methods, keras in _bases():
      patches.route_class(base, base, methods, keras)
      for cls in _subclasses(base):
        patches.route_class(cls, base, methods, keras)
      patches.set(base, '__init_subclass__', classmethod(
          _subclass_hook(base, methods, keras, patches)))
    patches.route_gradients_functions()
    yield


def _subclass_hook(base, methods, keras, patches):
  """Routes the methods of a subclass defined while the towers are built."""

  def hook(cls, **kwargs):
    super(base, cls).__init_subclass__(**kwargs)
    if patches.owns():  # Not a class another thread or graph defines.
      patches.route_class(cls, base, methods, keras)

  return hook


# ----------------------------------------------------------------------------
# What can be routed.

def variables_of_gradients_call(call: Call) -> Optional[List]:
  """For `tf.gradients`: the variables to route, or None to let it run.

  Gradients of one scalar loss with respect to variables are the towers'
  business; gradients with respect to tensors (a gradient penalty on the
  inputs, per example) are the tower's own and run unchanged.

  Raises:
    ValueError: The call mixes variables and tensors, differentiates
      several or non-scalar tensors with respect to variables, or stops
      gradients at tensors of the tower.
  """
  xs = tf.nest.flatten(call.get(1))
  is_variable = [_is_variable(x) for x in xs]
  if not any(is_variable):
    return None
  if not all(is_variable):
    raise ValueError(
        'tf.gradients was given both variables and tensors as xs; under '
        'replicate_model_fn gradients of the loss with respect to variables '
        'are those of the whole batch, those with respect to tensors the '
        "tower's own. Make two calls.")
  ys = tf.nest.flatten(call.get(0))
  if len(ys) != 1 or ys[0].shape.rank not in (0, None):
    raise ValueError(
        f'tf.gradients({ys}, <variables>): replicate_model_fn routes '
        'gradients of one scalar loss with respect to variables (the '
        'whole batch\'s loss is a weighted sum of the towers\' scalar '
        'losses). Reduce the loss to a scalar first.')
  if call.argument('stop_gradients') is not None:
    raise ValueError(
        'tf.gradients(loss, <variables>, stop_gradients=...) cannot be made '
        'the whole batch\'s gradients: the stopped tensors belong to one '
        'tower. Apply tf.stop_gradient inside the loss instead.')
  return xs


def _is_variable(x) -> bool:
  from tensorflow.python.ops import variables as variables_lib  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  return isinstance(x, (tf.Variable, variables_lib.PartitionedVariable))


def refusal(call: Call) -> Optional[str]:
  """Why `call`'s optimizer cannot be made one update of the towers."""
  optimizer = call.optimizer
  if optimizer is None:
    return None
  name = type(optimizer).__name__
  new_keras = _keras_new_optimizer()
  legacy = keras_legacy_optimizer()
  if (new_keras is not None and new_keras is not legacy and
      isinstance(optimizer, new_keras)):
    return (
        f'{name} is one of the new (non-legacy) tf.keras.optimizers. In a '
        'graph-mode model_fn its apply_gradients returns only the increment '
        'of its step counter and never updates the weights: one device '
        'would run without training (its minimize fails there). Use '
        f'tf.keras.optimizers.legacy.{name} or a tf.compat.v1.train '
        'optimizer.')
  if isinstance(optimizer, tf1.train.SyncReplicasOptimizer):
    return (
        f'{name} aggregates gradients across worker replicas itself (it '
        'waits for replicas_to_aggregate of them each step), which '
        'replicate_model_fn cannot make into one update of its towers. Use '
        'the optimizer it wraps directly: the towers already make one update '
        'from the whole batch. To train synchronously across machines, use '
        'RunConfig(train_distribute=...).')
  cross_shard = getattr(getattr(tf1, 'tpu', None), 'CrossShardOptimizer',
                        None)
  if cross_shard is not None and isinstance(optimizer, cross_shard):
    return (
        f'{name} sums gradients across TPU shards with a cross-replica op '
        'that runs only on TPUs. Use the optimizer it wraps directly: the '
        'towers already make one update from the whole batch.')
  return None

