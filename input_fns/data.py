"""`Data`: what the trainer needs from a data source.

A source (digits, CSV, TFRecord, image folder, synthetic) subclasses `Data`
and says how to read one pass of single examples; `Data` turns that into the
train, eval and predict input_fns and the serving receivers, the same way for
every source. A source whose examples need parsing (CSV lines, serialized
Examples, image files) also gives them unparsed, with a batch parse, so that
in a synchronous cluster each task parses only its own rows of each global
batch.
"""

import abc
import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import tensorflow as tf

from estimator_towers.cluster.task_input import task_slice
from input_fns import pipeline
from input_fns import serving

tf1 = tf.compat.v1

TRAIN = 'train'
EVAL = 'eval'
KINDS = ('tabular', 'image')
EXPORT_FORMATS = ('json', 'csv', 'example')
# Receiver tensor names of the 'csv' and 'example' serving signatures.
CSV_RECEIVER_KEY = 'csv_lines'
EXAMPLE_RECEIVER_KEY = 'examples'

InputFn = Callable[[], tf.data.Dataset]


@dataclasses.dataclass(frozen=True)
class Unparsed:
  """A source's examples before parsing, and how to parse a batch of them.

  Attributes:
    records: Single raw records (e.g. (path, line number, line)), in the
      order `_examples` yields their parses, shuffled the same way.
    parse_batch: Maps a batch of records (the leaves of a record with a
      batch dimension in front, as positional arguments when a record is a
      tuple; any number of rows, none included) to the (features, labels)
      batch of their examples, equal to batching `_examples`.
  """
  records: tf.data.Dataset
  parse_batch: Callable[..., Tuple[Any, Any]]


@dataclasses.dataclass(eq=False)
class Data(abc.ABC):
  """What the trainer needs from a data source.

  Labels are int32 class ids [batch] in [0, n_classes). Image data yield
  features {'image': float32 [batch, H, W, C] in [0, 1]}; tabular data a dict
  column name -> Tensor [batch, ...] (float32 numeric, string categorical).

  Attributes:
    kind: 'tabular' or 'image'.
    n_classes: Number of classes.
    feature_columns: tf.compat.v1.feature_column columns for
      `input_layer(features, feature_columns)`; [] for images.
    image_shape: (H, W, C) for images; None for tabular data.
  """
  kind: str
  n_classes: int
  feature_columns: list
  image_shape: Optional[Tuple[int, int, int]]

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f'kind={self.kind!r}; use one of {KINDS}.')
    if (isinstance(self.n_classes, bool) or not isinstance(self.n_classes, int)
        or self.n_classes < 2):
      raise ValueError(f'n_classes={self.n_classes!r}; pass an int >= 2.')
    if self.kind == 'image':
      if (self.image_shape is None or len(self.image_shape) != 3 or
          not all(isinstance(d, int) and d >= 1 for d in self.image_shape)):
        raise ValueError(f'image_shape={self.image_shape!r}; image data need '
                         '(height, width, channels), three ints >= 1.')
      self.image_shape = tuple(self.image_shape)
    elif self.image_shape is not None:
      raise ValueError(f'image_shape={self.image_shape!r} for tabular data; '
                       'pass None.')

  # What each source provides.

  @abc.abstractmethod
  def _examples(self, split: str, shuffle: bool = False,
                seed: int = 0) -> tf.data.Dataset:
    """One pass of single (features, label) examples of `split`.

    Args:
      split: TRAIN or EVAL. EVAL (also what predict reads) must come in the
        order of `example_ids`.
      shuffle: Whether to shuffle (only asked for TRAIN), anew each epoch.
      seed: The shuffle's op-level seed.

    Returns:
      A finite dataset; the features' shapes must be fully known.
    """

  def _unparsed(self, split: str, shuffle: bool = False,
                seed: int = 0) -> Optional[Unparsed]:
    """The examples of `_examples(split, shuffle, seed)`, before parsing.

    Returns:
      None (the default) where there is nothing to parse (arrays in memory),
      or where parsing decides which records make up a batch (skipping
      malformed rows): the train input_fn then batches `_examples`.
    """
    del split, shuffle, seed
    return None

  @abc.abstractmethod
  def example_ids(self) -> List[str]:
    """One id per example of predict_input_fn, in the same order."""

  def _serving_field_order(self) -> List[str]:
    """Feature names in the order of a serving CSV line's fields."""
    return sorted(self.feature_signature())

  def _serving_defaults(self) -> Mapping[str, Any]:
    """Feature name -> value for a field a serving request leaves empty."""
    return {}

  def _parse_serving_examples(self, serialized: tf.Tensor) -> Dict[str, Any]:
    """Features from serialized tf.Examples (string Tensor [batch])."""
    return serving.parse_examples(serialized, self.feature_signature(),
                                  self._serving_defaults())

  # The trainer's interface.

  def train_input_fn(self, batch_size: int, shuffle: bool = True,
                     seed: int = 0,
                     num_epochs: Optional[int] = None) -> InputFn:
    """An input_fn yielding (features, labels) batches.

    Args:
      batch_size: The global batch (the towers split it); an int >= 1.
      shuffle: Whether to shuffle the examples, anew each epoch.
      seed: The shuffle's op-level seed; with the RunConfig's tf_random_seed
        it fixes the order.
      num_epochs: Passes over the training data, after which the input ends
        (and training stops, if it has not reached its steps); None repeats
        forever.

    Returns:
      An input_fn for Estimator.train, taking an optional `config` (the
      Estimator passes its RunConfig). In a synchronous cluster (training
      tasks, no ps tasks) every task reads the same batches of
      `batch_size` and keeps its part of each (`task_slice`), so that
      `batch_size` stays the global batch and all tasks stop together.
      Sources with unparsed records (`_unparsed`) batch and slice those,
      then parse: each task parses only its own rows.

    Raises:
      ValueError: batch_size, seed or num_epochs is not a valid int.
    """
    pipeline.check_batch_size(batch_size)
    pipeline.check_seed(seed)
    if num_epochs is not None and (isinstance(num_epochs, bool) or
                                   not isinstance(num_epochs, int) or
                                   num_epochs < 1):
      raise ValueError(f'num_epochs={num_epochs!r}; pass an int >= 1, or '
                       'None to repeat forever.')

    def input_fn(config=None):
      unparsed = self._unparsed(TRAIN, shuffle=bool(shuffle), seed=seed)
      if unparsed is None:
        examples = self._examples(TRAIN, shuffle=bool(shuffle), seed=seed)
        batches = examples.repeat(num_epochs).batch(batch_size)
        # In a synchronous cluster each task keeps its part of every global
        # batch; elsewhere this is the batch itself.
        return task_slice(batches, config).prefetch(pipeline.AUTOTUNE)
      records = unparsed.records.repeat(num_epochs).batch(batch_size)
      # Slicing the raw records first: a task parses (decodes, checks) only
      # the rows it trains on, not W times as many.
      mine = task_slice(records, config)
      return pipeline.parallel_map(mine, unparsed.parse_batch).prefetch(
          pipeline.AUTOTUNE)

    return input_fn

  def eval_input_fn(self, batch_size: int) -> InputFn:
    """An input_fn yielding (features, labels) batches: one pass, in order.

    Args:
      batch_size: The global batch; an int >= 1. The last batch may be
        smaller.

    Returns:
      A no-argument input_fn for Estimator.evaluate.

    Raises:
      ValueError: batch_size is not an int >= 1.
    """
    pipeline.check_batch_size(batch_size)

    def input_fn():
      return pipeline.batch_and_prefetch(self._examples(EVAL), batch_size)

    return input_fn

  def predict_input_fn(self, batch_size: int) -> InputFn:
    """An input_fn yielding feature batches of the eval data, in order.

    Predictions line up with `example_ids()`.

    Args:
      batch_size: The global batch; an int >= 1. The last batch may be
        smaller.

    Returns:
      A no-argument input_fn for Estimator.predict.

    Raises:
      ValueError: batch_size is not an int >= 1.
    """
    pipeline.check_batch_size(batch_size)

    def input_fn():
      features = self._examples(EVAL).map(lambda features, label: features)
      return pipeline.batch_and_prefetch(features, batch_size)

    return input_fn

  def feature_signature(self) -> Dict[str, tf.TypeSpec]:
    """Feature name -> unbatched tf.TensorSpec (or SparseTensorSpec).

    Read off the eval dataset, so it is what training yields.
    """
    signature = getattr(self, '_signature', None)
    if signature is None:
      # A scratch graph: building the dataset reads no data, and must not
      # add ops to whatever graph the caller is building.
      with tf.Graph().as_default():
        signature = dict(self._examples(EVAL).element_spec[0])
      for key, spec in signature.items():
        if (not isinstance(spec, tf.SparseTensorSpec) and
            not spec.shape.is_fully_defined()):
          raise AssertionError(f'Feature {key!r} has shape {spec.shape}; '
                               'sources must give static shapes.')
      self._signature = signature
    return dict(signature)

  def serving_input_receiver_fn(
      self, export_format: str
  ) -> Callable[[], tf.estimator.export.ServingInputReceiver]:
    """A serving_input_receiver_fn for Estimator.export_saved_model.

    The receiver's features have the training features' keys, dtypes and
    shapes, with batch size None (any).

    Args:
      export_format: What a client sends:
        'json': one tensor per feature (receiver keys = feature names), as
          a JSON list of instances feeds.
        'csv': a string Tensor [batch] of CSV lines (receiver key
          'csv_lines'), the feature fields without the label; tabular data
          only.
        'example': serialized tf.Examples (receiver key 'examples'). Images
          are a float_list of H*W*C values in [0, 1] under 'image', unless a
          source documents otherwise.

    Returns:
      A no-argument function that builds the receiver in the current graph.

    Raises:
      ValueError: export_format is unknown, or 'csv' for image data.
    """
    if export_format not in EXPORT_FORMATS:
      raise ValueError(f'export_format={export_format!r}; use one of '
                       f'{EXPORT_FORMATS}.')
    if export_format == 'csv' and self.kind == 'image':
      raise ValueError("export_format='csv' needs tabular data; images are "
                       "served as 'json' or 'example'.")
    receiver = tf.estimator.export.ServingInputReceiver

    def json_receiver_fn():
      features, receivers = serving.placeholders(self.feature_signature())
      return receiver(features, receivers)

    def csv_receiver_fn():
      lines = tf1.placeholder(tf.string, [None], name=CSV_RECEIVER_KEY)
      features = serving.decode_csv_lines(
          lines, self.feature_signature(), self._serving_field_order(),
          self._serving_defaults())
      return receiver(features, {CSV_RECEIVER_KEY: lines})

    def example_receiver_fn():
      serialized = tf1.placeholder(tf.string, [None],
                                   name=EXAMPLE_RECEIVER_KEY)
      features = self._parse_serving_examples(serialized)
      return receiver(features, {EXAMPLE_RECEIVER_KEY: serialized})

    return {'json': json_receiver_fn, 'csv': csv_receiver_fn,
            'example': example_receiver_fn}[export_format]
