"""Sharing the machine's GPUs and CPU threads among parallel trials.

The sweep runs up to maxParallelTrials trials at once, each in a device
slot. Slot i gets its share of the GPUs through CUDA_VISIBLE_DEVICES and a
share of the CPU through TensorFlow's thread pools
(`--intra-op-threads`, `--inter-op-threads`) and OMP_NUM_THREADS, so that
parallel trials do not fight over the same cores.
"""

import dataclasses
import shutil
import subprocess
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from absl import logging

from trainer import core_share

THREAD_FLAGS = ('intra-op-threads', 'inter-op-threads')


@dataclasses.dataclass(frozen=True)
class Slot:
  """What one running trial may use."""
  index: int
  gpus: Tuple[str, ...]
  intra_op_threads: int
  inter_op_threads: int


def visible_gpus(environ: Mapping[str, str]) -> List[str]:
  """The GPU ids trials may use.

  CUDA_VISIBLE_DEVICES, when set, says which (an empty value or -1: none).
  Otherwise `nvidia-smi -L` counts them; without nvidia-smi there are none.
  Importing TensorFlow here to ask would take seconds and GPU memory the
  trials need.

  Args:
    environ: The sweep's environment.

  Returns:
    Device ids as CUDA_VISIBLE_DEVICES spells them ('0', '1', or UUIDs).
  """
  if 'CUDA_VISIBLE_DEVICES' in environ:
    ids = []
    for item in environ['CUDA_VISIBLE_DEVICES'].split(','):
      item = item.strip()
      # CUDA ignores everything from the first invalid entry on.
      if not item or item.startswith('-'):
        break
      ids.append(item)
    return ids
  return _nvidia_smi_gpus()


def _nvidia_smi_gpus() -> List[str]:
  binary = shutil.which('nvidia-smi')
  if binary is None:
    return []
  result = subprocess.run([binary, '-L'], capture_output=True, text=True,
                          timeout=60, check=False)
  if result.returncode != 0:
    # A broken driver: TensorFlow would see no GPU either.
    logging.warning('nvidia-smi -L exited %d (%s); running trials without '
                    'GPUs.', result.returncode, result.stderr.strip()[:200])
    return []
  count = sum(1 for line in result.stdout.splitlines()
              if line.startswith('GPU '))
  return [str(i) for i in range(count)]


def check_parallel(parallel: int, gpus: Sequence[str], cpus: int) -> None:
  """Refuses more parallel trials than the machine has CPUs or GPUs.

  More would only make the trials take turns on the same cores (and a huge
  maxParallelTrials would exhaust memory building the slots).

  Raises:
    ValueError: parallel > max(cpus, len(gpus)).
  """
  limit = max(cpus, len(gpus), 1)
  if parallel > limit:
    raise ValueError(f'maxParallelTrials: {parallel} is more trials than this '
                     f'machine runs at once ({cpus} CPUs, {len(gpus)} GPUs); '
                     f'set it to at most {limit}.')


def make_slots(parallel: int, gpus: Sequence[str], cpus: int) -> List[Slot]:
  """Splits GPUs and CPU threads into `parallel` slots.

  GPUs: with at least as many GPUs as slots, each slot gets its own
  (consecutive ids; the first slots get one more when they do not divide
  evenly). With fewer GPUs than slots, slots share them round-robin, each
  trial seeing one GPU. Threads: core_share.pool_sizes (intra-op =
  max(1, cpus // parallel), inter-op = max(1, intra-op // 2)).

  Args:
    parallel: maxParallelTrials.
    gpus: Visible GPU ids.
    cpus: CPUs of the machine.

  Returns:
    One Slot per parallel trial.
  """
  intra, inter = core_share.pool_sizes(parallel, cpus)
  shares = _gpu_shares(parallel, list(gpus))
  return [Slot(i, tuple(shares[i]), intra, inter) for i in range(parallel)]


def _gpu_shares(parallel: int, gpus: List[str]) -> List[List[str]]:
  if not gpus:
    return [[] for _ in range(parallel)]
  if len(gpus) < parallel:
    return [[gpus[i % len(gpus)]] for i in range(parallel)]
  base, extra = divmod(len(gpus), parallel)
  shares, start = [], 0
  for i in range(parallel):
    size = base + (1 if i < extra else 0)
    shares.append(gpus[start:start + size])
    start += size
  return shares


def flags_set(fixed_flags: Sequence[str]) -> List[str]:
  """Names of the flags in a command line, hyphenated (--a_b is a-b)."""
  names = []
  for arg in fixed_flags:
    if arg.startswith('--') and len(arg) > 2:
      names.append(arg[2:].partition('=')[0].replace('_', '-'))
  return names


def thread_flags(slot: Slot, fixed_flags: Sequence[str]) -> List[str]:
  """The thread-pool flags to add: those the fixed flags do not set."""
  present = set(flags_set(fixed_flags))
  flags = core_share.pool_flags(slot.intra_op_threads, slot.inter_op_threads)
  return [flags[name] for name in THREAD_FLAGS if name not in present]


def slot_env(slot: Slot, environ: Mapping[str, str],
             fixed_flags: Sequence[str]) -> Dict[str, str]:
  """Environment variables that confine a trial to its slot.

  OMP_NUM_THREADS follows the intra-op pool (the user's
  --intra-op-threads when the fixed flags set it) unless the sweep's own
  environment sets it. CUDA_VISIBLE_DEVICES is set only when there are
  GPUs to share.
  """
  env = {}
  if 'OMP_NUM_THREADS' not in environ:
    intra = _fixed_value(fixed_flags, 'intra-op-threads')
    threads = intra if intra and intra.isdigit() and int(intra) > 0 \
        else str(slot.intra_op_threads)
    env['OMP_NUM_THREADS'] = threads
  if slot.gpus:
    env['CUDA_VISIBLE_DEVICES'] = ','.join(slot.gpus)
  return env


def _fixed_value(fixed_flags: Sequence[str], name: str) -> Optional[str]:
  for i, arg in enumerate(fixed_flags):
    key, sep, value = arg.partition('=')
    if key.startswith('--') and key[2:].replace('_', '-') == name:
      if sep:
        return value
      return fixed_flags[i + 1] if i + 1 < len(fixed_flags) else None
  return None
