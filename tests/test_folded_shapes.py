"""Constants folded from static shapes remember the tensor they came from."""

import gc
import weakref

import pytest
import tensorflow as tf

from estimator_towers.graph import folded_shapes

pytestmark = pytest.mark.fast


def test_sizes_shapes_and_small_fills_name_their_source():
  with tf.Graph().as_default():
    x = tf.zeros([6, 3]) + 1.0
    with folded_shapes.recording():
      size, shape = tf.size(x), tf.shape(x)
      ones, zeros = tf.ones_like(x), tf.zeros_like(x)
    for constant, kind in ((size, folded_shapes.SIZE),
                           (shape, folded_shapes.SHAPE),
                           (ones, folded_shapes.FILL),
                           (zeros, folded_shapes.FILL)):
      assert constant.op.type == 'Const'
      assert folded_shapes.source(constant.op) is x
      assert folded_shapes.kind(constant.op) == kind


def test_a_big_fill_names_the_source_of_its_shape():
  with tf.Graph().as_default():
    x = tf.zeros([100, 100]) + 1.0
    with folded_shapes.recording():
      ones = tf.ones_like(x)
    assert ones.op.type == 'Fill'
    shape = ones.op.inputs[0].op
    assert folded_shapes.source(shape) is x
    assert folded_shapes.kind(shape) == folded_shapes.SHAPE


def test_a_function_body_names_the_outer_tensors_it_folded():
  # The call reads nothing of them: only this record ties them to it.
  with tf.Graph().as_default() as graph:
    x = tf.zeros([6, 3]) + 1.0
    inner = tf.zeros([2]) + 1.0
    with folded_shapes.recording():
      call = tf.function(lambda: tf.size(x) + tf.size(inner * 2.0))()
    body = graph._get_function(call.op.get_attr('f').name).graph  # pylint: disable=protected-access
    assert x.name not in [t.name for t in call.op.inputs]
    # `inner * 2.0` is the body's own tensor: its fold is not an outer one.
    assert [t.name for t in folded_shapes.folded_in(body)] == [x.name]
    assert folded_shapes.folded_in(graph) == []


def test_nothing_is_recorded_outside_the_context_or_for_run_time_shapes():
  with tf.Graph().as_default():
    x = tf.zeros([6, 3]) + 1.0
    before = tf.size(x)
    with folded_shapes.recording():
      unknown = tf.compat.v1.placeholder(tf.float32, [None, 3])
      dynamic = tf.size(unknown)
      with tf.Graph().as_default():  # Another graph: not the build's.
        other = tf.size(tf.zeros([2]) + 1.0)
    after = tf.size(x)
    assert dynamic.op.type == 'Size'
    for op in (before.op, dynamic.op, other.op, after.op):
      assert folded_shapes.source(op) is None
      assert folded_shapes.kind(op) is None


def test_a_graph_with_records_is_freed():
  # A record holding its source tensor kept the graph (the record's key)
  # alive for the rest of the process.
  graph = tf.Graph()
  with graph.as_default():
    with folded_shapes.recording():
      tf.size(tf.zeros([6, 3]) + 1.0)
  freed = weakref.ref(graph)
  del graph
  gc.collect()
  assert freed() is None


def test_what_is_computed_from_a_folded_shape_is_told_from_a_number():
  with tf.Graph().as_default():
    x = tf.zeros([6, 3]) + 1.0
    with folded_shapes.recording():
      rows = tf.shape(x)[0]
      width = tf.shape(x)[1]
    end = tf.stack([rows * 2])
    assert folded_shapes.computed_from(end)
    assert not folded_shapes.computed_from(tf.stack([tf.constant(6) * 2]))
    # A walk that skips the width's element finds no folded shape there.
    assert not folded_shapes.computed_from(
        width, skip=lambda op: op is width.op)
    assert folded_shapes.computed_from(width)
