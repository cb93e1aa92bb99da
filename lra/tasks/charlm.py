"""Character language modelling: enwik8 and text8 (the Longformer / Transformer-XL benchmarks).

enwik8: the first 10^8 bytes of an English Wikipedia XML dump (`enwik8.zip`), every byte value a
token, XML markup and UTF-8 multi-byte sequences as they are. text8: 10^8 characters of the same
articles reduced to a-z and space (`text8.zip`), read at byte level too (27 ids occur). Both use
the standard split by position (90M / 5M / 5M), id = byte + 1 (vocabulary 257, 0 = padding).

The dataset, training windows, every-character-once evaluation windows and the fallback corpus
(used without the archive when `data.fallback` is set) are in `lra.data.charlm`; see
docs/character_lm.md.
"""

from __future__ import annotations

import functools

import numpy as np

from lra.data import builders, charlm
from lra.tasks.language_model import LanguageModelTask, stream_rows


def streams(windows: charlm.Windows, rows: int) -> charlm.Windows:
  """The training windows in the order of `rows` contiguous streams, unshuffled: batch t row r
  is window r * n + t of the n = len // rows windows of stream r (Transformer-XL's batches, for
  a memory carried across steps); the remainder of the split is left out."""
  n = len(windows) // rows
  if n < 1:
    raise ValueError(f"{len(windows)} training windows cannot make {rows} streams.")
  order = (np.arange(rows)[None, :] * n + np.arange(n)[:, None]).reshape(-1)   # [t, r]
  out = charlm.Windows(windows.stream, windows.starts[order], windows.length,
                       windows.first_scored[order])
  out.shuffle = False
  return out


def eval_streams(stream: np.ndarray, rows: int) -> charlm.Windows:
  """The evaluation split as contiguous rows (Transformer-XL's evaluation): row r reads
  characters [r n, (r + 1) n] (inputs and the targets one ahead) and scores them all, so every
  character after the first is scored exactly once; the model reads a row in segments with its
  memory carried across (lra/tasks/language_model.py)."""
  if stream.size < 2:
    raise ValueError("a split needs at least 2 characters to evaluate on.")
  count, length = stream_rows(stream.size, rows)
  return charlm.Windows(stream, np.arange(count) * length, length, np.zeros(count, np.int64))


def get_source(corpus, data_cfg, split: str):
  """`charlm.get_source`; with `data.streams` > 0 the training windows are `streams`, with
  `data.eval_streams` > 0 the evaluation splits are `eval_streams`."""
  source = charlm.get_source(corpus, data_cfg, split)
  rows = int(data_cfg.get("streams", 0) or 0)
  if split == "train":
    return streams(source, rows) if rows else source
  eval_rows = int(data_cfg.get("eval_streams", 0) or 0)
  return eval_streams(source.stream, eval_rows) if eval_rows else source


def _task(name: str) -> LanguageModelTask:
  corpus = charlm.CORPORA[name]
  return LanguageModelTask(
      name=name, vocab_size=builders.BYTE_VOCAB_SIZE, num_classes=builders.BYTE_VOCAB_SIZE,
      get_source=functools.partial(get_source, corpus),
      prepare=functools.partial(charlm.prepare, corpus),
      status=functools.partial(charlm.status, corpus))


ENWIK8 = _task("enwik8")
TEXT8 = _task("text8")
