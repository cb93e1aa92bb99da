"""Path-X (LRA): Pathfinder at 128x128, 16,384 pixels, 2 classes, one config for every kind.

`arg` keys: `attention` (any name in `attention.kinds`; default `band`, because dense attention
over 16,384 tokens needs 1 GiB per head and example for the weights alone), `size` (`base`: the
LRA settings on the released images; `small`: generated 128x128 images and a model sized for a
CPU), `window` (one-sided window of the local kinds).

Main command (generates 1,000 128x128 "hard" images, then trains a 1-layer, 32-wide
band-attention model for 200 steps of batch 16):

  .venv/bin/lra run pathx --size small

Expected: chance level (the measured value and time are in docs/image_and_pathfinder.md). No
model in LRA learned Path-X.

LRA base: `lra run pathx --size base --attention NAME --workdir DIR` needs
`pathfinder128/curv_contour_length_14` of the LRA release. 500,000 steps of batch 64, length
16,384; use an efficient kind (`dot_product` and `synthesizer` are quadratic in memory).
"""

from __future__ import annotations

import ml_collections

from attention import kinds
from configs import common, pathfinder

SMALL_IMAGES = 1000
SMALL_STEPS = 200


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The Path-X config for `arg` = "attention=NAME,size=base|small,window=W"."""
  a = common.task_arg(arg, attention="band")
  c = common.task_config("pathx", pathfinder.data_config(task="pathx", resolution=128))
  if a.size == "base":
    # LRA image/configs/pathfinder128/base_pathfinder128_config.py (its only model config);
    # LRA's attention dropout 0.1 is left out.
    common.set_model(c.model, layers=1, width=32, heads=2, qkv=16, mlp=32, classifier=32,
                     dropout=0.1, pos_emb="learned", pool="mean")
    common.epoch_schedule(c, train_examples=160_000, batch=64, learning_rate=1e-3,
                          checkpoint_epochs=1, log_every=500, grad_clip=1.0)
    window = a.window or 128
  else:
    pathfinder.small(c, images=SMALL_IMAGES, layers=1)
    common.cpu_schedule(c, steps=SMALL_STEPS, batch=16, eval_batch=32, learning_rate=1e-3,
                        warmup=20, weight_decay=0.0, log_every=25, eval_every=100,
                        checkpoint_every=100)
    window = a.window or 32
  common.set_attention(c, a, window)
  return c


def sweep(add) -> None:
  """Every attention kind that fits at 16,384 tokens on Path-X base, three seeds: not the
  quadratic ones ([L, L] weights or parameters at L = 16,384)."""
  common.lra_sweep(add, skip=kinds.names_where(lambda k: k.cost == "quadratic"))
