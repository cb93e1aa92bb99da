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
- `prepare` builds the dataset when it is not there yet, with a progress note. tfds writes into a
  temporary folder that it renames when complete and deletes on failure, so an error (a corrupt
  archive, Ctrl-C) leaves no half-written dataset.
- `TaskData`: a task's `build`/`prepare`/`status` from its builder, how to find its original
  files, and what its status says while they are not built; `TaskData.from_archive` for a task
  made from one archive.
- `PaddedSource`: random access to one split for grain; pads token fields to fixed lengths and
  adds an id offset. Bytes and pixels are stored raw (0..255) and read as ids 1..256
  (`BYTE_OFFSET`), so id 0 is padding in every task and a black pixel or a NUL byte is data.
- `Status` and `archive_status`: what `lra data status` prints for one task.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Callable, Mapping, Sequence

from etils import epath
import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from lra.data import archives

BYTE_OFFSET = 1          # stored byte/pixel value v is token id v + 1; 0 is padding
BYTE_VOCAB_SIZE = 257    # padding + 256 byte values
SPLITS = ("train", "validation", "test")


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


class LabelledBuilder(Builder, skip_registration=True):
  """Base of the classification datasets: token arrays `INPUTS` and an int32 `targets` label.

  Each token field is a variable-length uint8 array (`token_feature`: ids, bytes or pixels, no
  padding). The description is the task module's docstring. With `DISABLE_SHUFFLING` (the
  default) the examples are stored in the order the builder yields them.
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


def prepare(builder: tfds.core.DatasetBuilder, label: str,
            manual_dir: epath.PathLike | None = None) -> tfds.core.DatasetBuilder:
  """Builds `builder`'s dataset as array_record unless it is already prepared; returns it.

  `manual_dir` is the folder holding the original files (tfds' `DownloadConfig.manual_dir`, read
  by the builder as `dl_manager.manual_dir`); None for a builder that reads no files.
  """
  if builder.is_prepared():
    return builder
  print(f"{label}: preparing {builder.builder_config.name} in {builder.data_dir} ...",
        file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  builder.download_and_prepare(
      file_format="array_record",
      download_config=tfds.download.DownloadConfig(
          manual_dir=manual_dir, compute_stats=tfds.download.ComputeStatsMode.SKIP))
  print(f"{label}: prepared in {time.perf_counter() - t0:.0f} s.", file=sys.stderr, flush=True)
  return builder


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
    return Status(task, False, " ".join(missing))
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
  """

  task: str
  builder: Callable[[ml_collections.ConfigDict], tfds.core.DatasetBuilder]
  locate: Callable[[ml_collections.ConfigDict], epath.PathLike | None]
  pending: Callable[[ml_collections.ConfigDict, tfds.core.DatasetBuilder], Status]

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

  def build(self, data_cfg: ml_collections.ConfigDict) -> tfds.core.DatasetBuilder:
    """The builder of data_cfg's dataset, prepared first (from the located files) if needed."""
    builder = self.builder(data_cfg)
    if builder.is_prepared():
      return builder
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
