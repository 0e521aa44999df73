"""input_fns: every source yields what model_fns expect, in order, and serves.

Input pipelines run the way Estimator runs them: the input_fn is called
inside a graph and read through a one-shot iterator in a session. Data files
are written to tmp_path by the tests themselves.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import input_fns
from input_helpers import (bytes_feature, example, float_feature,
                           int_feature, run_input_fn, write_png,
                           write_records)

tf1 = tf.compat.v1


# Helpers.


def concat(batches):
  """Concatenates batches of (features, labels) or of features."""
  return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches)


def batch_sizes(batches):
  return [len(tf.nest.flatten(batch)[0]) for batch in batches]


def assert_features_like(features, data):
  """Keys, dtypes and shapes match the data's feature signature."""
  signature = data.feature_signature()
  assert sorted(features) == sorted(signature)
  for key, spec in signature.items():
    value = features[key]
    if isinstance(spec, tf.SparseTensorSpec):
      assert isinstance(value, tf1.SparseTensorValue), key
      continue
    expected_kind = 'O' if spec.dtype == tf.string else 'f'
    assert value.dtype.kind == expected_kind, key
    if spec.dtype == tf.float32:
      assert value.dtype == np.float32, key
    assert value.shape[1:] == tuple(spec.shape.as_list()), key


def serve(data, export_format, feed):
  """Builds the receiver in a graph and runs its features on `feed`.

  Args:
    feed: receiver key -> value.

  Returns:
    (receiver features as numpy, the receiver's features as Tensors).
  """
  with tf.Graph().as_default():
    receiver = data.serving_input_receiver_fn(export_format)()
    assert isinstance(receiver, tf.estimator.export.ServingInputReceiver)
    feed_dict = {receiver.receiver_tensors[key]: value
                 for key, value in feed.items()}
    with tf1.Session() as session:
      return session.run(receiver.features, feed_dict), receiver.features


def assert_same_features(actual, expected):
  assert sorted(actual) == sorted(expected)
  for key in expected:
    if expected[key].dtype == object:
      np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)
    else:
      np.testing.assert_allclose(actual[key], expected[key], rtol=1e-6,
                                 atol=1e-6, err_msg=key)







def input_layer_width(data, features_batch):
  """Runs the data's feature_columns on a batch; returns the input width."""
  with tf.Graph().as_default():
    features = {
        key: (tf.SparseTensor(*value)
              if isinstance(value, tf1.SparseTensorValue) else
              tf.constant(value)) for key, value in features_batch.items()}
    net = tf1.feature_column.input_layer(features, data.feature_columns)
    with tf1.Session() as session:
      session.run([tf1.global_variables_initializer(),
                   tf1.tables_initializer()])
      return session.run(net).shape


# The shared pipeline.

@pytest.mark.fast
@pytest.mark.parametrize('bad', [0, -1, 1.5, True, '8', None])
def test_batch_size_must_be_a_positive_int(bad):
  data = input_fns.synthetic_tabular(num_examples=20)
  for make in (data.train_input_fn, data.eval_input_fn,
               data.predict_input_fn):
    with pytest.raises(ValueError, match='batch_size'):
      make(bad)


# digits.

@pytest.mark.fast
def test_digits_split_is_fixed_and_aligned_with_example_ids():
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  data = input_fns.digits()
  assert (data.kind, data.n_classes, data.image_shape) == ('tabular', 10, None)
  ids = data.example_ids()
  assert ids == input_fns.digits().example_ids()  # Deterministic.
  assert len(ids) == 360 and len(set(ids)) == 360

  batches = run_input_fn(data.eval_input_fn(100))
  assert batch_sizes(batches) == [100, 100, 100, 60]  # Remainder kept.
  features, labels = concat(batches)
  assert_features_like(features, data)
  assert labels.dtype == np.int32
  bunch = datasets.load_digits()
  index = np.array([int(i) for i in ids])
  np.testing.assert_allclose(features['pixels'], bunch.data[index] / 16.0)
  np.testing.assert_array_equal(labels, bunch.target[index])

  # One pass of train (unshuffled) is the other 1437 examples.
  train_batches = run_input_fn(data.train_input_fn(1437, shuffle=False), 2)
  assert batch_sizes(train_batches) == [1437, 1437]  # Repeats.
  train_features, _ = train_batches[0]
  np.testing.assert_array_equal(train_batches[1][0]['pixels'],
                                train_features['pixels'])
  rest = np.setdiff1d(np.arange(1797), index)
  np.testing.assert_allclose(np.sort(train_features['pixels'], axis=0),
                             np.sort(bunch.data[rest] / 16.0, axis=0))

  predictions = concat(run_input_fn(data.predict_input_fn(128)))
  assert set(predictions) == {'pixels'}
  np.testing.assert_array_equal(predictions['pixels'], features['pixels'])
  assert input_layer_width(data, {'pixels': features['pixels'][:3]}) == (3,
                                                                         64)


@pytest.mark.fast
def test_digits_image_view():
  data = input_fns.digits('image')
  assert (data.kind, data.image_shape, data.feature_columns) == (
      'image', (8, 8, 1), [])
  features, labels = concat(run_input_fn(data.eval_input_fn(64)))
  tabular, tabular_labels = concat(
      run_input_fn(input_fns.digits().eval_input_fn(64)))
  assert features['image'].shape == (360, 8, 8, 1)
  np.testing.assert_array_equal(features['image'].reshape(360, 64),
                                tabular['pixels'])
  np.testing.assert_array_equal(labels, tabular_labels)


@pytest.mark.fast
def test_digits_unknown_view():
  with pytest.raises(ValueError, match="view='pictures'"):
    input_fns.digits('pictures')


@pytest.mark.fast
def test_train_shuffle_is_seeded_and_covers_each_epoch():
  data = input_fns.synthetic_tabular(num_features=2, num_examples=50)
  in_order = concat(run_input_fn(data.train_input_fn(40, shuffle=False), 1))
  first = run_input_fn(data.train_input_fn(40, seed=3), 2)
  again = run_input_fn(data.train_input_fn(40, seed=3), 2)
  other = run_input_fn(data.train_input_fn(40, seed=4), 2)
  np.testing.assert_array_equal(first[0][0]['x'], again[0][0]['x'])
  assert not np.array_equal(first[0][0]['x'], other[0][0]['x'])
  assert not np.array_equal(first[0][0]['x'], in_order[0]['x'])
  # 40 train examples: each batch of 40 is one whole epoch, reshuffled.
  for batch in first:
    np.testing.assert_array_equal(np.sort(batch[0]['x'], axis=0),
                                  np.sort(in_order[0]['x'], axis=0))
  assert not np.array_equal(first[0][0]['x'], first[1][0]['x'])


# synthetic.

@pytest.mark.fast
def test_synthetic_tabular_is_learnable_and_ordered():
  data = input_fns.synthetic_tabular(num_features=8, n_classes=3,
                                     num_examples=600, seed=1)
  assert data.feature_columns[0].name == 'x'
  train_x, train_y = concat(run_input_fn(
      data.train_input_fn(480, shuffle=False), 1))
  eval_batches = run_input_fn(data.eval_input_fn(50))
  assert batch_sizes(eval_batches) == [50, 50, 20]
  eval_x, eval_y = concat(eval_batches)
  assert data.example_ids() == [str(i) for i in range(480, 600)]
  centres = np.stack([train_x['x'][train_y == c].mean(0) for c in range(3)])
  nearest = np.argmin(((eval_x['x'][:, None] - centres) ** 2).sum(-1), 1)
  assert (nearest == eval_y).mean() > 0.6  # Chance is 1/3.


@pytest.mark.fast
def test_synthetic_images_are_deterministic_learnable_images():
  data = input_fns.synthetic_images((6, 5, 3), n_classes=4, num_examples=100)
  assert (data.kind, data.image_shape, data.n_classes) == (
      'image', (6, 5, 3), 4)
  batches = run_input_fn(data.eval_input_fn(8))
  assert batch_sizes(batches) == [8, 8, 4]
  features, labels = concat(batches)
  assert_features_like(features, data)
  again, _ = concat(run_input_fn(input_fns.synthetic_images(
      (6, 5, 3), n_classes=4, num_examples=100).eval_input_fn(20)))
  np.testing.assert_array_equal(features['image'], again['image'])
  assert 0.0 <= features['image'].min() and features['image'].max() <= 1.0
  assert data.example_ids() == [str(i) for i in range(80, 100)]
  train, train_labels = concat(run_input_fn(
      data.train_input_fn(80, shuffle=False), 1))
  assert len(set(train_labels.tolist())) == 4
  means = np.stack([train['image'][train_labels == c].mean(0)
                    for c in range(4)])
  distances = ((features['image'][:, None] - means) ** 2).sum((2, 3, 4))
  assert (np.argmin(distances, 1) == labels).mean() > 0.9


@pytest.mark.fast
def test_demo_helpers_still_serve_arrays():
  x, y = input_fns.gaussian_blobs(num_examples=10, num_features=3)
  features, labels = concat(run_input_fn(input_fns.arrays_input_fn(x, y, 4)))
  np.testing.assert_array_equal(features['x'], x)
  np.testing.assert_array_equal(labels, y)


# CSV.

HEADER = 'size,weight,colour,label\n'
TRAIN_ROWS = ['1,2,red,0', '3,4,"dark, blue",1', '5,6,green,2']
EVAL_ROWS = ['0.5,1e1,red,2', ' -2 , 7 ,green,0', '', '8,9,red,1',
             '10,11,"dark, blue",0']  # A blank line and spaces.
CATEGORICAL = {'colour': ['red', 'green', 'dark, blue']}


def write_csv(path, rows, header=HEADER):
  with open(path, 'w') as f:
    f.write(header + ''.join(row + '\n' for row in rows))
  return str(path)


@pytest.fixture
def csv_files(tmp_path):
  write_csv(tmp_path / 'train-1.csv', TRAIN_ROWS)
  write_csv(tmp_path / 'train-2.csv', TRAIN_ROWS[::-1])
  return (str(tmp_path / 'train-*.csv'),
          write_csv(tmp_path / 'eval.csv', EVAL_ROWS))


def make_csv(train_glob, eval_file, **kwargs):
  kwargs.setdefault('categorical_columns', CATEGORICAL)
  kwargs.setdefault('n_classes', 3)
  return input_fns.csv_data([train_glob], [eval_file], label_column='label',
                            **kwargs)


@pytest.mark.fast
def test_csv_reads_header_types_and_order(csv_files):
  train_glob, eval_file = csv_files
  data = make_csv(train_glob, eval_file)
  assert (data.kind, data.n_classes, data.image_shape) == ('tabular', 3, None)
  batches = run_input_fn(data.eval_input_fn(3))
  assert batch_sizes(batches) == [3, 1]
  features, labels = concat(batches)
  assert_features_like(features, data)
  assert {k: v.dtype for k, v in data.feature_signature().items()} == {
      'size': tf.float32, 'weight': tf.float32, 'colour': tf.string}
  np.testing.assert_array_equal(features['size'], [0.5, -2, 8, 10])
  np.testing.assert_array_equal(features['weight'], [10, 7, 9, 11])
  assert features['colour'].tolist() == [b'red', b'green', b'red',
                                         b'dark, blue']
  np.testing.assert_array_equal(labels, [2, 0, 1, 0])
  # Lines count from 1 with the header; the blank line 4 is no row.
  assert data.example_ids() == [f'{eval_file}:{n}' for n in (2, 3, 5, 6)]
  predictions = concat(run_input_fn(data.predict_input_fn(2)))
  np.testing.assert_array_equal(predictions['size'], features['size'])

  train = concat(run_input_fn(data.train_input_fn(6, shuffle=False), 1))
  assert sorted(train[1].tolist()) == [0, 0, 1, 1, 2, 2]
  assert input_layer_width(data, features) == (4, 1 + 1 + 3)


@pytest.mark.fast
def test_csv_declared_columns_with_and_without_header(tmp_path, csv_files):
  train_glob, eval_file = csv_files
  expected = concat(run_input_fn(
      make_csv(train_glob, eval_file).eval_input_fn(10)))
  bare = write_csv(tmp_path / 'bare.csv', EVAL_ROWS, header='')
  names = ['size', 'weight', 'colour', 'label']
  no_header = make_csv(train_glob, bare, columns=names, header=False)
  got = concat(run_input_fn(no_header.eval_input_fn(10)))
  assert_same_features(got[0], expected[0])
  np.testing.assert_array_equal(got[1], expected[1])
  assert no_header.example_ids()[0] == f'{bare}:1'
  # Declared names override the header, which is skipped.
  renamed = make_csv(train_glob, eval_file, header=True,
                     columns=['a', 'b', 'c', 'label'],
                     categorical_columns={'c': 5})
  features, _ = concat(run_input_fn(renamed.eval_input_fn(10)))
  assert sorted(features) == ['a', 'b', 'c']
  np.testing.assert_array_equal(features['a'], expected[0]['size'])
  assert input_layer_width(renamed, features) == (4, 1 + 1 + 2)
  with pytest.raises(ValueError, match='header=False'):
    make_csv(train_glob, bare, header=False)
  with pytest.raises(ValueError, match='has 4 fields'):
    make_csv(train_glob, eval_file, columns=['a', 'b', 'label'])


@pytest.mark.fast
def test_csv_header_mismatch_names_the_file(tmp_path, csv_files):
  train_glob, _ = csv_files
  other = write_csv(tmp_path / 'other.csv', ['1,2,red,0'],
                    header='size,mass,colour,label\n')
  with pytest.raises(ValueError, match='other.csv'):
    make_csv(train_glob, other)


@pytest.mark.fast
def test_csv_defaults_fill_empty_fields(tmp_path, csv_files):
  train_glob, _ = csv_files
  holes = write_csv(tmp_path / 'holes.csv', [',2,,1', '3,,green,0'])
  data = make_csv(train_glob, holes,
                  defaults={'size': -1.5, 'colour': 'red', 'weight': 0})
  features, labels = concat(run_input_fn(data.eval_input_fn(5)))
  np.testing.assert_array_equal(features['size'], [-1.5, 3])
  np.testing.assert_array_equal(features['weight'], [2, 0])
  assert features['colour'].tolist() == [b'red', b'green']
  np.testing.assert_array_equal(labels, [1, 0])
  with pytest.raises(TypeError, match="defaults\\['size'\\]"):
    make_csv(train_glob, holes, defaults={'size': 'big'})
  with pytest.raises(ValueError, match="defaults\\['height'\\]"):
    make_csv(train_glob, holes, defaults={'height': 1.0})


@pytest.mark.fast
@pytest.mark.parametrize('row, reason', [
    ('1,2,red', 'expected 4 fields, found 3'),
    ('1,2,red,0,9', 'expected 4 fields, found 5'),
    ('1,heavy,red,0', 'column `weight`: `heavy` is not a number'),
    (',2,red,0', 'column `size` is empty and has no default'),
    ('1,2,red,3', 'label `3` is not a class id in \\[0, 3\\)'),
    ('1,2,red,one', 'label `one` is not a class id'),
    ('1,2,re"d,0', 'malformed quoting'),
])
def test_csv_malformed_row_names_file_and_line(tmp_path, csv_files, row,
                                               reason):
  train_glob, _ = csv_files
  bad = write_csv(tmp_path / 'bad.csv', ['1,2,red,0', '', row, '4,5,red,1'])
  data = make_csv(train_glob, bad)  # Building does not read every row.
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=f'{bad}:4: {reason}'):
    run_input_fn(data.eval_input_fn(1))
  with pytest.raises(ValueError, match=f'{bad}:4: {reason}'):
    data.example_ids()


@pytest.mark.fast
def test_csv_label_vocabulary(tmp_path, csv_files):
  _, _ = csv_files
  rows = ['1,2,red,cat', '3,4,red,dog', '5,6,red,bird']
  path = write_csv(tmp_path / 'animals.csv', rows)
  data = input_fns.csv_data(
      [path], [path], label_column='label', categorical_columns=CATEGORICAL,
      label_vocabulary=['bird', 'cat', 'dog'])
  assert data.n_classes == 3
  _, labels = concat(run_input_fn(data.eval_input_fn(5)))
  np.testing.assert_array_equal(labels, [1, 2, 0])
  unknown = write_csv(tmp_path / 'unknown.csv', ['1,2,red,cow'])
  bad = input_fns.csv_data(
      [path], [unknown], label_column='label',
      categorical_columns=CATEGORICAL, label_vocabulary=['bird', 'cat', 'dog'])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='unknown.csv:2: label `cow` is not in'):
    run_input_fn(bad.eval_input_fn(1))
  with pytest.raises(ValueError, match='n_classes'):
    input_fns.csv_data([path], [path], label_column='label',
                       categorical_columns=CATEGORICAL)


@pytest.mark.fast
def test_csv_skip_malformed_skips_and_counts(tmp_path, csv_files):
  train_glob, _ = csv_files
  good = write_csv(tmp_path / 'good.csv', ['1,2,red,0'])
  bad = write_csv(tmp_path / 'bad.csv', [
      '1,2,red,0', 'x,2,red,0', '2,3,red,1', '2,3,red', '4,5,red,2'])
  data = make_csv(train_glob, str(tmp_path / '[bg]*.csv'),
                  skip_malformed=True)
  assert data.skipped_rows('eval') == {bad: 2, good: 0}
  assert data.malformed_rows('eval') == [
      f'{bad}:3: column `size`: `x` is not a number',
      f'{bad}:5: expected 4 fields, found 3']
  assert data.skipped_rows('train') == {str(tmp_path / 'train-1.csv'): 0,
                                        str(tmp_path / 'train-2.csv'): 0}
  features, labels = concat(run_input_fn(data.eval_input_fn(2)))
  np.testing.assert_array_equal(features['size'], [1, 2, 4, 1])
  np.testing.assert_array_equal(labels, [0, 1, 2, 0])
  assert data.example_ids() == [f'{bad}:2', f'{bad}:4', f'{bad}:6',
                                f'{good}:2']
  with pytest.raises(ValueError, match='split'):
    data.skipped_rows('test')


@pytest.mark.fast
def test_csv_non_finite_numbers_are_malformed_unless_allowed(tmp_path,
                                                             csv_files):
  train_glob, _ = csv_files
  path = write_csv(tmp_path / 'odd.csv', [
      '1,2,red,0', 'nan,2,red,0', '3,-Infinity,red,1', '1e39,4,red,2',
      '5,INF,red,1'])
  data = make_csv(train_glob, path)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='odd.csv:3: column `size`: `nan` is not a finite'):
    run_input_fn(data.eval_input_fn(5))
  assert data.malformed_rows('eval') == [
      f'{path}:3: column `size`: `nan` is not a finite float32 (pass '
      '--allow-non-finite / allow_non_finite=True to keep such values)',
      f'{path}:4: column `weight`: `-Infinity` is not a finite float32 (pass '
      '--allow-non-finite / allow_non_finite=True to keep such values)',
      f'{path}:5: column `size`: `1e39` is not a finite float32 (pass '
      '--allow-non-finite / allow_non_finite=True to keep such values)',
      f'{path}:6: column `weight`: `INF` is not a finite float32 (pass '
      '--allow-non-finite / allow_non_finite=True to keep such values)']
  skipping = make_csv(train_glob, path, skip_malformed=True)
  features, _ = concat(run_input_fn(skipping.eval_input_fn(5)))
  np.testing.assert_array_equal(features['size'], [1])
  allowing = make_csv(train_glob, path, allow_non_finite=True)
  features, labels = concat(run_input_fn(allowing.eval_input_fn(5)))
  np.testing.assert_array_equal(features['size'], [1, np.nan, 3, np.inf, 5])
  np.testing.assert_array_equal(features['weight'], [2, 2, -np.inf, 4,
                                                     np.inf])
  np.testing.assert_array_equal(labels, [0, 0, 1, 2, 1])
  with pytest.raises(ValueError, match="defaults\\['size'\\]=nan is not a "
                     'finite'):
    make_csv(train_glob, path, defaults={'size': float('nan')})
  make_csv(train_glob, path, defaults={'size': float('nan')},
           allow_non_finite=True)


@pytest.mark.fast
def test_csv_bad_globs_fail_when_built(tmp_path, csv_files):
  train_glob, eval_file = csv_files
  with pytest.raises(ValueError, match='nothing-\\*.csv.*matches no file'):
    make_csv(str(tmp_path / 'nothing-*.csv'), eval_file)
  open(tmp_path / 'empty.csv', 'w').close()
  write_csv(tmp_path / 'header-only.csv', [])
  with pytest.raises(ValueError, match="'.*empty.csv' matches only files "
                     'without examples'):
    make_csv(train_glob, str(tmp_path / 'empty.csv'))
  with pytest.raises(ValueError, match='header-only.csv'):
    make_csv(str(tmp_path / 'header-only.csv'), eval_file)
  # An empty file next to good ones is fine: it adds no rows.
  data = make_csv(str(tmp_path / 'train-*.csv'), eval_file)
  assert len(data.example_ids()) == 4
  with pytest.raises(TypeError, match='train_files'):
    input_fns.csv_data([], [eval_file], label_column='label', n_classes=3)


@pytest.mark.fast
def test_csv_serving_matches_training_features(csv_files):
  train_glob, eval_file = csv_files
  data = make_csv(train_glob, eval_file, defaults={'weight': 0.25})
  expected, _ = concat(run_input_fn(data.eval_input_fn(10)))

  lines = ['0.5,1e1,red', '-2,7,green', '8,9,red', '10,,"dark, blue"']
  got, tensors = serve(data, 'csv', {'csv_lines': lines})
  expected['weight'][3] = 0.25  # Serving fills the empty field too.
  assert_same_features(got, expected)
  signature = data.feature_signature()
  assert {k: v.dtype for k, v in tensors.items()} == {
      k: v.dtype for k, v in signature.items()}

  examples = [example(size=float_feature([s]), weight=float_feature([w]),
                      colour=bytes_feature([c]))
              for s, w, c in zip(expected['size'], expected['weight'],
                                 expected['colour'])]
  got, _ = serve(data, 'example', {'examples': examples})
  assert_same_features(got, expected)

  got, tensors = serve(data, 'json', expected)
  assert_same_features(got, expected)
  assert all(t.shape.as_list() == [None] for t in tensors.values())
  with pytest.raises(ValueError, match="export_format='xml'"):
    data.serving_input_receiver_fn('xml')


# TFRecord.

@pytest.mark.fast
def test_tfrecord_tabular_round_trip(tmp_path):
  rng = np.random.RandomState(0)
  def rows(n, offset):
    return [dict(x=rng.rand(3).astype(np.float32), count=offset + i,
                 colour=['red', 'blue'][i % 2], tags=['a', 'b', 'c'][:i % 3],
                 label=i % 3) for i in range(n)]
  def records(rows_):
    return [example(x=float_feature(r['x']), count=int_feature([r['count']]),
                    colour=bytes_feature([r['colour']]),
                    tags=bytes_feature(r['tags']),
                    label=int_feature([r['label']])) for r in rows_]
  write_records(tmp_path / 'train.tfrecord', records(rows(8, 0)))
  eval_rows = rows(3, 100) + rows(2, 200)
  b = write_records(tmp_path / 'eval-b.tfrecord', records(eval_rows[3:]))
  a = write_records(tmp_path / 'eval-a.tfrecord', records(eval_rows[:3]))
  spec = {'x': tf.io.FixedLenFeature([3], tf.float32),
          'count': tf.io.FixedLenFeature([], tf.int64),
          'colour': tf.io.FixedLenFeature([], tf.string),
          'tags': tf.io.VarLenFeature(tf.string),
          'label': tf.io.FixedLenFeature([], tf.int64)}
  data = input_fns.tfrecord_data(
      [str(tmp_path / 'train.tfrecord')], [str(tmp_path / 'eval-*')],
      feature_spec=spec, label_key='label', n_classes=3,
      categorical_columns={'colour': ['red', 'blue'], 'tags': 10})
  assert data.kind == 'tabular'
  batches = run_input_fn(data.eval_input_fn(4))
  assert batch_sizes(batches) == [4, 1]
  features, labels = batches[0]
  assert_features_like(features, data)
  assert features['count'].dtype == np.float32
  np.testing.assert_array_equal(features['count'], [100, 101, 102, 200])
  np.testing.assert_allclose(features['x'],
                             np.stack([r['x'] for r in eval_rows[:4]]))
  np.testing.assert_array_equal(labels, [0, 1, 2, 0])
  assert features['tags'].values.tolist() == [b'a', b'a', b'b']
  assert data.example_ids() == [f'{a}:0', f'{a}:1', f'{a}:2', f'{b}:0',
                                f'{b}:1']
  # x: 3, count: 1, colour: one-hot 2, tags: embedding 2 (10 buckets).
  assert input_layer_width(data, features) == (4, 8)

  eval_records = records(eval_rows)
  got, tensors = serve(data, 'example', {'examples': eval_records[:4]})
  assert isinstance(tensors['tags'], tf.SparseTensor)
  np.testing.assert_array_equal(got['tags'].values, features['tags'].values)
  del got['tags'], features['tags']
  assert_same_features(got, features)
  with pytest.raises(ValueError, match='variable-length'):
    serve(data, 'csv', {})
  got, _ = serve(data, 'json', {
      'x': features['x'], 'count': features['count'],
      'colour': features['colour'], 'tags': [['a', ''], ['a', 'b']] * 2})
  assert got['tags'].values.tolist() == [b'a', b'a', b'b', b'a', b'a', b'b']


def _png_images(n, shape, seed):
  return np.random.RandomState(seed).randint(0, 256, (n,) + shape,
                                             dtype=np.uint8)


@pytest.mark.fast
def test_tfrecord_encoded_and_raw_images(tmp_path):
  pixels = _png_images(5, (4, 3, 3), 0)
  encoded = [tf.io.encode_png(p).numpy() for p in pixels]
  png = write_records(tmp_path / 'png.tfrecord', [
      example(png=bytes_feature([e]), raw=float_feature(p / 255.0),
              label=int_feature([i % 2])) for i, (e, p) in enumerate(
                  zip(encoded, pixels))])
  spec = {'png': tf.io.FixedLenFeature([], tf.string),
          'raw': tf.io.FixedLenFeature([36], tf.float32),
          'label': tf.io.FixedLenFeature([], tf.int64)}
  for key in ('png', 'raw'):
    data = input_fns.tfrecord_data([png], [png], feature_spec=spec,
                                   label_key='label', n_classes=2,
                                   image_key=key, image_shape=(4, 3, 3))
    assert (data.kind, data.feature_columns) == ('image', [])
    batches = run_input_fn(data.eval_input_fn(2))
    assert batch_sizes(batches) == [2, 2, 1]
    features, labels = concat(batches)
    assert list(features) == ['image']
    np.testing.assert_allclose(features['image'], pixels / 255.0, atol=1e-6)
    np.testing.assert_array_equal(labels, [0, 1, 0, 1, 0])
    records = [r.numpy() for r in tf.data.TFRecordDataset(png)]
    got, tensors = serve(data, 'example', {'examples': records})
    assert tensors['image'].shape.as_list() == [None, 4, 3, 3]
    np.testing.assert_allclose(got['image'], features['image'], atol=1e-6)
    with pytest.raises(ValueError, match="'csv' needs tabular"):
      data.serving_input_receiver_fn('csv')
  # Decoding resizes to image_shape and converts channels.
  data = input_fns.tfrecord_data([png], [png], feature_spec=spec,
                                 label_key='label', n_classes=2,
                                 image_key='png', image_shape=(2, 2, 1))
  features, _ = concat(run_input_fn(data.eval_input_fn(5)))
  assert features['image'].shape == (5, 2, 2, 1)
  with pytest.raises(ValueError, match='image_shape'):
    input_fns.tfrecord_data([png], [png], feature_spec=spec,
                            label_key='label', n_classes=2, image_key='raw',
                            image_shape=(4, 4, 3))


@pytest.mark.fast
def test_tfrecord_bad_label_and_bad_globs(tmp_path):
  spec = {'x': tf.io.FixedLenFeature([], tf.float32),
          'label': tf.io.FixedLenFeature([], tf.int64)}
  path = write_records(tmp_path / 'data.tfrecord', [
      example(x=float_feature([1.0]), label=int_feature([label]))
      for label in (0, 1, 5)])
  data = input_fns.tfrecord_data([path], [path], feature_spec=spec,
                                 label_key='label', n_classes=2)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=f'Bad label 5 in TFRecord {path}:2'):
    run_input_fn(data.eval_input_fn(2))
  open(tmp_path / 'empty.tfrecord', 'w').close()
  with pytest.raises(ValueError, match="eval_files: the glob '.*empty"):
    input_fns.tfrecord_data([path], [str(tmp_path / 'empty.tfrecord')],
                            feature_spec=spec, label_key='label',
                            n_classes=2)
  with pytest.raises(ValueError, match='missing.*matches no file'):
    input_fns.tfrecord_data([str(tmp_path / 'missing*')], [path],
                            feature_spec=spec, label_key='label',
                            n_classes=2)
  with pytest.raises(ValueError, match='categorical_columns'):
    input_fns.tfrecord_data(
        [path], [path], label_key='label', n_classes=2,
        feature_spec=dict(spec, s=tf.io.FixedLenFeature([], tf.string)))


@pytest.mark.fast
def test_tfrecord_non_finite_floats_fail_unless_allowed(tmp_path):
  spec = {'x': tf.io.FixedLenFeature([2], tf.float32),
          'label': tf.io.FixedLenFeature([], tf.int64)}
  path = write_records(tmp_path / 'data.tfrecord', [
      example(x=float_feature(x), label=int_feature([0]))
      for x in ([1.0, 2.0], [3.0, np.nan], [np.inf, 4.0])])
  data = input_fns.tfrecord_data([path], [path], feature_spec=spec,
                                 label_key='label', n_classes=2)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=f'Feature x of TFRecord {path}:1 is nan or inf; '
                     'pass --allow-non-finite'):
    run_input_fn(data.eval_input_fn(3))
  allowing = input_fns.tfrecord_data([path], [path], feature_spec=spec,
                                     label_key='label', n_classes=2,
                                     allow_non_finite=True)
  features, _ = concat(run_input_fn(allowing.eval_input_fn(3)))
  np.testing.assert_array_equal(features['x'],
                                [[1, 2], [3, np.nan], [np.inf, 4]])
  raw = write_records(tmp_path / 'raw.tfrecord', [
      example(image=float_feature([0.5, np.nan, 0.5, 0.5]),
              label=int_feature([1]))])
  images = input_fns.tfrecord_data(
      [raw], [raw], label_key='label', n_classes=2, image_key='image',
      image_shape=(2, 2, 1),
      feature_spec={'image': tf.io.FixedLenFeature([4], tf.float32),
                    'label': tf.io.FixedLenFeature([], tf.int64)})
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=f'Feature image of TFRecord {raw}:0 is nan'):
    run_input_fn(images.eval_input_fn(1))


# Image folders.


@pytest.fixture
def image_root(tmp_path):
  pixels = _png_images(9, (4, 4, 3), 1)
  root = tmp_path / 'photos'
  paths = {}
  for i, (class_name, n) in enumerate([('dog', 4), ('cat', 5)]):
    for j in range(n):
      paths[write_png(root / class_name / f'{j}.png', pixels[i * 4 + j])] = (
          pixels[i * 4 + j], class_name)
  (root / 'cat' / 'notes.txt').write_text('not an image')
  return str(root), paths


@pytest.mark.fast
def test_image_folder_split_labels_and_order(image_root):
  root, written = image_root
  data = input_fns.image_folder_data(root, image_size=(4, 4),
                                     eval_fraction=0.5)
  assert data.class_names == ['cat', 'dog']
  assert (data.kind, data.n_classes, data.image_shape) == ('image', 2,
                                                           (4, 4, 3))
  ids = data.example_ids()
  assert len(ids) == 2 + 3  # round(4 / 2) dogs, round(5 / 2) cats.
  assert ids == sorted(ids, key=lambda p: (os.path.basename(
      os.path.dirname(p)), p))
  batches = run_input_fn(data.eval_input_fn(2))
  assert batch_sizes(batches) == [2, 2, 1]
  features, labels = concat(batches)
  assert_features_like(features, data)
  for path, image, label in zip(ids, features['image'], labels):
    pixels, class_name = written[path]
    np.testing.assert_allclose(image, pixels / 255.0, atol=1e-6)
    assert data.class_names[label] == class_name
  predicted = concat(run_input_fn(data.predict_input_fn(3)))
  np.testing.assert_array_equal(predicted['image'], features['image'])
  train, _ = concat(run_input_fn(data.train_input_fn(4, shuffle=False), 1))
  assert train['image'].shape == (4, 4, 4, 3)
  assert input_fns.image_folder_data(
      root, image_size=(4, 4), eval_fraction=0.5).example_ids() == ids

  small = input_fns.image_folder_data(root, image_size=(2, 3), channels=1,
                                      eval_fraction=0.5)
  features, _ = concat(run_input_fn(small.eval_input_fn(8)))
  assert features['image'].shape == (5, 2, 3, 1)
  assert 0 <= features['image'].min() and features['image'].max() <= 1


@pytest.mark.fast
def test_image_folder_with_eval_dir_and_serving(tmp_path, image_root):
  root, _ = image_root
  pixels = _png_images(2, (4, 4, 3), 2)
  eval_dir = tmp_path / 'held-out'
  first = write_png(eval_dir / 'dog' / 'a.png', pixels[0])
  write_png(eval_dir / 'dog' / 'nested' / 'b.png', pixels[1])
  data = input_fns.image_folder_data(root, str(eval_dir), image_size=(4, 4))
  assert data.example_ids()[0] == first
  assert len(data.example_ids()) == 2
  features, labels = concat(run_input_fn(data.eval_input_fn(8)))
  np.testing.assert_array_equal(labels, [1, 1])
  train, _ = concat(run_input_fn(data.train_input_fn(9, shuffle=False), 1))
  assert len(train['image']) == 9

  records = [example(image=float_feature(image)) for image in
             features['image']]
  got, tensors = serve(data, 'example', {'examples': records})
  np.testing.assert_allclose(got['image'], features['image'])
  assert tensors['image'].dtype == tf.float32
  got, tensors = serve(data, 'json', {'image': features['image']})
  np.testing.assert_array_equal(got['image'], features['image'])
  assert tensors['image'].shape.as_list() == [None, 4, 4, 3]

  unknown = tmp_path / 'other'
  write_png(unknown / 'bird' / 'a.png', pixels[0])
  with pytest.raises(ValueError, match="classes \\['bird'\\]"):
    input_fns.image_folder_data(root, str(unknown), image_size=(4, 4))


@pytest.mark.fast
def test_image_folder_errors_name_the_directory(tmp_path):
  with pytest.raises(ValueError, match='nowhere.*is not a directory'):
    input_fns.image_folder_data(str(tmp_path / 'nowhere'))
  (tmp_path / 'flat').mkdir()
  (tmp_path / 'flat' / 'a.png').write_bytes(b'')
  with pytest.raises(ValueError, match='flat.*has no subdirectories'):
    input_fns.image_folder_data(str(tmp_path / 'flat'))
  (tmp_path / 'textual' / 'a').mkdir(parents=True)
  (tmp_path / 'textual' / 'b').mkdir()
  (tmp_path / 'textual' / 'a' / 'x.txt').write_text('')
  with pytest.raises(ValueError, match='textual.*hold no'):
    input_fns.image_folder_data(str(tmp_path / 'textual'))


# Through a real Estimator: train, evaluate, predict, export and serve.

@pytest.mark.training
def test_estimator_trains_predicts_and_exports_csv_data(tmp_path, csv_files):
  train_glob, eval_file = csv_files
  data = make_csv(train_glob, eval_file)

  def model_fn(features, labels, mode):
    net = tf1.feature_column.input_layer(features, data.feature_columns)
    logits = tf.keras.layers.Dense(data.n_classes)(net)
    if mode == tf.estimator.ModeKeys.PREDICT:
      return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
    loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  estimator = tf.estimator.Estimator(model_fn, str(tmp_path / 'model'))
  estimator.train(data.train_input_fn(4), steps=3)
  assert estimator.evaluate(data.eval_input_fn(3))['global_step'] == 3
  predictions = list(estimator.predict(data.predict_input_fn(3)))
  assert len(predictions) == len(data.example_ids()) == 4
  export_dir = estimator.export_saved_model(
      str(tmp_path / 'export'), data.serving_input_receiver_fn('csv'))
  serve_fn = tf.saved_model.load(export_dir).signatures['serving_default']
  outputs = serve_fn(csv_lines=tf.constant(
      ['0.5,1e1,red', '-2,7,green', '8,9,red', '10,11,"dark, blue"']))
  np.testing.assert_allclose(outputs['logits'].numpy(),
                             np.stack([p['logits'] for p in predictions]),
                             rtol=1e-5, atol=1e-5)
