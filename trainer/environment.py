"""TensorFlow environment defaults for the command-line entry points.

These variables are read when TensorFlow is imported, so an entry point calls
`configure(sys.argv)` before importing anything that imports TensorFlow.
Values already in the environment win.
"""

import os
from typing import Optional, Sequence


def _flag_value(argv: Sequence[str], name: str) -> Optional[str]:
  """The value of --name (either spelling) in argv, without parsing flags."""
  spellings = {f'--{name}', f'--{name.replace("-", "_")}'}
  for i, arg in enumerate(argv):
    key, sep, value = arg.partition('=')
    if key in spellings:
      if sep:
        return value
      return argv[i + 1] if i + 1 < len(argv) else None
  return None


def configure(argv: Sequence[str]) -> None:
  """Sets TensorFlow's log level and, for CPU towers, turns oneDNN off.

  With several virtual CPU towers, a batch smaller than the tower count
  leaves some towers an empty shard in evaluation; TF 2.15's oneDNN
  convolution returns a wrongly shaped result for an empty batch (the
  default Eigen kernel does not), so CPU-tower runs use the default kernels.
  """
  # 3 hides the C++ runtime's import-time noise (e.g. CUDA plugin
  # registration errors on machines without GPUs); real failures still
  # reach Python as exceptions with their message.
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  towers = _flag_value(argv, 'cpu-towers')
  if towers and towers.isdigit() and int(towers) > 1:
    os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
