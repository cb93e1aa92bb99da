"""One run per workdir: a lock file that names its holder and is taken over only when it is gone.

`<workdir>/lock` holds JSON `{"host", "pid", "started"}`, created with O_EXCL by process 0 of a
run. Another run on the same workdir stops with one line naming the holder. A lock whose holder
is on this host and no longer alive (a run killed with SIGKILL, or a machine that rebooted) is
taken over. The holder's process on another host cannot be checked from here, so the holder
keeps a heartbeat: a thread touches the lock (its mtime) every `HEARTBEAT_S` seconds, and a lock
from another host whose heartbeat stopped `STALE_AFTER` seconds ago (four missed beats: a job
killed with SIGKILL, a node that died) is taken over.

In a multi-process run only process 0 takes the lock, and the others must learn its outcome
before any collective, or a refusal leaves them waiting in one until jax's shutdown barrier
gives up minutes later. `WorkdirLock(..., agree=...)` does that: every process calls `acquire`,
process 0 tries, and `agree(refused)` (lra/mesh.py `any_process`, an all-reduce over the
processes) tells every process whether it was refused; the others then raise the same one-line
WorkdirBusy, reading the holder from the lock file themselves.

`process_alive` is the one liveness check of a process on this host, and `live_holder` says
which live process on this host holds a workdir: `lra sweep` and `lra results` read locks
through it to tell a running run from an interrupted one.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from typing import Callable

HEARTBEAT_S = 30.0
STALE_AFTER = 4 * HEARTBEAT_S


class WorkdirBusy(RuntimeError):
  """Another live run holds the workdir."""


def process_alive(pid: int) -> bool:
  """Whether process `pid` exists on this host and has not exited.

  A PermissionError from the probe means the process exists (it belongs to another user); a
  zombie (exited, not yet reaped by its parent) counts as exited.
  """
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  try:
    with open(f"/proc/{pid}/stat") as f:
      if f.read().rpartition(")")[2].split()[0] == "Z":
        return False
  except (OSError, IndexError):
    pass   # no /proc (not Linux), or the process ended meanwhile: the probe said it existed
  return True


def read_holder(workdir: str) -> dict | None:
  """The record in `<workdir>/lock`: None when there is no lock, {} when it cannot be read (a
  crash, or a holder still writing it)."""
  try:
    with open(os.path.join(workdir, "lock")) as f:
      holder = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError):
    return {}
  return holder if isinstance(holder, dict) else {}


def live_holder(workdir: str) -> int | None:
  """The pid of the live process on this host that holds `<workdir>/lock`, else None (no lock,
  an unreadable one, a holder that is gone, or one on another host, which cannot be checked)."""
  holder = read_holder(workdir)
  if not holder or "pid" not in holder or holder.get("host") != socket.gethostname():
    return None
  pid = int(holder["pid"])
  return pid if process_alive(pid) else None


def busy_message(path: str, holder: dict) -> str:
  return (f"{os.path.dirname(path)} is in use by another run (pid {holder.get('pid')} on "
          f"{holder.get('host')}, started {holder.get('started')}); wait for it to finish, stop "
          f"it, or use another --workdir (delete {path} only if that run is gone).")


def refusal(workdir: str) -> str | None:
  """The one line a run on `workdir` would be refused with now (a live holder: on this host, or
  on another whose heartbeat is fresh), else None. Advisory (the lock itself decides): a SLURM
  task checks it before importing jax, so that a job on a busy workdir ends in seconds."""
  lock = WorkdirLock(workdir)
  holder = lock._holder()
  if not holder or lock._stale(holder):
    return None
  return busy_message(lock.path, holder)


def exit_if_busy(argv: list[str]) -> None:
  """For a task's `lra run` argv with `--workdir PATH` (local): exits with the one-line refusal
  (status 2) when the workdir is busy."""
  for i, a in enumerate(argv[:-1]):
    if a == "--workdir" and "://" not in argv[i + 1]:
      message = refusal(argv[i + 1])
      if message:
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds `<workdir>/lock` for the duration (no-op if disabled).

  `enabled`: whether this process takes the lock (process 0 of a run on a local workdir).
  `agree(refused) -> bool`: with several processes, whether any process was refused (called by
  every process of the run, at the same point); None with one process.
  """

  def __init__(self, workdir: str, *, enabled: bool = True, stale_after: float = STALE_AFTER,
               heartbeat_s: float = HEARTBEAT_S,
               agree: Callable[[bool], bool] | None = None):
    self.path = os.path.join(workdir, "lock")
    self.enabled = enabled
    self.stale_after = stale_after
    self.heartbeat_s = heartbeat_s
    self.agree = agree
    self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    self._beating: threading.Event | None = None

  def _holder(self) -> dict | None:
    return read_holder(os.path.dirname(self.path))   # {}: unreadable, treated as stale

  def _stale(self, holder: dict) -> bool:
    if not holder or "pid" not in holder:
      return True
    if holder.get("host") == self.record["host"]:
      return int(holder["pid"]) == os.getpid() or not process_alive(int(holder["pid"]))
    try:   # on another host: its heartbeat
      return time.time() - os.path.getmtime(self.path) > self.stale_after
    except OSError:
      return True

  def acquire(self) -> None:
    """Takes the lock (process 0), or raises WorkdirBusy in every process of the run."""
    refusal = None
    if self.enabled:
      try:
        self._take()
      except WorkdirBusy as e:
        refusal = e
    if self.agree is not None and self.agree(refusal is not None) and refusal is None:
      if self.enabled:
        self.release()
      holder = self._holder() or {}
      raise WorkdirBusy(busy_message(self.path, holder) if holder else
                        f"{os.path.dirname(self.path)} is in use by another run (process 0 of "
                        f"this run was refused its lock).")
    if refusal is not None:
      raise refusal
    if self.enabled:
      self._start_heartbeat()

  def _take(self) -> None:
    for _ in range(3):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        holder = self._holder()
        if holder is None:
          continue          # released meanwhile: try again
        if not self._stale(holder):
          raise WorkdirBusy(busy_message(self.path, holder)) from None
        os.remove(self.path)   # its holder is gone: take it over
        continue
      with os.fdopen(fd, "w") as f:
        json.dump(self.record, f)
      return
    raise WorkdirBusy(f"could not take {self.path}: other runs keep creating it.")

  def _start_heartbeat(self) -> None:
    stop = self._beating = threading.Event()

    def beat():
      while not stop.wait(self.heartbeat_s):
        self.heartbeat()

    threading.Thread(target=beat, name="workdir-lock-heartbeat", daemon=True).start()

  def heartbeat(self) -> None:
    """Marks the lock as live (its mtime), for runs on other hosts."""
    if self.enabled:
      try:
        os.utime(self.path)
      except OSError as e:
        if e.errno != errno.ENOENT:
          raise

  def release(self) -> None:
    if self._beating is not None:
      self._beating.set()
      self._beating = None
    if not self.enabled:
      return
    holder = self._holder()
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == self.record["host"]:
      os.remove(self.path)

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> bool:
    self.release()
    return False
