"""A run's folder as `lra sweep` and `lra results` read it: finished, running or neither.

A run folder holds the trainer's files (`config.json`, `results.json`, `lock`, ...) or, for a
staged run, one folder per phase (`phase1/`, `phase2/`, ...); a sweep adds `sweep.json` (its
command and attempts) and `log.txt` (the output of every attempt). A run has finished when it
has its `results.json` (a staged one, its last phase's); it is running when a live process on
this host holds its lock (lra/lock.py) or is the sweep's unfinished last attempt. Pure Python.

A finished run is never rewritten (`rerun_of_finished`): `lra run` in the workdir of a finished
run compares the command's config with the saved `config.json`. Unchanged, the stored result is
shown and nothing is touched; only `num_train_steps` raised, the run continues from its last
checkpoint to the new count; anything else (fewer steps, another field) is refused in one line
naming the fields, since the run's checkpoints, metrics and results would then describe two
different runs.
"""

from __future__ import annotations

import json
import os
import re
import socket
from typing import Any

from launch.values import flatten, value_text
from lra import identity, lock, storage
from lra import rundir
from lra.rundir import RunDir

# Fields that change how a run reports, not what it trains: a finished run may be shown with
# other values of them.
NOT_RUN_FIELDS = ("progress", "peer_timeout_s")
RECORD = "sweep.json"   # per run: the command and its attempts
LOG = "log.txt"         # per run: the output of every attempt, appended


def phase_dirs(path: str) -> list[str]:
  """The phase folders of a staged run (`phase1`, `phase2`, ...), in order."""
  return RunDir(path).phase_names()


read_dict = rundir.read_dict


def finished(run_dir: str, staged_phases: int = 0) -> bool:
  """Whether the run has its results: a `results.json` holding a JSON object, or the last
  phase's for a staged one (`staged_phases`: the number of phases of a staged config, 0 for
  none). A damaged one does not count: rerunning the run writes it again."""
  return RunDir(run_dir).finished(staged_phases)


def read_record(run_dir: str) -> dict[str, Any]:
  """The sweep's record of the run (`sweep.json`), {} when there is none (or it is damaged)."""
  return read_dict(os.path.join(run_dir, RECORD)) or {}


def _runs(pid: int, command_has: str) -> bool:
  """Whether process `pid`'s command line holds `command_has` (True where /proc is absent)."""
  path = f"/proc/{pid}/cmdline"
  if not os.path.exists(path):
    return True
  try:
    with open(path, "rb") as f:
      return command_has.encode() in f.read()
  except OSError:
    return False


def live_pid(run_dir: str) -> int | None:
  """A live process on this host running `run_dir`: the holder of its `lock` (or a phase's, see
  lra/lock.py), or the process of the sweep's unfinished last attempt."""
  for d in [run_dir] + [os.path.join(run_dir, d) for d in phase_dirs(run_dir)]:
    pid = lock.live_holder(d)
    if pid is not None:
      return pid
  last = (read_record(run_dir).get("attempts") or [{}])[-1]
  if "pid" in last and "exit_code" not in last and last.get("host") == socket.gethostname():
    pid = int(last["pid"])   # a recorded pid may since belong to another program
    if lock.process_alive(pid) and _runs(pid, "launch.cli"):
      return pid
  return None


def last_line(path: str) -> str:
  """The last non-empty line of a text file ('' when there is none)."""
  try:
    with open(path, "rb") as f:
      f.seek(max(0, os.path.getsize(path) - 8192))
      text = f.read().decode("utf-8", "replace")
  except OSError:
    return ""
  lines = [x.strip() for x in re.split(r"[\r\n]", text) if x.strip()]
  return lines[-1] if lines else ""


def finished_results(run_dir: str) -> dict[str, Any] | None:
  """The results of a finished (unstaged) run in `run_dir`: its `results.json`, when it parses
  to a record of the steps that `config.json` asks for; None otherwise (not started, running,
  or continuing to a higher step count, whose results.json is the shorter run's; a damaged
  results.json, which the rerun writes again)."""
  results = RunDir(run_dir).read_results()
  if results is None or not isinstance(results.get("steps"), int):
    return None
  saved = RunDir(run_dir).read_config()
  if saved is not None and saved.get("num_train_steps") != results["steps"]:
    return None
  return results


def config_differences(saved: dict[str, Any], config: dict[str, Any]) -> list[str]:
  """`field: old -> new` for each field of two configs (as config.json holds them) that
  differs, leaving out NOT_RUN_FIELDS."""
  before, after = flatten(identity.upgraded(saved)), flatten(config)
  missing = "(absent)"
  out = []
  for key in sorted(set(before) | set(after)):
    if key in NOT_RUN_FIELDS:
      continue
    old, new = before.get(key, missing), after.get(key, missing)
    if old != new:
      text = lambda v: v if v is missing else value_text(v)  # noqa: E731
      out.append(f"{key}: {text(old)} -> {text(new)}")
  return out


def rerun_of_finished(config_json: str, run_dir: str) -> tuple[str, dict[str, Any] | None]:
  """What `lra run` does in `run_dir` with the config whose `config.json` text is
  `config_json`: ("new", None) when the folder holds no finished run (train or resume),
  ("same", results) when it holds this run finished (show its results, change nothing),
  ("more", results) when only num_train_steps is higher (continue from the last checkpoint).
  Raises ValueError (one line naming the fields and what to do) for any other change; nothing
  is written."""
  results = finished_results(run_dir)
  if results is None:
    return "new", None
  config = json.loads(config_json)
  saved = storage.read_json(RunDir(run_dir).config)
  if not isinstance(saved, dict):   # a run of an earlier version without its config: steps
    saved = {**config, "num_train_steps": results["steps"]}
  changed = config_differences(saved, config)
  steps = [x for x in changed if x.startswith("num_train_steps:")]
  others = [x for x in changed if not x.startswith("num_train_steps:")]
  if not changed:
    return "same", results
  new_steps = config.get("num_train_steps")
  if not others and isinstance(new_steps, int) and new_steps > results["steps"]:
    return "more", results
  where = RunDir(run_dir).results
  if others:
    fields = "; ".join(steps + others)
    raise ValueError(f"{run_dir} holds a finished run ({where}) whose config differs: "
                     f"{fields}. A finished run is not rewritten: pass a new --workdir for "
                     f"this config (only num_train_steps may be raised, to continue it).")
  raise ValueError(f"{run_dir} holds a finished run of {results['steps']} steps ({where}): "
                   f"{steps[0]} would rewrite it with an earlier step. Pass a new --workdir "
                   f"to train {new_steps} steps (a higher num_train_steps continues this run).")
