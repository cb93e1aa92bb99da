"""The original public data files: where they come from, where they go, and reading them safely.

Every archive is described once by an `Archive` (file name, address, what it is, and its SHA-256
where one is published). `locate(archive, manual_dir, download=...)` returns its path in the
manual directory, downloading it first when asked; otherwise `DataMissingError` names the
address, the file name and the directory to put it in.

Reading verifies an archive end to end in the same pass, before anything is built from it
(`tar_members` yields its last member before the final checks; the builders collect first):
gzip is decompressed to the end of the file, checking the CRC-32 and length in every member's
trailer; each zip member is read to its end (CRC-32 and size checked) with its local header
matching the central directory; the file's SHA-256 is compared with the published one when
known, and remembered (`fingerprint`) so that a dataset records which file it was built from.
Any failure, whatever the library raised, is a `CorruptArchiveError` whose one line names the
file, what is wrong, and where to download it again.

The LRA release (`lra_release.gz`, 8.2 GB: ListOps, AAN, Pathfinder) is read extracted:
`release_path(manual_dir, relpath)` finds `relpath` under `manual_dir/lra_release/` (or the
doubly nested `lra_release/lra_release/`, or `manual_dir`), or extracts just that folder from
the archive into a temporary folder, renamed once the whole archive is read and verified, with
a record of the archive (`EXTRACTED_FROM`; `builders.drop_stale_extraction` removes the
folder once another archive is in place). Temporary folders of killed processes are removed
under `exclusive`, a lock file the kernel releases when its holder dies. Data root
(`$LRA_DATA`, `~/lra_data`): `manual/` holds the archives (or the extracted `lra_release/`),
`<task>/` the tfds datasets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import gzip
import hashlib
import json
import os
import pickle
import shutil
import struct
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from typing import Iterable, Iterator, Mapping

import tqdm

# The data root and default folders, also used from here by the builders and `lra data`.
from lra.data.paths import (DATA_ROOT_ENV, data_root, default_data_dir,  # noqa: F401
                            default_manual_dir)

CHUNK = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
EXTRACTED_FROM = ".lra_extracted_from.json"   # in an extracted folder: the archive's fingerprint


@dataclasses.dataclass(frozen=True)
class Archive:
  """One original public file."""
  filename: str        # the name it has at its source, e.g. "aclImdb_v1.tar.gz"
  url: str             # where to download it
  description: str     # what it is, with its size, for messages and `lra data status`
  sha256: str | None = None   # the published SHA-256 (hex), only where one is published


@dataclasses.dataclass(frozen=True)
class Fingerprint:
  """Which file an archive was: its size and modification time (cheap to compare) and SHA-256."""
  size: int
  mtime_ns: int
  sha256: str


LRA_RELEASE = Archive(
    "lra_release.gz", "https://storage.googleapis.com/long-range-arena/lra_release.gz",
    "the Long Range Arena release (ListOps, AAN, Pathfinder; a tar.gz of 8.2 GB, 18.6 GB "
    "extracted)")
RELEASE_PARENTS = ("lra_release", os.path.join("lra_release", "lra_release"), "")


class DataMissingError(FileNotFoundError):
  """An input file is not where it is expected and could not be downloaded."""


class CorruptArchiveError(ValueError):
  """An archive is truncated, corrupt, or not in the expected format."""


def missing_message(archive: Archive, manual_dir: str, *, what: str = "",
                    reason: str = "") -> str:
  """The message for a missing archive: what, from where, to which file name, in which dir."""
  need = what or archive.filename
  msg = (f"{need} not found. Download {archive.url} ({archive.description}) and place it as "
         f"{os.path.join(manual_dir, archive.filename)}")
  if archive is LRA_RELEASE:
    msg += f" (or extract it there, so that {os.path.join(manual_dir, 'lra_release')} exists)"
  msg += (". Then rerun. To keep the files elsewhere, pass --manual_dir DIR to `lra data "
          "prepare`, or --config.data.manual_dir=DIR to `lra run`.")
  if reason:
    msg += f" ({reason})"
  return msg


def fetch(url: str, dest: str, *, timeout: float = 30.0) -> None:
  """Downloads `url` to `dest` through `dest + ".part"`, with a progress bar on stderr.

  Nothing is left at `dest` unless the download completed.
  """
  os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
  part = dest + ".part"
  try:
    with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as f, \
        tqdm.tqdm(total=int(response.headers.get("Content-Length") or 0) or None, unit="B",
                  unit_scale=True, unit_divisor=1024, mininterval=1.0,
                  desc=f"downloading {os.path.basename(dest)}") as bar:
      total, done = bar.total, 0
      while chunk := response.read(CHUNK):
        f.write(chunk)
        done += len(chunk)
        bar.update(len(chunk))
    if total and done != total:
      raise OSError(f"the connection closed after {done} of {total} bytes")
    os.replace(part, dest)
    print(f"downloaded {dest} ({done / 2**20:.1f} MB)", file=sys.stderr, flush=True)
  finally:
    if os.path.exists(part):
      os.remove(part)


def locate(archive: Archive, manual_dir: str, *, download: bool) -> str:
  """The path of `archive` in `manual_dir`; downloads it there first when `download` is set.

  Raises DataMissingError (address, file name, directory) when it is absent and cannot be had.
  """
  manual_dir = os.path.expanduser(manual_dir)
  path = os.path.join(manual_dir, archive.filename)
  if os.path.isfile(path):
    return path
  if not download:
    raise DataMissingError(missing_message(archive, manual_dir))
  try:
    fetch(archive.url, path)
  except (urllib.error.URLError, OSError, ValueError) as e:
    raise DataMissingError(missing_message(
        archive, manual_dir, reason=f"downloading it failed: {e}")) from None
  return path


# ----------------------------------------------------------------------------------------------
# Verified reading.

# What tarfile, gzip, zlib, zipfile and pickle raise on damaged input (zipfile: also
# NotImplementedError for an unknown method, RuntimeError for an "encrypted" flag, OSError).
_CORRUPTION_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error,
                      EOFError, OSError, ValueError, NotImplementedError, RuntimeError,
                      struct.error, IndexError, KeyError, OverflowError,
                      pickle.UnpicklingError)


def corrupt_message(path: str, archive: Archive | None, what: str | BaseException) -> str:
  """One line: the file, what is wrong with it, and what to do."""
  if isinstance(what, BaseException):
    what = f"{type(what).__name__}: {what}"
  what = " ".join(str(what).split())[:300]
  msg = f"{path} is truncated or corrupt ({what}). Delete it"
  if archive is not None:
    msg += f", download it again from {archive.url} and put it at {path}"
  return msg + "; no dataset was written."


@contextlib.contextmanager
def reading(path: str, archive: Archive | None = None) -> Iterator[None]:
  """Turns the errors of reading a truncated or corrupt archive into CorruptArchiveError.

  Wrap only reading: an OSError of writing (a full disk) is not the archive's fault.
  """
  try:
    yield
  except CorruptArchiveError:
    raise
  except _CORRUPTION_ERRORS as e:
    raise CorruptArchiveError(corrupt_message(path, archive, e)) from e


class _Hashing:
  """A read-only file that counts the bytes read through it and hashes them (SHA-256)."""

  mode = "rb"

  def __init__(self, f):
    self._f, self.sha, self.size = f, hashlib.sha256(), 0

  def read(self, n: int = -1) -> bytes:
    data = self._f.read(n)
    self.sha.update(data)
    self.size += len(data)
    return data

  def drain(self) -> None:
    while self.read(CHUNK):
      pass


_HASHED: dict[str, Fingerprint] = {}        # real path -> its last fingerprint in this process
_RECORDERS: list[dict[str, Fingerprint]] = []


def _verified(path: str, archive: Archive | None, st: os.stat_result, raw: _Hashing) -> None:
  """The checks after a whole archive was read through `raw`; remembers its fingerprint."""
  if raw.size != st.st_size:
    raise CorruptArchiveError(corrupt_message(
        path, archive, f"it changed while being read: {st.st_size} bytes, then {raw.size}"))
  sha = raw.sha.hexdigest()
  if archive is not None and archive.sha256 and sha != archive.sha256.lower():
    raise CorruptArchiveError(corrupt_message(
        path, archive, f"its SHA-256 is {sha}, the published one is {archive.sha256}"))
  fp = Fingerprint(st.st_size, st.st_mtime_ns, sha)
  _HASHED[os.path.realpath(path)] = fp
  for reads in _RECORDERS:
    reads[os.path.basename(path)] = fp


@contextlib.contextmanager
def recording_reads() -> Iterator[dict[str, Fingerprint]]:
  """Collects {file name: Fingerprint} of the archives read and verified while inside."""
  reads: dict[str, Fingerprint] = {}
  _RECORDERS.append(reads)
  try:
    yield reads
  finally:
    _RECORDERS.remove(reads)


def tar_members(path: str, archive: Archive | None = None) -> Iterator[tuple[str, bytes]]:
  """Streams (member name, contents) of the regular files of a (compressed) tar archive.

  One sequential pass that also verifies the archive: a gzip'd tar is decompressed to the end of
  the file (each gzip member's CRC-32 and length checked) and its SHA-256 computed (and compared
  with `archive.sha256` when published). These checks come after the last member: use nothing
  until the iteration has ended. Raises CorruptArchiveError.
  """
  with reading(path, archive), open(path, "rb") as f:
    st = os.fstat(f.fileno())
    gzipped = f.read(2) == GZIP_MAGIC
    f.seek(0)
    raw = _Hashing(f)
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
    with tarfile.open(fileobj=stream, mode="r|" if gzipped else "r|*") as tar:
      for member in tar:
        if member.isfile():
          yield member.name, tar.extractfile(member).read()
      while stream.read(CHUNK):   # gzip: on to the end, checking every trailer
        pass
    raw.drain()
    _verified(path, archive, st, raw)


def _check_local_header(f, info: zipfile.ZipInfo) -> None:
  """The local header of `info` agrees with the central directory on how to read the data."""
  f.seek(info.header_offset)
  header = f.read(30)
  if len(header) < 30:
    raise zipfile.BadZipFile(f"the local header of {info.filename!r} is cut off")
  sig, _, flags, method, _, _, crc, csize, size, name_len, _ = struct.unpack("<4s5H3L2H", header)
  wrong = [what for what, bad in (
      ("signature", sig != b"PK\x03\x04"), ("compression method", method != info.compress_type),
      ("name length", name_len != len(info.orig_filename.encode(
          "utf-8" if info.flag_bits & 0x800 else "cp437", "replace"))),
      ("CRC-32", not flags & 0x08 and crc != info.CRC),
      ("sizes", not flags & 0x08 and 0xFFFFFFFF not in (csize, size)
       and (csize, size) != (info.compress_size, info.file_size))) if bad]
  if wrong:
    raise zipfile.BadZipFile(f"the local header of {info.filename!r} disagrees with the central "
                             f"directory ({', '.join(wrong)})")


def zip_member(path: str, name: str, archive: Archive | None = None) -> bytes:
  """The contents of member `name` of a zip archive, after verifying the whole archive.

  Hashes the file (SHA-256, compared with `archive.sha256` when published), then reads every
  member to its end (zipfile checks each CRC-32), checking each local header against the
  central directory and each size. Raises CorruptArchiveError.
  """
  with reading(path, archive), open(path, "rb") as f:
    st = os.fstat(f.fileno())
    raw = _Hashing(f)
    raw.drain()
    with zipfile.ZipFile(f) as z:
      if name not in z.NameToInfo:
        raise CorruptArchiveError(corrupt_message(
            path, archive, f"it has no member {name!r}, only {', '.join(z.namelist()[:5])}: "
                           f"it is damaged or not the expected archive"))
      contents = None
      for info in z.infolist():
        _check_local_header(f, info)
        with z.open(info) as member:
          data = b"".join(iter(lambda: member.read(CHUNK), b""))
        if len(data) != info.file_size:
          raise zipfile.BadZipFile(f"{info.filename!r} holds {len(data)} bytes, the central "
                                   f"directory says {info.file_size}")
        if info.filename == name:
          contents = data
    _verified(path, archive, st, raw)
  return contents


# ----------------------------------------------------------------------------------------------
# Fingerprints: which file a dataset (or an extracted folder) was made from.


def sha256_file(path: str) -> str:
  """The SHA-256 of a file, read once (a progress bar for large files)."""
  sha = hashlib.sha256()
  with open(path, "rb") as f, tqdm.tqdm(
      total=os.fstat(f.fileno()).st_size, unit="B", unit_scale=True, unit_divisor=1024,
      mininterval=1.0, desc=f"SHA-256 of {os.path.basename(path)}",
      disable=os.path.getsize(path) < 1 << 30) as bar:
    while chunk := f.read(CHUNK):
      sha.update(chunk)
      bar.update(len(chunk))
  return sha.hexdigest()


def fingerprint(path: str) -> Fingerprint:
  """Size, mtime and SHA-256 of `path`; hashed only if this process has not hashed (or read and
  verified) the file with this size and mtime."""
  st = os.stat(path)
  known = _HASHED.get(os.path.realpath(path))
  if known and (known.size, known.mtime_ns) == (st.st_size, st.st_mtime_ns):
    return known
  fp = Fingerprint(st.st_size, st.st_mtime_ns, sha256_file(path))
  _HASHED[os.path.realpath(path)] = fp
  return fp


def record_to_json(record: Mapping[str, Fingerprint]) -> str:
  """{archive file name: Fingerprint} as JSON."""
  return json.dumps({k: dataclasses.asdict(v) for k, v in sorted(record.items())}, indent=1)


def record_from_json(text: str) -> dict[str, Fingerprint]:
  """The record written by `record_to_json`; {} when it cannot be parsed."""
  try:
    return {k: Fingerprint(int(v["size"]), int(v["mtime_ns"]), str(v["sha256"]))
            for k, v in json.loads(text).items()}
  except (ValueError, TypeError, KeyError, AttributeError):
    return {}


def write_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` through a temporary file renamed over it."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


@contextlib.contextmanager
def exclusive(lock: str, what: str, stale: Iterable[str] = ()) -> Iterator[None]:
  """Holds the lock file `lock` (an flock, which the kernel releases when the holder dies, even
  by SIGKILL), waiting with a note while another process holds it; once held, removes whatever
  matches the `stale` glob patterns: the temporary folders of killed processes, since a live
  process writing one would hold this lock. No lock (and no removal) on a remote path."""
  if "://" in lock:
    yield
    return
  os.makedirs(os.path.dirname(lock), exist_ok=True)
  fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o664)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 20, 0).decode("ascii", "replace").strip() or "?"
      print(f"waiting for process {holder}, busy with a {what} (it holds {lock}) ...",
            file=sys.stderr, flush=True)
      fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    for pattern in stale:
      for path in sorted(glob.glob(pattern)):
        print(f"removing {path}, left by a {what} that was stopped", file=sys.stderr, flush=True)
        if os.path.isdir(path) and not os.path.islink(path):
          shutil.rmtree(path)
        else:
          os.remove(path)
    yield
  finally:
    os.close(fd)


# ----------------------------------------------------------------------------------------------
# The LRA release, read extracted.


def find_release_path(manual_dir: str, relpath: str) -> str | None:
  """`relpath` (e.g. "listops-1000") inside an extracted LRA release under manual_dir, or None."""
  manual_dir = os.path.expanduser(manual_dir)
  for parent in RELEASE_PARENTS:
    path = os.path.normpath(os.path.join(manual_dir, parent, relpath))
    if os.path.exists(path):
      return path
  return None


def extraction_record(folder: str) -> dict[str, Fingerprint]:
  """{archive file name: Fingerprint} of the archive `folder` was extracted from; {} if none
  (a folder extracted by hand, or no folder)."""
  try:
    with open(os.path.join(folder, EXTRACTED_FROM)) as f:
      return record_from_json(f.read())
  except OSError:
    return {}


def release_lock(manual_dir: str) -> str:
  """The lock file held while extracting the release under manual_dir."""
  return os.path.join(manual_dir, ".lra_release.lock")


def _release_relpath(member: str) -> str:
  """A release member's path without its leading `lra_release/` folders."""
  parts = [p for p in member.split("/") if p not in ("", ".")]
  while parts and parts[0] == "lra_release":
    parts = parts[1:]
  return "/".join(parts)


def extract_release(tarball: str, manual_dir: str, relpath: str) -> str:
  """Extracts the members under `relpath` of the LRA release into manual_dir/lra_release/.

  Reads the archive once, sequentially, verifying it to its end; writes into a temporary folder
  renamed when the whole archive has been read and verified (with a record of the archive in
  it), so an interrupted or failed extraction leaves no folder. Returns the extracted path.
  """
  relpath = relpath.strip("/")
  dest = os.path.join(manual_dir, "lra_release", relpath)
  parent = os.path.dirname(dest)
  with exclusive(release_lock(manual_dir), "release extraction",
                 stale=[os.path.join(glob.escape(parent), ".extracting-*")]):
    if os.path.exists(dest):   # extracted by another process while this one waited
      return dest
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".extracting-", dir=parent)
    count = 0
    print(f"extracting {relpath} from {tarball} (one pass over the archive, verified)...",
          file=sys.stderr, flush=True)
    try:
      for name, data in tqdm.tqdm(tar_members(tarball, LRA_RELEASE), mininterval=1.0,
                                  desc=f"reading {os.path.basename(tarball)}", unit=" members"):
        rel = _release_relpath(name)
        if rel != relpath and not rel.startswith(relpath + "/"):
          continue
        if ".." in rel.split("/"):
          raise CorruptArchiveError(corrupt_message(
              tarball, LRA_RELEASE, f"the member {name!r} points outside its folder"))
        out = os.path.join(tmp, os.path.relpath(rel, relpath)) if rel != relpath else \
            os.path.join(tmp, "__file__")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
          f.write(data)
        count += 1
      # Here the whole archive has been read and verified.
      if not count:
        raise CorruptArchiveError(
            f"{tarball} has no member under {relpath}; it is not the LRA release "
            f"({LRA_RELEASE.url}) or is truncated.")
      single = os.path.join(tmp, "__file__")
      if os.path.exists(single):
        os.replace(single, dest)
      else:
        with open(os.path.join(tmp, EXTRACTED_FROM), "w") as f:
          f.write(record_to_json({LRA_RELEASE.filename: fingerprint(tarball)}))
        os.replace(tmp, dest)
    finally:
      if os.path.exists(tmp):
        shutil.rmtree(tmp)
  print(f"extracted {count} files to {dest}", file=sys.stderr, flush=True)
  return dest


def release_path(manual_dir: str, relpath: str, *, download: bool) -> str:
  """`relpath` of the LRA release under manual_dir, extracted from lra_release.gz if needed."""
  manual_dir = os.path.expanduser(manual_dir)
  found = find_release_path(manual_dir, relpath)
  if found:
    return found
  where = os.path.join(manual_dir, "lra_release")
  what = f"{relpath} of the LRA release (looked under {where})"
  try:
    tarball = locate(LRA_RELEASE, manual_dir, download=download)
  except DataMissingError as e:
    msg = str(e).replace(f"{LRA_RELEASE.filename} not found", f"{what} not found", 1)
    raise DataMissingError(msg) from None
  return extract_release(tarball, manual_dir, relpath)
