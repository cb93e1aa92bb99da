"""Text (LRA): IMDb sentiment from bytes, 2 classes, one config for every attention kind.

`arg` keys: `attention` (any name in `attention.kinds`), `size` (`base`: the LRA settings;
`small`: sized to train on a laptop CPU), `window` (one-sided window of the local kinds).

Needs `aclImdb_v1.tar.gz` (84 MB, https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz)
in `$LRA_DATA/manual/` (default `~/lra_data/manual/`); it is downloaded there when the machine is
online. The first run builds the dataset (one pass over the archive).

Main command (256 bytes per review, a 2-layer, 64-wide model, 1,000 steps of batch 32, model
selection on a held-out 10% of train, test evaluated at the end, most of the time the
25,000-review test evaluation; its time is in docs/text_and_retrieval.md):

  .venv/bin/lra run text --size small

Expected: not measured on IMDb yet (the archive is not on the development machine); the test set
is balanced (majority class 0.5). See docs/text_and_retrieval.md.

LRA base: `lra run text --size base --attention band --workdir DIR` (20,000 steps, batch 32,
1,000 bytes, validation = test as in LRA; LRA reports 52.98-65.90% test accuracy).
"""

from __future__ import annotations

import ml_collections

from configs import common


def data_config() -> ml_collections.ConfigDict:
  """The LRA data settings: the first 1,000 bytes of each review, validation = test."""
  return common.data_fields(
      "text",
      max_length=1000,        # bytes per review after truncation (first bytes) / padding
      validation="test",      # "test" (LRA: validate on test) or "holdout" (from train)
      holdout_fraction=0.1,   # with validation="holdout": share of train held out
      holdout_seed=0)         # with validation="holdout": which reviews are held out


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The Text config for `arg` = "attention=NAME,size=base|small,window=W"."""
  a = common.task_arg(arg, attention="dot_product")
  c = common.task_config("text", data_config())
  if a.size == "base":
    # LRA base_tc_config (the repository config, not the paper appendix: LRA issue #21);
    # LRA evaluated every 100 steps on the full test set, 1,000 here.
    c.data.max_length = 1000
    common.set_model(c.model, layers=4, width=256, heads=4, mlp=1024, classifier=1024,
                     dropout=0.1, pos_emb="sinusoidal", pool="cls")
    common.set_schedule(c, steps=20_000, batch=32, eval_batch=128, learning_rate=0.05,
                        schedule="rsqrt", warmup=8000, weight_decay=0.1, log_every=100,
                        eval_every=1000, checkpoint_every=1000)
    window = a.window or 128
  else:
    c.data.max_length = 256
    c.data.validation = "holdout"  # 2,500 held-out train reviews: cheap, and test stays unseen
    common.set_model(c.model, layers=2, width=64, heads=4, mlp=128, classifier=128,
                     dropout=0.1, pos_emb="sinusoidal", pool="mean")
    common.cpu_schedule(c, steps=1000, batch=32, eval_batch=200, learning_rate=2e-3,
                        warmup=100, weight_decay=0.01, eval_every=500, checkpoint_every=500)
    window = a.window or 32
  common.set_attention(c, a, window)
  return c


def sweep(add) -> None:
  """The LRA comparison: every attention kind on Text base, three seeds."""
  common.lra_sweep(add)
