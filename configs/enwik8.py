"""enwik8 character language model (Longformer, staged training), for every attention kind.

`arg` keys: `attention` (default `band`; kinds that cannot be causal are refused), `size`
(`base` = Longformer-small, `large` = Longformer-large, `small` = a CPU demo), `window` (the
top layer's one-sided window in phase 1). The settings, their sources in the Longformer paper and
where they differ from it are in docs/character_lm.md.

Main command (a CPU demo: 4 layers of width 128, two phases of 250 steps at length 128 and
125 steps at length 256). It uses enwik8.zip when it is in ~/lra_data/manual; otherwise it
prints a note and uses the fallback corpus, the UTF-8 prose of Python's reference-manual
topics (pydoc_data.topics, 466,195 bytes on Python 3.11.7, split 90/5/5):

  .venv/bin/lra run enwik8 --size small

Expected: the last line `test bits per character` about 2.42 (uniform over bytes: 8), in
`workdirs/enwik8-band-small/phase2/results.json`. Measured on the fallback corpus, seed 0, on the
shared 2-core machine under load: 2.424 (phase 1: 2.616), 4 min 43 s wall (3 min 37 s user CPU).

Longformer: `lra run enwik8 --size base --workdir DIR` (Longformer-small: 12 layers, 5 phases from
length 2,048 to 23,040, evaluation windows of 32,256 with stride 512) or `--size large` (30
layers). These need enwik8.zip (http://mattmahoney.net/dc/enwik8.zip, downloaded into
~/lra_data/manual when online) and weeks of GPU time; they were not run here (no archive, no
internet). The paper reports test BPC 1.00 (small) and 0.99 (large).
"""

from __future__ import annotations

import ml_collections

from configs import charlm


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The enwik8 config for `arg` = "attention=NAME,size=base|large|small,window=W"."""
  return charlm.get_config("enwik8", arg)


def sweep(add) -> None:
  """Longformer-small (`base`), three seeds."""
  charlm.sweep(add)
