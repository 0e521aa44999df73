"""Checks predictions the graph walk cannot prove against one device.

`predicted_rows` refuses a prediction whose rows are not each computed from
their own example when it can prove it from the graph. Past an op the walk
does not know (a `tf.function` or `tf.py_function` body, a while loop, a
TensorArray, a scatter, a convolution over the batch axis) it proves
nothing: such a prediction merged silently whatever it did to its rows.

For those outputs the model_fn is called once more, on the whole batch on
tower 0's device and with tower 0's variables, as one device would run it.
That copy is computed only on the first batch: a hook fetches it beside the
towers' merged predictions and raises before any row is handed out when
they differ. Later batches run the towers alone, so a step that differs
only on batches of another size (a last partial batch) is not caught; the
copy costs one more model_fn build per predict call and one more forward
pass on the first batch.

A SavedModel has no first batch to check: an export serving towers
(`replicate_serving=True`) refuses such outputs instead.

EVAL's loss gets the same check: a loss past such a step (a py_function of
the batch, a tf.scan over its rows) is evaluated, and trained, on each
tower's shard; the first evaluation batch names it.
"""

from typing import Dict, Mapping

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

# Float predictions of the same rows differ between a shard and the whole
# batch by the order of a matmul's sums; mixing rows differs by far more.
_RTOL = {tf.float16: 1e-2, tf.bfloat16: 3e-2}
_DEFAULT_RTOL = 1e-4
_ATOL_SCALE = 1e-5
_SHOWN = 4  # Values of a differing row shown in the message.

ADVICE = ('A step that picks, orders, pairs or numbers the rows of its '
          "batch, or uses a statistic of the batch, runs on each tower's "
          'shard instead of the batch. Do it after predicting (on what '
          'estimator.predict returns), pass what it needs in as a feature, '
          'or predict on one device.')
LOSS_ADVICE = ('A loss that picks, orders, pairs or numbers the rows of its '
               "batch, or uses a statistic of the batch, is computed on each "
               "tower's shard instead of the batch, in training too: train "
               'and evaluate it on one device, or give it every tower\'s '
               'rows with estimator_towers.whole_batch.')


def refuse_in_serving(unproven: Mapping[str, tf.Operation]) -> None:
  """Refuses outputs of a towers' serving graph the walk cannot prove.

  Args:
    unproven: {output name (predicted_rows.outputs): the op the walk could
      not follow}.

  Raises:
    ValueError: always, naming the first output.
  """
  name, op = next(iter(unproven.items()))  # Predictions come first.
  raise ValueError(
      f'The serving output {name!r} is computed through {op.type} '
      f'{op.name!r}, which replicate_model_fn cannot follow: it cannot tell '
      'whether each row comes from its own example alone, and a SavedModel '
      'serving towers has no first batch to check against one device. '
      'Export with replicate_serving=False (the default: one device serves '
      'the whole request).')


class FirstBatchCheck(tf1.train.SessionRunHook):
  """Compares merged tensors with one device's on the first batch.

  Args:
    merged: {name: the merged prediction (or EVAL loss) the Estimator
      fetches}.
    one_device: {name: the same tensor of the model_fn run once on the
      whole batch}.
    unproven: {name: the op the walk could not follow}, for messages.
    loss: Whether the tensors are the EVAL loss (for the message).
  """

  def __init__(self, merged: Dict[str, tf.Tensor],
               one_device: Dict[str, tf.Tensor],
               unproven: Mapping[str, tf.Operation], loss: bool = False):
    self._merged = merged
    self._one_device = one_device
    self._unproven = dict(unproven)
    self._loss = loss
    self._checked = False

  def before_run(self, run_context):
    if self._checked:
      return None
    return tf1.train.SessionRunArgs((self._merged, self._one_device))

  def after_run(self, run_context, run_values):
    if self._checked:
      return
    self._checked = True
    merged, one_device = run_values.results
    for name in sorted(merged):
      found = difference(merged[name], one_device[name],
                         self._merged[name].dtype)
      if found:
        op = self._unproven[name]
        what = 'The loss' if self._loss else f'The prediction {name!r}'
        raise ValueError(
            f"{what} is not one device's: on the first batch {found}. It is "
            f'computed through {op.type} {op.name!r}, which '
            'replicate_model_fn cannot follow, so it compared the first '
            'batch with the model_fn run once on the whole batch. '
            + (LOSS_ADVICE if self._loss else ADVICE))


def difference(towers: np.ndarray, one: np.ndarray, dtype: tf.DType) -> str:
  """How the towers' merged rows differ from one device's ('' if alike).

  Args:
    towers: The merged prediction of one batch.
    one: One device's prediction of the same batch.
    dtype: Their dtype (for the tolerance of floats).
  """
  towers, one = np.asarray(towers), np.asarray(one)
  if towers.shape != one.shape:
    return (f'the towers give shape {list(towers.shape)} and one device '
            f'{list(one.shape)}')
  if towers.ndim == 0:
    return '' if _close(towers, one, dtype) else (
        f'the towers give {towers.item()!r} and one device {one.item()!r}')
  for row in range(towers.shape[0]):
    if not _close(towers[row], one[row], dtype).all():
      return (f'row {row} is {_shown(towers[row])} on the towers and '
              f'{_shown(one[row])} on one device')
  return ''


def _close(a: np.ndarray, b: np.ndarray, dtype: tf.DType) -> np.ndarray:
  if dtype.is_floating or dtype.is_complex:
    rtol = _RTOL.get(dtype.base_dtype, _DEFAULT_RTOL)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return np.isclose(a, b, rtol=rtol, atol=_ATOL_SCALE * scale,
                      equal_nan=True)
  return np.asarray(a == b)


def _shown(row: np.ndarray) -> str:
  flat = np.ravel(row)
  shown = ', '.join(repr(v.item() if hasattr(v, 'item') else v)
                    for v in flat[:_SHOWN])
  more = ', ...' if flat.size > _SHOWN else ''
  return f'[{shown}{more}]'
