"""A run's files, on the local disk or in a bucket (`gs://...`), through `etils.epath`.

Every file the trainer reads or writes in a workdir (config, metrics, TensorBoard events,
results, phase results, checkpoint folders) goes through these functions, so `--workdir
gs://BUCKET/runs/x` works on a TPU pod: epath reaches buckets through fsspec (`gcsfs` for
`gs://`, installed by `pip install -e '.[gcs]'`), and orbax writes the checkpoints itself.

Local and remote paths differ in what they can do atomically:
  * local: a file is written to `<name>.tmp` and renamed over the old one (`os.replace`), so
    a kill leaves the old or the new file, never half of one; lines are appended in place;
  * remote: an object upload is atomic by itself (the object changes when the upload ends), and
    objects cannot be appended to, so writers keep the lines they wrote and upload the whole
    file again (`LineFile`); renames are a copy and a delete.
A line file's last line cut short (a writer killed while appending it) is dropped before the
next line is added, locally as remotely. A file that is not UTF-8 text, or not JSON where JSON
is read, raises a one-line ValueError naming it (`read_text`, `read_json`).
Only process 0 writes the shared files (the callers check `jax.process_index()`).

Before the first access to a `gs://` bucket, `check_remote` makes sure it can work and raises a
one-line `BucketError` (a ValueError, which the commands print as `error: ...`) otherwise:
gcsfs not installed (the `gcs` extra), a bucket that does not exist (a typo), no credentials
or no access. Without it these end in long tracebacks, or, for a missing bucket, in gcsfs
creating it. `copy_tree` uploads a local folder (a dataset prepared locally, lra data prepare).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from typing import Any

from etils import epath

REMOTE_PREFIXES = ("gs://", "s3://", "az://", "hf://")


def is_remote(path: Any) -> bool:
  """Whether `path` names a bucket (`gs://`, `s3://`, ...) rather than the local disk."""
  return os.fspath(path).startswith(REMOTE_PREFIXES)


class BucketError(ValueError):
  """A bucket that cannot be used: no gcsfs, no such bucket, no credentials or no access."""


def remote_filesystem(path: Any):
  """epath's fsspec filesystem for remote path `path` (gcsfs for `gs://`; BucketError without
  the gcs extra)."""
  if os.fspath(path).startswith("gs://"):
    try:
      import gcsfs  # noqa: F401
    except ImportError:
      raise BucketError(f"{os.fspath(path)} is in Google Cloud Storage, which needs gcsfs: "
                        f"pip install -e '.[gcs]'.") from None
  from etils.epath import backend
  return backend.fsspec_backend.fs(os.fspath(path))


def check_remote(path: Any) -> None:
  """Raises a one-line BucketError when the bucket of `gs://` path `path` cannot be used (once
  per bucket and process; other paths pass)."""
  path = os.fspath(path)
  if path.startswith("gs://"):
    _check_bucket(path[len("gs://"):].split("/")[0])


@functools.lru_cache(maxsize=None)   # a failure raises, so only usable buckets are kept
def _check_bucket(bucket: str) -> None:
  fs = remote_filesystem(f"gs://{bucket}")   # BucketError without gcsfs
  if not hasattr(fs, "call"):
    return   # not gcsfs (a stand-in filesystem registered for gs://)
  from gcsfs.retry import HttpError
  try:
    fs.call("GET", "b/{}/o", bucket, maxResults=1, json_out=True)
  except FileNotFoundError:
    raise BucketError(f"bucket gs://{bucket} does not exist (a typo?); create it (gcloud "
                      f"storage buckets create gs://{bucket}) or name another.") from None
  except (HttpError, OSError) as e:
    code = getattr(e, "code", None)
    text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    method = getattr(getattr(fs, "credentials", None), "method", None)
    if code == 401 or (method == "anon" and (code == 403 or "Forbidden" in text)):
      raise BucketError(f"no credentials for gs://{bucket} ({text}): run `gcloud auth "
                        f"application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS "
                        f"to a service account key file.") from None
    if code == 403 or "Forbidden" in text:
      raise BucketError(f"no access to gs://{bucket} with the credentials found ({text}): "
                        f"grant them storage access to the bucket.") from None
    raise BucketError(f"gs://{bucket} cannot be reached: {type(e).__name__}: {text}") from None


def copy_tree(src: str, dst: Any, *, last: str | None = None) -> int:
  """Copies local folder `src` to `dst` (a bucket folder, or a local one), file by file, the
  file named `last` (e.g. a dataset's `dataset_info.json`, by which readers know it is whole)
  after all others; returns the number of files copied."""
  files = sorted(os.path.relpath(os.path.join(folder, name), src)
                 for folder, _, names in os.walk(src) for name in names)
  files.sort(key=lambda rel: os.path.basename(rel) == last)   # stable: `last` moves to the end
  remote = is_remote(dst)
  fs = remote_filesystem(dst) if remote else None
  for rel in files:
    target = join(dst, *rel.split(os.sep))
    if remote:
      check_remote(target)
      fs.put_file(os.path.join(src, rel), target)
    else:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.copyfile(os.path.join(src, rel), target)
  return len(files)


def _path(path: Any) -> epath.Path:
  check_remote(path)
  return epath.Path(path)


def resolve(path: Any) -> str:
  """A workdir as given by the user -> the string used everywhere after: local paths absolute
  (with `~` expanded), remote ones unchanged."""
  path = os.fspath(path)
  return path if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def join(*parts: Any) -> str:
  """`os.path.join` that also joins remote paths."""
  return os.fspath(epath.Path(parts[0]).joinpath(*parts[1:])) if is_remote(parts[0]) else \
      os.path.join(*parts)


def exists(path: Any) -> bool:
  return _path(path).exists()


def isdir(path: Any) -> bool:
  return _path(path).is_dir()


def makedirs(path: Any) -> None:
  _path(path).mkdir(parents=True, exist_ok=True)


def listdir(path: Any) -> list[str]:
  """Names in folder `path` (empty when it does not exist)."""
  p = _path(path)
  return sorted(child.name for child in p.iterdir()) if p.is_dir() else []


def rmtree(path: Any) -> None:
  p = _path(path)
  if p.is_dir():
    p.rmtree()
  elif p.exists():
    p.unlink()


def read_text(path: Any) -> str | None:
  """The file's text, or None when it does not exist. A file that is not UTF-8 text raises a
  one-line ValueError naming it and the first bad byte."""
  p = _path(path)
  if not p.exists():
    return None
  data = p.read_bytes()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    raise ValueError(f"{os.fspath(path)} is not UTF-8 text (byte 0x{data[e.start]:02x} on line "
                     f"{line}): a damaged file; repair that line, or move the file away "
                     f"(the run then writes it afresh).") from None


def read_bytes(path: Any) -> bytes | None:
  """The file's bytes, or None when it does not exist."""
  p = _path(path)
  return p.read_bytes() if p.exists() else None


def walk(top: Any):
  """`os.walk(top)` (top-down; the caller may prune `dirs` in place), also in a bucket, where
  each folder is listed afresh (no listing cache: other processes write there)."""
  top = os.fspath(top)
  if not is_remote(top):
    yield from os.walk(top)
    return
  check_remote(top)
  fs = remote_filesystem(top)
  stack = [top.rstrip("/")]
  while stack:
    base = stack.pop()
    try:
      entries = fs.ls(base, detail=True, refresh=True) if hasattr(fs, "call") else \
          fs.ls(base, detail=True)
    except FileNotFoundError:
      continue
    dirs, files = [], []
    for entry in entries:
      name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
      if name:
        (dirs if entry["type"] == "directory" else files).append(name)
    dirs.sort()
    files.sort()
    yield base, dirs, files
    stack.extend(f"{base}/{d}" for d in reversed(dirs))


def write_text(path: Any, text: str) -> None:
  """Writes `text` so that a reader (or a kill) sees the old file or the new one, whole."""
  if is_remote(path):
    _path(path).write_text(text)   # an object changes when its upload completes
    return
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_json(path: Any, obj: Any) -> None:
  write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str))


def read_json(path: Any) -> Any:
  """The parsed file, or None when it does not exist."""
  text = read_text(path)
  if text is None:
    return None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{os.fspath(path)} is not valid JSON (line {e.lineno} column {e.colno}: "
                     f"{e.msg}): a damaged file; repair it, or move it away.") from None


def append_text(path: Any, text: str) -> None:
  """Adds `text` at the end of the file (remote: the file is read and uploaded whole)."""
  if is_remote(path):
    epath.Path(path).write_text((read_text(path) or "") + text)
  else:
    with open(path, "a") as f:
      f.write(text)


def replace(src: Any, dst: Any) -> None:
  """Renames `src` over `dst` (remote: a copy, then the source is deleted)."""
  if is_remote(src):
    _path(src).copy(dst, overwrite=True)
    epath.Path(src).unlink()
  else:
    os.replace(src, dst)


def _drop_partial_line(path: str) -> None:
  """Truncates a local file after its last newline: a line cut short (a writer killed while
  appending it) is removed, so the next line starts on a line of its own."""
  try:
    f = open(path, "rb+")
  except FileNotFoundError:
    return
  with f:
    size = f.seek(0, os.SEEK_END)
    end = size
    while end > 0:
      start = max(0, end - 65536)
      f.seek(start)
      chunk = f.read(end - start)
      cut = chunk.rfind(b"\n")
      if cut >= 0:
        end = start + cut + 1
        break
      end = start
    if end != size:
      f.truncate(end)


class LineFile:
  """A text file that grows by lines (metrics.jsonl). Locally each line is appended in place;
  remotely, where objects cannot grow, the file's lines are kept and uploaded whole each time
  (a metrics file holds thousands of lines at most)."""

  def __init__(self, path: Any):
    self.path = os.fspath(path)
    self.remote = is_remote(self.path)
    # Remote: the file's lines, read once; local: [] once the file's end was checked.
    self._lines: list[str] | None = None

  def append(self, line: str) -> None:
    if not self.remote:
      if self._lines is None:   # once: a last line cut short is dropped, as remotely
        _drop_partial_line(self.path)
        self._lines = []
      with open(self.path, "a") as f:
        f.write(line + "\n")
      return
    if self._lines is None:
      text = read_text(self.path) or ""
      self._lines = text.splitlines(keepends=True)
      if self._lines and not self._lines[-1].endswith("\n"):
        self._lines.pop()   # a line cut short, as read_metrics leaves it out
    self._lines.append(line + "\n")
    write_text(self.path, "".join(self._lines))

  def rewrite(self, lines: list[str]) -> None:
    """Replaces the file by `lines` (each without its newline), atomically."""
    write_text(self.path, "".join(line + "\n" for line in lines))
    if self.remote:
      self._lines = [line + "\n" for line in lines]


class _EventFile:
  """A TensorBoard event file in a bucket: the bytes written so far, uploaded whole on each
  flush (what tensorboardX's own gs:// writer does, here through epath instead of the
  google-cloud-storage client)."""

  def __init__(self, path: str):
    self.path = path
    self.data = bytearray()
    self.flushed = 0

  def write(self, data: bytes) -> None:
    self.data += data

  def flush(self) -> None:
    if len(self.data) != self.flushed:
      epath.Path(self.path).write_bytes(bytes(self.data))
      self.flushed = len(self.data)

  def close(self) -> None:
    self.flush()


class _EventFiles:
  def open(self, path: str) -> _EventFile:
    return _EventFile(path)

  def directory_check(self, path: str) -> None:
    del path   # buckets have no folders to create


def register_tensorboard_writers() -> None:
  """Makes tensorboardX write `gs://`, `s3://` ... event files through epath."""
  from tensorboardX import record_writer
  for prefix in REMOTE_PREFIXES:
    record_writer.register_writer_factory(prefix.split(":")[0], _EventFiles())
