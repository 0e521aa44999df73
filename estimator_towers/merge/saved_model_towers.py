"""Batch prediction from a SavedModel on several devices at once.

`SavedModelTowers`: the serving graph is imported once per tower, each copy
under its own device, and every batch is split across the copies (as evenly
as possible; towers beyond a small last batch are not run) and put back
together in input order. (A SavedModelEstimator's model_fn on towers is
saved_model_estimator's.)
"""

from typing import Dict, Iterable, Iterator, List

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


class SavedModelTowers:
  """A SavedModel signature replicated over `devices` in one session.

  Args:
    export_dir: The SavedModel directory.
    devices: One device per tower, e.g. ['/device:CPU:0', '/device:CPU:1'].
    session_config: The session's ConfigProto (it must have the devices).
    signature: The signature to run.

  Raises:
    ValueError: the signature does not exist.
  """

  def __init__(self, export_dir: str, devices: List[str],
               session_config=None, signature: str = 'serving_default'):
    self._graph = tf.Graph()
    self._session = tf1.Session(graph=self._graph, config=session_config)
    self._towers = []
    for i, device in enumerate(devices):
      with self._graph.as_default(), tf.device(device):
        meta = tf1.saved_model.loader.load(
            self._session, [tf1.saved_model.tag_constants.SERVING],
            export_dir, import_scope=f'tower_{i}')
      if signature not in meta.signature_def:
        raise ValueError(
            f'{export_dir} has no signature {signature!r}; it has '
            f'{sorted(meta.signature_def)}.')
      self._towers.append(self._scoped(meta.signature_def[signature], i))
    self._run_every_main_op()

  def _run_every_main_op(self) -> None:
    """Initialises every tower's tables and local variables.

    The loader runs only the first main op it finds in the graph's
    collection, which after the first import is tower 0's.
    """
    keys = (tf1.saved_model.constants.MAIN_OP_KEY,
            tf1.saved_model.constants.LEGACY_INIT_OP_KEY)
    ops = [op for key in keys for op in self._graph.get_collection(key)]
    if ops:
      self._session.run(ops)

  def _scoped(self, signature_def, index: int):
    def tensor(info):
      return self._graph.get_tensor_by_name(f'tower_{index}/{info.name}')
    return ({k: tensor(v) for k, v in signature_def.inputs.items()},
            {k: tensor(v) for k, v in signature_def.outputs.items()})

  @property
  def input_keys(self) -> List[str]:
    return sorted(self._towers[0][0])

  def predict(self, batches: Iterable[Dict[str, np.ndarray]]
             ) -> Iterator[Dict[str, np.ndarray]]:
    """Yields one output row per input row, in input order.

    Raises:
      ValueError: a batch lacks an input of the signature.
    """
    for batch in batches:
      missing = sorted(set(self.input_keys) - set(batch))
      if missing:
        raise ValueError(f'The SavedModel needs inputs {missing} that the '
                         f'input files do not give (they give '
                         f'{sorted(batch)}). Export it with '
                         '--export-format=json.')
      size = len(next(iter(batch.values())))
      bounds = np.linspace(0, size, len(self._towers) + 1).astype(int)
      feed, fetches = {}, []
      for (inputs, outputs), lo, hi in zip(self._towers, bounds[:-1],
                                           bounds[1:]):
        if hi == lo:
          continue  # An idle tower is not run at all.
        feed.update({inputs[k]: batch[k][lo:hi] for k in inputs})
        fetches.append(outputs)
      results = self._session.run(fetches, feed)
      merged = {k: np.concatenate([r[k] for r in results]) for k in results[0]}
      for row in range(size):
        yield {k: v[row] for k, v in merged.items()}

  def close(self) -> None:
    self._session.close()
