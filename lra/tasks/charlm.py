"""Character language modelling: enwik8 and text8 (the Longformer / Transformer-XL benchmarks).

enwik8: the first 10^8 bytes of an English Wikipedia XML dump (`enwik8.zip`), every byte value a
token, XML markup and UTF-8 multi-byte sequences as they are. text8: 10^8 characters of the same
articles reduced to a-z and space (`text8.zip`), read at byte level too (27 ids occur). Both use
the standard split by position (90M / 5M / 5M), id = byte + 1 (vocabulary 257, 0 = padding).

The dataset, training windows and their contiguous streams, every-character-once evaluation
windows or rows and the fallback corpus (used without the archive when `data.fallback` is set)
are in `lra.data.charlm`; this file pairs each corpus with the language-model family. See
docs/character_lm.md.
"""

from __future__ import annotations

import functools

from lra.data import builders, charlm
from lra.tasks.language_model import LanguageModelTask


def _task(name: str) -> LanguageModelTask:
  corpus = charlm.CORPORA[name]
  return LanguageModelTask(
      name=name, vocab_size=builders.BYTE_VOCAB_SIZE, num_classes=builders.BYTE_VOCAB_SIZE,
      get_source=functools.partial(charlm.get_source, corpus),
      prepare=functools.partial(charlm.prepare, corpus),
      status=functools.partial(charlm.status, corpus))


ENWIK8 = _task("enwik8")
TEXT8 = _task("text8")
