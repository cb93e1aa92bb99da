"""One run per workdir: a lock file that names its holder and is taken over only when it is gone.

`<workdir>/lock` holds JSON `{"host", "pid", "started"}`, created with O_EXCL by process 0 of a
run. Another run on the same workdir stops with one line naming the holder. A lock whose holder
is on this host and no longer alive (a run killed with SIGKILL, or a machine that rebooted) is
taken over; a lock held from another host is taken over only when it is older than
`stale_after` seconds (its heartbeat, rewritten at every checkpoint, stopped), since its process
cannot be checked from here.

`process_alive` is the one liveness check of a process on this host, and `live_holder` says
which live process on this host holds a workdir: `lra sweep` and `lra results` read locks
through it to tell a running run from an interrupted one.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time

STALE_AFTER = 6 * 3600.0


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


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds `<workdir>/lock` for the duration (no-op if disabled)."""

  def __init__(self, workdir: str, *, enabled: bool = True, stale_after: float = STALE_AFTER):
    self.path = os.path.join(workdir, "lock")
    self.enabled = enabled
    self.stale_after = stale_after
    self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S")}

  def _holder(self) -> dict | None:
    return read_holder(os.path.dirname(self.path))   # {}: unreadable, treated as stale

  def _stale(self, holder: dict) -> bool:
    if not holder or "pid" not in holder:
      return True
    if holder.get("host") == self.record["host"]:
      return int(holder["pid"]) == os.getpid() or not process_alive(int(holder["pid"]))
    try:
      return time.time() - os.path.getmtime(self.path) > self.stale_after
    except OSError:
      return True

  def acquire(self) -> None:
    if not self.enabled:
      return
    for _ in range(3):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        holder = self._holder()
        if holder is None:
          continue          # released meanwhile: try again
        if not self._stale(holder):
          raise WorkdirBusy(
              f"{os.path.dirname(self.path)} is in use by another run (pid {holder['pid']} on "
              f"{holder.get('host')}, started {holder.get('started')}); wait for it to finish, "
              f"stop it, or use another --workdir (delete {self.path} only if that run is "
              f"gone).") from None
        os.remove(self.path)   # its holder is gone: take it over
        continue
      with os.fdopen(fd, "w") as f:
        json.dump(self.record, f)
      return
    raise WorkdirBusy(f"could not take {self.path}: other runs keep creating it.")

  def heartbeat(self) -> None:
    """Marks the lock as live (its mtime), for holders on other hosts."""
    if self.enabled:
      try:
        os.utime(self.path)
      except OSError as e:
        if e.errno != errno.ENOENT:
          raise

  def release(self) -> None:
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
