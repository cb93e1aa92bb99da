"""Path-X (LRA): Pathfinder at 128x128, 16,384 pixels, 2 classes, one config for every kind.

`arg` keys: `attention` (any name in `attention.REGISTRY`; default `band`, because dense
attention over 16,384 tokens needs 1 GiB per head and example for the weights alone), `size`
(`base`: the LRA settings on the released images; `small`: generated 128x128 images and a model
sized for a CPU), `window` (one-sided window of the local kinds).

Main command (generates 1,000 128x128 "hard" images, about 25 s, then trains a 1-layer, 32-wide
band-attention model for 200 steps of batch 16; about 9 minutes on the 2-core development
machine under load from other jobs):

  .venv/bin/lra run pathx --size small

Expected: chance level, about 0.5 test accuracy (measured, seed 0: 0.47 with the best-validation
parameters and 0.53 with the final ones, on 100 test images whose majority class is 53%). It
checks the 16,384-token pipeline end to end; no model in LRA learned Path-X.

LRA base: `lra run pathx --size base --attention NAME --workdir DIR` needs
`pathfinder128/curv_contour_length_14` of the LRA release (`lra_release.gz` or its extracted
`lra_release/` tree in `~/lra_data/manual/`; not on the development machine, so not measured
here). 500,000 steps of batch 64, length 16,384. Every model in LRA failed (chance, 50%);
S4-style models reach 88-98%. Use an efficient kind (band, block_local, block_sparse, bigbird,
favor, linear, linformer, lsh); `dot_product` and `synthesizer` are quadratic in memory.
"""

from __future__ import annotations

import ml_collections

import attention
from configs import common
from lra.tasks import pathx

SMALL_IMAGES = 1000
SMALL_STEPS = 200
QUADRATIC = ("dot_product", "synthesizer")  # [L, L] weights or parameters at L = 16,384


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The Path-X config for `arg` = "attention=NAME,size=base|small,window=W"."""
  a = common.task_arg(arg, attention="band")
  c = common.task_config(pathx)
  m = c.model
  if a.size == "base":
    # LRA image/configs/pathfinder128/base_pathfinder128_config.py (its only model config).
    m.num_layers, m.emb_dim, m.num_heads, m.qkv_dim, m.mlp_dim = 1, 32, 2, 16, 32
    m.classifier_dim = 32         # LRA's classifier head is Dense(mlp_dim)
    m.dropout = 0.1               # LRA: attention dropout 0.1 too; the models here have none
    m.pos_emb = "learned"
    m.pool = "mean"
    c.batch_size = 64
    c.eval_batch_size = 64
    c.learning_rate = 1e-3
    c.schedule = "cosine"
    c.warmup_steps = 2500         # one epoch of 160,000 / 64
    c.weight_decay = 0.0
    c.grad_clip = 1.0
    c.num_train_steps = 500_000   # 200 epochs
    c.log_every = 500
    c.eval_every = 2500           # every epoch, as LRA
    c.checkpoint_every = 2500
    window = a.window or 128
  else:
    c.data.generate = True
    c.data.num_generated = SMALL_IMAGES
    m.num_layers, m.emb_dim, m.num_heads, m.qkv_dim, m.mlp_dim = 1, 32, 2, 32, 64
    m.classifier_dim = 64
    m.dropout = 0.0
    m.pos_emb = "learned"
    m.pool = "mean"
    c.batch_size = 16
    c.eval_batch_size = 32
    c.learning_rate = 1e-3
    c.schedule = "cosine"
    c.warmup_steps = 20
    c.weight_decay = 0.0
    c.grad_clip = 1.0
    c.num_train_steps = SMALL_STEPS
    c.log_every = 25
    c.eval_every = 100
    c.checkpoint_every = 100
    window = a.window or 32
  common.set_attention(c, a, window)
  return c


def sweep(add) -> None:
  """Every attention kind that fits at 16,384 tokens on Path-X base, three seeds."""
  for name in sorted(attention.REGISTRY):
    if name in QUADRATIC:
      continue
    for seed in (0, 1, 2):
      add(config_arg=f"attention={name},size=base", seed=seed)
