"""Runs a public codebase's model_fn on one device and on towers, compares.

Not a test module (pytest does not collect it): the driver scripts next to
it (run_tfgan.py, run_efficientnet.py, run_simclr.py) import it to run a
model_fn they take, unchanged, from a public codebase. Each run:

1. writes one step-0 checkpoint of the unwrapped model_fn (every run starts
   from the same weights: layer initialisers are not reproduced by
   `tf_random_seed` across graphs that differ, as towers' graphs do);
2. trains `steps` steps on one device, unwrapped, twice (the second run
   measures the one-device noise floor);
3. trains the model_fn wrapped by `replicate_model_fn` on 2 and 3 virtual
   CPU towers under each aggregation;
4. compares every checkpointed variable, the eval metrics and the
   predictions with the first one-device run, and prints a table row per
   run. A run whose Estimator raises is a row with the error's first line.

See docs/compatibility_codebases.md for the commands and the results.
"""

import os
import shutil
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

import estimator_towers

tf1 = tf.compat.v1
SEED = 7
CASES = [(2, 'global_loss'), (2, 'all_reduce'),
         (3, 'global_loss'), (3, 'all_reduce')]


def save_start_checkpoint(model_fn: Callable, input_fn: Callable,
                          model_dir: str, params: Optional[dict]) -> None:
  """Writes a step-0 checkpoint of the unwrapped `model_fn` in TRAIN mode."""
  with tf.Graph().as_default():
    tf1.set_random_seed(SEED)
    features, labels = tf1.data.make_one_shot_iterator(input_fn()).get_next()
    tf1.train.get_or_create_global_step()
    model_fn(features, labels, tf.estimator.ModeKeys.TRAIN, params)
    saver = tf1.train.Saver()
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      os.makedirs(model_dir, exist_ok=True)
      saver.save(session, os.path.join(model_dir, 'model.ckpt'),
                 global_step=0)


def _estimator(model_fn, model_dir, towers, aggregation, params):
  """One device unwrapped when towers == 1, else the wrapped model_fn."""
  config = estimator_towers.make_run_config(
      model_dir, cpu_devices=towers, tf_random_seed=SEED,
      save_checkpoints_steps=100_000, save_summary_steps=100_000,
      log_step_count_steps=100_000)
  if towers > 1:
    model_fn = estimator_towers.replicate_model_fn(
        model_fn, aggregation=aggregation)
  return tf.estimator.Estimator(model_fn, config=config, params=params)


def _variables(model_dir):
  reader = tf.train.load_checkpoint(model_dir)
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()
          if name != '_CHECKPOINTABLE_OBJECT_GRAPH'}


def _flat_predictions(predictions):
  """The predictions of every example, stacked per key."""
  rows = list(predictions)
  if not rows:
    return {}
  if isinstance(rows[0], dict):
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  return {'predictions': np.stack(rows)}


def run_one(model_fn, train_input_fn, eval_input_fn, predict_input_fn,
            params, start_dir, work_dir, towers, aggregation, steps,
            eval_steps):
  """Trains, evaluates and predicts; returns what to compare."""
  model_dir = os.path.join(work_dir, f'{towers}_{aggregation}')
  shutil.rmtree(model_dir, ignore_errors=True)
  shutil.copytree(start_dir, model_dir)
  estimator = _estimator(model_fn, model_dir, towers, aggregation, params)
  began = time.time()
  estimator.train(train_input_fn, steps=steps)
  metrics = estimator.evaluate(eval_input_fn, steps=eval_steps)
  predictions = (_flat_predictions(estimator.predict(predict_input_fn))
                 if predict_input_fn else {})
  return {'variables': _variables(model_dir), 'metrics': metrics,
          'predictions': predictions, 'seconds': time.time() - began}


def _max_diff(expected: Dict[str, Any], actual: Dict[str, Any]):
  """(max abs diff, max rel diff, worst name, names missing either side)."""
  missing = sorted(set(expected) ^ set(actual))
  worst_abs, worst_rel, worst = 0.0, 0.0, ''
  for name in sorted(set(expected) & set(actual)):
    a = np.asarray(expected[name], np.float64)
    b = np.asarray(actual[name], np.float64)
    if a.shape != b.shape:
      missing.append(f'{name} (shape {a.shape} vs {b.shape})')
      continue
    diff = np.abs(a - b)
    absolute = float(diff.max()) if diff.size else 0.0
    # Relative to the variable's largest value, at least 1e-3: an element
    # near zero (an RMSProp accumulator entry) or a variable that is float
    # noise itself (the moving mean of a batch-normalised output, ~1e-9)
    # would make a ratio huge.
    relative = absolute / max(float(np.abs(a).max()), 1e-3) \
        if diff.size else 0.0
    if absolute > worst_abs:
      worst_abs, worst = absolute, name
    worst_rel = max(worst_rel, relative)
  return worst_abs, worst_rel, worst, missing


def compare_checkpoints(work_dir: str) -> None:
  """Prints the variable comparison of every run kept under `work_dir`."""
  reference = {'variables': _variables(os.path.join(work_dir,
                                                    '1_unwrapped'))}
  for name in sorted(os.listdir(work_dir)):
    if name in ('start', '1_unwrapped'):
      continue
    try:
      result = {'variables': _variables(os.path.join(work_dir, name))}
    except ValueError:  # No checkpoint: the run failed.
      continue
    absolute, relative, worst, missing = _max_diff(reference['variables'],
                                                   result['variables'])
    print(f'{name}: variables max abs {absolute:.3g} rel {relative:.3g} '
          f'({worst}) missing {missing[:4]}')


def compare(reference, result) -> str:
  """One table line: variables, metrics and predictions vs one device."""
  parts = []
  for key in ('variables', 'metrics', 'predictions'):
    absolute, relative, worst, missing = _max_diff(reference[key],
                                                   result[key])
    text = f'{key}: max abs {absolute:.3g} rel {relative:.3g}'
    if worst:
      text += f' ({worst})'
    if missing:
      text += f' MISSING/DIFFERENT {missing[:4]}'
    parts.append(text)
  return '; '.join(parts)


def run_all(name: str, model_fn: Callable, train_input_fn: Callable,
            eval_input_fn: Callable, predict_input_fn: Optional[Callable],
            params: Optional[dict], steps: int, eval_steps: int = 1,
            work_dir: str = '/tmp/h8code/runs',
            cases: Optional[List] = None,
            tower_model_fn: Optional[Callable] = None) -> None:
  """Every run of the module docstring, printed as table rows.

  `tower_model_fn` is what the towers wrap when it differs from the
  one-device `model_fn` (the codebase's own, returning a TPUEstimatorSpec
  that only replicate_model_fn and TPUEstimator accept); default model_fn.
  """
  work_dir = os.path.join(work_dir, name)
  shutil.rmtree(work_dir, ignore_errors=True)
  start_dir = os.path.join(work_dir, 'start')
  save_start_checkpoint(model_fn, train_input_fn, start_dir, params)

  def one(towers, aggregation):
    fn = model_fn if towers == 1 else (tower_model_fn or model_fn)
    return run_one(fn, train_input_fn, eval_input_fn, predict_input_fn,
                   params, start_dir, work_dir, towers, aggregation, steps,
                   eval_steps)

  reference = one(1, 'unwrapped')
  print(f'ROW {name} 1 device: metrics {reference["metrics"]} '
        f'({reference["seconds"]:.0f} s)', flush=True)
  again = one(1, 'unwrapped_again')
  print(f'ROW {name} 1 device again (noise floor): '
        f'{compare(reference, again)}', flush=True)
  for towers, aggregation in cases or CASES:
    try:
      result = one(towers, aggregation)
    except Exception as e:  # pylint: disable=broad-except
      # A failure is a row of the table, not the end of the run; the
      # traceback is printed whole so that the report can quote it.
      traceback.print_exc()
      first = str(e).strip().splitlines()[0] if str(e).strip() else ''
      print(f'ROW {name} {towers} towers {aggregation}: FAILED '
            f'{type(e).__name__}: {first[:400]}', flush=True)
      continue
    print(f'ROW {name} {towers} towers {aggregation}: train ok; '
          f'{compare(reference, result)}; metrics {result["metrics"]} '
          f'({result["seconds"]:.0f} s)', flush=True)
