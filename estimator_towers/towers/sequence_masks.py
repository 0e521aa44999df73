"""Sequence masks as wide as the sparse sequences they mask, as on one device.

A SparseTensor shard keeps the batch's dense width (`sharding.slice_rows`),
so a sequence densified from it (the sequence feature columns' input layer)
is as wide as the batch's longest sequence, as on one device: a model that
runs over the padding unmasked sees one device's padding. The lengths come
from the shard's rows, though, and `tf.sequence_mask(lengths)` without
`maxlen` is as wide as the *shard's* longest sequence. On one device both
widths are the batch's longest sequence; on a tower whose longest sequence
is shorter they differ, and a recurrent layer reading the sequence with that
mask failed while the step ran (the canned RNNClassifier on parsed
variable-length sequences: "Trying to access element 6 in a list with 6
elements", 2 of 5 random datasets). Cutting the shards to their own width
instead would change the numbers of the unmasked models.

`widen` gives such a mask, when a loop reads it, the width of the sparse
sequences its lengths come from: `tf.sequence_mask(lengths, maxlen=width)`,
which is one device's mask (positions past a sequence's length are False
whatever the width).
"""

from typing import Any

import tensorflow as tf

from estimator_towers.graph import functions
from estimator_towers.graph import op_ledger
from estimator_towers.towers import loss_reduction
from estimator_towers.towers import sharding

# Consumers followed from a mask before giving up (a loop is near it).
_MAX_WALK = 2000


def widen(shard: Any, tower: op_ledger.Region) -> None:
  """Widens the tower's loop-read masks of sparse sequences (module doc).

  Args:
    shard: The tower's features and labels.
    tower: The tower's ops (its model_fn call).
  """
  sparse = [leaf for leaf in sharding.leaves(shard)
            if isinstance(leaf, tf.SparseTensor)]
  if not sparse:
    return
  from_each = [loss_reduction.ExampleDependence([leaf.indices], tower.start)
               for leaf in sparse]
  graph = sparse[0].graph
  for op in op_ledger.ops_between(graph, tower.start.next_id,
                                  tower.end.next_id):
    if op.type != 'Max' or '/SequenceMask/' not in f'/{op.name}':
      continue
    sources = [leaf for leaf, depends in zip(sparse, from_each)
               if depends(op.inputs[0])]
    if sources and _read_by_a_loop(op, tower):
      _replace_longest(op, sources[0])


def _replace_longest(longest: tf.Operation, source: tf.SparseTensor) -> None:
  """Makes the mask's width the sparse sequences' width, not its longest."""
  value = longest.outputs[0]
  with longest.graph.name_scope(None), longest.graph.device(longest.device):
    width = tf.cast(source.dense_shape[1], value.dtype,
                    name=f'{longest.name}/batch_width')
  for consumer in list(value.consumers()):
    for position, tensor in enumerate(consumer.inputs):
      if tensor is value:
        consumer._update_input(position, width)  # pylint: disable=protected-access


def _read_by_a_loop(op: tf.Operation, tower: op_ledger.Region) -> bool:
  """Whether a loop op of the tower consumes `op`'s value, directly or not."""
  pending, seen = [op], set()
  while pending and len(seen) < _MAX_WALK:
    current = pending.pop()
    if current.name in seen or not tower.contains(current):
      continue
    seen.add(current.name)
    if current.type in functions.LOOPS:
      return True
    pending.extend(consumer for t in current.outputs
                   for consumer in t.consumers())
  return False
