"""Image (LRA): CIFAR-10 as 1,024 grayscale pixels, 10 classes, one config for every attention kind.

`arg` keys: `attention` (any name in `attention.kinds`; default `dot_product` for base, `band`
for small), `size` (`base`: the LRA settings; `small`: sized for a CPU), `window` (one-sided
window of the local kinds).

Needs `cifar-10-python.tar.gz` (https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, 163 MB)
in `~/lra_data/manual/` (downloaded there on first use when the machine is online); the first
run builds the dataset in `~/lra_data/image/` (seconds).

Main command (a 1-layer, 32-wide band-attention model, 1,000 steps of batch 32; its time is in
docs/image_and_pathfinder.md):

  .venv/bin/lra run image --size small

Expected: not measured on CIFAR-10 here (no archive, no internet); expect little above chance
(10%) from this short run. LRA's Transformer reaches 42.4% with the base settings.

LRA base: `lra run image --size base --attention NAME --workdir DIR` (35,000 steps of batch 256,
the LRA repository's cifar10 transformer_base settings; LRA reports 38-44% test accuracy).
"""

from __future__ import annotations

import ml_collections

from configs import common

SMALL_STEPS = 1000


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The Image config for `arg` = "attention=NAME,size=base|small,window=W"."""
  # Default kind: LRA's dense Transformer for base; band for small (dense attention over 1,024
  # tokens is several times slower per step than band on a CPU: docs/image_and_pathfinder.md).
  a = common.task_arg(arg, attention={"base": "dot_product", "small": "band"})
  c = common.task_config("image", common.data_fields("image", max_length=1024))
  if a.size == "base":
    # LRA image/configs/cifar10/transformer_base.py (the repository config: the appendix's
    # values do not train, issues #16 and #33). LRA's attention dropout 0.2 is left out: the
    # models here have no dropout on attention weights.
    common.set_model(c.model, layers=1, width=128, heads=8, qkv=64, mlp=128, classifier=128,
                     dropout=0.3, pos_emb="learned", pool="cls")
    common.epoch_schedule(c, train_examples=45_000, batch=256, learning_rate=5e-4)
    window = a.window or 128
  else:
    common.set_model(c.model, layers=1, width=32, heads=2, mlp=64, classifier=64, dropout=0.0,
                     pos_emb="learned", pool="mean")
    common.cpu_schedule(c, steps=SMALL_STEPS, batch=32, eval_batch=256, learning_rate=1e-3,
                        warmup=100, weight_decay=0.0, eval_every=250, checkpoint_every=250)
    window = a.window or 32
  common.set_attention(c, a, window)
  return c


def sweep(add) -> None:
  """The LRA comparison: every attention kind on Image base, three seeds."""
  common.lra_sweep(add)
