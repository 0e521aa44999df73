"""Each task of a synchronous cluster parses only its share of the batch.

The train input_fns of file sources batch raw records (lines, serialized
Examples, image paths, indices) at the global size, keep the task's rows,
and only then parse them. The tasks' parts, in task order, must still be
exactly the one-process batches, the last partial (and empty parts) too.
"""

import numpy as np
import pytest
import tensorflow as tf

import input_fns
from input_helpers import (bytes_feature, dataset_elements, example,
                           float_feature, int_feature, task_configs,
                           write_png, write_records)

pytestmark = pytest.mark.fast

tf1 = tf.compat.v1

# 11 rows, 2 epochs, batches of 7: 7, 7, 7, 1. Two tasks keep 4+3 and 1+0,
# three tasks 3+2+2 and 1+0+0.
ROWS, EPOCHS, BATCH, SEED = 11, 2, 7, 3
# Ops that parse, decode or make an example: none may run before the slice.
PARSE_OPS = frozenset(['DecodeCSV', 'ParseExampleV2', 'ParseSingleExample',
                       'ReadFile', 'DecodeImage', 'DecodePng',
                       'StatelessRandomNormalV2', 'StatelessRandomNormal'])


def _task_configs(monkeypatch, num_tasks):
  """The RunConfigs of a chief and num_tasks - 1 workers, in task order."""
  return task_configs(monkeypatch, workers=num_tasks - 1)


def _leaf_rows(leaf):
  """A batched leaf's rows as Python values (a SparseTensor's per row)."""
  if isinstance(leaf, tf1.SparseTensorValue):
    return [leaf.values[leaf.indices[:, 0] == i].tolist()
            for i in range(leaf.dense_shape[0])]
  return [np.asarray(row).tolist() for row in leaf]


def _rows(batch):
  """(features, labels) batch -> one tuple of values per row."""
  features, labels = batch
  leaves = [features[key] for key in sorted(features)] + [labels]
  return list(zip(*[_leaf_rows(leaf) for leaf in leaves]))


def _function_op_types(library, name, seen):
  """Op types of a function of the graph, and of those it calls."""
  if name in seen or name not in library:
    return set()
  seen.add(name)
  types = set()
  for node in library[name].node_def:
    types.add(node.op)
    for attr in node.attr.values():
      names = [attr.func.name] + [f.name for f in attr.list.func]
      for called in filter(None, names):
        types |= _function_op_types(library, called, seen)
  return types


def _op_types_upstream(op, library):
  """Op types of `op`'s dataset pipeline up to it, inside functions too."""
  pending, seen_ops, seen_functions, types = [op], set(), set(), set()
  while pending:
    op = pending.pop()
    if op.name in seen_ops:
      continue
    seen_ops.add(op.name)
    types.add(op.type)
    for attr in op.node_def.attr.values():
      if attr.func.name:
        types |= _function_op_types(library, attr.func.name, seen_functions)
    pending.extend(t.op for t in op.inputs)
  return types


def _assert_parses_after_slicing(dataset):
  """Nothing up to the map right after the global batch parses."""
  graph = tf1.get_default_graph()
  library = {f.signature.name: f
             for f in graph.as_graph_def().library.function}
  ops = graph.get_operations()
  (batch,) = [op for op in ops if op.type == 'BatchDatasetV2']
  (sliced,) = [op for op in ops if op.inputs and
               op.inputs[0].op is batch]
  assert not PARSE_OPS & _op_types_upstream(sliced, library)
  # ... and parsing happens downstream, so the check above can fail.
  final = dataset._variant_tensor.op  # pylint: disable=protected-access
  assert PARSE_OPS & _op_types_upstream(final, library)


# The sources, each with 11 training rows.

def _csv(tmp_path):
  colours = ['red', 'green', 'dark, blue']
  labels = ['bird', 'cat', 'dog']
  paths = []
  for part, rows in (('a', range(6)), ('b', range(6, ROWS))):
    path = tmp_path / f'train-{part}.csv'
    path.write_text('size,weight,colour,label\n' + ''.join(
        f'{i},{i * 0.5},"{colours[i % 3]}",{labels[i * 7 % 3]}\n'
        for i in rows))
    paths.append(str(path))
  return input_fns.csv_data(
      paths, paths[:1], label_column='label', label_vocabulary=labels,
      categorical_columns={'colour': colours}, shuffle_buffer_size=5)


def _csv_skipping(tmp_path):
  path = tmp_path / 'train.csv'
  path.write_text('size,label\n' + ''.join(
      f'{i},{i % 2}\n' if i % 4 else f'x{i},0\n' for i in range(ROWS + 4)))
  return input_fns.csv_data([str(path)], [str(path)], label_column='label',
                            n_classes=2, skip_malformed=True,
                            shuffle_buffer_size=5)


def _tfrecord(tmp_path):
  paths = [write_records(tmp_path / f'{part}.tfrecord', [
      example(x=float_feature([i, -i]), n=int_feature([i * 3]),
              tags=bytes_feature(['t'] * (i % 3) + [f'v{i}']),
              label=int_feature([i % 2])) for i in rows])
           for part, rows in (('a', range(5)), ('b', range(5, ROWS)))]
  spec = {'x': tf.io.FixedLenFeature([2], tf.float32),
          'n': tf.io.FixedLenFeature([], tf.int64),
          'tags': tf.io.VarLenFeature(tf.string),
          'label': tf.io.FixedLenFeature([], tf.int64)}
  return input_fns.tfrecord_data(paths, paths[:1], feature_spec=spec,
                                 label_key='label', n_classes=2,
                                 categorical_columns={'tags': 8},
                                 shuffle_buffer_size=4)


def _pixels(n):
  return np.random.RandomState(0).randint(0, 256, (n, 4, 3, 3),
                                          dtype=np.uint8)


def _tfrecord_images(tmp_path):
  path = write_records(tmp_path / 'png.tfrecord', [
      example(png=bytes_feature([tf.io.encode_png(p).numpy()]),
              label=int_feature([i % 3])) for i, p in enumerate(
                  _pixels(ROWS))])
  spec = {'png': tf.io.FixedLenFeature([], tf.string),
          'label': tf.io.FixedLenFeature([], tf.int64)}
  return input_fns.tfrecord_data([path], [path], feature_spec=spec,
                                 label_key='label', n_classes=3,
                                 image_key='png', image_shape=(4, 3, 3),
                                 shuffle_buffer_size=6)


def _image_folder(tmp_path, corrupt=()):
  """Class folders 'a' (6 images) and 'b' (5); `corrupt`: train positions
  whose file is not an image."""
  root = tmp_path / 'photos'
  for i, pixels in enumerate(_pixels(ROWS)):
    path = root / ('a' if i < 6 else 'b') / f'{i:02d}.png'
    write_png(path, pixels)
    if i in corrupt:
      path.write_bytes(b'not a png')
  held_out = root.parent / 'held_out'
  write_png(held_out / 'a' / 'x.png', _pixels(1)[0])
  return input_fns.image_folder_data(str(root), str(held_out),
                                     image_size=(4, 3))


def _synthetic_images(tmp_path):
  del tmp_path
  return input_fns.synthetic_images((4, 3, 3), n_classes=3,
                                    num_examples=ROWS + 2)


def _arrays(tmp_path):
  del tmp_path  # In memory: 11 train rows, 2 eval.
  return input_fns.synthetic_tabular(num_features=3, num_examples=ROWS + 2)


SOURCES = {'csv': _csv, 'csv_skipping': _csv_skipping,
           'tfrecord': _tfrecord, 'tfrecord_images': _tfrecord_images,
           'image_folder': _image_folder,
           'synthetic_images': _synthetic_images, 'arrays': _arrays}
# Sources without parsing, or that must parse to know the batch.
PARSE_ALL = ('arrays', 'csv_skipping')


def _one_process(data):
  """Today's one-process batches: parsed examples, batched."""
  with tf.Graph().as_default():
    examples = data._examples('train', shuffle=True, seed=SEED)  # pylint: disable=protected-access
    batches = examples.repeat(EPOCHS).batch(BATCH)
    return batches.element_spec, dataset_elements(batches)


@pytest.mark.parametrize('source', sorted(SOURCES))
def test_tasks_shares_add_up_to_the_one_process_batches(tmp_path,
                                                        monkeypatch, source):
  data = SOURCES[source](tmp_path)
  spec, expected = _one_process(data)
  assert len(expected[-1][1]) == 1  # Tasks but the chief get empty parts.
  input_fn = data.train_input_fn(BATCH, seed=SEED, num_epochs=EPOCHS)
  with tf.Graph().as_default():
    alone = dataset_elements(input_fn(None))
  assert [_rows(batch) for batch in alone] == [
      _rows(batch) for batch in expected]
  for num_tasks in (2, 3):
    tasks = []
    for config in _task_configs(monkeypatch, num_tasks):
      with tf.Graph().as_default():
        dataset = input_fn(config)
        assert dataset.element_spec == spec
        if source not in PARSE_ALL:
          _assert_parses_after_slicing(dataset)
        tasks.append(dataset_elements(dataset))
    for task in tasks:
      assert len(task) == len(expected)
    for step, batch in enumerate(expected):
      assert sum((_rows(task[step]) for task in tasks), []) == _rows(batch)


def test_a_bad_row_fails_only_the_task_that_parses_it(tmp_path, monkeypatch):
  # Unshuffled batches of 2 over two tasks: the chief keeps the even rows
  # (6 batches of 1), the worker the odd ones, which are bad here.
  csv_path = tmp_path / 'rows.csv'
  csv_path.write_text('x,label\n' + ''.join(
      f'{i},0\n' if i % 2 == 0 else f'{i},9\n' for i in range(ROWS)))
  csv = input_fns.csv_data([str(csv_path)], [str(csv_path)],
                           label_column='label', n_classes=2)
  records = write_records(tmp_path / 'rows.tfrecord', [
      example(x=float_feature([i]), label=int_feature([i % 2 * 9]))
      for i in range(ROWS)])
  tfrecord = input_fns.tfrecord_data(
      [records], [records], label_key='label', n_classes=2,
      feature_spec={'x': tf.io.FixedLenFeature([], tf.float32),
                    'label': tf.io.FixedLenFeature([], tf.int64)})
  folder = _image_folder(tmp_path, corrupt=(1, 3))
  first_bad = {csv: f'{csv_path}:3: label `9` is not a class id',
               tfrecord: f'Bad label 9 in TFRecord {records}:1',
               folder: 'image'}
  chief, worker = _task_configs(monkeypatch, 2)
  for data, message in first_bad.items():
    input_fn = data.train_input_fn(2, shuffle=False, num_epochs=1)
    with tf.Graph().as_default():
      assert len(dataset_elements(input_fn(chief))) == 6
    with tf.Graph().as_default(), pytest.raises(
        tf.errors.InvalidArgumentError, match=message):
      dataset_elements(input_fn(worker))

