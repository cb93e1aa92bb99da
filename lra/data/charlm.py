"""Character language modelling (enwik8, text8): the byte-stream dataset, windows, and a fallback.

Corpora: `enwik8.zip` (member `enwik8`: the first 100,000,000 bytes of an English Wikipedia XML
dump) and `text8.zip` (member `text8`: 100,000,000 characters of the same articles reduced to
a-z and space), both from http://mattmahoney.net/dc/. The standard split (Mikolov et al. 2012,
used by Transformer-XL and Longformer) is by position: the first 90M characters train, the next
5M validation, the next 5M test. `data.split_sizes` sets other boundaries (tiny test fixtures;
a prefix of the corpus), always in this order and never past the end of the file.

Storage: one tfds builder (array_record) whose three splits each hold the split's bytes as a
sequence of `CHUNK_BYTES` chunks, `{"index": chunk number, "bytes": uint8 [<= CHUNK_BYTES]}`,
written in stream order with shuffling disabled; the reader sorts by `index` and concatenates,
so the stream is recovered exactly whatever the storage order. Byte v is token id v + 1
(`builders.BYTE_OFFSET`), VOCAB_SIZE 257, id 0 padding: a NUL byte is data. The builder reads
the archive from tfds' manual_dir, the folder `archives.locate` found it in (or downloaded it
to).

Examples (`{"inputs", "targets", "mask"}`, int32 [L] each): a window starting at s has inputs
stream[s : s + L] + 1 and targets stream[s + 1 : s + L + 1] + 1; `mask` is 1 at the positions
that are scored (0 past the end of the split, where inputs and targets are padding).
- train: windows of max_length + 1 bytes starting every max_length bytes (plus one window ending
  at the end of the split), all positions scored; the grain pipeline shuffles them.
- validation/test: the Transformer-XL / Longformer protocol, in which every character after the
  first is predicted exactly once. Windows of L = eval_length bytes with stride
  S = L - eval_context: the first window scores all its positions, every later one only its last
  S positions (each with at least eval_context + 1 characters of context in the window); the
  last window is padded and masked. Summing -log p over the masked positions and dividing by
  their number gives the exact bits per character of the split (divided by ln 2).
- with `data.streams` = R > 0, the training windows in the order of R contiguous streams,
  unshuffled (`streams`: Transformer-XL's batches, for a memory carried across steps); with
  `data.eval_streams` = R > 0, each evaluation split as at most R contiguous rows (`eval_streams`),
  read by the model in segments with its memory carried across.

Fallback corpus: with `data.fallback` (the default only for the CPU configs) and no archive, the
same builder, windows and evaluation run on real English text that every Python installation
has: the reference-manual topics of `pydoc_data.topics` joined in sorted key order, as UTF-8
for enwik8 and reduced to text8's alphabet for text8, split 90/5/5 by position, under its own
builder config name (with a digest of the text). A note says which corpus is in use and where
to put the real archive.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import sys
from typing import Sequence

import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from lra.data import archives, builders

CHUNK_BYTES = 1 << 20
STANDARD_SPLIT = (90_000_000, 5_000_000, 5_000_000)   # train, validation, test characters
FALLBACK_DESCRIPTION = ("the fallback corpus (Python's reference-manual topics from "
                        "pydoc_data.topics, real English prose of about 0.5-0.8 MB)")


@dataclasses.dataclass(frozen=True)
class Corpus:
  """One character-LM corpus: its task name, original archive and member, fallback form."""
  name: str
  archive: archives.Archive
  member: str
  fallback_alphabet: str   # "bytes" (UTF-8 as is) or "text8" (a-z and single spaces)


CORPORA = {
    "enwik8": Corpus("enwik8", archives.Archive(
        "enwik8.zip", "http://mattmahoney.net/dc/enwik8.zip",
        "the first 10^8 bytes of an English Wikipedia XML dump; a zip of 36 MB"),
        member="enwik8", fallback_alphabet="bytes"),
    "text8": Corpus("text8", archives.Archive(
        "text8.zip", "http://mattmahoney.net/dc/text8.zip",
        "10^8 characters of English Wikipedia reduced to a-z and space; a zip of 31 MB"),
        member="text8", fallback_alphabet="text8"),
}

_NOTED: set = set()   # fallback notes already printed in this process


def eval_geometry(data_cfg: ml_collections.ConfigDict) -> tuple[int, int]:
  """(L, context) of the evaluation windows; raises when they do not make a stride."""
  length = int(data_cfg.eval_length or data_cfg.max_length)
  context = int(data_cfg.eval_context)
  if length < 1 or not 0 <= context < length:
    raise ValueError(
        f"the evaluation windows need 0 <= data.eval_context < data.eval_length (or "
        f"max_length when eval_length is 0); got eval_context={context}, length={length}. "
        f"The stride is length - eval_context: set eval_context to length - 512 for the "
        f"Longformer protocol, or lower it.")
  return length, context


# ----------------------------------------------------------------------------------------------
# The text: archive or fallback, and the split boundaries.


def fallback_text(corpus: Corpus) -> bytes:
  """The fallback corpus as bytes of `corpus`'s kind (UTF-8, or text8's a-z and space)."""
  from pydoc_data import topics
  text = "\n".join(topics.topics[key] for key in sorted(topics.topics))
  if corpus.fallback_alphabet == "text8":
    text = re.sub(r"[^a-z]+", " ", text.lower()).strip()
  return text.encode("utf-8")


def split_bounds(total: int, split_sizes: Sequence[int] | None) -> list[tuple[int, int]]:
  """[(start, end)] of train, validation, test over a text of `total` characters.

  `split_sizes` gives the three lengths in order from the start; None splits 90/5/5.
  """
  if split_sizes is None:
    val = test = total // 20
    sizes = (total - val - test, val, test)
  else:
    sizes = tuple(int(s) for s in split_sizes)
    if len(sizes) != 3 or min(sizes) < 2:
      raise ValueError(f"data.split_sizes must be three sizes (train, validation, test) of at "
                       f"least 2 characters each, got {split_sizes}.")
    if sum(sizes) > total:
      raise ValueError(
          f"data.split_sizes {sizes} add up to {sum(sizes):,} characters but the text has "
          f"{total:,}; the standard split {STANDARD_SPLIT} needs the full 100,000,000-character "
          f"file. Set data.split_sizes to fit.")
  bounds, start = [], 0
  for size in sizes:
    bounds.append((start, start + size))
    start += size
  return bounds


# ----------------------------------------------------------------------------------------------
# tfds dataset (array_record).


@dataclasses.dataclass
class CharLMConfig(tfds.core.BuilderConfig):
  """Where the text comes from: the corpus archive (in the manual_dir), or the fallback corpus."""
  corpus: str = ""
  split_sizes: tuple = ()       # () = 90/5/5 by position (the fallback corpus)
  fallback: bool = False


class CharLMBuilder(builders.Builder, skip_registration=True):
  """A character stream per split, stored as numbered uint8 chunks in stream order."""

  name = "char_lm"
  RELEASE_NOTES = {"1.0.0": "Byte chunks of the standard enwik8/text8 splits or a fallback."}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "index": tfds.features.Tensor(shape=(), dtype=np.int64),   # chunk number
            "bytes": builders.token_feature(),                       # raw bytes, no padding
        }),
        homepage="http://mattmahoney.net/dc/textdata.html",
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    cfg = self.builder_config
    corpus = CORPORA[cfg.corpus]
    if cfg.fallback:
      data = fallback_text(corpus)
    else:
      path = os.fspath(dl_manager.manual_dir / corpus.archive.filename)
      data = archives.zip_member(path, corpus.member, corpus.archive)
    text = np.frombuffer(data, np.uint8)
    bounds = split_bounds(text.size, None if cfg.fallback else cfg.split_sizes)
    return {split: self._generate_examples(text[a:b])
            for split, (a, b) in zip(builders.SPLITS, bounds)}

  def _generate_examples(self, stream: np.ndarray):
    for index, start in enumerate(range(0, stream.size, CHUNK_BYTES)):
      yield index, {"index": np.int64(index), "bytes": stream[start:start + CHUNK_BYTES]}


def archive_config(corpus: Corpus, data_cfg: ml_collections.ConfigDict) -> CharLMConfig:
  """The builder config for the archive: named after the corpus (and non-standard splits)."""
  sizes = tuple(int(s) for s in data_cfg.split_sizes)
  name = corpus.name if sizes == STANDARD_SPLIT else (
      f"{corpus.name}_split{'_'.join(str(s) for s in sizes)}")
  return CharLMConfig(name=name, corpus=corpus.name, split_sizes=sizes,
                      description=f"{corpus.archive.filename}, splits {sizes}.")


def fallback_config(corpus: Corpus) -> CharLMConfig:
  """The builder config for the fallback corpus: named after a digest of its text."""
  digest = hashlib.sha256(fallback_text(corpus)).hexdigest()[:10]
  kind = "" if corpus.fallback_alphabet == "bytes" else f"_{corpus.fallback_alphabet}"
  return CharLMConfig(name=f"fallback_pydoc{kind}_{digest}", corpus=corpus.name, fallback=True,
                      description=f"Fallback: {FALLBACK_DESCRIPTION}, split 90/5/5.")


def _note_fallback(corpus: Corpus, manual_dir: str, size: int) -> None:
  key = (corpus.name, manual_dir)
  if key in _NOTED:
    return
  _NOTED.add(key)
  print(f"NOTE: {corpus.name}: {corpus.archive.filename} is not in {manual_dir}, so this run "
        f"uses {FALLBACK_DESCRIPTION}: {size:,} characters, split 90/5/5. Its bits per "
        f"character are not comparable with published {corpus.name} results. For the real "
        f"corpus, download {corpus.archive.url} and place it as "
        f"{os.path.join(manual_dir, corpus.archive.filename)}.", file=sys.stderr, flush=True)


def resolve(corpus: Corpus, data_cfg: ml_collections.ConfigDict
            ) -> tuple[CharLMBuilder, str | None]:
  """(builder, manual_dir) for data_cfg: the archive's dataset (prepared, or with the folder of
  the archive, found or downloaded), else the fallback corpus (no manual_dir) when
  data.fallback is set; raises DataMissingError otherwise."""
  data_dir = os.path.expanduser(data_cfg.data_dir)
  manual_dir = os.path.expanduser(data_cfg.manual_dir)
  builder = CharLMBuilder(config=archive_config(corpus, data_cfg), data_dir=data_dir)
  if builder.is_prepared():
    if builders.reuse(builder, corpus.name, manual_dir):   # rebuilt if its archive was replaced
      return builder, None
    builder = CharLMBuilder(config=archive_config(corpus, data_cfg), data_dir=data_dir)
  try:
    path = archives.locate(corpus.archive, manual_dir, download=bool(data_cfg.download))
  except archives.DataMissingError as e:
    if not data_cfg.fallback:
      raise archives.DataMissingError(
          f"{e} Or set data.fallback=True to train on {FALLBACK_DESCRIPTION} instead (a "
          f"demo, not the benchmark).") from None
    config = fallback_config(corpus)
    _note_fallback(corpus, manual_dir, len(fallback_text(corpus)))
    return CharLMBuilder(config=config, data_dir=data_dir), None
  return builder, os.path.dirname(path)


def build(corpus: Corpus, data_cfg: ml_collections.ConfigDict) -> CharLMBuilder:
  """Prepares the dataset for data_cfg if it is not there yet; returns its builder."""
  builder, manual_dir = resolve(corpus, data_cfg)
  return builders.prepare(builder, corpus.name, manual_dir)


def prepare(corpus: Corpus, data_cfg: ml_collections.ConfigDict) -> str:
  """Builds the dataset for data_cfg if needed; returns its folder."""
  return os.fspath(build(corpus, data_cfg).data_dir)


def status(corpus: Corpus, data_cfg: ml_collections.ConfigDict) -> builders.Status:
  """Whether the dataset is prepared; if not, what it needs (and whether the fallback is on)."""
  data_dir = os.path.expanduser(data_cfg.data_dir)
  manual_dir = os.path.expanduser(data_cfg.manual_dir)
  builder = CharLMBuilder(config=archive_config(corpus, data_cfg), data_dir=data_dir)
  st = builders.archive_status(corpus.name, builder, [(corpus.archive, manual_dir)])
  if st.ready or not data_cfg.fallback or os.path.isfile(
      os.path.join(manual_dir, corpus.archive.filename)):
    return st
  fallback = CharLMBuilder(config=fallback_config(corpus), data_dir=data_dir)
  if fallback.is_prepared():
    return builders.Status(corpus.name, True, f"{fallback.data_dir} (the fallback corpus; for "
                                              f"the benchmark: {st.detail})")
  return builders.Status(corpus.name, False, f"{st.detail} Until then, data.fallback=True "
                                             f"builds {FALLBACK_DESCRIPTION} on first use.")


# ----------------------------------------------------------------------------------------------
# Reading: the split's stream, and windows over it.


def read_stream(builder: CharLMBuilder, split: str) -> np.ndarray:
  """The whole split as one uint8 array, in stream order."""
  source = builder.as_data_source(split=split)
  records = source.__getitems__(list(range(len(source))))
  records = sorted(records, key=lambda r: int(r["index"]))
  if [int(r["index"]) for r in records] != list(range(len(records))):
    raise ValueError(f"{builder.data_dir}: the {split} chunks are not numbered 0..{len(records)-1}"
                     f"; delete the folder to rebuild the dataset.")
  return np.concatenate([np.asarray(r["bytes"], np.uint8) for r in records] or
                        [np.zeros(0, np.uint8)])


class Windows:
  """Random access to windows of a byte stream: {"inputs", "targets", "mask"} int32 [L].

  Window i starts at starts[i]; inputs are stream[s : s + L] + 1 and targets stream[s + 1 :
  s + L + 1] + 1, zero-padded past the end; mask is 1 at positions first_scored[i].. that have
  a real target.
  """

  def __init__(self, stream: np.ndarray, starts: np.ndarray, length: int,
               first_scored: np.ndarray):
    self.stream = np.asarray(stream, np.uint8)
    self.starts = np.asarray(starts, np.int64)
    self.first_scored = np.asarray(first_scored, np.int64)
    self.length = int(length)

  def __len__(self) -> int:
    return int(self.starts.size)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < len(self):
      raise IndexError(f"index {index} out of range for {len(self)} windows.")
    s, length = int(self.starts[index]), self.length
    seg = self.stream[s:s + length + 1].astype(np.int32) + builders.BYTE_OFFSET
    inputs = np.zeros(length, np.int32)                                   # [L]
    targets = np.zeros(length, np.int32)                                  # [L]
    mask = np.zeros(length, np.int32)                                     # [L]
    inputs[:min(length, seg.size)] = seg[:length]
    real = max(seg.size - 1, 0)
    targets[:real] = seg[1:]
    mask[int(self.first_scored[index]):real] = 1
    return {"inputs": inputs, "targets": targets, "mask": mask}

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
    return [self[int(i)] for i in indices]

  def __repr__(self) -> str:
    return (f"Windows({len(self)} of length {self.length} over {self.stream.size:,} "
            f"characters)")


def train_windows(stream: np.ndarray, length: int) -> Windows:
  """Windows of length + 1 characters every `length` characters, plus one ending at the end."""
  if stream.size < 2:
    raise ValueError("a split needs at least 2 characters to make a training window.")
  last = max(stream.size - 1 - length, 0)
  starts = list(range(0, last + 1, length))
  if starts[-1] != last:
    starts.append(last)
  return Windows(stream, np.array(starts), length, np.zeros(len(starts), np.int64))


def eval_windows(stream: np.ndarray, length: int, context: int) -> Windows:
  """Every character after the first scored once: stride length - context, the first window
  scoring all positions and the others their last (length - context)."""
  if stream.size < 2:
    raise ValueError("a split needs at least 2 characters to evaluate on.")
  stride = length - context
  count = 1 + max(0, math.ceil((stream.size - 1 - length) / stride))
  first = np.full(count, context, np.int64)
  first[0] = 0
  return Windows(stream, np.arange(count) * stride, length, first)


def stream_rows(size: int, rows: int) -> tuple[int, int]:
  """(rows, row length) of a split of `size` characters read as at most `rows` contiguous
  streams: the `size - 1` targets (every character after the first) in rows of
  ceil((size - 1) / rows) characters, the last row shorter, no row empty."""
  targets = max(int(size) - 1, 1)
  length = -(-targets // int(rows))
  return -(-targets // length), length


def streams(windows: Windows, rows: int) -> Windows:
  """The training windows in the order of `rows` contiguous streams, unshuffled: batch t row r
  is window r * n + t of the n = len // rows windows of stream r (Transformer-XL's batches, for
  a memory carried across steps); the remainder of the split is left out."""
  n = len(windows) // rows
  if n < 1:
    raise ValueError(f"{len(windows)} training windows cannot make {rows} streams.")
  order = (np.arange(rows)[None, :] * n + np.arange(n)[:, None]).reshape(-1)   # [t, r]
  out = Windows(windows.stream, windows.starts[order], windows.length,
                windows.first_scored[order])
  out.shuffle = False
  return out


def eval_streams(stream: np.ndarray, rows: int) -> Windows:
  """The evaluation split as contiguous rows (Transformer-XL's evaluation): row r reads
  characters [r n, (r + 1) n] (inputs and the targets one ahead) and scores them all, so every
  character after the first is scored exactly once; the model reads a row in segments with its
  memory carried across (lra/tasks/language_model.py)."""
  if stream.size < 2:
    raise ValueError("a split needs at least 2 characters to evaluate on.")
  count, length = stream_rows(stream.size, rows)
  return Windows(stream, np.arange(count) * length, length, np.zeros(count, np.int64))


def get_source(corpus: Corpus, data_cfg: ml_collections.ConfigDict, split: str) -> Windows:
  """Training windows ("train") or evaluation windows ("validation", "test") of the split; with
  `data.streams` > 0 the training windows are `streams`, with `data.eval_streams` > 0 the
  evaluation splits are `eval_streams`."""
  builders.check_split(corpus.name, split)
  length, context = eval_geometry(data_cfg)
  stream = read_stream(build(corpus, data_cfg), split)
  if split == "train":
    windows = train_windows(stream, int(data_cfg.max_length))
    rows = int(data_cfg.get("streams", 0) or 0)
    return streams(windows, rows) if rows else windows
  rows = int(data_cfg.get("eval_streams", 0) or 0)
  return eval_streams(stream, rows) if rows else eval_windows(stream, length, context)
