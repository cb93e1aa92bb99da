"""Checkpoints of the train state and the data iterator, saved together with orbax.

A step directory holds two items: `state` (the pytree `{"params", "opt", "step"}`, restored
directly into its shardings) and `data` (the input iterator's JSON state, so a resumed run sees
exactly the batches an uninterrupted run would, plus the checksums of the state's arrays).
Resuming picks the latest step that restores and matches its checksums; a step that fails
(missing, partial or damaged files) is reported in one line and the previous one is tried; when
the workdir has checkpoints and none restores, `CheckpointError` is raised rather than silently
starting from scratch. Orbax writes each step to a temporary directory and renames it when
complete (in a `gs://` bucket: in place, then a `commit_success.txt` file); what a killed or
failed save leaves is never a finished step, and is removed when the checkpointer opens the
directory. A failed save is reported by its exception alone: what orbax and its abandoned
writes report is dropped (`_quiet_orbax`).

Before the checkpointer opens a folder, what is in it or in its place and is no checkpoint is
moved aside with one line (`lra.leftovers`).

Checksums (`fingerprint`): for every array, the sum of its bits as uint32 words and the sum of
those words times odd position weights, both modulo 2^32, computed on device. Integer sums do
not depend on the order of addition, so the value is the same whatever the sharding or process
count, and any change of one byte of one array changes it. The `data` item's own values (the
iterator's position, the open window's metric sums, a best checkpoint's validation record) are
covered by a SHA-256 of their JSON (`data_digest`), so an edited value is refused like a
damaged array.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lra import leftovers, storage
from lra.rundir import RunDir

TMP_MARKER = leftovers.TMP_MARKER   # of a step being written to a local disk
CHECKSUMS = "checksums"                # key of the state's checksums in the `data` item

class CheckpointError(RuntimeError):
  """The workdir has checkpoints but none of them can be restored. `errors`: why each step
  could not be, when the exception lists them (`CheckpointError(errors, message)`)."""

  def __init__(self, *args: Any):
    self.errors: list[str] = []
    if len(args) == 2 and isinstance(args[0], list):
      self.errors, args = args[0], args[1:]
    super().__init__(*args)


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


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
  ok = [jnp.all(jnp.isfinite(x)) for x in leaves
        if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(ok)) if ok else jnp.bool_(True)


def non_finite(state: Any, data_state: Any = None) -> bool:
  """Whether any floating array of `state` (one jitted reduction on device) or any float of
  `data_state` (the metric sums) is NaN or infinite."""
  floats = [x for x in jax.tree.leaves(data_state) if isinstance(x, float)]
  if any(not np.isfinite(x) for x in floats):
    return True
  return not bool(np.asarray(jax.device_get(
      _all_finite(jax.tree.leaves(state)).addressable_data(0))))


def fingerprint(tree: Any) -> str:
  """A checksum of every array in `tree` (and of its structure), independent of sharding."""
  sums = _leaf_sums(jax.tree.leaves(tree))
  words = np.asarray(jax.device_get(sums.addressable_data(0)))
  digest = hashlib.sha256(str(jax.tree.structure(tree)).encode())
  digest.update(words.astype("<u4").tobytes())
  return digest.hexdigest()[:32]


def _plain(value: Any) -> Any:
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f"{type(value).__name__} is not JSON")


def data_digest(data_state: dict) -> str:
  """A checksum of the `data` item's values (its JSON with sorted keys)."""
  text = json.dumps(data_state, sort_keys=True, separators=(",", ":"), default=_plain)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def checksums(state: Any) -> dict[str, str]:
  """The checksums saved with a state: of the whole state, and of its params alone."""
  out = {"state": fingerprint(state)}
  if isinstance(state, dict) and "params" in state:
    out["params"] = fingerprint(state["params"])
  return out


@contextlib.contextmanager
def _quiet_orbax(quiet_after_failure: bool = False):
  """Drops orbax's log records (it logs through absl's logger) for the block: a failed restore
  or save is reported in one line by the checkpointer, not by orbax's tracebacks. When one
  fails, the reads or writes it abandoned complete later into the event loop orbax has closed,
  and tensorstore prints each "Event loop is closed" error through `sys.excepthook`, from its
  own threads and possibly before the failure reaches the caller: the filter of those errors is
  installed before the block starts (`_drop_loop_closed_errors`), for the rest of the process.
  asyncio's reports of abandoned futures ("Task exception was never retrieved") are dropped
  from the start of the block, since orbax's loop may collect a failed read's task before the
  failure reaches the caller; after a failure they stay dropped, and with
  `quiet_after_failure` (a save: its abandoned writes go on failing until the process ends)
  orbax's log records stay dropped, as do the warnings of its coroutines left unawaited."""
  _drop_loop_closed_errors()
  absl_logger = logging.getLogger("absl")
  asyncio_logger = logging.getLogger("asyncio")
  level, asyncio_level = absl_logger.level, asyncio_logger.level
  absl_logger.setLevel(logging.CRITICAL)
  asyncio_logger.setLevel(logging.CRITICAL)
  try:
    yield
  except BaseException:
    # the abandoned reads' coroutines, collected unawaited, warn as the process ends
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited",
                            category=RuntimeWarning)
    if not quiet_after_failure:
      absl_logger.setLevel(level)
    raise
  absl_logger.setLevel(level)
  asyncio_logger.setLevel(asyncio_level)


def _drop_loop_closed_errors() -> None:
  """From now on, "Event loop is closed" errors of abandoned reads and writes are not printed
  (`sys.excepthook`, `sys.unraisablehook`, `threading.excepthook`); every other error is."""
  if not isinstance(sys.excepthook, functools.partial):
    sys.excepthook = functools.partial(_except_unless_loop_closed, sys.excepthook)
  if not isinstance(sys.unraisablehook, functools.partial):
    sys.unraisablehook = functools.partial(_unless_loop_closed, sys.unraisablehook)
  if not isinstance(threading.excepthook, functools.partial):
    threading.excepthook = functools.partial(_unless_loop_closed, threading.excepthook)


def _loop_closed(error: BaseException | None) -> bool:
  return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _except_unless_loop_closed(hook, kind, error, tb) -> None:
  if not _loop_closed(error):
    hook(kind, error, tb)


def _unless_loop_closed(hook, unraisable) -> None:
  """Hands `unraisable` to `hook` unless it is an abandoned write's "Event loop is closed"."""
  if not _loop_closed(unraisable.exc_value):
    hook(unraisable)


_terminal: tuple[int, tuple[int, int]] | None = None
"""While `stderr_to` has sent descriptor 2 away: (a copy of the user's stderr, the identity
of the file descriptor 2 was sent to)."""


def _identity(fd: int) -> tuple[int, int]:
  st = os.fstat(fd)
  return st.st_dev, st.st_ino


def stderr_to(log_path: str) -> None:
  """Sends what is written to descriptor 2 from now on to `log_path` (or nowhere, when it
  cannot be opened); `report` still reaches the user's stderr. A descriptor cannot point into a
  bucket: a `gs://` log is written to a local temporary file, appended to the log through
  lra.storage when the process exits (after its threads ended), never in the current folder."""
  global _terminal
  sys.stderr.flush()
  if storage.is_remote(log_path):
    fd, local = tempfile.mkstemp(prefix="lra-error-", suffix=".log")
    os.close(fd)
    atexit.register(_upload_log, local, log_path)
    log_path = local
  try:
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  except OSError:
    fd = os.open(os.devnull, os.O_WRONLY)
  if _terminal is None or _identity(2) != _terminal[1]:
    if _terminal is not None:
      os.close(_terminal[0])
    _terminal = (os.dup(2), _identity(fd))
  else:   # sent away already: the copy of the user's stderr is kept
    _terminal = (_terminal[0], _identity(fd))
  os.dup2(fd, 2)
  os.close(fd)


def _upload_log(local: str, log_path: str) -> None:
  """Appends local file `local` (when not empty) to `log_path` in a bucket and removes it."""
  try:
    with open(local, errors="replace") as f:
      text = f.read()
    if text:
      storage.append_text(log_path, text)
  except Exception:  # noqa: BLE001 - at exit, with the user's line printed: nothing to add
    pass
  finally:
    with contextlib.suppress(OSError):
      os.remove(local)


def report(line: str) -> None:
  """Prints one line for the user on stderr, also after `stderr_to` sent descriptor 2 to the
  error log."""
  sys.stderr.flush()
  if _terminal is not None and _identity(2) == _terminal[1]:
    os.write(_terminal[0], (line + "\n").encode())
  else:
    print(line, file=sys.stderr, flush=True)



def remove_unfinished(directory: str) -> list[str]:
  """Removes the saves that never finished and returns their names: what orbax takes for
  temporary, on a local disk a `<step>.orbax-checkpoint-tmp...` folder, in a `gs://` bucket
  (where orbax writes the step in place and then `commit_success.txt`) a step folder without
  that file. Process 0 only.

  Orbax's own `cleanup_tmp_directories` option removes the same folders (it lists them with the
  same function), but in a thread that the manager's constructor starts and only its first save
  waits for: the restore and `restore_latest`'s check for unfinished steps would run while it
  deletes, and it does not say what it removed."""
  if jax.process_index() != 0 or not storage.isdir(directory):
    return []
  removed = []
  for temporary in ocp.path.step.all_temporary_paths(directory):
    path = temporary.get()
    try:
      storage.rmtree(str(path))
    except OSError:
      pass   # removed meanwhile, or not removable: orbax ignores it as well
    removed.append(path.name)
  return sorted(removed)


class Checkpointer:
  """Saves every `every` steps (and on request), keeps the newest `keep`, restores the latest."""

  def __init__(self, directory: str, *, every: int, keep: int):
    self.directory = storage.resolve(directory)
    self.every = int(every)
    # Process 0 clears the folder; the manager's constructor (create=True) then waits for every
    # process before any of them lists its steps.
    try:
      moved = leftovers.move_leftovers(self.directory)
    except leftovers.LeftoverError as e:
      raise CheckpointError(str(e)) from e
    if moved:
      print(moved, flush=True)
    removed = remove_unfinished(self.directory)
    if removed:
      print(f"Removed unfinished checkpoint saves in {self.directory}: {', '.join(removed)} "
            f"(an earlier run stopped while writing them).", flush=True)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=int(keep), create=True, enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data"))

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def _step_dirs_on_disk(self) -> list[str]:
    return [d for d in storage.listdir(self.directory)
            if d.split(".")[0].isdigit() and TMP_MARKER not in d]

  def due(self, step: int) -> bool:
    """Whether `step` is on the saving period."""
    return self.every > 0 and step % self.every == 0

  def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
    """Saves when `step` is on the period (or `force`); returns whether it saved. A state
    holding NaN or infinite values is never saved: FloatingPointError, one line saying which
    step a rerun resumes from."""
    if not force and not self.due(step):
      return False
    if step in self.manager.all_steps():
      return False
    if non_finite(state, data_state):
      kept = self.steps()
      since = (f"it resumes from the last checkpoint, step {kept[-1]}" if kept else
               "it starts from step 0, as no checkpoint was saved before")
      raise FloatingPointError(
          f"training diverged: the train state at step {step} holds NaN or infinite values, "
          f"so it was not saved; rerun with a lower --config.learning_rate (or "
          f"--config.grad_clip): {since}.")
    data_state = {**data_state, CHECKSUMS: {**checksums(state), "data": data_digest(data_state)}}
    with _quiet_orbax(quiet_after_failure=True):
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)
      self.manager.wait_until_finished()
    return True

  def restore_latest(self, abstract_state: Any, *, warn: bool = True
                     ) -> tuple[Any, dict, int] | None:
    """Restores the newest restorable step as (state, data_state, step), or None if none exist.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct`s with shardings: the target. Each
    step that fails is reported in a line (unless not `warn`), and the previous one is tried.
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
        if saved is not None and "data" in saved and saved["data"] != data_digest(data_state):
          raise CheckpointError("its data/metadata values (the data position, the metric sums "
                                "or the best record) do not match the checksum saved with them "
                                "(edited or damaged)")
      except Exception as e:  # noqa: BLE001 - any failure means: try the previous step
        cause = str(e).splitlines()[0][:300] if str(e) else ""
        errors.append(f"step {step}: {type(e).__name__}: {cause}")
        if not warn:
          continue
        print(f"WARNING: checkpoint step {step} in {self.directory} cannot be used ("
              f"{errors[-1]}); trying the previous step.", flush=True)
        continue
      return restored["state"], data_state, step
    raise CheckpointError(
        errors,
        f"none of the checkpoints in {self.directory} (steps {steps}) could be restored ("
        f"{'see the warnings above' if warn else '; '.join(errors)}): the config or code may "
        f"have changed shapes since they were written, or the files are damaged. Rerun with "
        f"the config that wrote them, or use a fresh --workdir.")

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """The parameters of `step` alone (partial restore), checked against their checksums;
    CheckpointError when they cannot be read or do not match."""
    return _restore_params(self.manager, step, abstract_params, self.directory)

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
  if storage.isdir(RunDir(directory).checkpoints):
    directory = RunDir(directory).checkpoints
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
  try:
    return _restore_params(manager, step, abstract_params, directory, "config.init_from"), step
  finally:
    manager.close()


def _restore_params(manager: Any, step: int, abstract_params: Any, directory: str,
                    source: str = "") -> Any:
  """The `params` of `step` in `manager`'s directory (partial restore), checked against the
  checksums saved with them; CheckpointError naming the directory (and `source`, the config
  field that named it) otherwise."""
  target = {"params": abstract_params}
  named = f" ({source})" if source else ""
  try:
    with _quiet_orbax():
      restored = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
              target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
              partial_restore=True),
          data=ocp.args.JsonRestore()))
  except Exception as e:  # noqa: BLE001 - report which directory and why, whatever failed
    raise CheckpointError(
        f"could not read the parameters of step {step} in {directory}{named}: "
        f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}. The model "
        f"config must match that run's (parameter shapes may not depend on the sequence "
        f"length).") from e
  params = restored["state"]["params"]
  saved = (restored["data"] or {}).get(CHECKSUMS, {}).get("params")
  if saved is not None and saved != fingerprint(params):
    raise CheckpointError(
        f"the parameters of step {step} in {directory}{named} do not match the checksums "
        f"saved with them (damaged files); rerun that run's last phase or restore its files.")
  return params
