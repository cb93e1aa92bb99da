"""Checkpoints of the train state and the data iterator, saved together with orbax.

A step directory holds two items: `state` (the pytree `{"params", "opt", "step"}`, restored
directly into its shardings) and `data` (the input iterator's JSON state, so a resumed run sees
exactly the batches an uninterrupted run would, plus the checksums of the state's arrays).
Resuming picks the latest step that restores and matches its checksums; a step that fails
(missing, partial or damaged files) is reported in one line and the previous one is tried; when
the workdir has checkpoints and none restores, `CheckpointError` is raised rather than silently
starting from scratch. Orbax writes each step to a temporary directory and renames it when
complete; a temporary directory left by a killed or failed save is never a finished step, and is
removed when the checkpointer opens the directory.

Checksums (`fingerprint`): for every array, the sum of its bits as uint32 words and the sum of
those words times odd position weights, both modulo 2^32, computed on device. Integer sums do
not depend on the order of addition, so the value is the same whatever the sharding or process
count, and any change of one byte of one array changes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lra import storage

TMP_MARKER = ".orbax-checkpoint-tmp"   # orbax's suffix for a step directory being written
CHECKSUMS = "checksums"                # key of the state's checksums in the `data` item

class CheckpointError(RuntimeError):
  """The workdir has checkpoints but none of them can be restored."""


def _words(x: jax.Array) -> jax.Array:
  """The bits of `x` as a flat uint32 array (narrower types widened, wider ones split)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.reshape(-1).astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  narrow = {1: jnp.uint8, 2: jnp.uint16}[size]
  return jax.lax.bitcast_convert_type(x, narrow).reshape(-1).astype(jnp.uint32)


@jax.jit
def _leaf_sums(leaves: list) -> jax.Array:
  sums = []
  for x in leaves:
    w = _words(x)                                                          # [N] uint32
    weights = jnp.arange(w.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761) | jnp.uint32(1)
    sums.append(jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * weights, dtype=jnp.uint32),
                           jnp.uint32(w.shape[0])]))
  return jnp.stack(sums) if sums else jnp.zeros((0, 3), jnp.uint32)      # [leaves, 3]


def fingerprint(tree: Any) -> str:
  """A checksum of every array in `tree` (and of its structure), independent of sharding."""
  sums = _leaf_sums(jax.tree.leaves(tree))
  words = np.asarray(jax.device_get(sums.addressable_data(0)))
  digest = hashlib.sha256(str(jax.tree.structure(tree)).encode())
  digest.update(words.astype("<u4").tobytes())
  return digest.hexdigest()[:32]


def checksums(state: Any) -> dict[str, str]:
  """The checksums saved with a state: of the whole state, and of its params alone."""
  out = {"state": fingerprint(state)}
  if isinstance(state, dict) and "params" in state:
    out["params"] = fingerprint(state["params"])
  return out


@contextlib.contextmanager
def _quiet_orbax():
  """Orbax logs a traceback for every failed restore; the checkpointer reports one line."""
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    absl_logger.setLevel(level)


_terminal: tuple[int, tuple[int, int]] | None = None
"""While `stderr_to` has sent descriptor 2 away: (a copy of the user's stderr, the identity
of the file descriptor 2 was sent to)."""


def _identity(fd: int) -> tuple[int, int]:
  st = os.fstat(fd)
  return st.st_dev, st.st_ino


@contextlib.contextmanager
def _stderr_kept_for(log_path: str):
  """Holds back what is written to stderr (file descriptor 2, so orbax's and tensorstore's
  threads too) while a save runs: replayed when it succeeds. When it fails, the held text and
  everything written to descriptor 2 from then on (orbax's abandoned tasks keep reporting
  while the error travels up and when the interpreter shuts down) go to `log_path`, and the
  caller's one line reaches the user through `report`."""
  sys.stderr.flush()
  saved = os.dup(2)
  failed = False
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    except BaseException:
      failed = True
      raise
    finally:
      sys.stderr.flush()
      if failed:   # straight from the held file to the log: nothing slips through meanwhile
        stderr_to(log_path, terminal=saved)
      else:
        os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      text = held.read()
      try:
        if text:
          os.write(2, text)
      except OSError:
        pass   # the disk may be the very thing that is full


def stderr_to(log_path: str, terminal: int = 2) -> None:
  """Sends what is written to descriptor 2 from now on to `log_path` (or nowhere, when it
  cannot be opened); `report` still reaches the user's stderr (`terminal`, a descriptor of it,
  when descriptor 2 is already elsewhere)."""
  global _terminal
  sys.stderr.flush()
  try:
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  except OSError:
    fd = os.open(os.devnull, os.O_WRONLY)
  if _terminal is None or _identity(2) != _terminal[1]:
    if _terminal is not None:
      os.close(_terminal[0])
    _terminal = (os.dup(terminal), _identity(fd))
  else:
    _terminal = (_terminal[0], _identity(fd))
  os.dup2(fd, 2)
  os.close(fd)


def report(line: str) -> None:
  """Prints one line for the user on stderr, also after `stderr_to` sent descriptor 2 to the
  error log."""
  sys.stderr.flush()
  if _terminal is not None and _identity(2) == _terminal[1]:
    os.write(_terminal[0], (line + "\n").encode())
  else:
    print(line, file=sys.stderr, flush=True)


def remove_unfinished(directory: str) -> list[str]:
  """Removes orbax's temporary step directories (saves that never finished); returns them."""
  if jax.process_index() != 0 or not storage.isdir(directory):
    return []
  removed = [d for d in storage.listdir(directory) if TMP_MARKER in d]
  for name in removed:
    try:
      storage.rmtree(storage.join(directory, name))
    except OSError:
      pass   # removed meanwhile, or not removable: orbax ignores it as well
  return removed


class Checkpointer:
  """Saves every `every` steps (and on request), keeps the newest `keep`, restores the latest."""

  def __init__(self, directory: str, *, every: int, keep: int):
    self.directory = storage.resolve(directory)
    self.every = int(every)
    removed = remove_unfinished(self.directory)
    if removed:
      print(f"Removed unfinished checkpoint saves in {self.directory}: {', '.join(removed)} "
            f"(an earlier run stopped while writing them).", flush=True)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=int(keep), create=True, enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data"))

  def _error_log(self) -> str:
    """Where a failed save's held-back stderr goes: `<workdir>/error.log`, on this machine
    (`error.log` in the current folder when the workdir is a bucket)."""
    if storage.is_remote(self.directory):
      return "error.log"
    return os.path.join(os.path.dirname(self.directory), "error.log")

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def _step_dirs_on_disk(self) -> list[str]:
    return [d for d in storage.listdir(self.directory)
            if d.split(".")[0].isdigit() and TMP_MARKER not in d]

  def due(self, step: int) -> bool:
    """Whether `step` is on the saving period."""
    return self.every > 0 and step % self.every == 0

  def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
    """Saves when `step` is on the period (or `force`); returns whether it saved."""
    if not force and not self.due(step):
      return False
    if step in self.manager.all_steps():
      return False
    data_state = {**data_state, CHECKSUMS: checksums(state)}
    with _stderr_kept_for(self._error_log()):
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)
      self.manager.wait_until_finished()
    return True

  def restore_latest(self, abstract_state: Any) -> tuple[Any, dict, int] | None:
    """Restores the newest restorable step as (state, data_state, step), or None if none exist.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct`s with shardings: the target.
    """
    steps = self.steps()
    if not steps:
      leftovers = self._step_dirs_on_disk()
      if leftovers:
        raise CheckpointError(
            f"{self.directory} holds step directories {leftovers} but none is a finished "
            f"checkpoint (partial saves?). Move them away to start from scratch, or point "
            f"--workdir elsewhere.")
      return None
    errors = []
    for step in reversed(steps):
      try:
        with _quiet_orbax():
          restored = self.manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        data_state = restored["data"]
        if data_state is None:
          raise CheckpointError("the data iterator state is missing")
        saved = data_state.pop(CHECKSUMS, None)  # absent in checkpoints of earlier versions
        if saved is not None and saved["state"] != fingerprint(restored["state"]):
          raise CheckpointError("its arrays do not match the checksums saved with them "
                                "(damaged files)")
      except Exception as e:  # noqa: BLE001 - any failure means: try the previous step
        cause = str(e).splitlines()[0][:300] if str(e) else ""
        errors.append(f"step {step}: {type(e).__name__}: {cause}")
        print(f"WARNING: checkpoint step {step} in {self.directory} cannot be used ("
              f"{errors[-1]}); trying the previous step.", flush=True)
        continue
      return restored["state"], data_state, step
    raise CheckpointError(
        f"none of the checkpoints in {self.directory} (steps {steps}) could be restored (see "
        f"the warnings above): the config or code may have changed shapes since they were "
        f"written, or the files are damaged. Use a fresh --workdir, or delete the checkpoints "
        f"to start from scratch.")

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) for a pytree of arrays: the restore target."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def load_params(directory: str, abstract_params: Any) -> tuple[Any, int]:
  """The newest parameters saved in a checkpoint directory (or a workdir's `checkpoints/`).

  Only `params` is read (partial restore), so the source run may have had another optimizer or
  schedule; the shapes must match. Returns (params, step); raises CheckpointError naming the
  directory when there is nothing to restore.
  """
  directory = storage.resolve(directory)
  if storage.isdir(storage.join(directory, "checkpoints")):
    directory = storage.join(directory, "checkpoints")
  manager, step = None, None
  if storage.isdir(directory):
    manager = ocp.CheckpointManager(directory, item_names=("state", "data"))
    step = manager.latest_step()
  if step is None:
    if manager is not None:
      manager.close()
    raise CheckpointError(
        f"config.init_from = {directory} holds no finished checkpoint to initialise from; "
        f"finish that run first or clear init_from.")
  target = {"params": abstract_params}
  try:
    with _quiet_orbax():
      restored = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
              target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
              partial_restore=True),
          data=ocp.args.JsonRestore()))
  except Exception as e:  # noqa: BLE001 - report which directory and why, whatever failed
    raise CheckpointError(
        f"could not read the parameters of step {step} in {directory} (config.init_from): "
        f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}. The model "
        f"config must match that run's (parameter shapes may not depend on the sequence "
        f"length).") from e
  finally:
    manager.close()
  params = restored["state"]["params"]
  saved = (restored["data"] or {}).get(CHECKSUMS, {}).get("params")
  if saved is not None and saved != fingerprint(params):
    raise CheckpointError(
        f"the parameters of step {step} in {directory} (config.init_from) do not match the "
        f"checksums saved with them (damaged files); rerun that run's last phase or restore "
        f"its files.")
  return params, step
