"""text8 character language model: the enwik8 setup (configs/charlm.py) on a-z and space.

Every size, attention kind and phase is as in configs/enwik8.py (Longformer's staged schedule;
docs/character_lm.md). Without text8.zip (http://mattmahoney.net/dc/text8.zip) in
~/lra_data/manual, the CPU demo reduces the fallback corpus to text8's alphabet (375,756
characters). Main command:

  .venv/bin/lra run text8 --size small

It ends with the `test bits per character` of phase 2, in
`workdirs/text8-band-small/phase2/results.json`; docs/character_lm.md has the measured value
and time. Longformer reports 1.10 for `--size base`.

Recurrence (docs/recurrence.md): `--size xl-small` / `compressive-small` (CPU, fallback corpus) and
`xl-base` (Transformer-XL 12L) / `compressive-base` (the Compressive Transformer's enwik8
settings), e.g. `.venv/bin/lra run text8 --size xl-small`.
"""

from __future__ import annotations

import functools

from configs import charlm

SIZES = charlm.SIZES   # `--size` (configs.sizes)

# get_config(arg) with `arg` = "attention=NAME,size=base|large|small,window=W"; sweep(add): the
# Longformer-small (`base`) run, three seeds.
get_config = functools.partial(charlm.get_config, "text8")
sweep = charlm.sweep
