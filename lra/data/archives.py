"""The original public data files: where they come from, where they go, and reading them safely.

Every archive a task needs is described once by an `Archive` (file name, download address, what
it is). `locate(archive, manual_dir, download=...)` returns its path in the manual directory,
downloading it first when asked and the machine is online; otherwise it raises
`DataMissingError`, whose message names the address, the expected file name and the directory to
put it in. `reading(path, archive)` turns the errors of a truncated or corrupt archive (tar, gzip,
zip, pickle) into a `CorruptArchiveError` that says to delete and fetch the file again.

The LRA release (`lra_release.gz`, 8.2 GB) holds ListOps, AAN (retrieval) and Pathfinder. Tasks
read it extracted: `release_path(manual_dir, "pathfinder32/curv_contour_length_14")` finds that
folder under `manual_dir/lra_release/` (or the doubly nested `lra_release/lra_release/` of some
copies, or `manual_dir` itself); when only the archive is there, it extracts that folder (and
nothing else) from the archive, into a temporary folder renamed when complete.

Layout of the data root (`$LRA_DATA`, default `~/lra_data`):

  ~/lra_data/manual/            archives: aclImdb_v1.tar.gz, cifar-10-python.tar.gz, enwik8.zip,
                                text8.zip, lra_release.gz or its extracted lra_release/ tree
  ~/lra_data/<task>/            the prepared tfds datasets (array_record)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import os
import pickle
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from typing import Iterator

import tqdm

# The data root and default folders, also used from here by the builders and `lra data`.
from lra.data.paths import (DATA_ROOT_ENV, data_root, default_data_dir,  # noqa: F401
                            default_manual_dir)


@dataclasses.dataclass(frozen=True)
class Archive:
  """One original public file."""
  filename: str        # the name it has at its source, e.g. "aclImdb_v1.tar.gz"
  url: str             # where to download it
  description: str     # what it is, with its size, for messages and `lra data status`


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
      while chunk := response.read(1 << 20):
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


_CORRUPTION_ERRORS = (tarfile.TarError, EOFError, zlib.error, zipfile.BadZipFile,
                      gzip.BadGzipFile, pickle.UnpicklingError)


def corrupt_message(path: str, archive: Archive | None, error: BaseException) -> str:
  msg = f"{path} is truncated or corrupt ({type(error).__name__}: {error}). Delete it"
  if archive is not None:
    msg += f" and download it again from {archive.url}"
  return msg + "; no dataset was written."


@contextlib.contextmanager
def reading(path: str, archive: Archive | None = None) -> Iterator[None]:
  """Turns the errors of a truncated or corrupt archive into CorruptArchiveError."""
  try:
    yield
  except CorruptArchiveError:
    raise
  except _CORRUPTION_ERRORS as e:
    raise CorruptArchiveError(corrupt_message(path, archive, e)) from e


def tar_members(path: str, archive: Archive | None = None) -> Iterator[tuple[str, bytes]]:
  """Streams (member name, contents) of the regular files of a (compressed) tar archive."""
  with reading(path, archive), tarfile.open(path, "r|*") as tar:
    for member in tar:
      if member.isfile():
        f = tar.extractfile(member)
        yield member.name, f.read()


def zip_member(path: str, name: str, archive: Archive | None = None) -> bytes:
  """The contents of member `name` of a zip archive (CRC checked)."""
  with reading(path, archive), zipfile.ZipFile(path) as z:
    try:
      return z.read(name)
    except KeyError:
      raise CorruptArchiveError(
          f"{path} has no member {name!r} (it has {', '.join(z.namelist()[:5])}); it is not "
          f"the expected archive" + (f": get it from {archive.url}" if archive else "") + ".") \
          from None


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


def _release_relpath(member: str) -> str:
  """A release member's path without its leading `lra_release/` folders."""
  parts = [p for p in member.split("/") if p not in ("", ".")]
  while parts and parts[0] == "lra_release":
    parts = parts[1:]
  return "/".join(parts)


def extract_release(tarball: str, manual_dir: str, relpath: str) -> str:
  """Extracts the members under `relpath` of the LRA release into manual_dir/lra_release/.

  Reads the archive once, sequentially; writes into a temporary folder renamed when complete, so
  an interrupted or failed extraction leaves nothing behind. Returns the extracted path.
  """
  relpath = relpath.strip("/")
  dest = os.path.join(manual_dir, "lra_release", relpath)
  os.makedirs(os.path.dirname(dest), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".extracting-", dir=os.path.dirname(dest))
  count = 0
  print(f"extracting {relpath} from {tarball} (one pass over the archive)...", file=sys.stderr,
        flush=True)
  try:
    for name, data in tqdm.tqdm(tar_members(tarball, LRA_RELEASE), mininterval=1.0,
                                desc=f"reading {os.path.basename(tarball)}", unit=" members"):
      rel = _release_relpath(name)
      if rel != relpath and not rel.startswith(relpath + "/"):
        continue
      out = os.path.join(tmp, os.path.relpath(rel, relpath)) if rel != relpath else \
          os.path.join(tmp, "__file__")
      os.makedirs(os.path.dirname(out), exist_ok=True)
      with open(out, "wb") as f:
        f.write(data)
      count += 1
    if not count:
      raise CorruptArchiveError(
          f"{tarball} has no member under {relpath}; it is not the LRA release ({LRA_RELEASE.url})"
          f" or is truncated.")
    single = os.path.join(tmp, "__file__")
    os.replace(single if os.path.exists(single) else tmp, dest)
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
