"""tf.data input_fns that keep the towers fed."""
