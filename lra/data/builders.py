"""Shared pieces of the task datasets: the tfds builder base, preparing, padded sources, status.

- `Builder`: the base of our tfds GeneratorBasedBuilders. They write array_record files, need no
  TensorFlow, and are not registered in the tfds catalogue (subclass with
  `skip_registration=True`). `token_feature()` is the feature of a variable-length uint8 array.
- `prepare(builder, label)`: builds the dataset when it is not there yet, with a progress note.
  tfds writes into a temporary folder that it renames when complete and deletes on failure, so
  an error (a corrupt archive, Ctrl-C) leaves no half-written dataset.
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
from typing import Mapping, Sequence

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
  """Base of the task builders: version 1.0.0, configs made per data origin by the task."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}
  BUILDER_CONFIGS = []

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # tfds' default lookup goes through importlib_resources, which is not a dependency here.
    return epath.Path(sys.modules[cls.__module__].__file__)


def prepare(builder: tfds.core.DatasetBuilder, label: str) -> tfds.core.DatasetBuilder:
  """Builds `builder`'s dataset as array_record unless it is already prepared; returns it."""
  if builder.is_prepared():
    return builder
  print(f"{label}: preparing {builder.builder_config.name} in {builder.data_dir} ...",
        file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  builder.download_and_prepare(
      file_format="array_record",
      download_config=tfds.download.DownloadConfig(
          compute_stats=tfds.download.ComputeStatsMode.SKIP))
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
