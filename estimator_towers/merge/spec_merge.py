"""Merging the towers' EstimatorSpecs into the one the Estimator runs.

Hooks and user summaries come from tower 0, so they appear once, under the
names one-device training gives them. The scaffold is the last tower's in
every mode: in training its Saver sees the optimizer's slots (see
merge_train), and a model_fn that keeps what it built (`self.saver = ...`)
keeps the last call's, the scaffold that runs.
"""

from typing import Callable, Dict, Sequence

import tensorflow as tf

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys
_export = tf.estimator.export


def _check_same_keys(what: str, per_tower: Sequence) -> None:
  first = sorted(per_tower[0])
  for i, keys in enumerate(per_tower[1:], start=1):
    if sorted(keys) != first:
      raise ValueError(
          f'Towers disagree on {what}: tower 0 has {first}, tower {i} has '
          f'{sorted(keys)}. Every tower must build the same model.')


def check_train(specs: Sequence[tf.estimator.EstimatorSpec]) -> None:
  """Fails when a tower's TRAIN spec lacks a loss or a train_op."""
  for i, spec in enumerate(specs):
    if spec.loss is None:
      raise ValueError(f'Tower {i} returned a TRAIN EstimatorSpec without a '
                       'loss; set EstimatorSpec(loss=...).')
    if spec.train_op is None:
      raise ValueError(f'Tower {i} returned a TRAIN EstimatorSpec without a '
                       'train_op; set EstimatorSpec(train_op=...).')


def merge_train(specs, loss: tf.Tensor,
                effects: Sequence[tf.Operation]) -> tf.estimator.EstimatorSpec:
  """One TRAIN spec: the global loss; the last tower's train_op.

  Args:
    specs: The towers' specs (see `check_train`).
    loss: The global-batch loss (tower_weights.TowerWeights.merged_loss).
    effects: What earlier towers' train_ops must still run (see
      tower_effects); their updates are the last tower's one update.

  The last tower's scaffold is used: a Saver the model_fn builds after its
  optimizer call sees the optimizer's slots only in the last tower, where
  they are created.
  """
  # UPDATE_OPS run where the model_fn runs them, as on one device: earlier
  # towers' entries wait for the last tower's (graph/stand_ins).
  train_op = tf.group(specs[-1].train_op, *effects,
                      name='replicated_train_op')
  return specs[0]._replace(loss=loss, train_op=train_op,
                           scaffold=specs[-1].scaffold)


def check_eval(specs: Sequence[tf.estimator.EstimatorSpec]) -> None:
  """Fails when a tower's EVAL spec lacks a loss or its metrics differ."""
  for i, spec in enumerate(specs):
    if spec.loss is None:
      raise ValueError(f'Tower {i} returned an EVAL EstimatorSpec without a '
                       'loss; set EstimatorSpec(loss=...).')
  _check_same_keys('eval_metric_ops', [s.eval_metric_ops for s in specs])


def merge_eval(specs, loss: tf.Tensor) -> tf.estimator.EstimatorSpec:
  """One EVAL spec: the global loss; metrics read from tower 0's shared
  state.

  The towers' metric variables are tower 0's (see variable_sharing), so each
  tower's update op accumulates into one state and tower 0's value op reads
  the whole batch's result.

  Args:
    specs: The towers' specs (see `check_eval`).
    loss: The global-batch loss (tower_weights.TowerWeights.merged_loss).
  """
  metrics = {}
  for name, (value, update) in specs[0].eval_metric_ops.items():
    updates = [update] + [s.eval_metric_ops[name][1] for s in specs[1:]]
    metrics[name] = (value, tf.group(*updates))
  return specs[0]._replace(loss=loss, eval_metric_ops=metrics,
                           scaffold=specs[-1].scaffold)


class RowOrder:
  """Puts the towers' per-example outputs back in input order.

  One per merge: the vectors it needs (the rows each tower was fed, where
  the real ones sit) are built once, and towers' tensors already put in
  order (export outputs repeat predictions) are reused, so a head's many
  predictions cost a few ops each.

  Args:
    sizes: Each tower's number of real examples (an int32 vector).
    padded: Whether an idle tower got one padding example (TRAIN, PREDICT)
      or an empty shard (EVAL).
  """

  def __init__(self, sizes: tf.Tensor, padded: bool = True):
    self._sizes, self._padded = sizes, padded
    self._fed = self._real_rows = None
    self._done = {}

  def concat(self, name: str, tensors: Sequence[tf.Tensor],
             kind: str = 'Prediction') -> tf.Tensor:
    """The towers' real rows of one output, concatenated in input order.

    Args:
      name: The tensors' name, for errors, e.g. "predictions['logits']".
      tensors: One per tower, with one row per example of its shard.
      kind: What the tensors are, for errors.

    Returns:
      The towers' real rows, concatenated.

    Raises:
      ValueError: The tensors are scalars (no rows to put in order).
    """
    name = f'{kind} {name}'
    if tensors[0].shape.rank == 0:
      raise ValueError(
          f'{name} is a scalar; it needs the batch as its '
          'first dimension so that the towers\' outputs can be put back in '
          'input order.')
    key = tuple(t.ref() for t in tensors)
    if key not in self._done:
      self._done[key] = self._concat(name, tensors)
    return self._done[key]

  def _concat(self, name: str, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    fed, real_rows = self._vectors()
    rows = tf.stack([_rows(t) for t in tensors])
    # One check for every tower: an output with one row per shard example
    # in each tower is the one that can be put back in input order.
    check = tf.debugging.Assert(tf.reduce_all(tf.equal(rows, fed)), [
        f'{name} does not have one row per example of each tower\'s shard. '
        'It must keep the batch as its first dimension: one row per input '
        'example. Rows per tower:', rows, 'examples fed per tower:', fed],
                                summarize=len(tensors))
    with tf.control_dependencies([check]):
      ordered = tf.concat(tensors, axis=0)
      return ordered if real_rows is None else tf.gather(ordered, real_rows)

  def _vectors(self):
    """The rows each tower was fed, and the real rows' positions in the
    towers' concatenated rows (None when every row is real)."""
    if self._fed is None:
      # Shared by every output: made outside any caller's control context.
      with tf.control_dependencies(None), tf.name_scope('row_order'):
        if self._padded:
          # An idle tower got one padding example, dropped here.
          self._fed = tf.maximum(self._sizes, 1)
          starts = tf.cumsum(self._fed, exclusive=True)
          self._real_rows = tf.ragged.range(
              starts, starts + self._sizes).flat_values
        else:
          self._fed = self._sizes
    return self._fed, self._real_rows


def _rows(tensor: tf.Tensor) -> tf.Tensor:
  """The rows of `tensor` at run time; 0 for a scalar of unknown static
  rank, which the row check then names (indexing its shape failed without
  naming it)."""
  shape = tf.shape(tensor, out_type=tf.int32)
  if tensor.shape.rank is None:
    shape = tf.concat([shape, [0]], axis=0)
  return shape[0]


def _merge_dict(what: str, dicts: Sequence[Dict], merge: Callable) -> Dict:
  _check_same_keys(what, dicts)
  return {k: merge(f'{what}[{k!r}]', [d[k] for d in dicts]) for k in dicts[0]}


def _merge_export_output(name: str, outputs: Sequence, merge: Callable):
  """One export output from the towers'; `merge(name, tensors)` merges
  each of its tensors as the predictions' are (a tensor free of the
  examples, a vocabulary, stays tower 0's)."""
  kind = type(outputs[0])
  for i, out in enumerate(outputs[1:], start=1):
    if type(out) is not kind:
      raise ValueError(f'Towers disagree on export_outputs[{name!r}]: tower 0 '
                       f'gives {kind.__name__}, tower {i} {type(out).__name__}.')
  if kind is _export.PredictOutput:
    return kind(_merge_dict(f'export_outputs[{name!r}]',
                            [o.outputs for o in outputs], merge))
  if kind is _export.RegressionOutput:
    return kind(merge(f'export_outputs[{name!r}]',
                      [o.value for o in outputs]))
  if kind is _export.ClassificationOutput:
    scores = classes = None
    if outputs[0].scores is not None:
      scores = merge(f'{name} scores', [o.scores for o in outputs])
    if outputs[0].classes is not None:
      classes = merge(f'{name} classes', [o.classes for o in outputs])
    return kind(scores=scores, classes=classes)
  raise TypeError(
      f'export_outputs[{name!r}] is a {kind.__name__}; replicate_model_fn '
      'merges PredictOutput, ClassificationOutput and RegressionOutput.')


def whole_batch_predictions(specs, rows: RowOrder,
                            depends_on_shard: Sequence[Callable]):
  """The towers' predictions in input order, for EVAL and TRAIN specs.

  What wraps the model_fn reads them beside the metrics and the loss
  (`tf.estimator.add_metrics`, hooks), so they must cover the whole batch,
  not tower 0's shard. A prediction that does not depend on the shard (a
  weight) or is one value per shard (a scalar) keeps tower 0's value.

  Args:
    specs: The towers' specs.
    rows: Puts the towers' rows in input order.
    depends_on_shard: Per tower, whether a tensor depends on its shard.

  Returns:
    Predictions shaped as tower 0's (a dict, a tensor or None).
  """
  first = specs[0].predictions
  # A Tensor has no truth value in a graph: only None and {} are empty.
  if first is None or (isinstance(first, dict) and not first):
    return first

  def merge(name, tensors):
    per_example = (isinstance(tensors[0], tf.Tensor) and
                   tensors[0].shape.rank != 0 and
                   _per_example(depends_on_shard, tensors))
    return rows.concat(name, tensors) if per_example else tensors[0]

  return _merged_predictions(specs, merge)


def _per_example(depends_on_shard: Sequence[Callable], tensors) -> bool:
  """Whether the towers' tensors may have one row per shard example.

  Yes when one depends on its tower's shard, or when its static rows are
  its shard's static rows: with a static batch size, `tf.fill([x.shape[0]],
  b)` is a constant of the shard's size, built from the shard's shape while
  the graph was built (kept whole, one device got half its rows).
  """
  for depends, tensor in zip(depends_on_shard, tensors):
    rows = getattr(depends, 'batch_size', None)
    if depends(tensor) or (rows is not None and tensor.shape.rank and
                           tf.compat.dimension_value(tensor.shape[0]) == rows):
      return True
  return False


def _merged_predictions(specs, merge: Callable):
  """`merge(name, towers' tensors)` of each prediction, shaped as tower 0's."""
  first = specs[0].predictions
  if isinstance(first, dict):
    _check_same_keys('predictions', [s.predictions for s in specs])
    return {k: merge(f'predictions[{k!r}]', [s.predictions[k] for s in specs])
            for k in first}
  return merge('predictions', [s.predictions for s in specs])


def merge_predict(specs, rows: RowOrder,
                  depends_on_shard: Sequence[Callable]
                  ) -> tf.estimator.EstimatorSpec:
  """One PREDICT spec: predictions and export outputs back in input order.

  A prediction that does not depend on the towers' shards (a constant, a
  weight) and is not shaped like them is one device's value already: tower
  0's is kept, unsplit.

  Args:
    specs: The towers' specs.
    rows: Puts the towers' rows in input order (an idle tower's padding
      rows dropped).
    depends_on_shard: Per tower, whether a tensor depends on its shard.
  """
  first = specs[0]

  def merge(name, tensors):
    if isinstance(tensors[0], tf.Tensor) and not _per_example(
        depends_on_shard, tensors):
      return tensors[0]
    return rows.concat(name, tensors)

  predictions = _merged_predictions(specs, merge)
  export_outputs = None
  if first.export_outputs:
    _check_same_keys('export_outputs', [s.export_outputs for s in specs])
    export_outputs = {
        name: _merge_export_output(
            name, [s.export_outputs[name] for s in specs], merge)
        for name in first.export_outputs}
  return first._replace(predictions=predictions, export_outputs=export_outputs,
                        scaffold=specs[-1].scaffold)
