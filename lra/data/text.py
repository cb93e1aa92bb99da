"""The Text dataset (LRA): IMDb sentiment from raw bytes, 2 classes, built from the original
aclImdb archive; the task is `lra.tasks.text`.

Archive: `aclImdb_v1.tar.gz` (the Large Movie Review Dataset v1.0, 84 MB) from
https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz, placed in `data.manual_dir`.
Its members `aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt` are the 25,000 + 25,000 labelled
reviews (`pos` = label 1, `neg` = label 0); `aclImdb/train/unsup/`, `urls_*.txt`, `*.feat`,
`imdb.vocab` and `README` are ignored. The archive is read once, as a stream, and verified to its
end (gzip CRC-32 and length, and the SHA-256 that TensorFlow Datasets publishes for it).

Stored example: the review's UTF-8 bytes with surrounding ASCII whitespace stripped (exactly the
text tfds `imdb_reviews` gave LRA), never truncated, as uint8; label int32. Examples are stored
sorted by (label, review id) within each split, so the dataset does not depend on the order of
the archive's members.

Tokenisation (LRA's tfds ByteTextEncoder): id = byte + 1, 0 = padding, VOCAB_SIZE 257. Reading
keeps the FIRST `data.max_length` bytes (LRA base: 1,000; the paper text says 4K) and pads.

Splits: `train` = the 25K train reviews, `test` = the 25K test reviews. LRA had no validation
split and evaluated (and so selected models) on the test set; `data.validation = "test"` (the
default) keeps that, so numbers compare with LRA's. `data.validation = "holdout"` instead holds
out a seeded `data.holdout_fraction` (10%) of the train reviews as the validation split, and
train shrinks accordingly, so models are selected without touching test. The split is applied
at read time over one prepared dataset (train and test), so switching the option needs no
rebuild and the held-out reviews are the same for every max_length.
"""

from __future__ import annotations

import collections
import os
import re
import sys
from typing import Sequence

import ml_collections
import numpy as np
import tensorflow_datasets as tfds
import tqdm

from lra.data import archives, builders

NAME = "text"
NUM_CLASSES = 2
PAD_ID = 0
VOCAB_SIZE = builders.BYTE_VOCAB_SIZE   # 256 byte values + padding

# The SHA-256 (and size, 84,125,825 bytes) that TensorFlow Datasets publishes for this file, in
# tensorflow_datasets/datasets/imdb_reviews/checksums.tsv.
IMDB = archives.Archive(
    "aclImdb_v1.tar.gz", "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz",
    "the Large Movie Review Dataset v1.0 (IMDb reviews; a tar.gz of 84 MB)",
    sha256="c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe")
LABELS = {"neg": 0, "pos": 1}
VALIDATION_CHOICES = ("test", "holdout")
_MEMBER = re.compile(r"^(?:\./)?aclImdb/(train|test)/(pos|neg)/(\d+)_(\d+)\.txt$")


# ----------------------------------------------------------------------------------------------
# Reading the archive.


def read_archive(path: str) -> dict[str, list[tuple[int, int, bytes]]]:
  """The labelled reviews of aclImdb_v1.tar.gz: {"train"|"test": [(label, id, bytes)]}, sorted.

  Raises CorruptArchiveError for a truncated archive or one without the aclImdb layout.
  """
  reviews = {"train": [], "test": []}
  seen = set()
  with tqdm.tqdm(desc=f"{NAME}: reading {os.path.basename(path)}", unit=" reviews",
                 mininterval=1.0) as progress:
    for name, data in archives.tar_members(path, IMDB):
      match = _MEMBER.match(name)
      if not match:
        continue
      split, label, review_id = match.group(1), LABELS[match.group(2)], int(match.group(3))
      if (split, label, review_id) in seen:
        raise archives.CorruptArchiveError(
            f"{path} holds {name} twice; it is not the original archive: download it again "
            f"from {IMDB.url}.")
      seen.add((split, label, review_id))
      reviews[split].append((label, review_id, data.strip()))
      progress.update()
  for split, rows in reviews.items():
    counts = collections.Counter(label for label, _, _ in rows)
    if not counts[0] or not counts[1]:
      raise archives.CorruptArchiveError(
          f"{path} has no reviews under aclImdb/{split}/pos/ or aclImdb/{split}/neg/; it is "
          f"not the expected archive (or is truncated): download it again from {IMDB.url}.")
    rows.sort(key=lambda r: (r[0], r[1]))
  print(f"{NAME}: {len(reviews['train'])} train and {len(reviews['test'])} test reviews "
        f"(the original archive has 25000 and 25000).", file=sys.stderr, flush=True)
  return reviews


# ----------------------------------------------------------------------------------------------
# tfds dataset (array_record).


class TextBuilder(builders.LabelledBuilder, skip_registration=True):
  """IMDb reviews as variable-length uint8 bytes (raw, no padding, no truncation) and an int32
  label, from aclImdb_v1.tar.gz in the manual_dir; sorted by (label, review id)."""

  name = "lra_text"
  RELEASE_NOTES = {"1.0.0": "aclImdb_v1 reviews as stripped UTF-8 bytes, sorted by label, id."}
  HOMEPAGE = "https://ai.stanford.edu/~amaas/data/sentiment/"

  def _split_generators(self, dl_manager):
    reviews = read_archive(os.fspath(dl_manager.manual_dir / IMDB.filename))
    return {split: self._generate_examples(rows) for split, rows in reviews.items()}

  def _generate_examples(self, rows):
    for i, (label, _, text) in enumerate(rows):
      yield i, {"inputs": np.frombuffer(text, np.uint8), "targets": np.int32(label)}


def _builder(data_cfg: ml_collections.ConfigDict) -> TextBuilder:
  return TextBuilder(config=tfds.core.BuilderConfig(name="bytes"),
                     data_dir=os.path.expanduser(data_cfg.data_dir))


# build/prepare/status: the archive is found (or downloaded) in data.manual_dir only to build.
DATA = builders.TaskData.from_archive(NAME, IMDB, _builder)


# ----------------------------------------------------------------------------------------------
# Splits and the random-access source.


class Subset:
  """Random access to the examples `indices` (ascending) of a source."""

  def __init__(self, source, indices: np.ndarray):
    self._source = source
    self.indices = np.asarray(indices, np.int64)

  def __len__(self) -> int:
    return int(self.indices.size)

  def __getitem__(self, index: int):
    return self._source[int(self.indices[index])]

  def __getitems__(self, indices: Sequence[int]) -> list:
    return list(self._source.__getitems__([int(self.indices[i]) for i in indices]))

  def __repr__(self) -> str:
    return f"Subset({self._source!r}, {self.indices.size} examples)"


def holdout_indices(num_train: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(kept train indices, held-out indices), both ascending: a seeded share of the train split."""
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"data.holdout_fraction must be in (0, 1), got {fraction}.")
  num_held = max(1, int(round(fraction * num_train)))
  if num_held >= num_train:
    raise ValueError(f"holding out {num_held} of {num_train} train examples leaves none to "
                     f"train on; lower data.holdout_fraction.")
  perm = np.random.default_rng(seed).permutation(num_train)
  return np.sort(perm[num_held:]), np.sort(perm[:num_held])


def get_source(data_cfg: ml_collections.ConfigDict, split: str) -> builders.PaddedSource:
  """A random-access source for `split` ("train", "validation" or "test"); builds data if needed.

  Examples are {"inputs": int32 [max_length] (byte + 1; 0 = padding), "targets": int32}; longer
  reviews keep their first max_length bytes (as LRA does). "validation" is the test split
  (data.validation="test", LRA) or the held-out part of train (data.validation="holdout").
  """
  builders.check_split(NAME, split)
  if data_cfg.validation not in VALIDATION_CHOICES:
    raise ValueError(f"unknown data.validation {data_cfg.validation!r}; valid: "
                     f"{', '.join(VALIDATION_CHOICES)} (LRA validated on test).")
  builder = DATA.build(data_cfg)
  if split == "test" or (split == "validation" and data_cfg.validation == "test"):
    source = builder.as_data_source(split="test")
  else:
    source = builder.as_data_source(split="train")
    if data_cfg.validation == "holdout":
      kept, held = holdout_indices(len(source), float(data_cfg.holdout_fraction),
                                   int(data_cfg.holdout_seed))
      source = Subset(source, held if split == "validation" else kept)
  return builders.PaddedSource(source, {"inputs": data_cfg.max_length},
                               offset=builders.BYTE_OFFSET)

