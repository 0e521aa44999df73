"""`--skip-malformed`: what it skipped, and a refusal when it skips all.

Skipping every row trained zero steps, evaluated zero examples (accuracy
0) and exported that model with exit 0. Before training, the task reads
each split once (only with --skip-malformed), refuses a split left without
rows, and keeps a count of the skipped rows to print when the run ends.
"""

from typing import Optional

import input_fns
from input_fns import data as data_lib

# (split, the flag that names its files, what the run does with it)
_SPLITS = ((data_lib.TRAIN, '--train-files', 'train on'),
           (data_lib.EVAL, '--eval-files', 'evaluate'))


def check(data: input_fns.Data, same_files: bool) -> Optional[str]:
  """Counts the rows --skip-malformed leaves out of each split.

  Args:
    data: The task's data source.
    same_files: Whether evaluation reads the training files (no
      --eval-files): they are read once.

  Returns:
    A line saying how many rows were skipped and where the first was, or
    None when nothing was skipped (or nothing can be).

  Raises:
    ValueError: every row of a split is malformed.
  """
  if not getattr(data, 'skip_malformed', False):
    return None
  parts = []
  for split, flag, use in _SPLITS[:1] if same_files else _SPLITS:
    rows, malformed = data.row_counts(split)
    if malformed and len(malformed) == rows:
      raise ValueError(
          f'--skip-malformed skipped all {rows} rows of {flag}, leaving '
          f'nothing to {use} (the first: {malformed[0]}). Fix the rows, or '
          'check --columns, --categorical-column and --label-column against '
          'the files.')
    if malformed:
      parts.append(f'{len(malformed)} of {rows} rows of {flag} (the first: '
                   f'{malformed[0]})')
  return ('skipped malformed rows: ' + '; '.join(parts)) if parts else None
