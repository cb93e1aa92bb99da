"""The checks `lra run` makes of what the user typed, before anything heavy is imported: the
values of a config (and of each phase of a staged one), overrides that a staged config's phases
would replace, empty names, `--dry_run`'s value and the workdir. Each raises ValueError with one
line that says what to do; `launch.train` prints it and exits with status 2."""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import ml_collections

from lra import identity, phases, schema, storage


def dry_run_steps(value: str | None) -> int | None:
  """The N of `--dry_run=steps:N` (0 for a bare `--dry_run`); None without `--dry_run`."""
  if value is None:
    return None
  head, _, count = value.partition(":")
  if head != "steps" or not count.isdigit():
    raise ValueError(f"--dry_run takes no value or steps:N (N timed steps), got {value!r}.")
  return int(count)


def check_config(config: ml_collections.ConfigDict) -> None:
  """Checks every value of `config` and, for a staged one, of each phase's config (no jax)."""
  if config.get("init_from") and config.get("init_from_hf"):
    raise ValueError(f"config.init_from_hf = {config.init_from_hf!r}: give init_from or "
                     f"init_from_hf, not both (init_from = {config.init_from!r}).")
  schema.check(config)
  for k in range(len(config.get("phases") or ())):
    schema.check(phases.phase_config(config, k), context=f"config.phases[{k}] gives ")


# The fields each phase of a staged config sets itself (lra/phases.py `phase_config`).
PHASE_FIELDS = {"num_train_steps": "steps", "data.max_length": "max_length",
                "learning_rate": "learning_rate", "batch_size": "batch_size",
                "warmup_steps": "warmup_steps"}


def check_phase_overrides(config: ml_collections.ConfigDict,
                          overrides: Sequence[tuple[str, str]]) -> None:
  """An override of a field that every phase of a staged config sets itself would be silently
  replaced by the phases: refused, naming the phases' values and how to change them. The two
  phases of `protocol=spt` are made from these fields after the overrides
  (`configs.common.apply_protocol`), so its overrides stand."""
  if not config.get("phases") or config.get("protocol", "scratch") == "spt":
    return
  for field, _ in overrides:
    key = PHASE_FIELDS.get(field)
    if key is None:
      continue
    values = ", ".join(f"{dict(p)[key]}" for p in config.phases)
    raise ValueError(
        f"--config.{field}: {config.task} ({identity.label(config)}) is staged, and each of "
        f"its {len(config.phases)} phases sets its own {key} ({values}), which would replace "
        f"it; change the phases instead (--config.phases=...), or pass "
        f"--config.phases=\"()\" to train the top-level fields in one phase.")


def _check_names(args: argparse.Namespace) -> None:
  """An empty `--attention` or `--size` is refused (not taken for the default)."""
  for flag, what in (("attention", "an attention kind (`lra list` lists them)"),
                     ("size", "one of the task's sizes (`lra run --help` lists them)")):
    value = getattr(args, flag, None)
    if value is not None and not str(value).strip():
      raise ValueError(f"--{flag} is empty: give {what}, or leave the flag out for the "
                       f"task's default.")


def check_workdir(workdir: str) -> None:
  """A local workdir must be a folder this process can create and write in: a file, or a
  folder under a read-only or virtual file system (/proc), is refused in one line."""
  if storage.is_remote(workdir):
    return
  path = storage.resolve(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"--workdir {workdir} is a file, not a folder: pass a folder for the "
                     f"run's files.")
  existing = path   # nothing is created here: the nearest existing folder is probed
  while not os.path.exists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  probe = os.path.join(existing, f".lra-write-check-{os.getpid()}")
  try:
    if not os.path.isdir(existing):
      raise NotADirectoryError(20, f"{existing} is a file")
    with open(probe, "w") as f:
      f.write("")
    os.remove(probe)
  except OSError as e:
    reason = e.strerror or type(e).__name__
    raise ValueError(f"--workdir {workdir} cannot be written ({reason}): pass a folder that "
                     f"this user can create and write in.") from None
