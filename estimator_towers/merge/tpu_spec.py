"""Model_fns written for TPUEstimator, run on towers.

Such a model_fn returns a `tf.compat.v1.estimator.tpu.TPUEstimatorSpec`
(BERT and most google-research models) and is run off-TPU with
`TPUEstimator(use_tpu=False)`, which turns the spec into an EstimatorSpec:
`scaffold_fn()` gives the scaffold, `eval_metrics=(fn, tensors)` becomes
`eval_metric_ops = fn(*tensors)` and `host_call=(fn, tensors)` a hook that
runs `fn(*tensors)` every step. The towers do the same once, on the whole
batch:

* each tower's spec is merged as an EstimatorSpec (loss, train_op,
  predictions, export outputs, hooks) like any other;
* the towers' `eval_metrics` and `host_call` tensors are concatenated in
  input order, as a TPU concatenates its shards' tensors, so each `fn` is
  called once on the whole batch's rows (these tensors must have one row
  per example, as on a TPU);
* tower 0's `scaffold_fn` is called once, after every tower is built (so
  e.g. `init_from_checkpoint` sees the shared, one-device variables).

The result is an EstimatorSpec, which both `tf.estimator.Estimator` and
`TPUEstimator(use_tpu=False)` accept.
"""

from typing import Callable, List, NamedTuple, Optional, Sequence

import tensorflow as tf
# Private, but the base class of every TPUEstimatorSpec (the public one and
# the canned heads' own).
from tensorflow_estimator.python.estimator.model_fn import _TPUEstimatorSpec  # pylint: disable=g-direct-tensorflow-import
# The class itself: reading it through tf.compat.v1.estimator.tpu at import
# time logs a deprecation warning on every command line.
from tensorflow_estimator.python.estimator.tpu.tpu_estimator import TPUEstimatorSpec  # pylint: disable=g-direct-tensorflow-import

# (tensor name, per-tower tensors) -> the whole batch's rows.
Concat = Callable[[str, List[tf.Tensor]], tf.Tensor]


class TpuParts(NamedTuple):
  """What a tower's TPUEstimatorSpec has beyond an EstimatorSpec."""
  eval_metrics: Optional[tuple]
  host_call: Optional[tuple]
  scaffold_fn: Optional[Callable]


def is_tpu_spec(spec) -> bool:
  return isinstance(spec, _TPUEstimatorSpec)


def as_estimator_spec(spec):
  """`spec`, converted as TPUEstimator does off-TPU if it is a TPU spec."""
  return spec.as_estimator_spec() if is_tpu_spec(spec) else spec


def split(spec) -> tuple:
  """(EstimatorSpec without metrics or scaffold, TpuParts) of a tower.

  Args:
    spec: A tower's TPUEstimatorSpec.

  Returns:
    The spec's EstimatorSpec parts, for merging with the other towers', and
    its eval_metrics, host_call and scaffold_fn.
  """
  parts = TpuParts(spec.eval_metrics, spec.host_call, spec.scaffold_fn)
  plain = tf.estimator.EstimatorSpec(
      mode=spec.mode, predictions=spec.predictions, loss=spec.loss,
      train_op=spec.train_op, eval_metric_ops={},
      export_outputs=spec.export_outputs,
      training_hooks=spec.training_hooks,
      evaluation_hooks=spec.evaluation_hooks,
      prediction_hooks=spec.prediction_hooks)
  return plain, parts


def finish(merged: tf.estimator.EstimatorSpec, parts: Sequence[TpuParts],
           concat: Concat, shard_rows: Sequence[Optional[int]]
           ) -> tf.estimator.EstimatorSpec:
  """The merged spec with the towers' TPU parts, converted off-TPU.

  Args:
    merged: The towers' specs merged (see spec_merge).
    parts: Each tower's TpuParts.
    concat: Puts the towers' tensors of one name in input order, keeping
      only each tower's real examples.
    shard_rows: Each tower's static number of input rows, None if unknown.

  Returns:
    The EstimatorSpec TPUEstimator(use_tpu=False) would make of one device's
    TPUEstimatorSpec on the whole batch.

  Raises:
    ValueError: The towers disagree on eval_metrics or host_call, or one of
      their tensors has no batch dimension.
  """
  concat = _checking_rows(concat, shard_rows)
  tpu_spec = TPUEstimatorSpec(
      mode=merged.mode, predictions=merged.predictions, loss=merged.loss,
      train_op=merged.train_op,
      eval_metrics=_merged_call('eval_metrics',
                                [p.eval_metrics for p in parts], concat),
      export_outputs=merged.export_outputs,
      scaffold_fn=parts[0].scaffold_fn,
      host_call=_merged_call('host_call', [p.host_call for p in parts],
                             concat),
      training_hooks=merged.training_hooks,
      evaluation_hooks=merged.evaluation_hooks,
      prediction_hooks=merged.prediction_hooks)
  return tpu_spec.as_estimator_spec()


def _checking_rows(concat: Concat, shard_rows) -> Concat:
  """`concat`, refusing tensors whose static rows are not the shard's.

  A TPU model_fn often passes per-step values shaped [1] (`tf.reshape(loss,
  [1])`) to host_call. Their rows are not examples: concatenated, `fn`
  would read one tower's value where one device has the whole batch's. A
  tower of one example would let them through the run-time row check.
  """

  def checked(name: str, tensors: List[tf.Tensor]) -> tf.Tensor:
    for i, tensor in enumerate(tensors):
      rows = tensor.shape[0] if tensor.shape.rank else None
      if rows is not None and rows != shard_rows[i]:
        raise ValueError(
            f'TPUEstimatorSpec {name} has {rows} row(s) in tower {i}, whose '
            f'shard has {shard_rows[i] or "a varying number of"} examples. '
            'Under replicate_model_fn, as on a TPU, these tensors are '
            'concatenated across towers: give one row per example and '
            'reduce in the function. A per-step value such as '
            'tf.reshape(loss, [1]) would be one tower\'s; write it as a '
            'summary in the model_fn instead.')
    return concat(name, tensors)

  return checked


def _merged_call(what: str, calls: Sequence[Optional[tuple]],
                 concat: Concat) -> Optional[tuple]:
  """(fn of tower 0, the towers' tensors concatenated), or None."""
  if all(call is None for call in calls):
    return None
  if any(call is None for call in calls):
    raise ValueError(f'Only some towers returned TPUEstimatorSpec({what}=...)'
                     '; every tower must build the same model.')
  fn, first = calls[0]
  if isinstance(first, dict):
    keys = sorted(first)
    for i, (_, tensors) in enumerate(calls[1:], start=1):
      if not isinstance(tensors, dict) or sorted(tensors) != keys:
        raise ValueError(f'Towers disagree on the tensors of {what}: tower 0 '
                         f'gives {keys}, tower {i} {tensors!r}.')
    return fn, {key: _rows(what, repr(key), [c[1][key] for c in calls],
                           concat) for key in first}
  for i, (_, tensors) in enumerate(calls[1:], start=1):
    if len(tensors) != len(first):
      raise ValueError(f'Towers disagree on the tensors of {what}: tower 0 '
                       f'gives {len(first)}, tower {i} {len(tensors)}.')
  return fn, [_rows(what, str(n), [c[1][n] for c in calls], concat)
              for n in range(len(first))]


def _rows(what: str, name: str, tensors: List, concat: Concat) -> tf.Tensor:
  tensors = [tf.convert_to_tensor(t) for t in tensors]
  if tensors[0].shape.rank == 0:
    raise ValueError(
        f'{what} tensor {name} is a scalar. Under replicate_model_fn, as on a '
        f'TPU, the {what} tensors are concatenated across towers along their '
        'first dimension: give one row per example (e.g. the per-example '
        'loss, labels, predictions) and reduce them in the function.')
  return concat(f'{what}[{name}]', tensors)
