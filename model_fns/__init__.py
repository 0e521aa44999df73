"""Ready-made model_fns, each written for ONE device and configured by params.

Wrap any of them with `trainer.replicate_model_fn` to use every device.

Public API:
  get_model_fn: a model_fn by name (MODEL_NAMES) or 'package.module:function'.
  model_kind: 'tabular', 'image' or None (a user's model_fn) for a name.
  MODEL_NAMES: ('linear', 'dnn', 'wide_deep', 'cifar_cnn', 'resnet',
    'keras_app').
  make_optimizer: a tf.compat.v1.train optimizer by name.
  linear_model_fn, tabular_dnn_model_fn, dnn_model_fn, wide_deep_model_fn,
  cifar_cnn_model_fn, resnet_model_fn, keras_app_model_fn: the model_fns
  themselves.
"""

from model_fns.cifar_cnn import cifar_cnn_model_fn
from model_fns.dnn import dnn_model_fn
from model_fns.dnn import tabular_dnn_model_fn
from model_fns.head import make_optimizer
from model_fns.head import OPTIMIZER_NAMES
from model_fns.keras_app import keras_app_model_fn
from model_fns.linear import linear_model_fn
from model_fns.registry import get_model_fn
from model_fns.registry import MODEL_NAMES
from model_fns.registry import model_kind
from model_fns.resnet import resnet_model_fn
from model_fns.wide_deep import wide_deep_model_fn

__all__ = [
    'MODEL_NAMES', 'OPTIMIZER_NAMES', 'cifar_cnn_model_fn', 'dnn_model_fn',
    'get_model_fn', 'keras_app_model_fn', 'linear_model_fn', 'make_optimizer',
    'model_kind', 'resnet_model_fn', 'tabular_dnn_model_fn',
    'wide_deep_model_fn',
]
