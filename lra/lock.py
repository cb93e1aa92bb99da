"""One run per workdir: a lock file that names its holder and is taken over only when it is gone.

`<workdir>/lock` holds JSON `{"host", "pid", "started", "token"}` (the token tells a holder its
own record), created with O_EXCL by process 0 of a run. Another run on the same workdir stops
with one line naming the holder. A lock whose holder is on this host and no longer alive (a run
killed with SIGKILL, or a machine that rebooted) is taken over. The holder's process on another
host cannot be checked from here, so the holder keeps a heartbeat: a thread touches the lock (its
mtime) every `HEARTBEAT_S` seconds, and a lock from another host whose heartbeat stopped
`STALE_AFTER` seconds ago (four missed beats: a job killed with SIGKILL, a node that died) is
taken over.

In a multi-process run only process 0 takes the lock, and the others must learn its outcome
before any collective, or a refusal leaves them waiting in one until jax's shutdown barrier
gives up minutes later. `WorkdirLock(..., agree=...)` does that: every process calls `acquire`,
process 0 tries, and `agree(refused)` (lra/mesh.py `any_process`, an all-reduce over the
processes) tells every process whether it was refused; the others then raise the same one-line
WorkdirBusy, reading the holder from the lock file themselves.

In a `gs://` bucket there is no O_EXCL, so the lock is an object written with GCS's generation
preconditions (`_BucketLockFile`, raw JSON-API requests through gcsfs's session): it is created
with `ifGenerationMatch=0` (only if absent), a stale one is taken over by overwriting it with
`ifGenerationMatch=<the generation read>` (so two runs taking it over at once cannot both win,
and a holder that beat meanwhile keeps it), the heartbeat rewrites it with the generation it
wrote last, and the release deletes it only while it is still the holder's. The heartbeat is the
object's `updated` time (the server's clock), compared with this host's: hosts kept in time by
NTP differ by far less than `STALE_AFTER`. The same-host rule (a dead pid on this host) applies
too. Other remote stores (`s3://`, ...) are not locked.

`process_alive` is the one liveness check of a process on this host, and `live_holder` says
which live process on this host holds a workdir: `lra sweep` and `lra results` read locks
through it to tell a running run from an interrupted one.
"""

from __future__ import annotations

import calendar
import errno
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any, Callable
from lra.rundir import RunDir

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


def _parse(text: str | bytes) -> dict:
  try:
    holder = json.loads(text)
  except ValueError:
    return {}
  return holder if isinstance(holder, dict) else {}


class _LocalLockFile:
  """`<workdir>/lock` on a local (or network) disk: O_EXCL, mtime as the heartbeat."""

  def __init__(self, path: str):
    self.path = path

  def read(self) -> tuple[dict, float | None] | None:
    """(holder record, time of its last beat or None), or None when there is no lock."""
    try:
      with open(self.path) as f:
        text = f.read()
      beat = os.path.getmtime(self.path)
    except FileNotFoundError:
      return None
    except OSError:
      return {}, None
    return _parse(text), beat

  def create(self, record: dict) -> bool:
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w") as f:
      json.dump(record, f)
    return True

  def take_over(self, record: dict) -> bool:
    try:
      os.remove(self.path)
    except FileNotFoundError:
      pass
    return self.create(record)

  def beat(self) -> None:
    try:
      os.utime(self.path)
    except OSError as e:
      if e.errno != errno.ENOENT:
        raise

  def remove(self) -> None:
    os.remove(self.path)


class _BucketLockFile:
  """`gs://.../lock`: an object written with generation preconditions (module docstring).

  `generation` is that of the object this process read or wrote last: the precondition of its
  next take-over, beat or delete. A precondition that fails is a 412, which gcsfs raises as
  FileExistsError."""

  def __init__(self, path: str):
    from lra import storage
    storage.check_remote(path)   # one line for no gcsfs, no bucket, no credentials
    self.path = path
    self.fs = storage.remote_filesystem(path)
    self.bucket, _, self.key = path[len("gs://"):].partition("/")
    self.generation: str | None = None
    self._writing = threading.Lock()   # the heartbeat thread and the loop's beat at saves

  def _call(self, method: str, path: str, *args, **kwargs) -> Any:
    return self.fs.call(method, path, *args, **kwargs)

  def read(self) -> tuple[dict, float | None] | None:
    try:
      meta = self._call("GET", "b/{}/o/{}", self.bucket, self.key, json_out=True)
      _, data = self._call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media",
                           generation=meta["generation"])
    except FileNotFoundError:
      return None
    self.generation = str(meta["generation"])
    return _parse(data), _rfc3339(meta.get("updated"))

  def _upload(self, record: dict, generation: str) -> bool:
    meta = json.dumps({"name": self.key, "contentType": "application/json"})
    body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
            f"Content-Type: application/json\n\n{json.dumps(record)}\n--==0==--").encode()
    try:
      upload = f"{self.fs._location}/upload/storage/v1/b/{self.bucket}/o"  # noqa: SLF001
      out = self._call("POST", upload, uploadType="multipart", data=body, json_out=True,
                       headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                       ifGenerationMatch=generation)
    except FileExistsError:   # 412: the object is not (or no longer) at that generation
      return False
    self.generation = str(out["generation"])
    return True

  def create(self, record: dict) -> bool:
    return self._upload(record, "0")

  def take_over(self, record: dict) -> bool:
    return self.generation is not None and self._upload(record, self.generation)

  def beat(self, record: dict | None = None) -> None:
    with self._writing:
      if self.generation is not None and record is not None and \
          not self._upload(record, self.generation):
        self.generation = None   # taken over by another run: nothing of ours to beat or delete

  def remove(self) -> None:
    try:
      self._call("DELETE", "b/{}/o/{}", self.bucket, self.key,
                 ifGenerationMatch=self.generation)
    except (FileNotFoundError, FileExistsError):
      pass
    self.generation = None


def _rfc3339(stamp: str | None) -> float | None:
  """Seconds since the epoch of a GCS time stamp (`2026-11-26T23:17:41.389Z`)."""
  if not stamp:
    return None
  whole, _, fraction = stamp.rstrip("Z").partition(".")
  return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + \
      float(f"0.{fraction or 0}")


def lock_file(workdir: str) -> _LocalLockFile | _BucketLockFile | None:
  """The lock of `workdir`: a local file, a bucket object (`gs://`), or None (other stores)."""
  path = RunDir(workdir).lock
  if workdir.startswith("gs://"):
    return _BucketLockFile(path)
  return None if "://" in workdir else _LocalLockFile(path)


def read_holder(workdir: str) -> dict | None:
  """The record in `<workdir>/lock`: None when there is no lock, {} when it cannot be read (a
  crash, or a holder still writing it)."""
  f = lock_file(workdir)
  found = f.read() if f is not None else None
  return None if found is None else found[0]


def live_holder(workdir: str) -> int | None:
  """The pid of the live process on this host that holds `<workdir>/lock`, else None (no lock,
  an unreadable one, a holder that is gone, or one on another host, which cannot be checked)."""
  holder = read_holder(workdir)
  if not holder or "pid" not in holder or holder.get("host") != socket.gethostname():
    return None
  pid = int(holder["pid"])
  return pid if process_alive(pid) else None


def busy_message(path: str, holder: dict) -> str:
  return (f"{path.rpartition('/')[0]} is in use by another run (pid {holder.get('pid')} on "
          f"{holder.get('host')}, started {holder.get('started')}); wait for it to finish, stop "
          f"it, or use another --workdir (delete {path} only if that run is gone).")


def refusal(workdir: str) -> str | None:
  """The one line a run on `workdir` would be refused with now (a live holder: on this host, or
  on another whose heartbeat is fresh), else None. Advisory (the lock itself decides): a SLURM
  task checks it before importing jax, so that a job on a busy workdir ends in seconds."""
  lock = WorkdirLock(workdir)
  if lock.file is None:
    return None
  found = lock.file.read()
  if not found or lock._stale(*found):
    return None
  return busy_message(lock.path, found[0])


def run_refusal(workdir: str) -> str | None:
  """`refusal` for a run's local folder and each of its phase folders (a staged run locks each
  phase's); None for a bucket's (its lock decides when taken)."""
  if "://" in workdir:
    return None
  for name in [""] + RunDir(workdir).phase_names():
    busy = refusal(os.path.join(workdir, name) if name else workdir)
    if busy:
      return busy
  return None


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

  `enabled`: whether this process takes the lock (process 0 of a run on a local or `gs://`
  workdir; other remote stores have no lock).
  `agree(refused) -> bool`: with several processes, whether any process was refused (called by
  every process of the run, at the same point); None with one process.
  """

  def __init__(self, workdir: str, *, enabled: bool = True, stale_after: float = STALE_AFTER,
               heartbeat_s: float = HEARTBEAT_S,
               agree: Callable[[bool], bool] | None = None):
    self.file = lock_file(workdir)
    self.path = self.file.path if self.file is not None else RunDir(workdir).lock
    self.enabled = enabled and self.file is not None
    self.stale_after = stale_after
    self.heartbeat_s = heartbeat_s
    self.agree = agree
    self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "token": secrets.token_hex(8)}
    self._beating: threading.Event | None = None

  def _holder(self) -> dict | None:
    found = self.file.read() if self.file is not None else None
    return None if found is None else found[0]   # {}: unreadable, treated as stale

  def _stale(self, holder: dict, beat: float | None) -> bool:
    if not holder or "pid" not in holder:
      return True
    if holder.get("host") == self.record["host"]:
      return int(holder["pid"]) == os.getpid() or not process_alive(int(holder["pid"]))
    # on another host: its heartbeat
    return beat is None or time.time() - beat > self.stale_after

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
                        f"{self.path.rpartition('/')[0]} is in use by another run (process 0 "
                        f"of this run was refused its lock).")
    if refusal is not None:
      raise refusal
    if self.enabled:
      self._start_heartbeat()

  def _take(self) -> None:
    for _ in range(3):
      if self.file.create(self.record):
        return
      found = self.file.read()
      if found is None:
        continue          # released meanwhile: try again
      if found[0].get("token") == self.record["token"]:
        return            # our own create, whose answer was lost and retried
      if not self._stale(*found):
        raise WorkdirBusy(busy_message(self.path, found[0])) from None
      if self.file.take_over(self.record):   # its holder is gone
        return
    raise WorkdirBusy(f"could not take {self.path}: other runs keep creating it.")

  def _start_heartbeat(self) -> None:
    stop = self._beating = threading.Event()

    def beat():
      while not stop.wait(self.heartbeat_s):
        self.heartbeat()

    threading.Thread(target=beat, name="workdir-lock-heartbeat", daemon=True).start()

  def heartbeat(self) -> None:
    """Marks the lock as live (a local file's mtime, a bucket object's rewrite), for runs on
    other hosts."""
    if not self.enabled:
      return
    if isinstance(self.file, _BucketLockFile):
      self.file.beat(self.record)
    else:
      self.file.beat()

  def release(self) -> None:
    if self._beating is not None:
      self._beating.set()
      self._beating = None
    if not self.enabled:
      return
    holder = self._holder()
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == self.record["host"]:
      self.file.remove()

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> bool:
    self.release()
    return False
