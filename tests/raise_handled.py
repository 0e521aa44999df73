"""Raises an error under `faults.handled`, as an entry point's main does.

    python -m tests.raise_handled "ValueError('eval_files=[] is empty.')"

For tests/test_faults.py; forked from a preloaded interpreter like the
entry points (tests/preloaded.py).
"""

import sys

# The expression may name any of these.
import tensorflow as tf  # pylint: disable=unused-import
from trainer import faults
from trainer import options  # pylint: disable=unused-import
from trainer import preemption  # pylint: disable=unused-import

if __name__ == '__main__':
  with faults.handled('prog', eval_files='--predict-files'):
    raise eval(sys.argv[1])  # pylint: disable=eval-used
