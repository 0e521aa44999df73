"""Stand-ins: what earlier towers get in place of an op only the last makes.

Some ops of a step exist once, built by the last tower from every tower's
shard: the one optimizer update, the one update of each batch-norm moving
statistic. An earlier tower's call gets a stand-in instead (a no-op, a read
of the variable). What the model_fn chains after such a call must still
come after the real op, as on one device: a second loss computed under
`tf.control_dependencies` of the first update, a training hook that runs
tower 0's update (TF-GAN's RunTrainOpsHook), tower 0's UPDATE_OPS grouped
into an op a hook runs. So once the towers are built and their effects
checked (the checks read each tower's own dependencies), every stand-in
gets its real op as a control input.
"""

from typing import Dict, Hashable, List

import tensorflow as tf

from estimator_towers.graph import op_ledger


class StandIns:
  """Stand-ins and the real ops they stand for, by call key."""

  def __init__(self):
    self._stand_ins: Dict[Hashable, List[tf.Operation]] = {}
    self._real: Dict[Hashable, List[tf.Operation]] = {}

  def add(self, key: Hashable, stand_in: tf.Operation) -> None:
    """Records an earlier tower's stand-in for the call `key`."""
    self._stand_ins.setdefault(key, []).append(stand_in)

  def set_real(self, key: Hashable, ops: List[tf.Operation]) -> None:
    """Records the last tower's real ops for the call `key`."""
    self._real[key] = list(ops)

  def connect(self) -> None:
    """Makes every stand-in wait for its real ops.

    Raises:
      ValueError: a real op waits for one of its own stand-ins (the model_fn
        fed an earlier tower's result into the last tower's call): the
        real op would wait for itself.
    """
    for key, stand_ins in self._stand_ins.items():
      real = self._real.get(key)
      if not real:
        continue
      looped = op_ledger.by_creation(set(stand_ins) &
                                     op_ledger.ancestors(real))
      if looped:
        raise ValueError(
            f'{real[0].name!r} waits for {looped[0].name!r}, what an '
            "earlier tower's same call returned in its place: it would "
            'wait for itself. Chain work after such a call from the '
            'train_op, not into what the call reads.')
      for stand_in in stand_ins:
        stand_in._add_control_inputs(real)  # pylint: disable=protected-access
