"""enwik8: byte-level language modelling on the first 10^8 bytes of English Wikipedia XML.

Data: `enwik8.zip` (http://mattmahoney.net/dc/enwik8.zip, member `enwik8`, 100,000,000 bytes),
placed in `data.manual_dir`. Standard split by position: 90M / 5M / 5M bytes. Every byte value is
a token (id = byte + 1, VOCAB_SIZE 257); the XML markup and UTF-8 multi-byte sequences stay as
they are.

The dataset, training windows, bits-per-character evaluation windows and the fallback corpus
(used without the archive when `data.fallback` is set) are shared with the other character-LM
task in `lra/tasks/charlm.py`; see docs/character_lm.md.
"""

from __future__ import annotations

import ml_collections

from lra import datasets
from lra.tasks import charlm

NAME = "enwik8"
MODEL = "lm"
PAD_ID = 0
VOCAB_SIZE = datasets.BYTE_VOCAB_SIZE     # 256 byte values + padding
NUM_CLASSES = VOCAB_SIZE                  # the LM predicts a token id at every position
CORPUS = charlm.CORPORA[NAME]
ARCHIVE = CORPUS.archive


def data_config() -> ml_collections.ConfigDict:
  """Data settings: the standard 90M/5M/5M split, window lengths, no fallback."""
  return charlm.data_config(CORPUS)


def get_source(data_cfg: ml_collections.ConfigDict, split: str) -> charlm.Windows:
  """Training windows ("train") or every-character-once evaluation windows of a split."""
  return charlm.get_source(CORPUS, data_cfg, split)


def prepare(data_cfg: ml_collections.ConfigDict) -> str:
  """Builds the dataset (from enwik8.zip, or the fallback corpus) if needed; returns its folder."""
  return charlm.prepare(CORPUS, data_cfg)


def status(data_cfg: ml_collections.ConfigDict) -> datasets.Status:
  """Whether the dataset is prepared, and if not what it needs."""
  return charlm.status(CORPUS, data_cfg)
