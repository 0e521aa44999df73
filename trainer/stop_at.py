"""`--stop-at=accuracy>=0.97`: the target, parsed and checked.

No TensorFlow here: the flags parse without it. trainer.tool_hooks stops
training when an evaluation meets the target.
"""

import dataclasses
import operator
import re
from typing import Callable, Dict, Sequence

from trainer import cli

_COMPARISONS: Dict[str, Callable[[float, float], bool]] = {
    '>=': operator.ge, '<=': operator.le, '>': operator.gt, '<': operator.lt}
_PATTERN = re.compile(r'^\s*([\w./-]+)\s*(>=|<=|>|<)\s*(\S+)\s*$')


@dataclasses.dataclass(frozen=True)
class Target:
  """A metric, a comparison and a threshold."""
  metric: str
  comparison: str
  threshold: float

  def reached(self, value: float) -> bool:
    return _COMPARISONS[self.comparison](value, self.threshold)

  def __str__(self) -> str:
    return f'{self.metric}{self.comparison}{self.threshold:g}'


def parse(text: str, flag: str = 'stop-at') -> Target:
  """The target `METRIC>=VALUE` (or <=, >, <) names.

  Raises:
    cli.UsageError: the text is no such comparison.
  """
  match = _PATTERN.match(text)
  threshold = None
  if match:
    try:
      threshold = float(match.group(3))
    except ValueError:
      pass
  if threshold is None:
    raise cli.UsageError(
        f"--{flag}={text!r} must look like METRIC>=VALUE (or <=, >, <), e.g. "
        f"--{flag}='accuracy>=0.97' (quoted: a shell redirects at >).")
  return Target(match.group(1), match.group(2), threshold)


def check_metric(target: Target, metric_names: Sequence[str],
                 flag: str = 'stop-at') -> None:
  """Refuses a metric the evaluation does not report.

  Raises:
    ValueError: names the metrics there are.
  """
  if target.metric not in metric_names:
    raise ValueError(
        f'--{flag}={target}: the evaluation reports no {target.metric!r}; '
        f'it reports {", ".join(sorted(metric_names))}.')
