"""`--dry-run`'s data check: read and parse the first rows of each split.

Building the input pipeline checks the files exist; only reading them finds
a row that does not parse, a label out of range or a NaN, which the real run
would hit at its first step. The sample is the first rows in file order, so
a dry run stays quick on large data.
"""

import tensorflow as tf

import input_fns

tf1 = tf.compat.v1
SAMPLE_ROWS = 1000
_BATCH = 250


def check(data: input_fns.Data, same_files: bool,
          rows: int = SAMPLE_ROWS) -> None:
  """Reads and parses up to `rows` examples of the training and eval data.

  Args:
    data: The task's data source.
    same_files: Whether evaluation reads the training files (no
      --eval-files): they are read once.
    rows: How many examples of each split to read.

  Raises:
    tf.errors.InvalidArgumentError: a row failed the pipeline's checks (its
      message names the file and line; trainer.data_errors shortens it).
  """
  batches = -(-rows // _BATCH)
  splits = [data.train_input_fn(_BATCH, shuffle=False, num_epochs=1)]
  if not same_files:
    splits.append(data.eval_input_fn(_BATCH))
  for input_fn in splits:
    with tf.Graph().as_default():
      dataset = input_fn().take(batches)
      get_next = tf1.data.make_one_shot_iterator(dataset).get_next()
      with tf1.Session() as session:
        try:
          while True:
            session.run(get_next)
        except tf.errors.OutOfRangeError:
          pass  # Fewer rows than the sample: all were read.
