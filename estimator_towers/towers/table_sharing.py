"""One mutable lookup table for all towers.

A `tf.lookup.experimental.MutableHashTable` or `DenseHashTable` the model_fn
creates is state outside variables: called once per tower, the model_fn
would make one table per tower, each seeing its shard's inserts, and the
checkpoint (which names a table by its constructor's `name`) would keep one
tower's keys. Instead, tower 0 creates each table, on the variables device
and under its one-device name, and the k-th table a later tower creates
uses the resource of tower 0's k-th table. Only tower 0's table is saved.

Within a step, the towers' accesses are ordered to give one device's
result on the whole batch: the k-th write (insert, remove) of a table runs
in every tower, in tower order, before any tower's (k+1)-th write, as one
device runs its k-th write on the whole batch before its next (so a remove
then an insert leaves the batch's inserted keys, whichever tower removed
them); within one write the last of repeated keys wins as in one insert of
the whole batch. Writes come after every read that does not itself wait for a write (a lookup before an
insert sees the table as it was before the step, in every tower). A read
that waits for a write of the same step, in a table more than one tower
writes, would see only the earlier towers' writes: it is refused. So is a
table used inside control flow v2 (`tf.cond`, `tf.while_loop`) or a
`tf.function`, whose accesses cannot be ordered from outside.

A tower left idle by a batch smaller than the tower count trains on a copy
of the first example at weight zero (see sharding); its writes are dropped,
or that copy would overwrite a later tower's value of the same key.

Read-only tables (`StaticHashTable`, feature-column vocabularies) are left
per tower: their copies hold the same contents.
"""

import contextlib
from typing import Callable, Iterator, List, Optional

import tensorflow as tf

from estimator_towers.graph import op_ledger
from estimator_towers.graph import patching
from estimator_towers.update import write_order

tf1 = tf.compat.v1
_TABLE_CLASSES = (tf.lookup.experimental.MutableHashTable,
                  tf.lookup.experimental.DenseHashTable)
_WRITES = frozenset(['LookupTableInsert', 'LookupTableInsertV2',
                     'LookupTableRemoveV2', 'LookupTableImport',
                     'LookupTableImportV2'])
# Methods that write keys; the first argument is the keys, the second (if
# any) the values.
_WRITE_METHODS = ('insert', 'insert_or_assign', 'remove', 'erase')
# Ops that run a function: what it does with the table is not visible here.
_FUNCTIONAL = frozenset(['If', 'StatelessIf', 'While', 'StatelessWhile',
                         'Case', 'StatelessCase', 'PartitionedCall',
                         'StatefulPartitionedCall'])
# A checkpoint's export reads the table when the Saver runs, not in a step.
_EXPORTS = frozenset(['LookupTableExport', 'LookupTableExportV2'])


class TableSharing:
  """Records tower 0's mutable tables and hands them to the later towers.

  Args:
    sizes: Each tower's number of real examples (an int32 vector): an idle
      tower's writes insert nothing. None leaves every tower's writes as
      they are.
  """

  def __init__(self, sizes: Optional[tf.Tensor] = None):
    self._created: List = []
    self.sizes = sizes

  @contextlib.contextmanager
  def tower(self, index: int) -> Iterator[None]:
    """Scopes one tower's model_fn call; tower 0 creates, the others reuse.

    Args:
      index: The tower index.

    Yields:
      Nothing.

    Raises:
      ValueError: A later tower creates a table tower 0 did not create.
    """
    # Only this thread's and graph's tables are shared (see patching).
    patcher = patching.Patcher()
    graph, owns = patcher.graph, patcher.owns
    cursor = [0]
    redirected = []

    def creator(original):
      def create_resource(table):
        if not owns():
          return original(table)
        if index == 0:
          handle = original(table)
          self._created.append(table)
          return handle
        first = self._matching(index, cursor[0], table)
        cursor[0] += 1
        redirected.append(table)
        # The name tower 0's resource has, which `table.name` reports.
        table._table_name = first._table_name  # pylint: disable=protected-access
        return first.resource_handle
      return create_resource

    patches = {(cls, '_create_resource'): creator(
        cls.__dict__['_create_resource']) for cls in _TABLE_CLASSES}
    if index and self.sizes is not None:
      real = self.sizes[index]
      for cls in _TABLE_CLASSES:
        for name in _WRITE_METHODS:
          if name in cls.__dict__:
            patches[(cls, name)] = _unless_idle(cls.__dict__[name], real,
                                                owns)
    with patcher:
      for (cls, name), method in patches.items():
        patcher.set(cls, name, method)
      yield
    if index:
      _drop_saveables(graph, redirected)
      if cursor[0] != len(self._created):
        raise ValueError(
            f'Tower {index} created {cursor[0]} mutable lookup tables but '
            f'tower 0 created {len(self._created)}. Every tower must build '
            'the same model.')

  def _matching(self, index: int, position: int, table):
    """Tower 0's table number `position`, checked to be of `table`'s kind."""
    if position >= len(self._created):
      raise ValueError(
          f'Tower {index} created lookup table {table._name!r} (mutable '  # pylint: disable=protected-access
          f'table number {position + 1}), but tower 0 created only '
          f'{len(self._created)}. Every tower must build the same model: do '
          'not make tables depend on the tower index or on the data.')
    first = self._created[position]
    if (type(first) is not type(table) or
        first.key_dtype != table.key_dtype or
        first.value_dtype != table.value_dtype or
        first._value_shape != table._value_shape):  # pylint: disable=protected-access
      raise ValueError(
          f'Tower {index} created lookup table {table._name!r} '  # pylint: disable=protected-access
          f'({type(table).__name__} {table.key_dtype.name} -> '
          f'{table.value_dtype.name}), but the matching table of tower 0, '
          f'{first.name!r}, is a {type(first).__name__} '
          f'{first.key_dtype.name} -> {first.value_dtype.name}. Every tower '
          'must build the same model.')
    return first

  def written(self, since: op_ledger.Mark) -> List[str]:
    """Names of the shared tables some op made after `since` writes."""
    return [table.name for table in self._created
            if any(op.type in _WRITES and op_ledger.made_after(op, since)
                   for op in table.resource_handle.consumers())]

  def order_accesses(self, towers: op_ledger.TowerLedger) -> None:
    """Orders the towers' accesses of each shared table (see module doc).

    Args:
      towers: Where each tower's ops begin; ops before tower 0's are not
        the towers'. Called once all towers are built.

    Raises:
      ValueError: A read waits for a write of the same step to a table that
        several towers write, a function uses a shared table, or the towers
        write a table different numbers of times.
    """
    first = towers.first
    for table in self._created:
      users = op_ledger.by_creation(
          op for op in table.resource_handle.consumers()
          if op_ledger.made_after(op, first) and op.type not in _EXPORTS)
      for op in users:
        if op.type in _FUNCTIONAL:
          raise ValueError(
              f'Lookup table {table.name!r} is used inside {op.type} '
              f'{op.name} (tf.cond, tf.while_loop or a tf.function); the '
              'towers share one table and cannot order accesses made '
              'inside a function. Use the table outside control flow, or '
              'keep it out of replicate_model_fn.')
      writes = [op for op in users if op.type in _WRITES]
      if len(writes) < 2:
        continue
      reads = [op for op in users if op.type not in _WRITES]
      write_names = {op.name for op in writes}
      for read in reads:
        if _waits_for(read, write_names, first):
          raise ValueError(
              f'Lookup table {table.name!r} is read by {read.name} after '
              'a write of the same step, and several towers write it: each '
              'tower would see only the writes of the towers before it, not '
              "the whole batch's. Read the table before writing it in the "
              'step (e.g. lookup, then insert), or keep the table out of '
              'replicate_model_fn.')
      writes = _write_major(table, writes, towers)
      for before, after in zip(writes, writes[1:]):
        after._add_control_inputs([before])  # pylint: disable=protected-access
      for write in writes:
        write._add_control_inputs(  # pylint: disable=protected-access
            [r for r in reads if r not in write.control_inputs])
      write_order.keep_whole(writes[:-1] + list(reads))


def _write_major(table, writes: List[tf.Operation],
                 towers: op_ledger.TowerLedger) -> List[tf.Operation]:
  """`writes` (in op order) as every tower's first write, then second, ...

  Tower by tower would be wrong when a table is written twice in a step:
  a later tower's remove would undo an earlier tower's insert, which one
  device, removing for the whole batch before inserting, never does.
  """
  by_tower = [[] for _ in range(towers.count)]
  for op in writes:
    by_tower[towers.tower_of(op)].append(op)
  counts = [len(ops) for ops in by_tower]
  if len(set(counts)) > 1:
    raise ValueError(
        f'The towers write lookup table {table.name!r} different numbers of '
        f'times in a step ({counts} write ops per tower: '
        f'{[op.name for op in writes]}); they cannot be matched to one '
        "device's writes. Every tower must build the same model: do not make "
        'table writes depend on the tower index.')
  return [ops[k] for k in range(counts[0]) for ops in by_tower]


def _unless_idle(method: Callable, real: tf.Tensor,
                 owns: Callable[[], bool]) -> Callable:
  """`method` writing no key when the tower has no real example."""

  def write(table, keys, *args, **kwargs):
    if not owns():
      return method(table, keys, *args, **kwargs)
    keys = tf.convert_to_tensor(keys, table.key_dtype)
    if not keys.shape.rank:
      return method(table, keys, *args, **kwargs)
    with tf.name_scope('unless_idle'):
      count = tf.where(real > 0, tf.shape(keys)[0], 0)
      args = list(args)
      if args:  # The values, one row per key.
        args[0] = tf.convert_to_tensor(args[0], table.value_dtype)[:count]
      elif 'values' in kwargs:
        kwargs['values'] = tf.convert_to_tensor(
            kwargs['values'], table.value_dtype)[:count]
      return method(table, keys[:count], *args, **kwargs)

  return write


def _waits_for(op: tf.Operation, names, since: op_ledger.Mark) -> bool:
  """True when `op` depends on an op named in `names` (among the ops made
  after `since`)."""
  pending, seen = list(op.inputs) + list(op.control_inputs), set()
  while pending:
    item = pending.pop()
    node = getattr(item, 'op', item)
    if node.name in seen or op_ledger.made_before(node, since):
      continue
    seen.add(node.name)
    if node.name in names:
      return True
    pending.extend(node.inputs)
    pending.extend(node.control_inputs)
  return False


def _drop_saveables(graph: tf.Graph, tables: List) -> None:
  """Removes later towers' checkpoint entries: tower 0's table is saved."""
  ids = {id(t) for t in tables}
  ref = graph.get_collection_ref(tf1.GraphKeys.SAVEABLE_OBJECTS)
  ref[:] = [s for s in ref if id(getattr(s, 'op', None)) not in ids]
