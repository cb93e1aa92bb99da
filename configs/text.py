"""Text (LRA): IMDb sentiment from bytes, 2 classes, one config for every attention kind.

`arg` keys: `attention` (any name in `attention.REGISTRY`), `size` (`base`: the LRA settings;
`small`: sized to train on a laptop CPU), `window` (one-sided window of the local kinds).

Needs `aclImdb_v1.tar.gz` (84 MB, https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz)
in `$LRA_DATA/manual/` (default `~/lra_data/manual/`); it is downloaded there when the machine is
online. The first run builds the dataset (one pass over the archive).

Main command (256 bytes per review, a 2-layer, 64-wide model, 1,000 steps of batch 32, model
selection on a held-out 10% of train, test evaluated at the end):

  .venv/bin/lra run text --size small

Expected: no real-data result yet - the archive is not on the development machine (it has no
internet), so this config has not been run on IMDb; the test suite builds a tiny archive in the
original format and trains two steps. Measured cost, on a synthetic archive of the real size
(50,000 reviews, ~1 KB each) while the 2-core machine was shared (load average 5-7): 1,121 s
wall, 384 s CPU, of which the 25,000-review test evaluation took 207 s. The test set is
balanced (majority class 0.5). The result is in `workdirs/text-dot_product-small/results.json`.

LRA base: `lra run text --size base --attention band --workdir DIR` (20,000 steps, batch 32,
1,000 bytes, validation = test as in LRA; LRA reports 52.98-65.90% test accuracy).
"""

from __future__ import annotations

import ml_collections

import attention
from configs import common
from lra.tasks import text


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The Text config for `arg` = "attention=NAME,size=base|small,window=W"."""
  a = common.task_arg(arg, attention="dot_product")
  c = common.task_config(text)
  if a.size == "base":
    # LRA base_tc_config: 4 layers, emb 256, 4 heads, qkv 256, mlp 1024 (classifier head
    # Dense(mlp_dim)), dropout 0.1, sinusoidal positions, CLS pooling, batch 32, lr 0.05 rsqrt
    # with 8,000 warmup steps, weight decay 0.1, 20,000 steps, max_length 1,000 bytes.
    # The paper appendix says 6 layers, 8 heads, 512 wide, mlp 2048 and 4K bytes instead
    # (LRA issue #21); the maintainers point to the repository config, used here.
    # LRA evaluated every 100 steps on the full test set (its validation set); 1,000 here.
    c.data.max_length = 1000
    c.model.emb_dim = 256
    c.model.num_heads = 4
    c.model.qkv_dim = 256
    c.model.mlp_dim = 1024
    c.model.classifier_dim = 1024
    c.model.num_layers = 4
    c.model.dropout = 0.1
    c.model.pos_emb = "sinusoidal"
    c.model.pool = "cls"
    c.batch_size = 32
    c.eval_batch_size = 128
    c.num_train_steps = 20_000
    c.learning_rate = 0.05
    c.schedule = "rsqrt"
    c.warmup_steps = 8000
    c.weight_decay = 0.1
    c.log_every = 100
    c.eval_every = 1000
    c.checkpoint_every = 1000
    window = a.window or 128
  else:
    c.data.max_length = 256
    c.data.validation = "holdout"  # 2,500 held-out train reviews: cheap, and test stays unseen
    c.model.emb_dim = 64
    c.model.num_heads = 4
    c.model.qkv_dim = 64
    c.model.mlp_dim = 128
    c.model.num_layers = 2
    c.model.classifier_dim = 128
    c.model.dropout = 0.1
    c.model.pool = "mean"
    c.batch_size = 32
    c.eval_batch_size = 200
    c.num_train_steps = 1000
    c.learning_rate = 2e-3
    c.schedule = "cosine"
    c.warmup_steps = 100
    c.weight_decay = 0.01
    c.grad_clip = 1.0
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 500
    window = a.window or 32
  common.set_attention(c, a, window)
  return c


def sweep(add) -> None:
  """The LRA comparison: every registered attention kind on Text base, three seeds."""
  for name in sorted(attention.REGISTRY):
    for seed in (0, 1, 2):
      add(config_arg=f"attention={name},size=base", seed=seed)
