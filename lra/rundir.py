"""A run's folder: the one module that names its entries and reads them.

A run folder (`--workdir`, local or `gs://`) holds what the trainer writes:

  config.json      the run's config, written when it starts
  checkpoints/     the training state's orbax checkpoints, one folder per step
  best/            the parameters with the best validation metric (one step)
  metrics.jsonl    one JSON record per logged step and evaluation
  results.json     the final results; its presence means the run has finished
  error.log        what a failed run left on stderr (a bucket's copy of it); a run that
                   then finishes renames it error.previous.log
  lock             the process that owns the folder (lra/lock.py)
  leftovers/       what a resume found in place of a checkpoint and moved aside (lra/leftovers.py)
  tensorboard/     event files, when asked for

A staged run (config.phases) holds one such folder per phase, `phase1/`, `phase2/`, ..., and its
own `metrics.jsonl` and `results.json` over all phases; a sweep adds `sweep.json` and `log.txt`
(launch/run_state.py). Every other module asks `RunDir` for these paths instead of spelling
them (tests/rundir_test.py checks that none does).

Pure standard library: `lra/lock.py` and the command line use it before jax is imported; reads
go through lra/storage.py (imported when first needed), and never raise for a damaged file.
"""

from __future__ import annotations

import os
import re
from typing import Any

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
BEST = "best"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
ERROR_LOG = "error.log"
ERROR_PREVIOUS_LOG = "error.previous.log"
LOCK = "lock"
LEFTOVERS = "leftovers"
TENSORBOARD = "tensorboard"
PHASE = "phase{}"
# Folders inside a run that are its own parts, never runs of their own (`lra results` walks past
# them); the phase folders are parts too, read as the run's phases.
PARTS = frozenset({CHECKPOINTS, BEST, TENSORBOARD, LEFTOVERS})
# Files whose presence marks a folder as a run.
MARKS = frozenset({CONFIG, RESULTS})
_PHASE = re.compile(r"phase(\d+)")
_STEP = re.compile(r"\d+")


def join(folder: str, *names: str) -> str:
  """`folder/name/...`, for a local path or a bucket's (`gs://b/run` + `lock`)."""
  folder = os.fspath(folder)
  if "://" in folder:
    return "/".join([folder.rstrip("/"), *names])
  return os.path.join(folder, *names)


class RunDir:
  """The paths of one run folder (`path`: as the user gave it, resolved or not) and the reads
  every part of the program shares. Each path property is a string for lra/storage.py."""

  def __init__(self, path: Any):
    self.path = os.fspath(path)

  def __repr__(self) -> str:
    return f"RunDir({self.path!r})"

  def __eq__(self, other: object) -> bool:
    return isinstance(other, RunDir) and other.path == self.path

  def __hash__(self) -> int:
    return hash(self.path)

  def _at(self, name: str) -> str:
    return join(self.path, name)

  config = property(lambda self: self._at(CONFIG))
  checkpoints = property(lambda self: self._at(CHECKPOINTS))
  best = property(lambda self: self._at(BEST))
  metrics = property(lambda self: self._at(METRICS))
  results = property(lambda self: self._at(RESULTS))
  error_log = property(lambda self: self._at(ERROR_LOG))
  error_previous_log = property(lambda self: self._at(ERROR_PREVIOUS_LOG))
  lock = property(lambda self: self._at(LOCK))
  leftovers = property(lambda self: self._at(LEFTOVERS))
  tensorboard = property(lambda self: self._at(TENSORBOARD))

  def phase(self, k: int) -> "RunDir":
    """Phase `k` (1-based) of a staged run."""
    if k < 1:
      raise ValueError(f"phase {k}: phases are numbered from 1")
    return RunDir(self._at(PHASE.format(k)))

  def phase_names(self) -> list[str]:
    """The phase folders present (`phase1`, `phase2`, ...), in order; [] when none or the
    folder cannot be listed."""
    names = [n for n in self._list(self.path) if _PHASE.fullmatch(n)]
    return sorted(names, key=lambda n: int(n[len("phase"):]))

  def steps(self, which: str = CHECKPOINTS) -> list[int]:
    """The step folders in `checkpoints/` (or `best/`), in order: the names orbax gives a
    finished save (an unfinished one carries a suffix)."""
    if which not in (CHECKPOINTS, BEST):
      raise ValueError(f"{which!r}: steps are in {CHECKPOINTS!r} or {BEST!r}")
    return sorted(int(n) for n in self._list(self._at(which)) if _STEP.fullmatch(n))

  def read_results(self) -> dict[str, Any] | None:
    """results.json's object; None when missing or damaged (not JSON, not an object)."""
    return read_dict(self.results)

  def read_config(self) -> dict[str, Any] | None:
    """config.json's object; None when missing or damaged."""
    return read_dict(self.config)

  def finished(self, staged_phases: int = 0) -> bool:
    """Whether the run has its results: its own results.json, or for a staged config of
    `staged_phases` phases its last phase's. A damaged one does not count."""
    where = self.phase(staged_phases) if staged_phases else self
    return where.read_results() is not None

  def retire_error_log(self) -> None:
    """For a run that finished: an earlier failure's error.log becomes error.previous.log, so
    that a folder holding an error log is one whose last run failed."""
    from lra import storage
    if storage.exists(self.error_log):
      storage.replace(self.error_log, self.error_previous_log)

  @staticmethod
  def _list(folder: str) -> list[str]:
    from lra import storage
    try:
      return storage.listdir(folder)
    except (OSError, ValueError):   # ValueError: a bucket that cannot be used
      return []


def read_dict(path: str) -> dict[str, Any] | None:
  """The JSON object in file `path`; None when it is missing or is not one (not UTF-8, not
  JSON, or JSON of another shape): never raises, so that any folder can be listed."""
  from lra import storage
  try:
    value = storage.read_json(path)
  except (OSError, ValueError):
    return None
  return value if isinstance(value, dict) else None
