"""Encoded image bytes to a float image of a fixed shape in [0, 1]."""

from typing import Sequence, Tuple

import tensorflow as tf

CHANNELS = (1, 3, 4)


def check_image_shape(image_shape: Sequence[int],
                      name: str = 'image_shape') -> Tuple[int, int, int]:
  """Returns (H, W, C) if it is three ints >= 1 with C in 1, 3, 4.

  Raises:
    ValueError: it is not.
  """
  if (not isinstance(image_shape, (tuple, list)) or len(image_shape) != 3 or
      not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1
              for d in image_shape) or image_shape[2] not in CHANNELS):
    raise ValueError(f'{name}={image_shape!r}; pass (height, width, '
                     f'channels) with channels in {CHANNELS}.')
  return tuple(image_shape)


def decode(contents: tf.Tensor, image_shape: Tuple[int, int, int]
          ) -> tf.Tensor:
  """Decodes one PNG, JPEG, GIF or BMP to float32 [H, W, C] in [0, 1].

  Args:
    contents: A scalar string Tensor of encoded bytes.
    image_shape: (H, W, C): the image is converted to C channels and resized
      (bilinear) to H x W.

  Returns:
    float32 [H, W, C] in [0, 1], with a static shape.
  """
  height, width, channels = image_shape
  # expand_animations=False: a GIF gives its first frame, so every format
  # decodes to rank 3.
  image = tf.io.decode_image(contents, channels=channels,
                             expand_animations=False)
  # Scale before resizing: bilinear weights are convex, so values stay in
  # [0, 1]; the clip only guards rounding.
  image = tf.image.convert_image_dtype(image, tf.float32)
  image = tf.image.resize(image, [height, width], method='bilinear')
  image = tf.clip_by_value(image, 0.0, 1.0)
  image.set_shape(image_shape)
  return image
