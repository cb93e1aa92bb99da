"""Leftovers in a run's checkpoint folders, moved aside before orbax opens them.

What sits in a checkpoint folder's place, or among its steps, and is no checkpoint (a file,
another tool's folder, a step folder without orbax's files, a broken symbolic link) is moved,
unchanged, to `<run folder>/leftovers/<UTC time>/` under its own relative path
(`leftovers/20250101-120000/best`, `.../checkpoints/40`) before the checkpointer
(`lra.checkpoint.Checkpointer`) opens the folder, with one line naming it and where it went:
orbax would otherwise fail on it at every save (a file named `best`), take it for a step (and
delete it as an old one, or as an unfinished save in a bucket), or fail to rename a finished
save onto it. Nothing is deleted.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import orbax.checkpoint as ocp

from lra import rundir, storage
from lra.rundir import RunDir

TMP_MARKER = ocp.path.step.TMP_DIR_SUFFIX   # of a step being written to a local disk
LEFTOVERS = rundir.LEFTOVERS   # beside a run's checkpoint folders: what was no checkpoint, moved aside
# What orbax writes in a step folder (any one of them makes it orbax's: finished, unfinished or
# damaged), and at the top of a checkpoint folder besides the steps.
ORBAX_STEP_NAMES = frozenset({"_CHECKPOINT_METADATA", "commit_success.txt", "state", "data",
                              "descriptor", "metadata"})
ORBAX_ROOT_NAMES = frozenset({"_ROOT_METADATA", "metadata", "descriptor"})


class LeftoverError(RuntimeError):
  """A leftover that could not be moved aside (one line: what, where, what to do)."""


def _leftover_kind(path: str) -> str | None:
  """What non-folder is at `path` (`a file`, `a broken symbolic link`), None for a folder or
  for nothing at all."""
  if storage.is_remote(path):
    return "a file" if storage.exists(path) and not storage.isdir(path) else None
  if os.path.isdir(path) or not os.path.lexists(path):
    return None
  return "a broken symbolic link" if os.path.islink(path) else "a file"


def _is_orbax_entry(directory: str, name: str) -> bool:
  """Whether `name` in checkpoint folder `directory` is orbax's: its root metadata, an
  unfinished save's temporary folder (`remove_unfinished` takes it), or a step folder holding
  any of orbax's files (a finished step, or a damaged one the restore reports and skips)."""
  if name in ORBAX_ROOT_NAMES or TMP_MARKER in name:
    return True
  path = storage.join(directory, name)
  if not name.isdigit() or _leftover_kind(path) is not None or not storage.isdir(path):
    return False
  return any(child in ORBAX_STEP_NAMES for child in storage.listdir(path))


def _move(source: str, target: str) -> None:
  """Moves file or folder `source` to `target` (whose parent is made), unchanged: a symbolic
  link is moved as a link; in a bucket, every object is copied and then deleted."""
  if storage.is_remote(source):
    fs = storage.remote_filesystem(source)
    fs.copy(source, target, recursive=storage.isdir(source))
    fs.rm(source, recursive=storage.isdir(source))
    return
  os.makedirs(os.path.dirname(target), exist_ok=True)
  shutil.move(source, target)   # a rename, or a copy and delete across file systems


def move_leftovers(directory: str) -> str | None:
  """Moves aside what is at checkpoint folder `directory`'s place, or in it, and is not a
  checkpoint (module docstring): `directory` itself when it is a file or a broken link, else
  each entry that is not orbax's (`_is_orbax_entry`). Process 0 only. Returns the one line
  saying what was moved where (printed by the checkpointer), or None when nothing was.
  LeftoverError (one line, what to do) when a leftover cannot be moved."""
  if jax.process_index() != 0:
    return None
  directory = storage.resolve(directory)
  run_dir, name = os.path.split(directory.rstrip("/"))
  kind = _leftover_kind(directory)
  if kind is not None:
    names, source_dir = [name], run_dir
  elif storage.isdir(directory):
    names = [n for n in storage.listdir(directory) if not _is_orbax_entry(directory, n)]
    source_dir = directory
  else:
    return None
  if not names:
    return None
  stamp = storage.join(RunDir(run_dir).leftovers, time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
  target_dir, n = stamp, 1   # a folder of this second that holds none of these names yet
  while any(storage.exists(storage.join(_under(target_dir, kind, name), x)) for x in names):
    target_dir, n = f"{stamp}-{n}", n + 1
  target_dir = _under(target_dir, kind, name)
  for leftover in names:
    source, target = storage.join(source_dir, leftover), storage.join(target_dir, leftover)
    try:
      _move(source, target)
    except Exception as e:  # noqa: BLE001 - an OSError, or a bucket's HTTP error
      cause = getattr(e, "strerror", None) or (str(e).splitlines()[0][:200] if str(e) else "")
      raise LeftoverError(
          f"{source} is not a checkpoint and could not be moved aside to {target} "
          f"({type(e).__name__}: {cause}); move it out of the checkpoint folder by hand, or "
          f"use a fresh --workdir.") from e
  if kind is not None:
    return (f"Moved {directory} aside to {storage.join(target_dir, name)}: it is {kind}, not a "
            f"checkpoint folder (kept unchanged; a new {name} folder takes its place).")
  return (f"Moved aside from {directory} what is not a checkpoint: {', '.join(names)} (kept "
          f"unchanged in {target_dir}).")


def _under(folder: str, kind: str | None, name: str) -> str:
  """Where the leftovers go in leftovers folder `folder`: itself for a checkpoint folder that
  is a leftover as a whole (`kind`), else its subfolder `name` (the checkpoint folder's)."""
  return folder if kind is not None else storage.join(folder, name)
