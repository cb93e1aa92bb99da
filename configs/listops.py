"""ListOps (LRA): nested list operations, 10 classes, one config for every attention kind.

`arg` keys: `attention` (any name in `attention.REGISTRY`), `size` (`base`: the LRA settings;
`small`: sized to train on a laptop CPU), `window` (one-sided window of the local kinds).

Main command (generates ListOps with 17-128 tokens per tree, trains a 2-layer, 64-wide model
for 800 steps of batch 32; a few minutes on a 2-core CPU, data generation and compilation
included):

  .venv/bin/lra run listops --size small

Expected: `test accuracy` about 0.39 against a majority-class rate of about 0.15 (measured:
0.391 vs 0.145 with 1,000 steps, seed 0), in `workdirs/listops-dot_product-small/results.json`.
Any attention kind: `--attention band` (see `lra list`).

LRA base: `lra run listops --size base --attention band --workdir DIR` (5,000 steps, batch 32,
length 2,000; LRA reports 36-37% test accuracy for most attention kinds).
"""

from __future__ import annotations

import ml_collections

import attention
from configs import common
from lra.tasks import listops


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The ListOps config for `arg` = "attention=NAME,size=base|small,window=W"."""
  a = common.task_arg(arg, attention="dot_product")
  c = common.task_config(listops)
  if a.size == "base":
    # LRA base_listops_config: 4 layers, 512 wide, 8 heads, mlp 1024, batch 32, 5K steps,
    # lr 0.05 rsqrt with 1K warmup, weight decay 0.1, eval every 50 steps in LRA (500 here:
    # the validation split is evaluated in full).
    window = a.window or 128
    c.eval_every = 500
  else:
    c.data.max_length = 128
    c.data.gen_min_length = 16
    c.data.gen_max_length = 129
    c.data.num_train = 20_000
    c.data.num_val = 1_000
    c.data.num_test = 2_000
    c.model.emb_dim = 64
    c.model.num_heads = 4
    c.model.qkv_dim = 64
    c.model.mlp_dim = 128
    c.model.num_layers = 2
    c.model.classifier_dim = 128
    c.model.dropout = 0.0
    c.model.pool = "mean"
    c.batch_size = 32
    c.eval_batch_size = 200
    c.num_train_steps = 800
    c.learning_rate = 2e-3
    c.schedule = "cosine"
    c.warmup_steps = 50
    c.weight_decay = 0.01
    c.grad_clip = 1.0
    c.log_every = 50
    c.eval_every = 200
    c.checkpoint_every = 200
    window = a.window or 16
  common.set_attention(c, a, window)
  return c


def sweep(add) -> None:
  """The LRA comparison: every registered attention kind on ListOps base, three seeds."""
  for name in sorted(attention.REGISTRY):
    for seed in (0, 1, 2):
      add(config_arg=f"attention={name},size=base", seed=seed)
