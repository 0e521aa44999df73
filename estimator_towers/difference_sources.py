"""What in a towered TRAIN graph makes towers differ from one device.

Some models are not meant to train identically on towers; equivalence.compare
names these EXPECTED sources beside the differences it measures, so that a
user can tell a known effect from a bug:
  * stateful random ops upstream of the loss (dropout; the library's list,
    tower_effects.RANDOM): each tower draws its own numbers for its shard,
    unless replicate_model_fn is given random_ops='one_device';
  * batch-norm layers (found by moving_statistics, which combines their
    moving statistics): each tower normalises its shard with the shard's
    statistics, unless replicate_model_fn is given batch_norm='global';
  * float16 / bfloat16 tensors: rounding depends on how the batch is cut;
  * GPU towers without op determinism (TF_DETERMINISTIC_OPS): scatter and
    segment sums and cuDNN gradients add in a varying order.
The tolerance is listed too; it explains nothing beyond itself.
"""

import dataclasses
import inspect
import os
import re
from typing import Any, Dict, List, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.framework import config as tf_framework_config  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.towers import moving_statistics
from estimator_towers.graph import op_ledger
from estimator_towers import replicate
from estimator_towers.towers import tower_effects

tf1 = tf.compat.v1

_LOW_PRECISION = (tf.float16, tf.bfloat16)


@dataclasses.dataclass(frozen=True)
class Source:
  """A known reason for towers to differ from one device.

  Attributes:
    name: Short name, e.g. 'random ops'.
    detail: What was found in the towered graph and what to do about it.
    explains: Whether it explains a difference beyond the tolerance (the
      tolerance itself is listed too, but explains nothing).
  """
  name: str
  detail: str
  explains: bool


class GraphSources:
  """The expected sources of difference of one TRAIN graph.

  Call `read` with the spec of the graph being built, then `sources`.
  """

  def __init__(self):
    self._random: List[str] = []
    self._batch_norm: List[str] = []
    self._low_precision: List[str] = []
    self._non_deterministic: List[str] = []

  def read(self, spec: tf.estimator.EstimatorSpec) -> None:
    """Reads the sources off the TRAIN graph being built, `spec`'s."""
    graph = tf1.get_default_graph()
    used = op_ledger.ancestors(
        getattr(t, 'op', t) for t in (spec.train_op, spec.loss)
        if t is not None)
    self._random = sorted({_one_device_name(op) for op in used
                           if op.type in tower_effects.RANDOM})
    self._batch_norm = moving_statistics.per_tower_layers(graph)
    self._low_precision = sorted({
        _one_device_name(op) for op in used
        if any(t.dtype in _LOW_PRECISION for t in op.outputs)})
    self._non_deterministic = sorted({
        op.type for op in used if _accumulates_in_any_order(op.type)})

  def sources(self, device_type: str, replicate_kwargs: Dict[str, Any],
              tolerance: Tuple[float, float]) -> Tuple[Source, ...]:
    """The expected sources of difference found, then the tolerance.

    Args:
      device_type: The towers' devices, 'CPU' or 'GPU'.
      replicate_kwargs: The towers' replicate_model_fn arguments, whose
        options may rule a source out.
      tolerance: (rtol, atol).

    Returns:
      The sources, each saying whether it explains a difference.
    """
    found = []
    for name, ops, option, found_as, when_set, otherwise in (
        ('random ops', self._random, ('random_ops', 'one_device'),
         'stateful random op(s) feed the loss ({}), e.g. dropout.',
         "the towers draw one device's numbers",
         'Each tower draws its own numbers for its shard; pass '
         "random_ops='one_device' to replicate_model_fn to draw one "
         "device's, or compare without dropout."),
        ('batch norm', self._batch_norm, ('batch_norm', 'global'),
         'batch-norm layer(s) ({}).',
         "they normalise with the global batch's statistics",
         "Each tower normalises its shard with the shard's own statistics "
         "(the moving statistics are exact); pass batch_norm='global' to "
         "replicate_model_fn for one device's.")):
      if ops:
        found.append(_unless_option(
            name, replicate_kwargs, option,
            f'{len(ops)} {found_as.format(_some(ops))}', when_set,
            otherwise))
    if self._low_precision:
      found.append(Source(
          'reduced precision',
          f'{len(self._low_precision)} op(s) compute in float16/bfloat16 '
          f'({_some(self._low_precision)}): their rounding depends on how '
          'the batch is cut; compare in float32, or raise rtol and atol to '
          "that precision's.", explains=True))
    if device_type == 'GPU' and not _deterministic():
      kinds = (f' (here: {", ".join(self._non_deterministic)})'
               if self._non_deterministic else '')
      found.append(Source(
          'non-deterministic kernels',
          'GPU kernels such as scatter and segment sums and cuDNN '
          f'gradients add in a varying order{kinds}; set '
          'TF_DETERMINISTIC_OPS=1 (or tf.config.experimental.'
          'enable_op_determinism()) to rule them out.', explains=True))
    rtol, atol = tolerance
    found.append(Source(
        'tolerance',
        f'rtol={rtol:g}, atol={atol:g}: towers add the shards\' gradients in '
        'another order than one device adds the batch, so float32 results '
        'differ in the last bits; a few steps stay well within 1e-4.',
        explains=False))
    return tuple(found)


def _unless_option(name: str, replicate_kwargs: Dict[str, Any],
                   option: Tuple[str, str], found: str, when_set: str,
                   otherwise: str) -> Source:
  """A source that a replicate_model_fn option (name, value) rules out."""
  key, value = option
  default = inspect.signature(
      replicate.replicate_model_fn).parameters[key].default
  if replicate_kwargs.get(key, default) == value:
    return Source(name, f'{found} With {key}={value!r} {when_set}, so they '
                  'explain no difference.', explains=False)
  return Source(name, f'{found} {otherwise}', explains=True)


def _one_device_name(op: tf.Operation) -> str:
  """The op's name without its tower's name scope (tower_1/...)."""
  return re.sub(r'^tower_\d+/', '', op.name)


def _accumulates_in_any_order(op_type: str) -> bool:
  """Op types whose GPU kernels add with atomics (no fixed order)."""
  return 'Segment' in op_type or op_type.startswith(
      ('ScatterAdd', 'ResourceScatterAdd', 'ScatterNdAdd',
       'ResourceScatterNdAdd', 'TensorScatterAdd', 'Conv2DBackprop',
       'BiasAddGrad'))


def _deterministic() -> bool:
  if os.environ.get('TF_DETERMINISTIC_OPS', '').lower() in ('1', 'true'):
    return True
  # Private, but the only reader of enable_op_determinism's switch.
  return tf_framework_config.is_op_determinism_enabled()


def _some(names: Sequence[str], most: int = 3) -> str:
  shown = ', '.join(names[:most])
  return shown + (f' and {len(names) - most} more' if len(names) > most
                  else '')
