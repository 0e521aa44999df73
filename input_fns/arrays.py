"""`ArrayData`: a `Data` over numpy arrays held in memory.

For small embedded datasets (digits, synthetic tabular data): the arrays
become constants of the input graph, so keep them to a few megabytes.
"""

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from input_fns import data as data_lib
from input_fns import pipeline

Split = Tuple[Mapping[str, np.ndarray], np.ndarray]


def _check_split(name: str, split: Split, n_classes: int
                ) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
  """Validates one (features, labels) pair; returns it as numpy arrays."""
  features, labels = split
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f'{name} labels have shape {labels.shape} and dtype '
                     f'{labels.dtype}; pass int class ids of shape [n].')
  if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
    raise ValueError(f'{name} labels span [{labels.min()}, {labels.max()}]; '
                     f'class ids must be in [0, {n_classes}).')
  arrays = {}
  for key, value in features.items():
    value = np.asarray(value)
    if value.shape[:1] != labels.shape:
      raise ValueError(f'{name} feature {key!r} has {value.shape[:1]} rows '
                       f'but there are {labels.shape} labels.')
    arrays[key] = value
  return arrays, labels.astype(np.int32)


class ArrayData(data_lib.Data):
  """In-memory train and eval arrays."""

  def __init__(self, *, kind: str, n_classes: int, feature_columns: list,
               image_shape: Optional[Tuple[int, int, int]], train: Split,
               eval: Split,  # pylint: disable=redefined-builtin
               eval_ids: Optional[Sequence[str]] = None):
    """Holds the arrays.

    Args:
      kind: 'tabular' or 'image'.
      n_classes: Number of classes.
      feature_columns: Columns for tabular data; [] for images.
      image_shape: (H, W, C) for images, else None.
      train: (features dict name -> array [n, ...], int labels [n]).
      eval: The same for the eval (and predict) data.
      eval_ids: One id per eval example; by default its index, as a string.

    Raises:
      ValueError: labels are not int class ids in range, arrays disagree in
        length, or eval_ids has the wrong length.
    """
    super().__init__(kind=kind, n_classes=n_classes,
                     feature_columns=feature_columns, image_shape=image_shape)
    self._splits = {
        data_lib.TRAIN: _check_split('train', train, n_classes),
        data_lib.EVAL: _check_split('eval', eval, n_classes)}
    num_eval = len(self._splits[data_lib.EVAL][1])
    if eval_ids is None:
      eval_ids = [str(i) for i in range(num_eval)]
    if len(eval_ids) != num_eval:
      raise ValueError(f'{len(eval_ids)} eval_ids for {num_eval} eval '
                       'examples; pass one id per example.')
    self._eval_ids = [str(i) for i in eval_ids]

  def _examples(self, split, shuffle=False, seed=0):
    features, labels = self._splits[split]
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    if shuffle:
      # The whole split fits in the buffer: a full shuffle.
      dataset = pipeline.shuffle(dataset, len(labels), seed)
    return dataset

  def example_ids(self) -> List[str]:
    return list(self._eval_ids)
