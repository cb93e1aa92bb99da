"""enwik8 character language model (Longformer, staged training), for every causal attention kind.

`arg` keys: `attention` (default `band`), `size` (`base` = Longformer-small, `large`, `small` = a
CPU demo), `window` (the top layer's window in phase 1); settings: configs/charlm.py and
docs/character_lm.md.

Main command (4 layers of width 128, 250 steps at length 128 then 125 at length 256, relative
positions; without enwik8.zip in ~/lra_data/manual it notes so and uses Python's reference-manual
topics, split 90/5/5):

  .venv/bin/lra run enwik8 --size small

It ends with the `test bits per character` of phase 2, in
`workdirs/enwik8-band-small/phase2/results.json`; docs/character_lm.md has the measured value
and time. `--size base` needs enwik8.zip (http://mattmahoney.net/dc/enwik8.zip) and weeks of GPU
time; Longformer reports 1.00 (small).

Recurrence (docs/recurrence.md): `--size xl-small` / `compressive-small` (CPU, fallback corpus) and
`xl-base` (Transformer-XL 12L) / `compressive-base` (the Compressive Transformer's enwik8
settings), e.g. `.venv/bin/lra run enwik8 --size xl-small`.
"""

from __future__ import annotations

import functools

from configs import charlm

SIZES = charlm.SIZES   # `--size` (configs.sizes)

# get_config(arg) with `arg` = "attention=NAME,size=base|large|small,window=W"; sweep(add): the
# Longformer-small (`base`) run, three seeds.
get_config = functools.partial(charlm.get_config, "enwik8")
sweep = charlm.sweep
