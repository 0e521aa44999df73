"""Test data for the input pipelines: tf.Examples, TFRecord and PNG files,
TF_CONFIG task configs, and a dataset read to its end."""

import json
import os

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


def run_input_fn(input_fn, max_batches=None):
  """Calls input_fn in a new graph, as Estimator does; returns its batches."""
  with tf.Graph().as_default():
    next_batch = tf1.data.make_one_shot_iterator(input_fn()).get_next()
    batches = []
    with tf1.Session() as session:
      while max_batches is None or len(batches) < max_batches:
        try:
          batches.append(session.run(next_batch))
        except tf.errors.OutOfRangeError:
          break
  return batches


def float_feature(values):
  return tf.train.Feature(float_list=tf.train.FloatList(
      value=np.ravel(values).tolist()))


def int_feature(values):
  return tf.train.Feature(int64_list=tf.train.Int64List(
      value=np.ravel(values).tolist()))


def bytes_feature(values):
  return tf.train.Feature(bytes_list=tf.train.BytesList(
      value=[v if isinstance(v, bytes) else v.encode() for v in values]))


def example(**features):
  return tf.train.Example(features=tf.train.Features(
      feature=features)).SerializeToString()


def write_records(path, records):
  with tf.io.TFRecordWriter(str(path)) as writer:
    for record in records:
      writer.write(record)
  return str(path)


def write_png(path, pixels):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tf.io.write_file(str(path), tf.io.encode_png(pixels))
  return str(path)


def task_config(monkeypatch, task_type='worker', index=0, workers=1, ps=0):
  """A RunConfig read from a TF_CONFIG cluster, as every task builds it."""
  cluster = {'chief': ['localhost:1'],
             'worker': [f'localhost:{2 + i}' for i in range(workers)]}
  if ps:
    cluster['ps'] = [f'localhost:{9 + i}' for i in range(ps)]
  if task_type == 'evaluator':
    cluster.pop('ps', None)
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': cluster, 'task': {'type': task_type, 'index': index}}))
  return tf.estimator.RunConfig()


def task_configs(monkeypatch, workers):
  """The chief's and every worker's RunConfig, in task order."""
  return [task_config(monkeypatch, 'chief', 0, workers)] + [
      task_config(monkeypatch, 'worker', i, workers) for i in range(workers)]


def dataset_elements(dataset):
  """Every element of a finite dataset of the default graph, as numpy."""
  with tf1.Session() as session:
    get_next = tf1.data.make_one_shot_iterator(dataset).get_next()
    out = []
    while True:
      try:
        out.append(session.run(get_next))
      except tf.errors.OutOfRangeError:
        return out
