"""Shared pieces of the task datasets: the tfds builder base, preparing, padded sources, status.

- `Builder`: the base of our tfds GeneratorBasedBuilders. They write array_record files, need no
  TensorFlow, and are not registered in the tfds catalogue (subclass with
  `skip_registration=True`). `token_feature()` is the feature of a variable-length uint8 array;
  `LabelledBuilder` is the base of the classification datasets (token arrays and an int32 label).
- Original files reach a builder through tfds' manual_dir: the task finds them first (an archive
  in `data.manual_dir`, downloaded there when allowed, or a folder of the LRA release or of
  generated data), then `prepare(builder, label, manual_dir)` builds with
  `DownloadConfig(manual_dir=...)` and the builder's `_split_generators` reads its files under
  `dl_manager.manual_dir` (an `epath.Path`). Builder configs hold no path: the config name says
  where the data comes from and names the folder `<data_dir>/<builder>/<config>/<version>`.
- `prepare` builds the dataset when it is not there yet, with a progress note, holding a lock
  file per dataset (`lock_file`): once it holds it, the `incomplete.*` folders that killed
  preparations of the same dataset left are removed (a live preparation would hold the lock),
  and a second process waits and then uses what the first built. tfds writes into a temporary
  `incomplete.*` folder that it renames when complete and deletes on failure, so an error (a
  corrupt archive, Ctrl-C) leaves no half-written dataset.
- Each dataset records the archives it was built from (`SOURCES_FILE`: file name, size, mtime
  and SHA-256 of every archive read and verified while building, or of the LRA release a folder
  was extracted from), written inside the temporary folder before tfds renames it. `reuse`
  compares that record with the archives now in manual_dir (size and mtime first; SHA-256 only
  when those changed) and removes a dataset whose archive was replaced, so it is built again. A
  dataset without a record (prepared before records were kept) or whose archive is gone is used.
  `drop_stale_extraction` does the same for a folder extracted from the LRA release.
- `TaskData`: a task's `build`/`prepare`/`status` from its builder, how to find its original
  files, and what its status says while they are not built; `TaskData.from_archive` for a task
  made from one archive.
- `PaddedSource`: random access to one split for grain; pads token fields to fixed lengths and
  adds an id offset. Bytes and pixels are stored raw (0..255) and read as ids 1..256
  (`BYTE_OFFSET`), so id 0 is padding in every task and a black pixel or a NUL byte is data.
- `Status` and `archive_status`: what `lra data status` prints for one task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Callable, Iterator, Mapping, Sequence

from etils import epath
import ml_collections
import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import tqdm_utils

from lra.data import archives

BYTE_OFFSET = 1          # stored byte/pixel value v is token id v + 1; 0 is padding
BYTE_VOCAB_SIZE = 257    # padding + 256 byte values
SPLITS = ("train", "validation", "test")
SOURCES_FILE = "lra_sources.json"   # in a dataset folder: {archive file name: fingerprint}


class _QuietConfigNotes(logging.Filter):
  """Drops tfds' notes about our (intentionally unregistered) builder configs.

  Every builder here makes its config from the data settings, so tfds would log "Using custom
  data configuration" and "Variant folder ... has no dataset_info.json" at each data access.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    msg = record.getMessage()
    return not (msg.startswith("Using custom data configuration")
                or (msg.startswith("Variant folder") and "has no dataset_info.json" in msg))


logging.getLogger("absl").addFilter(_QuietConfigNotes())

_WARNED: set[str] = set()


def warn_once(log: logging.Logger, message: str, *args) -> None:
  """`log.warning(message, *args)` the first time this text is logged in the process: a data
  note that holds for every split (a truncation, say) is printed once, not once per split."""
  text = message % args if args else message
  if text not in _WARNED:
    _WARNED.add(text)
    log.warning("%s", text)


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
  """tfds' progress bars only on a terminal: piped into a log, their redraws arrive as
  carriage returns and `ESC[A` cursor moves around every line."""
  was = tqdm_utils._active   # pylint: disable=protected-access
  tfds.display_progress_bar(sys.stderr.isatty())
  try:
    yield
  finally:
    tfds.display_progress_bar(was)


def check_split(task: str, split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"unknown {task} split {split!r}; valid splits: {', '.join(SPLITS)}.")


def token_feature() -> tfds.features.Tensor:
  """A variable-length uint8 array stored as raw bytes (tokens, bytes or pixels, no padding)."""
  return tfds.features.Tensor(shape=(None,), dtype=np.uint8,
                              encoding=tfds.features.Encoding.BYTES)


class Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base of the task builders: version 1.0.0, configs made per data origin by the task.

  A builder that reads original files finds them under `dl_manager.manual_dir`, the folder that
  `prepare(builder, label, manual_dir)` hands to tfds.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}
  BUILDER_CONFIGS = []
  # tfds refuses `dl_manager.manual_dir` to builders without instructions.
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "The folder holding the task's original files (an archive, or a folder of the LRA release "
      "or of generated data); `lra data status` says which file to get and where to put it.")

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # tfds' default lookup goes through importlib_resources, which is not a dependency here.
    return epath.Path(sys.modules[cls.__module__].__file__)

  # tfds prints "Downloading and preparing dataset Unknown size ..." before building and
  # "Dataset ... downloaded and prepared" after, also for generated data; `prepare` prints its
  # own two lines (what is built where, and how long it took) instead.
  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    pass

  def _download_and_prepare(self, dl_manager, download_config=None):
    """Builds as tfds does, then records the archives it read (verified) in SOURCES_FILE; tfds
    runs this with `data_dir` set to its temporary folder, renamed only when all is written."""
    with archives.recording_reads() as reads:
      super()._download_and_prepare(dl_manager, download_config)
    manual_dir = download_config.manual_dir if download_config else None
    if manual_dir:  # a folder extracted from the LRA release: the archive it came from
      reads = {**archives.extraction_record(os.fspath(manual_dir)), **reads}
    (epath.Path(self.data_dir) / SOURCES_FILE).write_text(archives.record_to_json(reads))


class LabelledBuilder(Builder, skip_registration=True):
  """Base of the classification datasets: token arrays `INPUTS` and an int32 `targets` label.

  Each token field is a variable-length uint8 array (`token_feature`: ids, bytes or pixels, no
  padding). The description is the docstring of the builder's module (`lra/data/<task>.py`).
  With `DISABLE_SHUFFLING` (the default) the examples are stored in the order the builder yields
  them.
  """

  HOMEPAGE = ""
  INPUTS: tuple[str, ...] = ("inputs",)
  DISABLE_SHUFFLING = True

  def _info(self) -> tfds.core.DatasetInfo:
    features = {name: token_feature() for name in self.INPUTS}
    features["targets"] = tfds.features.Tensor(shape=(), dtype=np.int32)
    return tfds.core.DatasetInfo(
        builder=self,
        description=sys.modules[type(self).__module__].__doc__,
        features=tfds.features.FeaturesDict(features),
        homepage=self.HOMEPAGE,
        disable_shuffling=self.DISABLE_SHUFFLING,
    )


def lock_file(builder: tfds.core.DatasetBuilder) -> str:
  """The lock file held while `builder`'s dataset is built or removed: `.<version>.lock` next to
  the version folder (and next to tfds' `incomplete.*_<version>` folders)."""
  return os.path.join(os.path.dirname(os.fspath(builder.data_dir)), f".{builder.version}.lock")


@contextlib.contextmanager
def building(builder: tfds.core.DatasetBuilder, label: str) -> Iterator[None]:
  """Holds `lock_file(builder)`; once held, removes the `incomplete.*` folders of the dataset."""
  parent = glob.escape(os.path.dirname(os.fspath(builder.data_dir)))
  with archives.exclusive(lock_file(builder), f"preparation of the {label} dataset",
                          stale=[os.path.join(parent, f"incomplete.*_{builder.version}")]):
    yield


def _fresh(builder: tfds.core.DatasetBuilder) -> tfds.core.DatasetBuilder:
  """A new builder like `builder`, which reads what is on disk now."""
  return type(builder)(config=builder.builder_config, data_dir=os.fspath(builder.data_dir_root))


def prepare(builder: tfds.core.DatasetBuilder, label: str,
            manual_dir: epath.PathLike | None = None) -> tfds.core.DatasetBuilder:
  """Builds `builder`'s dataset as array_record unless it is already prepared; returns it.

  `manual_dir` is the folder holding the original files (tfds' `DownloadConfig.manual_dir`, read
  by the builder as `dl_manager.manual_dir`); None for a builder that reads no files. Builds
  under `building` (one process at a time; what killed ones left is removed first).
  """
  if builder.is_prepared():
    return builder
  if "://" in os.fspath(builder.data_dir):   # tfds' array_record writer writes local files only
    raise archives.DataMissingError(
        f"the {label} dataset is not in {builder.data_dir} and cannot be built in a bucket: "
        f"run `lra data prepare` for this task with the same LRA_DATA, --size and "
        f"--config.data.* settings (it builds locally and uploads), then rerun.")
  with building(builder, label):
    if builder.is_prepared():   # built by another process while this one waited
      return _fresh(builder)
    print(f"{label}: preparing {builder.builder_config.name} in {builder.data_dir} ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with quiet_progress():
      builder.download_and_prepare(
          file_format="array_record",
          download_config=tfds.download.DownloadConfig(
              manual_dir=manual_dir, compute_stats=tfds.download.ComputeStatsMode.SKIP))
  print(f"{label}: prepared in {time.perf_counter() - t0:.0f} s.", file=sys.stderr, flush=True)
  return builder


def check_record(record: Mapping[str, archives.Fingerprint], manual_dir: str
                 ) -> tuple[str | None, dict[str, archives.Fingerprint] | None]:
  """(Why the archives in manual_dir are not those of `record`, or None; the record with the
  new size and mtime of archives whose bytes are the same, or None if none has moved).

  An absent archive counts as unchanged. Costs a stat per archive, and one SHA-256 pass over an
  archive whose size or mtime differ from the record.
  """
  updated = dict(record)
  for name, was in record.items():
    path = os.path.join(os.path.expanduser(manual_dir), name)
    try:
      st = os.stat(path)
    except OSError:
      continue
    if (st.st_size, st.st_mtime_ns) == (was.size, was.mtime_ns):
      continue
    now = archives.fingerprint(path)
    if now.sha256 != was.sha256:
      return (f"{path} is not the archive it was built from (SHA-256 {now.sha256[:16]}..., was "
              f"{was.sha256[:16]}...)"), None
    updated[name] = now
  return None, (updated if updated != dict(record) else None)


def drop_stale_extraction(manual_dir: str, relpath: str) -> None:
  """Removes `relpath` of the extracted LRA release when it was extracted from an archive other
  than the `lra_release.gz` now in manual_dir (with a note), so that it is extracted again."""
  manual_dir = os.path.expanduser(manual_dir)
  folder = archives.find_release_path(manual_dir, relpath)
  record = archives.extraction_record(folder) if folder and os.path.isdir(folder) else {}
  if not record:
    return
  reason, updated = check_record(record, manual_dir)
  if updated:
    with contextlib.suppress(OSError):
      archives.write_atomic(os.path.join(folder, archives.EXTRACTED_FROM),
                            archives.record_to_json(updated))
  if reason is None:
    return
  with archives.exclusive(archives.release_lock(manual_dir), "release extraction"):
    if os.path.isdir(folder):
      print(f"{reason}; removing {folder} extracted from it, to extract it again.",
            file=sys.stderr, flush=True)
      gone = tempfile.mkdtemp(prefix=".extracting-stale-", dir=os.path.dirname(folder))
      os.replace(folder, os.path.join(gone, "old"))
      shutil.rmtree(gone)


def reuse(builder: tfds.core.DatasetBuilder, label: str,
          manual_dir: epath.PathLike | None) -> bool:
  """Whether `builder`'s prepared dataset can be used as it is.

  True when it is prepared and every archive in its record is absent from manual_dir or the
  same file (same size and mtime; else same SHA-256, and the record takes the new mtime). A
  dataset whose archive was replaced is removed, with a one-line note, and False returned: the
  caller builds it again. A dataset without a record (prepared before records were kept) is
  used as it is.
  """
  if not builder.is_prepared():
    return False
  path = builder.data_path / SOURCES_FILE
  try:
    record = archives.record_from_json(path.read_text())
  except OSError:
    return True
  if not record or manual_dir is None:
    return True
  reason, updated = check_record(record, os.fspath(manual_dir))
  if reason is None:
    if updated:
      with contextlib.suppress(OSError):  # a read-only dataset: hashed again next time
        if "://" in os.fspath(path):
          path.write_text(archives.record_to_json(updated))
        else:
          archives.write_atomic(os.fspath(path), archives.record_to_json(updated))
    return True
  print(f"{label}: {reason}; rebuilding the dataset in {builder.data_dir}.", file=sys.stderr,
        flush=True)
  with building(builder, label):
    discard(builder)
  return False


def discard(builder: tfds.core.DatasetBuilder) -> None:
  """Removes the prepared dataset: renamed to an `incomplete.*` name first (one step, and a kill
  in the middle of deleting leaves a folder that the next preparation removes)."""
  path = builder.data_path
  if path.exists():
    gone = path.parent / f"incomplete.stale{secrets.token_hex(3).upper()}_{path.name}"
    path.rename(gone)
    gone.rmtree()


class PaddedSource:
  """Random access to one split; token fields padded to fixed lengths, ids offset by `offset`.

  `lengths` maps each token field (a 1-D uint8 array in the dataset) to its length L: the first
  L values are kept (longer examples are truncated at the end), each becomes `value + offset`
  as int32, and the rest is 0 (padding). Other fields come through as int32 arrays.
  """

  def __init__(self, source, lengths: Mapping[str, int], *, offset: int = 0):
    self._source = source
    self.lengths = {k: int(v) for k, v in lengths.items()}
    self.offset = int(offset)

  def __len__(self) -> int:
    return len(self._source)

  def _pad(self, record: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for key, value in record.items():
      if key in self.lengths:
        ids = np.asarray(value)[:self.lengths[key]]
        padded = np.zeros(self.lengths[key], np.int32)  # [L]
        padded[:ids.size] = ids.astype(np.int32) + self.offset
        out[key] = padded
      else:
        out[key] = np.asarray(value, np.int32)
    return out

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < len(self._source):
      raise IndexError(f"index {index} out of range for a split of {len(self._source)} examples.")
    return self._pad(self._source[int(index)])

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
    return [self._pad(r) for r in self._source.__getitems__([int(i) for i in indices])]

  def __repr__(self) -> str:
    return f"PaddedSource({self._source!r}, lengths={self.lengths}, offset={self.offset})"


@dataclasses.dataclass
class Status:
  """One line of `lra data status`: is the task's dataset ready, and if not what it needs."""
  task: str
  ready: bool
  detail: str  # the dataset folder when ready; otherwise what to do
  missing: bool = False   # an input file is absent: a run without data.download stops on it


def archive_status(task: str, builder: tfds.core.DatasetBuilder,
                   needed: Sequence[tuple[archives.Archive, str]], *,
                   present: Sequence[bool] | None = None) -> Status:
  """Status of a task built from archives. `needed` lists (archive, manual_dir);
  `present[i]` overrides the file check (for the LRA release, which may be extracted)."""
  if builder.is_prepared():
    return Status(task, True, os.fspath(builder.data_dir))
  missing = []
  for i, (archive, manual_dir) in enumerate(needed):
    here = present[i] if present is not None else os.path.isfile(
        os.path.join(os.path.expanduser(manual_dir), archive.filename))
    if not here:
      missing.append(archives.missing_message(archive, os.path.expanduser(manual_dir)))
  if missing:
    return Status(task, False, " ".join(missing), missing=True)
  return Status(task, False, f"the input files are in place; `lra data prepare {task}` (or the "
                             f"first `lra run {task}`) builds the dataset in "
                             f"{builder.data_dir}.")


@dataclasses.dataclass(frozen=True)
class TaskData:
  """The data functions of one task (`build`, `prepare`, `status`), from three task functions.

  - `builder(data_cfg)`: the task's builder for the data settings, made once per call; its config
    name says where the data comes from, so it needs no original file.
  - `locate(data_cfg)`: the folder holding the original files (the build's manual_dir), after
    downloading or extracting them where the settings allow, else DataMissingError naming what
    to get and where; None when the builder reads no file. Called only to build, so a prepared
    dataset loads without its original files.
  - `pending(data_cfg, builder)`: the status line while the dataset is not prepared.
  - `refresh(data_cfg)` (optional): run first by `build`; removes files extracted from an
    archive that has since been replaced (`drop_stale_extraction`).
  A prepared dataset whose archive in data.manual_dir was replaced is built again (`reuse`).
  """

  task: str
  builder: Callable[[ml_collections.ConfigDict], tfds.core.DatasetBuilder]
  locate: Callable[[ml_collections.ConfigDict], epath.PathLike | None]
  pending: Callable[[ml_collections.ConfigDict, tfds.core.DatasetBuilder], Status]
  refresh: Callable[[ml_collections.ConfigDict], None] | None = None

  @classmethod
  def from_archive(cls, task: str, archive: archives.Archive,
                   builder: Callable[[ml_collections.ConfigDict], tfds.core.DatasetBuilder]
                   ) -> TaskData:
    """A task made from one archive in data.manual_dir (downloaded there with data.download)."""
    return cls(
        task, builder,
        locate=lambda data_cfg: os.path.dirname(archives.locate(
            archive, data_cfg.manual_dir, download=data_cfg.download)),
        pending=lambda data_cfg, b: archive_status(task, b, [(archive, data_cfg.manual_dir)]))

  @classmethod
  def generated(cls, task: str, builder_class: type[tfds.core.DatasetBuilder],
                builder_config: Callable[[ml_collections.ConfigDict], tfds.core.BuilderConfig],
                generator: str) -> TaskData:
    """A task whose data a generator makes (no original file): `builder_class` with the config
    `builder_config(data_cfg)` in data.data_dir; while not prepared, the status says that the
    `generator` builds it on first use."""
    def builder(data_cfg):
      return builder_class(config=builder_config(data_cfg),
                           data_dir=os.path.expanduser(data_cfg.data_dir))

    def pending(data_cfg, b):
      del data_cfg
      return Status(task, False, f"built from the {generator} on first use (or by `lra data "
                                 f"prepare {task}`) in {b.data_dir}.")
    return cls(task, builder, locate=lambda data_cfg: None, pending=pending)

  def build(self, data_cfg: ml_collections.ConfigDict) -> tfds.core.DatasetBuilder:
    """The builder of data_cfg's dataset, prepared first (from the located files) if needed."""
    if self.refresh is not None:
      self.refresh(data_cfg)
    builder = self.builder(data_cfg)
    if builder.is_prepared():
      if reuse(builder, self.task, data_cfg.get("manual_dir")):
        return builder
      builder = self.builder(data_cfg)
    return prepare(builder, self.task, self.locate(data_cfg))

  def prepare(self, data_cfg: ml_collections.ConfigDict) -> str:
    """Builds the dataset for data_cfg if needed; returns its folder."""
    return os.fspath(self.build(data_cfg).data_dir)

  def status(self, data_cfg: ml_collections.ConfigDict) -> Status:
    """Whether the dataset is prepared (and where); if not, what it needs."""
    builder = self.builder(data_cfg)
    if builder.is_prepared():
      return Status(self.task, True, os.fspath(builder.data_dir))
    return self.pending(data_cfg, builder)
