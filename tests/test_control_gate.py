"""Ops built under many control inputs wait for them through one gate op.

The towers' one update is built inside the model_fn's
`control_dependencies(UPDATE_OPS)`; without the gate every backward op got
one control input per batch-norm update (205k of MobileNet's 230k edges on
2 towers with batch_norm='global'). These check the gate keeps the same
ordering (transitively), runs the same values, and stays out of control
flow.
"""

import pytest
import tensorflow as tf

from estimator_towers.graph import control_gate

tf1 = tf.compat.v1


def _writes(graph, count):
  """`count` variables and an op adding 1 to each."""
  with graph.as_default():
    variables = [tf1.Variable(0.0, name=f'v{k}') for k in range(count)]
    return variables, [v.assign_add(1.0).op for v in variables]


def _ancestors(op):
  seen, pending = set(), [op]
  while pending:
    current = pending.pop()
    if current not in seen:
      seen.add(current)
      pending.extend([t.op for t in current.inputs] +
                     list(current.control_inputs))
  return seen


@pytest.mark.fast
def test_ops_inside_wait_for_every_control_input_through_one_op():
  graph = tf.Graph()
  variables, writes = _writes(graph, 4)
  with graph.as_default():
    with tf.control_dependencies(writes), control_gate.gated('gate'):
      first = tf.constant(2.0)
      second = first * 3.0 + 1.0  # Dominated by `first`: no control input.
    gate = graph.get_operation_by_name('gate')
    assert first.op.control_inputs == [gate]
    assert set(gate.control_inputs) == set(writes)
    assert not second.op.control_inputs
    assert set(writes) <= _ancestors(second.op)
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      assert session.run(second) == 7.0
      # The writes ran, once each, before the value.
      assert session.run(variables) == [1.0] * 4


@pytest.mark.fast
def test_few_control_inputs_and_control_flow_are_left_as_they_are():
  graph = tf.Graph()
  _, writes = _writes(graph, 3)
  with graph.as_default():
    with tf.control_dependencies(writes[:1]), control_gate.gated('gate'):
      few = tf.constant(1.0)
    assert few.op.control_inputs == writes[:1]

    def branch():
      with tf.control_dependencies(writes), control_gate.gated('gate'):
        # Still inside the cond's context (clearing the control inputs
        # would leave it).
        assert graph._get_control_flow_context() is not None  # pylint: disable=protected-access
        return tf.constant(1.0)

    # A TF1 cond (control flow v1) keeps a context in the graph; a v2 cond
    # builds its branches in function graphs, where the outer writes become
    # the cond op's own control inputs.
    was_v2 = tf1.control_flow_v2_enabled()
    tf1.disable_control_flow_v2()
    try:
      tf1.cond(tf.constant(True), branch, lambda: tf.constant(0.0))
    finally:
      if was_v2:
        tf1.enable_control_flow_v2()
    assert not [op for op in graph.get_operations() if op.name == 'gate']
