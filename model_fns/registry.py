"""Model_fns by name: the ready-made ones, or a user's by import path."""

import importlib
from typing import Callable, Dict, Optional, Tuple

from model_fns import cifar_cnn
from model_fns import dnn
from model_fns import keras_app
from model_fns import linear
from model_fns import resnet
from model_fns import wide_deep

ModelFn = Callable[..., object]

# name -> (model_fn, kind of data it reads)
_MODELS: Dict[str, Tuple[ModelFn, str]] = {
    'linear': (linear.linear_model_fn, 'tabular'),
    'dnn': (dnn.tabular_dnn_model_fn, 'tabular'),
    'wide_deep': (wide_deep.wide_deep_model_fn, 'tabular'),
    'cifar_cnn': (cifar_cnn.cifar_cnn_model_fn, 'image'),
    'resnet': (resnet.resnet_model_fn, 'image'),
    'keras_app': (keras_app.keras_app_model_fn, 'image'),
}
MODEL_NAMES = tuple(_MODELS)
_PATH_FORM = "'package.module:function'"


def _unknown(name: object) -> ValueError:
  return ValueError(f'model {name!r} is neither one of {list(MODEL_NAMES)} nor '
                    f'an import path of the form {_PATH_FORM}.')


def _import_path(path: str) -> ModelFn:
  """The callable a 'package.module:attribute[.attribute]' path names."""
  module_name, _, attribute = path.partition(':')
  if not module_name or not attribute:
    raise ValueError(f'model {path!r} must be of the form {_PATH_FORM}, with '
                     'a module and a function name.')
  try:
    target = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f'model {path!r}: cannot import module {module_name!r} '
                     f'({e}); the form is {_PATH_FORM} with the module on '
                     'sys.path.') from e
  for part in attribute.split('.'):
    if not hasattr(target, part):
      raise ValueError(f'model {path!r}: {module_name!r} has no attribute '
                       f'{attribute!r}; the form is {_PATH_FORM}.')
    target = getattr(target, part)
  if not callable(target):
    raise ValueError(f'model {path!r} names a {type(target).__name__}, not a '
                     f'function; the form is {_PATH_FORM}, naming a model_fn.')
  return target


def get_model_fn(name: str) -> ModelFn:
  """A one-device model_fn by name.

  Args:
    name: One of MODEL_NAMES, or 'package.module:function' naming a user's
      model_fn (imported here).

  Returns:
    The model_fn, unwrapped (wrap it with trainer.replicate_model_fn).

  Raises:
    ValueError: the name is unknown, or the path cannot be imported or does
      not name a callable.
  """
  if not isinstance(name, str):
    raise _unknown(name)
  if name in _MODELS:
    return _MODELS[name][0]
  if ':' in name:
    return _import_path(name)
  raise _unknown(name)


def model_kind(name: str) -> Optional[str]:
  """'tabular' or 'image' for a ready-made model, None for a user's model_fn.

  Raises:
    ValueError: the name is neither in MODEL_NAMES nor an import path.
  """
  if isinstance(name, str) and name in _MODELS:
    return _MODELS[name][1]
  if isinstance(name, str) and ':' in name:
    return None
  raise _unknown(name)
