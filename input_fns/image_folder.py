"""Images in class folders, as Keras flow_from_directory reads them.

    root/<class name>/<any subfolders>/*.jpg|*.jpeg|*.png

Classes are the sorted subdirectory names (class id = position). Files are
decoded, resized and scaled to [0, 1] in parallel map calls; for training,
after a synchronous cluster's task has kept its share of each batch.
"""

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from input_fns import data as data_lib
from input_fns import images
from input_fns import pipeline

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png')
_SPLIT_SEED = 0

Examples = Tuple[List[str], List[int]]


def list_classes(root: str, name: str) -> Dict[str, List[str]]:
  """Class name -> sorted image paths under root/<class>.

  Raises:
    ValueError: root is no directory, has no subdirectories or no images.
  """
  if not isinstance(root, str) or not tf.io.gfile.isdir(root):
    raise ValueError(f'{name}={root!r} is not a directory; pass the folder '
                     'that holds one subfolder per class.')
  classes = sorted(entry.rstrip('/') for entry in tf.io.gfile.listdir(root)
                   if tf.io.gfile.isdir(os.path.join(root, entry)))
  if not classes:
    raise ValueError(f'{name}={root!r} has no subdirectories; put the images '
                     f'of each class in {root}/<class name>/.')
  found = {}
  for class_name in classes:
    paths = []
    for folder, _, filenames in tf.io.gfile.walk(
        os.path.join(root, class_name)):
      paths.extend(os.path.join(folder, filename) for filename in filenames
                   if filename.lower().endswith(IMAGE_EXTENSIONS))
    found[class_name] = sorted(paths)
  if not any(found.values()):
    raise ValueError(f'{name}={root!r}: its class subdirectories {classes} '
                     f'hold no {"/".join(IMAGE_EXTENSIONS)} files.')
  return found


def _flatten(found: Dict[str, List[str]], class_ids: Dict[str, int]
            ) -> Examples:
  paths, labels = [], []
  for class_name, class_paths in found.items():
    paths.extend(class_paths)
    labels.extend([class_ids[class_name]] * len(class_paths))
  return paths, labels


def _split(found: Dict[str, List[str]], class_ids: Dict[str, int],
           eval_fraction: float) -> Tuple[Examples, Examples]:
  """Per class, a fixed random `eval_fraction` of the files goes to eval."""
  rng = np.random.RandomState(_SPLIT_SEED)
  train, evaluation = {}, {}
  for class_name, paths in found.items():
    # Rounded half up (round() would send 2.5 to 2).
    num_eval = int(len(paths) * eval_fraction + 0.5)
    chosen = set(rng.permutation(len(paths))[:num_eval].tolist())
    evaluation[class_name] = [p for i, p in enumerate(paths) if i in chosen]
    train[class_name] = [p for i, p in enumerate(paths) if i not in chosen]
  return _flatten(train, class_ids), _flatten(evaluation, class_ids)


class ImageFolderData(data_lib.Data):
  """Image Data read from class folders; see `image_folder_data`.

  Attributes:
    class_names: Class names; class id = position.
  """

  def __init__(self, class_names: Sequence[str], train: Examples,
               evaluation: Examples, image_shape: Tuple[int, int, int]):
    """Use `image_folder_data`, which lists and checks the folders.

    Args:
      class_names: Class names; class id = position.
      train: (image paths, class ids) for training.
      evaluation: (image paths, class ids) for eval and predict, in order.
      image_shape: (H, W, C) the images are decoded to.
    """
    super().__init__(kind='image', n_classes=len(class_names),
                     feature_columns=[], image_shape=image_shape)
    self.class_names = list(class_names)
    self._splits = {data_lib.TRAIN: train, data_lib.EVAL: evaluation}

  def _image(self, path: tf.Tensor) -> tf.Tensor:
    return images.decode(tf.io.read_file(path), self.image_shape)

  def _paths(self, split: str, shuffle: bool, seed: int) -> tf.data.Dataset:
    """(path, label) of each image of `split`."""
    paths, labels = self._splits[split]
    examples = tf.data.Dataset.from_tensor_slices(
        (tf.constant(paths, tf.string), tf.constant(labels, tf.int32)))
    if shuffle:
      # Shuffling paths before decoding: a full shuffle at no memory cost.
      examples = pipeline.shuffle(examples, len(paths), seed)
    return examples

  def _examples(self, split, shuffle=False, seed=0):
    return pipeline.parallel_map(
        self._paths(split, shuffle, seed),
        lambda path, label: ({'image': self._image(path)}, label))

  def _unparsed(self, split, shuffle=False, seed=0):
    spec = tf.TensorSpec(self.image_shape, tf.float32)
    return data_lib.Unparsed(
        self._paths(split, shuffle, seed),
        lambda paths, labels: (
            {'image': pipeline.map_rows(self._image, paths, spec)}, labels))

  def example_ids(self) -> List[str]:
    """The eval images' file paths, in predict order."""
    return list(self._splits[data_lib.EVAL][0])


def image_folder_data(train_dir: str, eval_dir: Optional[str] = None, *,
                      image_size: Tuple[int, int] = (224, 224),
                      channels: int = 3,
                      eval_fraction: float = 0.2) -> ImageFolderData:
  """Image Data from folders of class subfolders.

  Args:
    train_dir: root/<class>/... of the training images.
    eval_dir: The same layout for eval (and predict) images, with classes
      among train_dir's. None: a fixed random `eval_fraction` of each class
      of train_dir is held out instead.
    image_size: (H, W) every image is resized to (bilinear).
    channels: 1 (grey), 3 (RGB) or 4 (RGBA); images are converted.
    eval_fraction: The held-out share when eval_dir is None, in (0, 1).

  Returns:
    The Data: features {'image': float32 [batch, H, W, channels] in [0, 1]};
    example_ids are the eval files' paths, ordered by class then path.

  Raises:
    ValueError: a directory is missing, has no class subdirectories or no
      images; fewer than 2 classes; eval classes unknown to train_dir; a bad
      image_size, channels or eval_fraction; an empty split.
  """
  if (not isinstance(image_size, (tuple, list)) or len(image_size) != 2):
    raise ValueError(f'image_size={image_size!r}; pass (height, width).')
  image_shape = images.check_image_shape(
      (*image_size, channels), 'image_size + (channels,)')
  found = list_classes(train_dir, 'train_dir')
  class_names = list(found)
  if len(class_names) < 2:
    raise ValueError(f'train_dir={train_dir!r} has {len(class_names)} class '
                     f'subdirectory ({class_names}); classification needs '
                     '>= 2.')
  class_ids = {name: i for i, name in enumerate(class_names)}
  if eval_dir is None:
    if (isinstance(eval_fraction, bool) or
        not isinstance(eval_fraction, (int, float)) or
        not 0 < eval_fraction < 1):
      raise ValueError(f'eval_fraction={eval_fraction!r}; pass a float in '
                       '(0, 1), or an eval_dir.')
    train, evaluation = _split(found, class_ids, eval_fraction)
    if not evaluation[0] or not train[0]:
      total = len(train[0]) + len(evaluation[0])
      raise ValueError(
          f'eval_fraction={eval_fraction} of the {total} images in '
          f'{train_dir!r} leaves an empty split; add images, change '
          'eval_fraction or pass eval_dir.')
  else:
    train = _flatten(found, class_ids)
    found_eval = list_classes(eval_dir, 'eval_dir')
    unknown = sorted(set(found_eval) - set(class_ids))
    if unknown:
      raise ValueError(f'eval_dir={eval_dir!r} has classes {unknown} that '
                       f'train_dir={train_dir!r} lacks; its classes are '
                       f'{class_names}.')
    evaluation = _flatten(found_eval, class_ids)
  return ImageFolderData(class_names, train, evaluation, image_shape)
