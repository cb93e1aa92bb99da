"""A run's folder as `lra sweep` and `lra results` read it: finished, running or neither.

A run folder holds the trainer's files (`config.json`, `results.json`, `lock`, ...) or, for a
staged run, one folder per phase (`phase1/`, `phase2/`, ...); a sweep adds `sweep.json` (its
command and attempts) and `log.txt` (the output of every attempt). A run has finished when it
has its `results.json` (a staged one, its last phase's); it is running when a live process on
this host holds its lock (lra/lock.py) or is the sweep's unfinished last attempt. Pure Python.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any

from lra import lock, storage

RECORD = "sweep.json"   # per run: the command and its attempts
LOG = "log.txt"         # per run: the output of every attempt, appended
_PHASE = re.compile(r"phase(\d+)")


def phase_dirs(path: str) -> list[str]:
  """The phase folders of a staged run (`phase1`, `phase2`, ...), in order."""
  try:
    names = [n for n in os.listdir(path) if _PHASE.fullmatch(n)]
  except OSError:
    return []
  return sorted(names, key=lambda n: int(n[5:]))


def finished(run_dir: str, staged_phases: int = 0) -> bool:
  """Whether the run has its results: `results.json`, or the last phase's for a staged one
  (`staged_phases`: the number of phases of a staged config, 0 for none)."""
  parts = [f"phase{staged_phases}"] if staged_phases else []
  return storage.exists(storage.join(run_dir, *parts, "results.json"))


def read_record(run_dir: str) -> dict[str, Any]:
  """The sweep's record of the run (`sweep.json`), {} when there is none."""
  record = storage.read_json(os.path.join(run_dir, RECORD))
  return record if isinstance(record, dict) else {}


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
