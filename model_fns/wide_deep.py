"""Wide & deep: a linear model and a DNN on the same columns, summed.

As tf.estimator's DNNLinearCombinedClassifier: the wide (linear) part sees
each categorical column as one weight per value, so it memorises; the deep
part sees categorical columns as dense vectors (one-hot, or embeddings of
`params['embedding_size']` dimensions), so it generalises. Their logits add
up; one optimizer trains both (the canned Estimator uses two).
"""

from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

from model_fns import hparams
from model_fns.dnn import dnn_logits
from model_fns.head import classifier_spec
from model_fns.linear import linear_logits

tf1 = tf.compat.v1


def _wide_and_deep_columns(columns: List[Any], embedding_size: Optional[int]
                          ) -> Tuple[List[Any], List[Any]]:
  """(the linear part's columns, the DNN part's) from the data's columns.

  A one-hot or embedded categorical column gives the linear part its
  categorical column as it is; numeric columns go to both parts unchanged.
  """
  wide, deep = [], []
  for column in columns:
    categorical = getattr(column, 'categorical_column', None)
    if categorical is None:
      wide.append(column)
      deep.append(column)
      continue
    wide.append(categorical)
    deep.append(tf1.feature_column.embedding_column(categorical,
                                                    embedding_size)
                if embedding_size else column)
  return wide, deep


def _embedding_size(params: Dict[str, Any]) -> Optional[int]:
  value = params.get('embedding_size')
  if value is not None and (isinstance(value, bool) or
                            not isinstance(value, int) or value < 1):
    raise ValueError(f"params['embedding_size']={value!r}; set it to a "
                     'positive int, or leave it unset for the columns as '
                     'the data gives them.')
  return value


def wide_deep_model_fn(features: Dict[str, tf.Tensor],
                       labels: Optional[tf.Tensor], mode: str,
                       params: Dict[str, Any]) -> tf.estimator.EstimatorSpec:
  """Classifies tabular features with linear plus DNN logits.

  Takes what tabular_dnn_model_fn takes: the features its
  `params['feature_columns']` read, int class ids (None to predict), the
  mode, and its params (the layers, 'dropout', 'weight_decay', the
  optimizer's), and besides an optional `params['embedding_size']`: the deep
  part's embedding width for every categorical column.

  Returns:
    The EstimatorSpec for `mode` (see head.classifier_spec).

  Raises:
    ValueError: a param is missing or invalid.
  """
  wide, deep = _wide_and_deep_columns(hparams.feature_columns(params),
                                      _embedding_size(params))
  wide_logits, weights = linear_logits(features, wide,
                                       hparams.n_classes(params))
  with tf1.variable_scope('dnn'):
    inputs = tf1.feature_column.input_layer(features, deep)
  deep_logits, kernels = dnn_logits(inputs, mode, params)
  return classifier_spec(mode, wide_logits + deep_logits, labels, params,
                         weights + kernels)
