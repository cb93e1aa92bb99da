"""Damaged, replaced and half-built data, through the real `lra data prepare` command, for each
archive format: the tar.gz of aclImdb and CIFAR-10, the zip of enwik8, and the LRA release
`lra_release.gz` (a tar.gz that is extracted first).

- A byte flipped in the header, the middle or the trailer (a zip's central directory and end
  record), and a truncated file: exit status 2, one `error: ` line naming the file and no
  traceback, and no dataset, `incomplete.*` or extraction folder left behind.
- Every single-byte flip (two masks) of a small tar.gz and zip is refused, or reads exactly the
  original members: for the tar.gz only where the file decompresses to the very same bytes (the
  gzip header's time, OS and name fields, bits the inflater ignores), never in the trailer; for
  the zip in metadata such as times, never in the method, CRC-32 or sizes of either header.
- A published SHA-256 is checked (aclImdb's, as tfds publishes it).
- A replaced archive (same name, other content) rebuilds the dataset on the next prepare; a
  touched one (same bytes, new time) is hashed once and reused; an archive moved away, or a
  dataset prepared before datasets recorded their archive, leaves the dataset in use.
- A killed preparation's `incomplete.*` folder (and a killed extraction's temporary folder) is
  removed by the next preparation, which succeeds; one held by a live process is left alone.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import subprocess
import sys
import zipfile
import zlib
from typing import Callable

import numpy as np
import pytest
import tensorflow_datasets as tfds

import task_helpers
from launch import cli, data as data_launcher, train as train_launcher
from lra.data import archives, builders, charlm, image, listops, listops_generator, text
from lra.tasks import text as text_task


@pytest.fixture(autouse=True)
def published_imdb():
  """The aclImdb Archive as published; in the tests, the tiny aclImdb is not that file."""
  with task_helpers.unpublished(text, "IMDB") as archive:
    yield archive


@pytest.fixture
def data_root(tmp_path, monkeypatch):
  """$LRA_DATA in the test folder."""
  monkeypatch.setenv("LRA_DATA", str(tmp_path))
  return tmp_path


# ----------------------------------------------------------------------------------------------
# The formats: a task, its archive written in two versions, and what its dataset holds.


def _reviews(version: int) -> dict:
  return {("train", "pos", 0, 9): b"Loved it, version %d." % version,
          ("train", "neg", 1, 2): b"Dull." * (3 + version),
          ("test", "pos", 2, 8): b"Great fun.",
          ("test", "neg", 3, 1): b"Awful, twice: %d." % version}


def _write_text(path: str, version: int) -> None:
  task_helpers.write_imdb(path, _reviews(version))


def _write_image(path: str, version: int) -> None:
  task_helpers.write_cifar(path, seed=version, per_batch=2)


def _write_enwik8(path: str, version: int) -> None:
  rng = np.random.default_rng(version)
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("enwik8", rng.choice(list(b"<page> abcdefgh\n\xc3\xa9"), 1000).astype(np.uint8)
               .tobytes())


def _write_release(path: str, version: int) -> None:
  rows = listops_generator.generate(30, min_length=5, max_length=30, seed=version)
  members = {"lra_release": None, "lra_release/listops-1000": None}
  for i, name in enumerate(listops.RELEASED_FILES.values()):
    lines = ["Source\tTarget"] + [f"{listops_generator.to_released_string(ids)}\t{label}"
                                  for ids, label in rows[10 * i:10 * (i + 1)]]
    members[f"lra_release/listops-1000/{name}"] = ("\n".join(lines) + "\n").encode()
  members["lra_release/tsv_data/new_aan_pairs.eval.tsv"] = b"1\ta\tb\tx\ty\n"
  task_helpers.write_tar(path, members)


@dataclasses.dataclass(frozen=True)
class Format:
  task: str
  filename: str
  write: Callable[[str, int], None]
  args: tuple[str, ...] = ()
  zip: bool = False

  def data_cfg(self, root):
    overrides = train_launcher.split_overrides(list(self.args))[1]
    return data_launcher.data_config(self.task, "small", str(root / "manual"), overrides)

  def contents(self, root) -> list[bytes]:
    """What the prepared dataset holds: the stored inputs of a split, as bytes."""
    cfg = self.data_cfg(root)
    if self.task == "enwik8":
      return [charlm.read_stream(charlm.build(charlm.CORPORA["enwik8"], cfg), "train").tobytes()]
    module = {"text": text, "image": image, "listops": listops}[self.task]
    source = module.get_source(cfg, "test")
    return [source[i]["inputs"].tobytes() for i in range(len(source))]


FORMATS = {
    "text": Format("text", text.IMDB.filename, _write_text),
    "image": Format("image", image.CIFAR10.filename, _write_image),
    "enwik8": Format("enwik8", "enwik8.zip", _write_enwik8,
                     ("--config.data.split_sizes=(900, 60, 40)",), zip=True),
    "release": Format("listops", archives.LRA_RELEASE.filename, _write_release,
                      ("--config.data.generate=false",)),
}


def write(root, fmt: Format, version: int = 0) -> str:
  path = os.path.join(root, "manual", fmt.filename)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fmt.write(path, version)
  return path


def prepare(root, fmt: Format, capsys) -> tuple[int, str]:
  """`lra data prepare TASK --size small --no-download` in-process: (exit status, stderr)."""
  rc = cli.main(["data", "prepare", fmt.task, "--size", "small", "--no-download",
                 "--manual_dir", str(root / "manual"), *fmt.args])
  return rc, capsys.readouterr().err


def leftovers(root) -> list[str]:
  """Dataset folders (finished or tfds' incomplete.*), extracted or half-extracted release
  folders under root."""
  found = []
  for folder, dirs, _ in os.walk(root):
    for d in dirs:
      if d.endswith("1.0.0") or d.startswith(("incomplete.", ".extracting-")) or \
          d == "listops-1000":
        found.append(os.path.join(folder, d))
  return found


# ----------------------------------------------------------------------------------------------
# Flipped bytes and truncation, through `lra data prepare`.


def _gzip_faults(data: bytes) -> dict[str, bytes]:
  n = len(data)
  flips = {"header (compression method)": 2, "middle": n // 2, "trailer CRC-32": n - 8,
           "trailer length": n - 1}
  faults = {name: _flip(data, i) for name, i in flips.items()}
  faults["truncated to half"] = data[:n // 2]
  faults["trailer cut off"] = data[:-4]
  return faults


def _zip_faults(data: bytes, path: str) -> dict[str, bytes]:
  with zipfile.ZipFile(path) as z:
    info, = z.infolist()
    start = info.header_offset + 30 + len(info.filename)
    central = z.start_dir
  flips = {"local header signature": 0, "middle": start + info.compress_size // 2,
           "central directory compression method": central + 10,
           "central directory CRC-32": central + 16,
           "end record: central directory offset": len(data) - 6}
  faults = {name: _flip(data, i) for name, i in flips.items()}
  faults["truncated to half"] = data[:len(data) // 2]
  return faults


def _flip(data: bytes, i: int, mask: int = 0xFF) -> bytes:
  out = bytearray(data)
  out[i] ^= mask
  return bytes(out)


@pytest.mark.parametrize("name", FORMATS)
def test_damaged_archive_is_one_error_line_and_builds_nothing(name, data_root, capsys):
  fmt = FORMATS[name]
  path = write(data_root, fmt)
  with open(path, "rb") as f:
    original = f.read()
  faults = _zip_faults(original, path) if fmt.zip else _gzip_faults(original)
  for fault, damaged in faults.items():
    with open(path, "wb") as f:
      f.write(damaged)
    rc, err = prepare(data_root, fmt, capsys)
    lines = err.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1 and lines[-1] == errors[0], (fault, err)
    assert path in errors[0] and "Traceback" not in err, (fault, err)
    assert "download it again from" in errors[0], (fault, err)
    assert leftovers(data_root) == [], fault
  with open(path, "wb") as f:
    f.write(original)
  assert prepare(data_root, fmt, capsys)[0] == 0   # the intact archive builds


# ----------------------------------------------------------------------------------------------
# Every single-byte flip of a small archive, read directly.


def _outcomes(path: str, original: bytes, read: Callable[[], object]) -> dict[int, str]:
  """For each offset and two masks: "refused", "same" (read exactly the original members) or
  what else happened."""
  want = read()
  out = {}
  for i in range(len(original)):
    for mask in (0x01, 0xFF):
      with open(path, "wb") as f:
        f.write(_flip(original, i, mask))
      try:
        got = read()
      except archives.CorruptArchiveError:
        outcome = "refused"
      except Exception as e:  # noqa: BLE001 - the outcome under test
        outcome = f"{type(e).__name__}: {e}"
      else:
        outcome = "same" if got == want else "changed"
      if out.get(i, "refused") == "refused":
        out[i] = outcome
  return out


def test_every_flip_in_a_tar_gz_is_refused_or_invisible(tmp_path):
  path = str(tmp_path / "aclImdb_v1.tar.gz")
  _write_text(path, 0)
  original = open(path, "rb").read()
  archive = archives.Archive("aclImdb_v1.tar.gz", "https://example.org/a.tar.gz", "test")
  outcomes = _outcomes(path, original, lambda: list(archives.tar_members(path, archive)))
  accepted = [i for i, o in outcomes.items() if o != "refused"]
  wrong = {i: outcomes[i] for i in accepted if outcomes[i] != "same"}
  assert not wrong, f"{len(wrong)} of {len(original)} offsets: {dict(list(wrong.items())[:8])}"
  # What is accepted decompresses to the very same bytes: a header field no check covers (the
  # text flag, time, extra flags, OS, file name) or bits the inflater ignores.
  payload = gzip.decompress(original)

  def invisible(i: int) -> bool:
    for mask in (0x01, 0xFF):
      try:
        if gzip.decompress(_flip(original, i, mask)) == payload:
          return True
      except (OSError, EOFError, zlib.error):
        pass
    return False

  assert all(invisible(i) for i in accepted)
  assert all(outcomes[i] == "refused" for i in range(len(original) - 8, len(original)))
  assert len(accepted) < len(original) // 10


def test_published_checksum_is_checked(tmp_path, published_imdb):
  path = str(tmp_path / "thing.tar.gz")
  task_helpers.write_tar(path, {"a.txt": b"hello"})
  wrong = archives.Archive("thing.tar.gz", "https://example.org/t.tar.gz", "test", "0" * 64)
  with pytest.raises(archives.CorruptArchiveError, match="SHA-256") as err:
    list(archives.tar_members(path, wrong))
  assert "https://example.org/t.tar.gz" in str(err.value)
  right = dataclasses.replace(wrong, sha256=archives.fingerprint(path).sha256)
  assert list(archives.tar_members(path, right)) == [("a.txt", b"hello")]
  # The one checksum the tasks know for certain: tfds publishes it with its imdb_reviews.
  with open(os.path.join(os.path.dirname(tfds.__file__), "datasets", "imdb_reviews",
                         "checksums.tsv")) as f:
    url, size, sha256, filename = f.read().split()
  assert (filename, sha256) == (published_imdb.filename, published_imdb.sha256)
  assert url.split("//")[1] == published_imdb.url.split("//")[1] and int(size) == 84125825


# ----------------------------------------------------------------------------------------------
# A replaced archive.


def _record(root, fmt: Format) -> str:
  for folder, _, files in os.walk(root / fmt.task):
    if builders.SOURCES_FILE in files and folder.endswith("1.0.0"):
      return os.path.join(folder, builders.SOURCES_FILE)
  raise AssertionError(f"no {builders.SOURCES_FILE} under {root / fmt.task}")


@pytest.mark.parametrize("name", FORMATS)
def test_replaced_archive_rebuilds_the_dataset(name, data_root, capsys, monkeypatch):
  fmt = FORMATS[name]
  path = write(data_root, fmt, 0)
  assert prepare(data_root, fmt, capsys)[0] == 0
  first = fmt.contents(data_root)
  with open(_record(data_root, fmt)) as f:
    assert json.load(f)[fmt.filename]["sha256"] == archives.fingerprint(path).sha256
  write(data_root, fmt, 1)   # a new download under the same name
  rc, err = prepare(data_root, fmt, capsys)
  assert rc == 0 and "rebuilding" in err and path in err, err
  second = fmt.contents(data_root)
  assert second != first
  # The same as a dataset built from the new archive in a fresh place.
  fresh = data_root / "fresh"
  os.makedirs(fresh / "manual")
  os.replace(path, fresh / "manual" / fmt.filename)
  monkeypatch.setenv("LRA_DATA", str(fresh))
  assert prepare(fresh, fmt, capsys)[0] == 0
  assert fmt.contents(fresh) == second
  monkeypatch.setenv("LRA_DATA", str(data_root))
  # The archive moved away: the prepared dataset is still used.
  rc, err = prepare(data_root, fmt, capsys)
  assert rc == 0 and "rebuilding" not in err and "preparing" not in err, err
  assert fmt.contents(data_root) == second


def test_touched_archive_is_hashed_once_and_reused(data_root, capsys, monkeypatch):
  fmt = FORMATS["text"]
  path = write(data_root, fmt, 0)
  assert prepare(data_root, fmt, capsys)[0] == 0
  st = os.stat(path)
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))   # same bytes, new time
  hashed = []
  real = archives.sha256_file
  monkeypatch.setattr(archives, "sha256_file", lambda p: hashed.append(p) or real(p))
  monkeypatch.setattr(archives, "_HASHED", {})
  for _ in range(2):
    rc, err = prepare(data_root, fmt, capsys)
    assert rc == 0 and "rebuilding" not in err and "preparing" not in err, err
  assert hashed == [path]   # the record now has the new time: no second hash
  with open(_record(data_root, fmt)) as f:
    assert json.load(f)[fmt.filename]["mtime_ns"] == st.st_mtime_ns + 5 * 10**9


def test_dataset_without_a_record_is_used_as_before(data_root, capsys):
  fmt = FORMATS["text"]
  write(data_root, fmt, 0)
  assert prepare(data_root, fmt, capsys)[0] == 0
  first = fmt.contents(data_root)
  os.remove(_record(data_root, fmt))   # prepared before datasets recorded their archive
  write(data_root, fmt, 1)
  rc, err = prepare(data_root, fmt, capsys)
  assert rc == 0 and "rebuilding" not in err and fmt.contents(data_root) == first


# ----------------------------------------------------------------------------------------------
# Killed preparations.


def _killed_build(folder: str) -> str:
  """A folder as a killed tfds build leaves it: incomplete.<random>_1.0.0 with a partial shard."""
  stale = os.path.join(folder, "incomplete.K1LL3D_1.0.0")
  os.makedirs(stale)
  with open(os.path.join(stale, "lra_text-train.array_record-00000-of-00001"), "wb") as f:
    f.write(b"\0" * 100)
  return stale


def test_killed_preparation_is_cleaned_and_the_next_succeeds(data_root, capsys):
  fmt = FORMATS["text"]
  write(data_root, fmt, 0)
  builder = text.DATA.builder(fmt.data_cfg(data_root))
  stale = _killed_build(os.path.dirname(builder.data_dir))
  rc, err = prepare(data_root, fmt, capsys)
  assert rc == 0 and not os.path.exists(stale) and stale in err, err
  assert text_task.TASK.status(fmt.data_cfg(data_root)).ready
  assert [os.path.basename(p) for p in leftovers(data_root)] == ["1.0.0"]


def test_killed_extraction_is_cleaned_and_the_next_succeeds(data_root, capsys):
  fmt = FORMATS["release"]
  write(data_root, fmt, 0)
  stale = data_root / "manual" / "lra_release" / ".extracting-k1ll3d"
  os.makedirs(stale / "listops-1000")
  (stale / "listops-1000" / "basic_train.tsv").write_bytes(b"Source\tTarget\n( [MAX")
  rc, err = prepare(data_root, fmt, capsys)
  assert rc == 0 and not stale.exists(), err
  assert len(fmt.contents(data_root)) == 10


def test_a_folder_being_built_by_a_live_process_is_left_alone(data_root, capsys, tmp_path):
  fmt = FORMATS["text"]
  write(data_root, fmt, 0)
  builder = text.DATA.builder(fmt.data_cfg(data_root))
  live = _killed_build(os.path.dirname(builder.data_dir))
  marker = tmp_path / "seen"
  holder = subprocess.Popen(
      [sys.executable, "-c",
       "import fcntl, os, sys, time\n"
       "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
       "fcntl.flock(fd, fcntl.LOCK_EX)\n"
       "print('locked', flush=True)\n"
       "time.sleep(1.0)\n"
       "open(sys.argv[3], 'w').write(str(os.path.isdir(sys.argv[2])))\n",
       builders.lock_file(builder), live, str(marker)],
      stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    rc, err = prepare(data_root, fmt, capsys)   # waits for the holder, then cleans and builds
  finally:
    holder.wait(timeout=30)
  assert rc == 0 and "waiting for process" in err, err
  assert marker.read_text() == "True" and not os.path.exists(live)
