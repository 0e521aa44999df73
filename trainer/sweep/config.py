"""The `hyperparameters` block of a Cloud `hptuning_config.yaml`, checked.

`load(path)` reads the YAML gcloud takes for `--config` (either the whole
file, `trainingInput: hyperparameters: ...`, or a bare `hyperparameters:`
block) and returns a `SweepConfig`. Every problem is a ValueError naming the
field, found before any trial starts.
"""

import dataclasses
import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import yaml

GOALS = ('MAXIMIZE', 'MINIMIZE')
ALGORITHMS = ('ALGORITHM_UNSPECIFIED', 'GRID_SEARCH', 'RANDOM_SEARCH')
TYPES = ('DOUBLE', 'INTEGER', 'CATEGORICAL', 'DISCRETE')
SCALES = ('UNIT_LINEAR_SCALE', 'UNIT_LOG_SCALE', 'UNIT_REVERSE_LOG_SCALE')
# INTEGER parameters become integer trainer flags (sizes, counts, steps):
# their range must fit int32, which TensorFlow's shapes and most ops take.
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
# A grid larger than this is almost surely a mistake (an INTEGER range).
MAX_GRID_POINTS = 100_000

_TOP_FIELDS = ('goal', 'hyperparameterMetricTag', 'maxTrials',
               'maxParallelTrials', 'maxFailedTrials',
               'enableTrialEarlyStopping', 'algorithm', 'params')
# Which optional fields each parameter type takes (besides name and type).
_PARAM_FIELDS = {
    'DOUBLE': ('minValue', 'maxValue', 'scaleType'),
    'INTEGER': ('minValue', 'maxValue', 'scaleType'),
    # Cloud accepts a scaleType on DISCRETE; the values are explicit, so it
    # changes nothing here.
    'DISCRETE': ('discreteValues', 'scaleType'),
    'CATEGORICAL': ('categoricalValues',),
}
# Flag names trainer.task can take: --<parameterName>=<value>.
_FLAG_NAME = re.compile(r'^[A-Za-z][A-Za-z0-9_-]*$')
# Names a parameter cannot have: the flag the sweep sets for every trial,
# and the other columns of sweep_results.csv (which has one per parameter,
# after 'trial').
_SWEEP_FLAGS = ('job-dir',)
RESULT_COLUMNS = ('trial', 'objective', 'status', 'duration_sec', 'job_dir',
                   'exit_code', 'log', 'error')

Number = Union[int, float]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """One entry of `params`; field names mirror the YAML ones."""
  name: str
  type: str
  min_value: Optional[Number] = None
  max_value: Optional[Number] = None
  discrete_values: Tuple[Number, ...] = ()
  categorical_values: Tuple[str, ...] = ()
  scale_type: Optional[str] = None

  def grid_values(self) -> List[Any]:
    """Every value a GRID_SEARCH visits, in order.

    Raises:
      ValueError: a DOUBLE parameter, which has no grid.
    """
    if self.type == 'DISCRETE':
      return list(self.discrete_values)
    if self.type == 'CATEGORICAL':
      return list(self.categorical_values)
    if self.type == 'INTEGER':
      return list(range(int(self.min_value), int(self.max_value) + 1))
    raise ValueError(f'{self.name}: a DOUBLE parameter has no grid.')

  def grid_count(self) -> int:
    """len(grid_values()), without building a long INTEGER range."""
    if self.type == 'INTEGER':
      return int(self.max_value) - int(self.min_value) + 1
    return len(self.grid_values())

  def to_dict(self) -> Dict[str, Any]:
    """The parameter as Cloud spells it, without unset fields."""
    out = {'parameterName': self.name, 'type': self.type}
    if self.min_value is not None:
      out['minValue'] = self.min_value
      out['maxValue'] = self.max_value
    if self.discrete_values:
      out['discreteValues'] = list(self.discrete_values)
    if self.categorical_values:
      out['categoricalValues'] = list(self.categorical_values)
    if self.scale_type is not None:
      out['scaleType'] = self.scale_type
    return out


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """A checked `hyperparameters` block, with Cloud's defaults filled in."""
  goal: str
  metric_tag: str
  max_trials: int
  max_parallel_trials: int
  max_failed_trials: int
  early_stopping: bool
  algorithm: str
  params: Tuple[ParamSpec, ...]

  @property
  def failure_limit(self) -> int:
    """How many failed trials the sweep tolerates; one more stops it.

    `maxFailedTrials` unset or 0 means "the service decides" on Cloud; here
    that is a quarter of maxTrials (at least 1), so a trainer that fails
    every time is stopped early while a few diverging trials are not.
    """
    if self.max_failed_trials > 0:
      return self.max_failed_trials
    return max(1, self.max_trials // 4)

  @property
  def grid_size(self) -> Optional[int]:
    """Points of the grid under GRID_SEARCH; None for other algorithms."""
    if self.algorithm != 'GRID_SEARCH':
      return None
    return math.prod(p.grid_count() for p in self.params)

  @property
  def trial_budget(self) -> int:
    """Trials to run: maxTrials, or fewer when a grid has fewer points."""
    grid = self.grid_size
    return self.max_trials if grid is None else min(self.max_trials, grid)

  def to_dict(self) -> Dict[str, Any]:
    """The block as Cloud spells it, defaults included (what is stored)."""
    return {
        'goal': self.goal,
        'hyperparameterMetricTag': self.metric_tag,
        'maxTrials': self.max_trials,
        'maxParallelTrials': self.max_parallel_trials,
        'maxFailedTrials': self.max_failed_trials,
        'enableTrialEarlyStopping': self.early_stopping,
        'algorithm': self.algorithm,
        'params': [p.to_dict() for p in self.params],
    }


def load(path: str) -> SweepConfig:
  """Reads and checks an hptuning_config.yaml.

  Args:
    path: The YAML file.

  Returns:
    The checked configuration.

  Raises:
    ValueError: the file cannot be read or parsed, or the configuration is
      invalid (the message names the field).
  """
  try:
    with open(path, encoding='utf-8') as f:
      document = yaml.load(f, Loader=_UniqueKeyLoader)
  except OSError as e:
    raise ValueError(f'cannot read --config {path}: {e.strerror}') from e
  except yaml.YAMLError as e:
    raise ValueError(f'--config {path} is not valid YAML: '
                     f'{_yaml_problem(e)}') from e
  return parse(hyperparameters_block(document))


def _yaml_problem(error: yaml.YAMLError) -> str:
  """A YAML error on one line: line:column: problem."""
  mark = getattr(error, 'problem_mark', None)
  problem = getattr(error, 'problem', None)
  if mark is None or problem is None:
    return ' '.join(str(error).split())
  return f'line {mark.line + 1}, column {mark.column + 1}: {problem}'


class _UniqueKeyLoader(yaml.SafeLoader):
  """SafeLoader that refuses a key repeated in one mapping.

  PyYAML keeps the last of repeated keys without a word, so a second
  `maxTrials:` or `minValue:` would silently replace the first.
  """

  def construct_mapping(self, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=True)
      try:
        first = seen.setdefault(key, key_node)
      except TypeError:
        continue  # An unhashable key: construct_mapping reports it.
      if first is not key_node:
        raise yaml.MarkedYAMLError(
            problem=f'{key!r} is set twice (also on line '
            f'{first.start_mark.line + 1}); write each field once',
            problem_mark=key_node.start_mark)
    return super().construct_mapping(node, deep=deep)


def hyperparameters_block(document: Any) -> Dict[str, Any]:
  """The `hyperparameters` mapping of a whole file or of a bare block.

  Raises:
    ValueError: neither `trainingInput.hyperparameters` nor
      `hyperparameters` is a mapping at the top of the document.
  """
  if not isinstance(document, dict):
    raise ValueError('the config must be a mapping with trainingInput: '
                     'hyperparameters: ... (or a bare hyperparameters: '
                     f'block), got {type(document).__name__}.')
  if 'trainingInput' in document:
    extra = sorted(set(document) - {'trainingInput'})
    if extra:
      raise ValueError(f'unknown top-level field(s) {extra}; the file holds '
                       'only trainingInput.')
    document = document['trainingInput']
    if not isinstance(document, dict) or 'hyperparameters' not in document:
      raise ValueError('trainingInput has no hyperparameters block.')
  elif 'hyperparameters' not in document:
    raise ValueError('the config has neither trainingInput.hyperparameters '
                     'nor hyperparameters at the top; found '
                     f'{sorted(document)}.')
  block = document['hyperparameters']
  if not isinstance(block, dict):
    raise ValueError('hyperparameters must be a mapping of fields (goal, '
                     f'params, ...), got {type(block).__name__}.')
  return block


def parse(block: Dict[str, Any]) -> SweepConfig:
  """Checks a `hyperparameters` mapping (already read from YAML).

  Args:
    block: The mapping under `hyperparameters`.

  Returns:
    The checked configuration with defaults filled in.

  Raises:
    ValueError: an unknown or missing field or a bad value, named.
  """
  unknown = sorted(set(block) - set(_TOP_FIELDS))
  if unknown:
    raise ValueError(f'hyperparameters: unknown field(s) {unknown}; supported '
                     f'fields: {list(_TOP_FIELDS)}.')
  goal = _choice(block, 'goal', GOALS, required=True)
  tag = block.get('hyperparameterMetricTag')
  if not isinstance(tag, str) or not tag.strip():
    raise ValueError('hyperparameterMetricTag: missing; set it to the tag '
                     'trials report (the --hypertune-metric of trainer.task, '
                     'e.g. accuracy).')
  max_trials = _count(block, 'maxTrials', default=1, minimum=1)
  parallel = _count(block, 'maxParallelTrials', default=1, minimum=1)
  if parallel > max_trials:
    raise ValueError(f'maxParallelTrials: {parallel} > maxTrials '
                     f'{max_trials}; lower maxParallelTrials or raise '
                     'maxTrials.')
  config = SweepConfig(
      goal=goal, metric_tag=tag, max_trials=max_trials,
      max_parallel_trials=parallel,
      max_failed_trials=_count(block, 'maxFailedTrials', default=0,
                               minimum=0),
      early_stopping=_boolean(block, 'enableTrialEarlyStopping'),
      algorithm=_choice(block, 'algorithm', ALGORITHMS, required=False)
      or 'ALGORITHM_UNSPECIFIED',
      params=_params(block.get('params')))
  _check_grid(config)
  return config


def _choice(block: Dict[str, Any], field: str, allowed: Sequence[str],
            required: bool) -> Optional[str]:
  value = block.get(field)
  if value is None:
    if required:
      raise ValueError(f'{field}: missing; use one of {list(allowed)}.')
    return None
  if value not in allowed:
    raise ValueError(f'{field}: unknown value {value!r}; use one of '
                     f'{list(allowed)}.')
  return value


def _count(block: Dict[str, Any], field: str, default: int,
           minimum: int) -> int:
  value = block.get(field, default)
  if value is None:
    value = default
  number = _integer(value, field)
  if number < minimum:
    raise ValueError(f'{field}: must be at least {minimum}, got {value!r}.')
  return number


def _boolean(block: Dict[str, Any], field: str) -> bool:
  value = block.get(field, False)
  if not isinstance(value, bool):
    raise ValueError(f'{field}: must be true or false, got {value!r}.')
  return value


def _number(value: Any, field: str) -> Number:
  """An int or float; numeric strings too (YAML reads 1e-4 as a string)."""
  if isinstance(value, bool):
    raise ValueError(f'{field}: must be a number, got {value!r}.')
  if isinstance(value, (int, float)):
    number = value
  elif isinstance(value, str):
    try:
      number = float(value)
    except ValueError as e:
      raise ValueError(f'{field}: must be a number, got {value!r}.') from e
  else:
    raise ValueError(f'{field}: must be a number, got {value!r}.')
  if not math.isfinite(number):
    raise ValueError(f'{field}: must be finite, got {value!r}.')
  return number


def _integer(value: Any, field: str) -> int:
  number = _number(value, field)
  if number != int(number):
    raise ValueError(f'{field}: must be a whole number, got {value!r}.')
  return int(number)


def _params(raw: Any) -> Tuple[ParamSpec, ...]:
  if not isinstance(raw, list) or not raw:
    raise ValueError('params: missing or empty; list at least one '
                     '{parameterName, type, ...}.')
  specs = []
  seen = {}
  for index, item in enumerate(raw):
    spec = _param(index, item)
    # Flags are the same whatever the spelling: --a_b is --a-b.
    key = spec.name.replace('_', '-')
    if key in seen:
      raise ValueError(f'params[{index}] ({spec.name}): duplicate '
                       f'parameterName; params[{seen[key]}] already sets '
                       'that flag.')
    seen[key] = index
    specs.append(spec)
  return tuple(specs)


def _param(index: int, item: Any) -> ParamSpec:
  where = f'params[{index}]'
  if not isinstance(item, dict):
    raise ValueError(f'{where}: must be a mapping with parameterName and '
                     f'type, got {item!r}.')
  name = item.get('parameterName')
  if not isinstance(name, str) or not _FLAG_NAME.match(name):
    raise ValueError(f'{where}: parameterName must be a flag name (letters, '
                     f'digits, - and _), got {name!r}.')
  where = f'{where} ({name})'
  if name.replace('_', '-') in _SWEEP_FLAGS:
    raise ValueError(f'{where}: parameterName --{name} is set by the sweep '
                     '(each trial writes under <job-dir>/<trial id>).')
  if name in RESULT_COLUMNS:
    raise ValueError(f'{where}: parameterName {name!r} would clash with a '
                     'column of sweep_results.csv '
                     f'{list(RESULT_COLUMNS)}.')
  kind = item.get('type')
  if kind not in TYPES:
    raise ValueError(f'{where}: type: unknown value {kind!r}; use one of '
                     f'{list(TYPES)}.')
  allowed = ('parameterName', 'type') + _PARAM_FIELDS[kind]
  unknown = sorted(set(item) - set(allowed))
  if unknown:
    raise ValueError(f'{where}: field(s) {unknown} do not apply to a {kind} '
                     f'parameter; it takes {list(allowed)}.')
  scale = item.get('scaleType')
  if scale is not None and scale not in SCALES:
    raise ValueError(f'{where}: scaleType: unknown value {scale!r}; use one '
                     f'of {list(SCALES)}.')
  if kind in ('DOUBLE', 'INTEGER'):
    return _ranged(where, name, kind, item, scale)
  if kind == 'DISCRETE':
    return ParamSpec(name, kind, discrete_values=_discrete(where, item),
                     scale_type=scale)
  return ParamSpec(name, kind, categorical_values=_categorical(where, item))


def _ranged(where: str, name: str, kind: str, item: Dict[str, Any],
            scale: Optional[str]) -> ParamSpec:
  for field in ('minValue', 'maxValue'):
    if item.get(field) is None:
      raise ValueError(f'{where}: {field} missing; a {kind} parameter needs '
                       'minValue and maxValue.')
  convert = _integer if kind == 'INTEGER' else _number
  low = convert(item['minValue'], f'{where}: minValue')
  high = convert(item['maxValue'], f'{where}: maxValue')
  if kind == 'DOUBLE':
    low, high = float(low), float(high)
  else:
    for field, value in (('minValue', low), ('maxValue', high)):
      if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f'{where}: {field} {item[field]!r} is outside the '
                         f'int32 range [{INT32_MIN}, {INT32_MAX}] that '
                         'integer trainer flags take; narrow the range.')
  if low > high:
    raise ValueError(f'{where}: minValue {low} > maxValue {high}; swap them.')
  if scale in ('UNIT_LOG_SCALE', 'UNIT_REVERSE_LOG_SCALE') and low <= 0:
    raise ValueError(f'{where}: {scale} needs minValue > 0, got {low}; use '
                     'UNIT_LINEAR_SCALE or a positive range.')
  return ParamSpec(name, kind, min_value=low, max_value=high,
                   scale_type=scale)


def _discrete(where: str, item: Dict[str, Any]) -> Tuple[Number, ...]:
  raw = item.get('discreteValues')
  if not isinstance(raw, list) or not raw:
    raise ValueError(f'{where}: discreteValues must be a non-empty list of '
                     f'numbers, got {raw!r}.')
  values = tuple(_number(v, f'{where}: discreteValues[{i}]')
                 for i, v in enumerate(raw))
  for i in range(1, len(values)):
    if values[i] <= values[i - 1]:
      raise ValueError(f'{where}: discreteValues must be strictly '
                       f'increasing: [{i - 1}] {values[i - 1]} then [{i}] '
                       f'{values[i]}.')
  return values


def _categorical(where: str, item: Dict[str, Any]) -> Tuple[str, ...]:
  raw = item.get('categoricalValues')
  if not isinstance(raw, list) or not raw:
    raise ValueError(f'{where}: categoricalValues must be a non-empty list '
                     f'of strings, got {raw!r}.')
  for i, value in enumerate(raw):
    if not isinstance(value, str):
      raise ValueError(f'{where}: categoricalValues[{i}] must be a string, '
                       f'got {value!r}; quote it in the YAML.')
  if len(set(raw)) != len(raw):
    raise ValueError(f'{where}: categoricalValues has duplicates: {raw}.')
  return tuple(raw)


def _check_grid(config: SweepConfig) -> None:
  if config.algorithm != 'GRID_SEARCH':
    return
  for index, spec in enumerate(config.params):
    if spec.type == 'DOUBLE':
      raise ValueError(f'params[{index}] ({spec.name}): GRID_SEARCH needs '
                       'every parameter discrete (DISCRETE, CATEGORICAL or '
                       'INTEGER); make it DISCRETE with discreteValues or '
                       'use another algorithm.')
  if config.grid_size > MAX_GRID_POINTS:
    raise ValueError(f'algorithm: GRID_SEARCH over {config.grid_size} points '
                     f'(more than {MAX_GRID_POINTS}); narrow the INTEGER '
                     'ranges or use RANDOM_SEARCH.')
