"""The search space of a sweep, in Optuna's terms.

Cloud's parameter types and scales map onto Optuna's `suggest_*` calls; the
algorithm picks the sampler and `enableTrialEarlyStopping` the pruner:

| Cloud | Optuna |
| --- | --- |
| DOUBLE, UNIT_LINEAR_SCALE (or unset) | `suggest_float(name, min, max)` |
| DOUBLE, UNIT_LOG_SCALE | `suggest_float(name, min, max, log=True)` |
| INTEGER | `suggest_int(name, min, max[, log=True])` |
| DISCRETE | `suggest_categorical(name, values)` (numbers stay numbers) |
| CATEGORICAL | `suggest_categorical(name, strings)` |
| UNIT_REVERSE_LOG_SCALE | mirrored log scale, see `REVERSE_LOG_SUFFIX` |
| algorithm unset / ALGORITHM_UNSPECIFIED | `TPESampler` |
| RANDOM_SEARCH | `RandomSampler` |
| GRID_SEARCH | `GridSampler` over every value of every parameter |
| enableTrialEarlyStopping | `MedianPruner` (else `NopPruner`) |
"""

from typing import Any, Dict, Optional, Union
import zlib

import numpy as np
import optuna

from trainer.sweep.config import ParamSpec
from trainer.sweep.config import SweepConfig

# A UNIT_REVERSE_LOG_SCALE parameter NAME is stored in Optuna as
# NAME + REVERSE_LOG_SUFFIX holding t, drawn on a log scale in [min, max];
# the trial gets v = min + max - t. Log-scale draws crowd near min, so the
# values crowd near max, which is what the reverse log scale is for (e.g. a
# momentum close to 1).
REVERSE_LOG_SUFFIX = ':reverse_log'

Value = Union[int, float, str]


def sampler(config: SweepConfig, seed: Optional[int] = None,
            stored_trials: int = 0) -> optuna.samplers.BaseSampler:
  """The Optuna sampler for the config's algorithm.

  Args:
    config: The sweep configuration.
    seed: Seed of the sampler's random draws; None draws a fresh one.
    stored_trials: Trials the study already holds (when resuming). A
      sampler seeded as for the first run would draw those trials'
      parameters again, so the seed is mixed with this count.

  Returns:
    GridSampler, RandomSampler or TPESampler.
  """
  seed = _run_seed(seed, stored_trials)
  if config.algorithm == 'GRID_SEARCH':
    space = {spec.name: spec.grid_values() for spec in config.params}
    return _RerunSafeGridSampler(space, seed=seed)
  if config.algorithm == 'RANDOM_SEARCH':
    if seed is None:
      return optuna.samplers.RandomSampler()
    return _TrialSeededRandomSampler(seed)
  # The constant liar keeps parallel trials from all being drawn next to
  # the same promising point while the others run.
  return optuna.samplers.TPESampler(
      seed=seed, constant_liar=config.max_parallel_trials > 1)


def _run_seed(seed: Optional[int], stored_trials: int) -> Optional[int]:
  """The seed of this run: `seed` for a new sweep, one derived from it after.

  Deterministic, so that resuming the same sweep the same way draws the
  same values, but different for every count of stored trials.
  """
  if seed is None or stored_trials == 0:
    return seed
  return int(np.random.SeedSequence([seed, stored_trials]).generate_state(1)[0])


class _TrialSeededRandomSampler(optuna.samplers.RandomSampler):
  """RandomSampler whose draws are a function of (seed, trial, parameter).

  With parallel trials Optuna reseeds the sampler in every worker thread,
  and the threads ask for trials in the order the earlier ones end: one
  seeded generator gave other values each run. Seeding each draw from the
  trial's number and the parameter's name gives trial N the same values
  whichever thread draws them, and whenever.
  """

  def __init__(self, seed: int):
    super().__init__(seed=seed)
    self._seed = seed

  def sample_independent(self, study, trial, param_name, param_distribution):
    name_key = zlib.crc32(param_name.encode())
    seed = np.random.SeedSequence([self._seed, trial.number, name_key])
    one_draw = optuna.samplers.RandomSampler(
        seed=int(seed.generate_state(1)[0]))
    return one_draw.sample_independent(study, trial, param_name,
                                       param_distribution)


class _RerunSafeGridSampler(optuna.samplers.GridSampler):
  """GridSampler that survives the queued reruns of interrupted trials.

  A rerun is an enqueued trial: it has fixed parameters and no grid point
  of its own. GridSampler.after_trial looks that grid point up when one
  point is left and fails with KeyError('grid_id') (optuna/optuna#6844).
  Its only job there is to stop the optimize loop once the grid is covered,
  which the sweep decides by its own count anyway, so a rerun skips it.
  """

  def after_trial(self, study, trial, state, values) -> None:
    if 'grid_id' not in trial.system_attrs:
      return
    super().after_trial(study, trial, state, values)


def pruner(config: SweepConfig,
           startup_trials: int) -> optuna.pruners.BasePruner:
  """MedianPruner when early stopping is on, else a pruner that never prunes.

  Args:
    config: The sweep configuration.
    startup_trials: Trials that must complete before any is pruned.
  """
  if not config.early_stopping:
    return optuna.pruners.NopPruner()
  return optuna.pruners.MedianPruner(n_startup_trials=startup_trials)


def direction(config: SweepConfig) -> str:
  """Optuna's study direction for the config's goal."""
  return 'maximize' if config.goal == 'MAXIMIZE' else 'minimize'


def suggest(trial: optuna.Trial, config: SweepConfig) -> Dict[str, Value]:
  """Draws every parameter of one trial.

  Args:
    trial: The Optuna trial to draw from (its sampler decides).
    config: The sweep configuration.

  Returns:
    {parameterName: the value the trial's flag gets}, in config order.
  """
  grid = config.algorithm == 'GRID_SEARCH'
  return {spec.name: _suggest_one(trial, spec, grid)
          for spec in config.params}


def _suggest_one(trial: optuna.Trial, spec: ParamSpec, grid: bool) -> Value:
  if spec.type == 'DISCRETE':
    return trial.suggest_categorical(spec.name, list(spec.discrete_values))
  if spec.type == 'CATEGORICAL':
    return trial.suggest_categorical(spec.name, list(spec.categorical_values))
  integer = spec.type == 'INTEGER'
  draw = trial.suggest_int if integer else trial.suggest_float
  low, high = spec.min_value, spec.max_value
  # A grid visits every integer: a scale would only reorder them.
  scale = None if grid else spec.scale_type
  if scale == 'UNIT_REVERSE_LOG_SCALE':
    mirrored = draw(spec.name + REVERSE_LOG_SUFFIX, low, high, log=True)
    value = low + high - mirrored
    # Rounding can step a float just outside the range; clamp it back.
    return value if integer else min(max(value, low), high)
  return draw(spec.name, low, high, log=scale == 'UNIT_LOG_SCALE')


def flag_value(value: Any) -> str:
  """How a parameter value is spelled on the trial's command line."""
  if isinstance(value, float):
    return repr(value)  # Shortest exact spelling: 0.0001, 1e-05.
  return str(value)
