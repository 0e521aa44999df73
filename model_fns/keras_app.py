"""Any tf.keras.applications network as a classifier model_fn, for one device.

The application is built inside the model_fn from random weights
(`weights=None`: nothing is downloaded) without its ImageNet top
(`include_top=False, pooling='avg'`), and a Dense(n_classes) head makes the
logits: the applications' own top ends in a softmax, which the loss would
apply a second time.

Minimum image sizes (height and width, from keras.applications 2.15):
Xception 71; InceptionV3 and InceptionResNetV2 75; every other application
(VGG16/19, ResNet*, MobileNet*, DenseNet*, NASNet*, EfficientNet*, ConvNeXt*,
RegNet*) 32. Smaller images are refused with a ValueError.

Keras batch-norm layers do not put their moving-average updates in
UPDATE_OPS in graph mode; this model_fn adds them there, so the train op (and
`trainer.replicate_model_fn`, tower after tower) runs them.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional

import tensorflow as tf

from model_fns import hparams
from model_fns.head import classifier_spec

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys

MIN_IMAGE_SIZES = {'Xception': 71, 'InceptionV3': 75, 'InceptionResNetV2': 75}
DEFAULT_MIN_IMAGE_SIZE = 32
# These include their preprocessing layers, which expect pixels in [0, 255].
_PIXELS_0_255 = ('ConvNeXt', 'EfficientNet', 'MobileNetV3', 'RegNet',
                 'ResNetRS')


def application_names() -> List[str]:
  """The network constructors tf.keras.applications offers."""
  # Lower-case attributes are modules (e.g. mobilenet_v2), not networks.
  return sorted(name for name in dir(tf.keras.applications)
                if name[:1].isupper()
                and callable(getattr(tf.keras.applications, name)))


def min_image_size(name: str) -> int:
  """The smallest height and width application `name` accepts."""
  return MIN_IMAGE_SIZES.get(name, DEFAULT_MIN_IMAGE_SIZE)


def _application(params: Mapping[str, Any]) -> Callable[..., tf.keras.Model]:
  name = params.get('keras_application')
  names = application_names()
  if name not in names:
    raise ValueError(
        f"params['keras_application']={name!r} is not a network of "
        f'tf.keras.applications; use one of {names} (e.g. MobileNetV2, '
        'ResNet50, Xception, VGG16).')
  return getattr(tf.keras.applications, name)


def _extra_kwargs(params: Mapping[str, Any]) -> Dict[str, Any]:
  extra = params.get('keras_application_kwargs') or {}
  if not isinstance(extra, Mapping):
    raise ValueError(f"params['keras_application_kwargs']={extra!r}; set it "
                     "to a dict of constructor arguments such as "
                     "{'alpha': 0.35}.")
  fixed = {'weights', 'include_top', 'input_shape', 'pooling', 'classes',
           'input_tensor'}.intersection(extra)
  if fixed:
    raise ValueError(f"params['keras_application_kwargs'] sets {sorted(fixed)}"
                     ', which keras_app_model_fn chooses itself; remove them.')
  return dict(extra)


def _backbone(params: Mapping[str, Any]) -> tf.keras.Model:
  """The application without its top, ending in global average pooling."""
  name = params.get('keras_application')
  constructor = _application(params)
  shape = hparams.image_shape(params)
  if min(shape[:2]) < min_image_size(name):
    raise ValueError(
        f"params['image_shape']={shape} is too small for {name}, which needs "
        f'images of at least {min_image_size(name)}x{min_image_size(name)}; '
        'resize the images or pick another keras_application.')
  extra = _extra_kwargs(params)
  try:
    return constructor(weights=None, include_top=False, input_shape=shape,
                       pooling='avg', **extra)
  except (TypeError, ValueError) as e:
    raise ValueError(f'tf.keras.applications.{name} refused image_shape='
                     f"{shape} or params['keras_application_kwargs']: {e}"
                     ) from e


def _scaled_pixels(images: tf.Tensor, params: Mapping[str, Any]) -> tf.Tensor:
  name = params['keras_application']
  built_in = _extra_kwargs(params).get('include_preprocessing', True)
  if built_in and name.startswith(_PIXELS_0_255):
    return images * 255.0
  return images


def _batch_norm_updates(model: tf.keras.Model, inputs: tf.Tensor) -> None:
  """Puts the updates of `model` called on `inputs` into UPDATE_OPS.

  `get_updates_for(inputs)` leaves out the updates Keras built while
  constructing the functional model on its own Input placeholder, which
  could not run.
  """
  for update in model.get_updates_for(inputs):
    tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)


def keras_app_model_fn(features: Dict[str, tf.Tensor],
                       labels: Optional[tf.Tensor], mode: str,
                       params: Dict[str, Any]) -> tf.estimator.EstimatorSpec:
  """Classifies images with a tf.keras.applications network.

  Args:
    features: {'image': float32 [batch, H, W, C] in [0, 1]} (or flattened).
    labels: int class ids [batch], or None when predicting.
    mode: A tf.estimator.ModeKeys value.
    params: 'n_classes'; 'image_shape' (H, W, C), at least min_image_size;
      'keras_application' (a name in tf.keras.applications, e.g.
      'MobileNetV2'); 'keras_application_kwargs' (default {}, more
      constructor arguments, e.g. {'alpha': 0.35}); 'dropout' (default 0,
      before the head, TRAIN only); 'weight_decay' (default 0, L2 on every
      kernel); for TRAIN 'learning_rate' and 'optimizer'.

  Returns:
    The EstimatorSpec for `mode` (see head.classifier_spec). In TRAIN the
    application's batch-norm updates are in UPDATE_OPS and run with the
    train op.

  Raises:
    ValueError: the application name is unknown, the images are smaller than
      it accepts, another param is invalid, or there is no image feature.
  """
  backbone = _backbone(params)
  images = _scaled_pixels(hparams.image_input(features, params), params)
  training = mode == ModeKeys.TRAIN
  net = backbone(images, training=training)
  if training:
    _batch_norm_updates(backbone, images)
  rate = hparams.dropout(params)
  if rate:
    net = tf.keras.layers.Dropout(rate, name='head_dropout')(
        net, training=training)
  head = tf.keras.layers.Dense(hparams.n_classes(params), name='logits')
  logits = head(net)
  kernels = [w for w in backbone.trainable_weights if 'kernel' in w.name]
  return classifier_spec(mode, logits, labels, params, kernels + [head.kernel])
