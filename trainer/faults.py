"""Known failures of the entry points, each turned into one command-line line.

`FAULTS` is the one table: exception type -> how to phrase the line, its
label (`<prog>: error: ...` or `<prog>: stopped: ...`) and the exit code.
`trainer.task` and `trainer.predict` run their work under `handled(prog)`.
An exception whose type is in no row goes on as it is, traceback and all;
so does one whose row phrases it as None (e.g. TensorFlow's own
InvalidArgumentError, which is no data check).
"""

import contextlib
import dataclasses
import sys
from typing import (Callable, Dict, Iterator, Mapping, NoReturn, Optional,
                    Tuple, Type)

from absl import logging
import tensorflow as tf

from trainer import cli
from trainer import cluster_config
from trainer import data_errors
from trainer import disk_space
from trainer import options as options_lib
from trainer import preemption
from trainer import sync_errors


@dataclasses.dataclass(frozen=True)
class Where:
  """What a phrasing may need to know besides the exception.

  Attributes:
    renamed: Arguments whose flag differs in this command, e.g.
      {'eval_files': '--predict-files'} for trainer.predict.
    model_dir: Where the failed run wrote, once it got that far.
    tf_config: The run's TF_CONFIG, as it checked it.
  """
  renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
  model_dir: Optional[str] = None
  tf_config: Optional[Dict] = None


# The attribute `run_noted` puts on an exception leaving a run.
_RUN_ATTRIBUTE = '_trainer_run'


@dataclasses.dataclass(frozen=True)
class Fault:
  """One row of the table.

  Attributes:
    types: The exception types of the row.
    phrase: (exception, where) -> the line, or None when this exception is
      not one the row knows (it is re-raised then).
    exit_code: The process's exit code; None: the exception's `exit_code`.
    label: What follows `<prog>: ` on the line.
    traceback_in_debug: Whether --verbosity=debug logs the traceback first.
  """
  types: Tuple[Type[BaseException], ...]
  phrase: Callable[[BaseException, Where], Optional[str]]
  exit_code: Optional[int] = cli.EXIT_FAILED
  label: str = 'error'
  traceback_in_debug: bool = False


def _in_flag_terms(message: str, where: Where) -> str:
  """A message with the model's and the input's arguments spelt as flags."""
  return data_errors.in_flag_terms(options_lib.in_flag_terms(message),
                                   **where.renamed)


def _cluster_failure(error, where: Where) -> Optional[str]:
  """A port taken when the server starts, or a synchronous peer lost."""
  if where.model_dir is not None and isinstance(error, tf.errors.UnknownError):
    message = cluster_config.server_start_failure(error.message,
                                                  where.tf_config)
    if message is not None:
      return _in_flag_terms(message, where)
  return sync_errors.cli_message(error, cluster_config.load_tf_config(),
                                 where.model_dir)


def _full_disk(error, where: Where) -> Optional[str]:
  """A full disk while the run saved; its partial checkpoint is removed."""
  if where.model_dir is None:
    return None  # Not while writing a run's checkpoints.
  message = disk_space.no_space_failure(error.message, where.model_dir)
  return None if message is None else _in_flag_terms(message, where)


def _nan_loss(error, where: Where) -> str:
  del error, where  # TensorFlow's message names no cause.
  return ('the loss became nan during training; nothing more was saved or '
          'exported. Look for nan/inf in the data (allowed only with '
          '--allow-non-finite) or lower --learning-rate.')


def _preempted(error, where: Where) -> str:
  """How to resume after a stop signal: one task, or every synchronous one."""
  del where  # The cluster is the environment's, whatever the run got to.
  if sync_errors.is_sync(cluster_config.load_tf_config()):
    # A synchronous task cannot resume alone: its peers' collectives broke.
    return (f'{error} This task trained in a synchronous cluster: restart '
            'every task; they resume from the chief\'s last checkpoint.')
  return f'{error} Re-run the same command to resume.'


# First matching row wins: OptionError is a ValueError.
FAULTS = (
    Fault((options_lib.OptionError,), lambda e, where: str(e),
          exit_code=cli.EXIT_USAGE),
    # Errors that explain a bad input or model; their messages say the fix.
    Fault((ValueError, TypeError),
          lambda e, where: _in_flag_terms(str(e), where),
          traceback_in_debug=True),
    Fault((tf.errors.InvalidArgumentError,),
          lambda e, where: (data_errors.cli_message(e) or
                            _cluster_failure(e, where))),
    # A peer of a synchronous cluster died, stopped, restarted alone or
    # ended early, or the tasks count the cluster apart; or this task's
    # server could not start.
    Fault((tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
           tf.errors.UnknownError, tf.errors.FailedPreconditionError,
           tf.errors.InternalError, tf.errors.CancelledError),
          _cluster_failure, traceback_in_debug=True),
    Fault((tf.errors.ResourceExhaustedError,), _full_disk,
          traceback_in_debug=True),
    Fault((tf.compat.v1.train.NanLossDuringTrainingError,), _nan_loss),
    # SIGTERM, Ctrl-C or SIGHUP: a checkpoint was saved.
    Fault((preemption.Preempted,), _preempted, exit_code=None,
          label='stopped'),
)


def fault_for(error: BaseException) -> Optional[Fault]:
  """The table's row for `error`, or None."""
  return next((f for f in FAULTS if isinstance(error, f.types)), None)


@contextlib.contextmanager
def run_noted(model_dir: str, tf_config: Optional[Dict]) -> Iterator[None]:
  """Notes on an exception leaving the block where the run wrote."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    # Noted, never handled here: `handled` reads the note.
    setattr(e, _RUN_ATTRIBUTE, (model_dir, tf_config))
    raise


@contextlib.contextmanager
def handled(prog: str, **renamed: str) -> Iterator[None]:
  """Ends the process with one line for an exception of the table.

  Args:
    prog: The name the line starts with.
    **renamed: See `Where.renamed`.
  """
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    fault = fault_for(e)
    if fault is None:
      raise
    model_dir, tf_config = getattr(e, _RUN_ATTRIBUTE, (None, None))
    line = fault.phrase(e, Where(renamed, model_dir, tf_config))
    if line is None:
      raise
    if fault.traceback_in_debug:
      # The traceback stays available with --verbosity=debug.
      logging.debug('Traceback of the error below:', exc_info=True)
    _end(prog, fault, line, e)


def _end(prog: str, fault: Fault, line: str, error: BaseException) -> NoReturn:
  """Writes `<prog>: <label>: <line>` to stderr (Cloud logs it) and exits."""
  sys.stderr.write(f'{prog}: {fault.label}: {line}\n')
  sys.exit(error.exit_code if fault.exit_code is None else fault.exit_code)
