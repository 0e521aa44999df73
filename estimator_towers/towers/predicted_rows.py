"""Refuses PREDICT outputs whose rows are not one device's, row for row.

The towers' predictions are merged by putting each tower's rows after the
previous tower's. That is one device's prediction only when each row is
computed from its own example: a prediction that keeps some rows chosen by
their position (`h[:6]`, `tf.gather(h, [0, 1])`, `tf.boolean_mask(h,
tf.range(n) < 6)`), puts them in another order (`tf.reverse(h, [0])`,
`tf.roll`, `h[::-1]`, a concat of slices), pairs them (`h @ tf.transpose(h)`),
numbers them (`tf.range(n)`) or combines them with a statistic of the
batch (batch norm with training=True, a softmax over the examples) does it
to each tower's shard, where one device does it to the batch. The merge's
row check catches only a tower that returns another number of rows than it
was fed, so such outputs were merged silently; here they are refused while
the graph is built, the predictions and every export output alike (a
SavedModel serves the export outputs).

EVAL's and TRAIN's merged predictions are read only by what wraps the
model_fn (`tf.estimator.add_metrics`, hooks): there such an output is not
refused but fails the step that reads it (`fail_when_read`).

One slice stays ambiguous: the first rows kept by a written number where
the batch's size is unknown (`h[:1000]` keeps every row of any batch of at
most 1000; `h[:6]` of a batch of 8 keeps each 4-row shard whole). It runs,
with a check that fails the step on a batch of more rows than it keeps.

What the walk cannot follow it cannot refuse: `unproven` names the outputs
computed past such a step, which prediction_audit compares with one device
on the first batch.
"""

from typing import Dict, Optional

import numpy as np
import tensorflow as tf

from estimator_towers.graph import folded_shapes
from estimator_towers.graph import op_ledger
from estimator_towers.towers import batch_mixing

_export = tf.estimator.export


def outputs(spec) -> Dict[str, tf.Tensor]:
  """The tensors of `spec`'s predictions and export outputs, by a name for
  messages: 'p' for predictions['p'] ('predictions' for a lone tensor),
  "export_outputs['serving_default']['p']" and the like."""
  found = predictions(spec)
  for name, output in (spec.export_outputs or {}).items():
    for part, tensor in _export_parts(output).items():
      found[f'export_outputs[{name!r}]{part}'] = tensor
  return {name: tensor for name, tensor in found.items()
          if isinstance(tensor, tf.Tensor)}


def predictions(spec) -> Dict[str, tf.Tensor]:
  """The tensors of `spec`'s predictions alone, named as `outputs` names
  them."""
  found = spec.predictions
  if not isinstance(found, dict):
    found = {} if found is None else {'predictions': found}
  return {name: tensor for name, tensor in found.items()
          if isinstance(tensor, tf.Tensor)}


def _export_parts(output) -> Dict[str, Optional[tf.Tensor]]:
  if isinstance(output, _export.PredictOutput):
    return {f'[{key!r}]': tensor for key, tensor in output.outputs.items()}
  if isinstance(output, _export.RegressionOutput):
    return {'.value': output.value}
  if isinstance(output, _export.ClassificationOutput):
    return {'.scores': output.scores, '.classes': output.classes}
  return {}  # merge_predict names any other kind.


def check(named: Dict[str, tf.Tensor], shard, since: op_ledger.Mark,
          per_tower_batch_norm: bool = False,
          global_rows: Optional[int] = None) -> Dict[str, int]:
  """Refuses outputs whose rows are not each computed from their example.

  Args:
    named: A tower's outputs, as `outputs` names them.
    shard: The tower's features.
    since: The mark taken before the tower's model_fn call.
    per_tower_batch_norm: Whether batch_norm='per_tower' accepts each
      shard's batch-norm moments.
    global_rows: The batch's static number of rows, or None.

  Returns:
    {name: the first rows it keeps by a written number}, for a batch of
    unknown size: `guard` checks them when the step runs.

  Raises:
    ValueError: an output's rows are picked, ordered, paired or numbered by
      their position, or computed with a statistic of the batch.
  """
  first_rows, wrong = findings(named, shard, since, per_tower_batch_norm,
                               global_rows)
  if wrong:
    raise ValueError(next(iter(wrong.values())))
  return first_rows


def findings(named: Dict[str, tf.Tensor], shard, since: op_ledger.Mark,
             per_tower_batch_norm: bool = False,
             global_rows: Optional[int] = None,
             statistics: bool = True):
  """What `check` finds, without raising.

  Args:
    named, shard, since, per_tower_batch_norm, global_rows: As for `check`.
    statistics: Whether to report outputs computed from a statistic of the
      batch (in TRAIN batch-norm layers get the whole batch's moments).

  Returns:
    ({name: the first rows it keeps by a written number}, {name: why its
    merged rows are not one device's}).
  """
  first_rows, wrong = {}, {}
  for name, tensor in named.items():
    found = batch_mixing.mixing_op(tensor, shard, since, per_tower_batch_norm,
                                   report_positions=True,
                                   global_rows=global_rows)
    if found is None or (found.kind == 'statistic' and not statistics):
      continue
    kept = getattr(found, 'kept', None)
    if found.kind == 'subset' and kept is not None and global_rows is None:
      first_rows[name] = kept
      continue
    wrong[name] = _message(name, found, global_rows)
  return first_rows, wrong


def unproven(named: Dict[str, tf.Tensor], shard, since: op_ledger.Mark
             ) -> Dict[str, tf.Operation]:
  """The outputs whose rows the walk could not follow to the end.

  Args:
    named, shard, since: As for `check`.

  Returns:
    {name: the first op on the way that reads the shard's rows and that
    `batch_mixing` does not know}: past it, a mixing goes unseen.
  """
  rows = batch_mixing.dense_rows(shard)
  found = {}
  for name, tensor in named.items():
    untraced = []
    batch_mixing.mixing_op(tensor, shard, since, untraced=untraced)
    if not untraced and rows and rows > 1:
      untraced = _sizes_written(tensor, since, rows)
    if untraced:
      found[name] = untraced[0]
  return found


def _sizes_written(tensor: tf.Tensor, since: op_ledger.Mark, rows: int):
  """The constants `tensor` is computed from that may be the shard's static
  size written into the graph (`h * tf.size(x)`, `h * x.shape[0]`): the
  walk cannot tell them from a number the model_fn wrote."""
  return [op for op in op_ledger.ancestors([tensor.op], since)
          if op.type == 'Const' and (
              folded_shapes.kind(op) in (folded_shapes.SIZE,
                                         folded_shapes.SHAPE) or
              _is_scalar(op, rows))]


def _is_scalar(op: tf.Operation, value: int) -> bool:
  constant = tf.get_static_value(op.outputs[0])
  return constant is not None and np.size(constant) == 1 and (
      float(np.ravel(constant)[0]) == value)


_ADVICE = ('Do it after predicting (on what estimator.predict returns), '
           'pass what it needs in as a feature, or predict on one device.')


def _message(name: str, found, global_rows: Optional[int]) -> str:
  op, what = found
  where = f'{op.type} {op.name!r} {what}'
  if found.kind == 'statistic':
    remedy = batch_mixing.batch_norm_remedy(False)
    return (
        f'The prediction {name!r} is computed from its batch as a whole: '
        f'{where}. One device computes it over the whole batch; each tower '
        f'would over its own shard. {remedy[0].upper()}{remedy[1:]}; '
        'otherwise predict on one device.')
  if found.kind == 'positions':
    return (
        f'The prediction {name!r} {what} ({op.type} {op.name!r}): each '
        'tower numbers its own shard from 0, one device the whole batch. '
        'Pass the position in as a feature, or predict on one device.')
  kept = getattr(found, 'kept', None)
  if found.kind == 'subset' and kept is not None:
    return (
        f'The prediction {name!r} keeps the first {kept} rows of its batch '
        f'by a written number: {where}. Each tower has a shard of the batch '
        f'of {global_rows} and keeps its own first rows, not the batch\'s. '
        'A number read from a static shape (x.shape[0]) is the shard\'s '
        'size on a tower: write tf.shape(x)[0] for every row. Otherwise '
        'slice the rows after predicting, or predict on one device.')
  doing = {'subset': 'keeps some rows of its batch by their position',
           'reordered': 'orders the rows of its batch by their position',
           'pairs': 'pairs the examples of its batch'}[found.kind]
  return (
      f'The prediction {name!r} {doing}: {where}. Each tower would do that '
      "to its own shard and the merged rows would not be one device's. "
      + _ADVICE)


def guard(spec, first_rows: Dict[str, int], batch_rows: tf.Tensor):
  """`spec` whose outputs in `first_rows` fail on too large a batch.

  An output keeping the first `kept` rows of a batch of unknown size keeps
  every row of a shard of at most `kept` rows: one device's prediction
  only when `kept` covers the whole batch (a shard of fewer rows than it
  keeps is caught by the merge's row check).

  Args:
    spec: The merged spec.
    first_rows: `check`'s result, by `outputs`' names.
    batch_rows: The batch's number of rows.

  Returns:
    `spec` with each of `first_rows` failing at run time on a batch of more
    rows than it keeps.
  """
  def guarded(name, tensor):
    kept = first_rows[name]
    return _after(tensor, tf.debugging.Assert(
        tf.greater_equal(tf.cast(kept, batch_rows.dtype), batch_rows), [
            f'The prediction {name!r} keeps the first {kept} rows of its '
            'batch; each tower would keep its own shard\'s first rows and '
            'predict more rows than one device does of this batch of',
            batch_rows, 'rows. Slice the rows after predicting, or predict '
            'on one device.']))

  return _replaced(spec, first_rows, guarded)


def fail_when_read(spec, wrong: Dict[str, str]):
  """`spec` whose predictions in `wrong` fail the step that reads them.

  In EVAL and TRAIN the merged predictions are read only by what wraps
  the model_fn (`tf.estimator.add_metrics`, a hook): a model_fn that
  returns such a prediction and never reads it trains and evaluates as
  one device, so it is not refused; a metric or hook reading it fails
  instead of reading other rows than one device's.

  Args:
    spec: The merged EVAL or TRAIN spec.
    wrong: `findings`' second result, by `outputs`' names.
  """
  def failing(name, tensor):
    return _after(tensor, tf.debugging.Assert(tf.constant(False), [
        wrong[name] + ' (read in EVAL or TRAIN, by '
        'tf.estimator.add_metrics or a hook)']))

  return _replaced(spec, wrong, failing)


def _after(tensor: tf.Tensor, check: tf.Operation) -> tf.Tensor:
  with tf.control_dependencies([check]):
    return tf.identity(tensor)


def _replaced(spec, names, replace):
  """`spec` with each output `outputs` names in `names` replaced by
  `replace(name, tensor)`."""
  def each(name, tensor):
    return replace(name, tensor) if name in names else tensor

  predictions = spec.predictions
  if isinstance(predictions, dict):
    predictions = {k: each(k, t) for k, t in predictions.items()}
  elif isinstance(predictions, tf.Tensor):
    predictions = each('predictions', predictions)
  export_outputs = spec.export_outputs
  if export_outputs:
    export_outputs = {name: _replaced_output(name, output, each)
                      for name, output in export_outputs.items()}
  return spec._replace(predictions=predictions, export_outputs=export_outputs)


def _replaced_output(name: str, output, each):
  prefix = f'export_outputs[{name!r}]'
  if isinstance(output, _export.PredictOutput):
    return _export.PredictOutput({
        key: each(f'{prefix}[{key!r}]', tensor)
        for key, tensor in output.outputs.items()})
  if isinstance(output, _export.RegressionOutput):
    return _export.RegressionOutput(each(f'{prefix}.value', output.value))
  if isinstance(output, _export.ClassificationOutput):
    scores, classes = output.scores, output.classes
    return _export.ClassificationOutput(
        scores=None if scores is None else each(f'{prefix}.scores', scores),
        classes=None if classes is None else each(f'{prefix}.classes',
                                                  classes))
  return output
