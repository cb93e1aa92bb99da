"""text8: character-level language modelling on 10^8 characters of Wikipedia text in a-z and space.

Data: `text8.zip` (http://mattmahoney.net/dc/text8.zip, member `text8`, 100,000,000 characters
of lowercase letters and single spaces), placed in `data.manual_dir`. Standard split by
position: 90M / 5M / 5M characters. Read at byte level like enwik8 (id = byte + 1, VOCAB_SIZE 257;
only 27 ids occur).

The dataset, training windows, bits-per-character evaluation windows and the fallback corpus
(used without the archive when `data.fallback` is set) are shared with the other character-LM
task in `lra/tasks/charlm.py`; see docs/character_lm.md.
"""

from __future__ import annotations

import ml_collections

from lra import datasets
from lra.tasks import charlm

NAME = "text8"
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
  """Builds the dataset (from text8.zip, or the fallback corpus) if needed; returns its folder."""
  return charlm.prepare(CORPUS, data_cfg)


def status(data_cfg: ml_collections.ConfigDict) -> datasets.Status:
  """Whether the dataset is prepared, and if not what it needs."""
  return charlm.status(CORPUS, data_cfg)
