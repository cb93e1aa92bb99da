"""ListOps (LRA): nested list operations, 10 classes, one config for every attention kind.

`arg` keys: `attention` (any name in `attention.kinds`), `size` (`base`: the LRA settings;
`small`: sized to train on a laptop CPU, on short trees; `cpu`: the LRA lengths on a laptop CPU,
band attention by default), `window` (one-sided window of the local kinds).

Main command (generates ListOps with 17-128 tokens per tree, trains a 2-layer, 64-wide model
for 800 steps of batch 32):

  .venv/bin/lra run listops --size small

It ends with the test accuracy beside the majority class, in
`workdirs/listops-dot_product-small/results.json` (the measured values and times: README.md and
docs/efficiency.md). Any attention kind: `--attention band`.

At the LRA lengths (trees of 500-2,000 tokens, max_length 2,000, the 2,000 test trees evaluated
at that length):

  .venv/bin/lra run listops --size cpu --workdir DIR

Its test accuracies for seeds 0-2 (`--config.seed=S`) are in docs/efficiency.md beside LRA's
Transformer (0.3637). The model is 2 layers, 64 wide, band attention with window 8,
read through a CLS token whose output depends on the first 2 x 8 = 16 tokens only: phase 1
trains 1,600 steps of batch 128 on the first 32 tokens of each tree (the same function, at cheap
steps), phase 2 20 steps of batch 32 at the full length. Its accuracy comes from the root
operator and its first arguments: each root operator's most frequent value alone gives 0.35.

LRA base: `lra run listops --size base --attention band --workdir DIR` (5,000 steps, batch 32,
length 2,000; LRA reports 36-37% test accuracy for most attention kinds). Settings and their
sources: docs/training.md.

Sweeps (docs/launch.md): `lra sweep listops --workdir DIR` runs `sweep` (every attention kind at
size base, seeds 0-2); `lra sweep listops --sweep kinds_small --workdir DIR --parallel 2` runs
`sweep_kinds_small` (dense and band at size small, two seeds, 200 steps each; its results are in
docs/launch.md); `--sweep every_kind_small` runs every attention kind at size small, seeds 0 and
1 (24 runs; the accuracy axis of docs/efficiency.md's speed-vs-accuracy plot); `lra results DIR
--lra` tabulates any of them.
"""

from __future__ import annotations

import ml_collections

from configs import common

SIZES = ("base", "small", "cpu")


def data_config() -> ml_collections.ConfigDict:
  """The LRA data settings: generated trees of 500-2,000 tokens in the LRA grammar."""
  return common.data_fields(
      "listops",
      max_length=2000,        # tokens per example after truncation/padding
      generate=True,          # without released TSVs, build from the generator
      num_train=96_000, num_val=2_000, num_test=2_000,
      gen_min_length=500,     # kept trees have gen_min_length < tokens < gen_max_length
      gen_max_length=2000, max_depth=10, max_args=10, seed=0,
      download=False)         # never fetch the 8.2 GB release just for ListOps


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The ListOps config for `arg` = "attention=NAME,size=base|small,window=W"."""
  a = common.task_arg(arg, attention={"base": "dot_product", "small": "dot_product",
                                      "cpu": "band"}, sizes=SIZES)
  c = common.task_config("listops", data_config())
  if a.size == "base":
    # LRA base_listops_config: 4 layers, 512 wide, 8 heads, mlp 1024, batch 32, 5K steps,
    # lr 0.05 rsqrt with 1K warmup, weight decay 0.1 (the trainer defaults); LRA evaluated
    # every 50 steps, 500 here (the validation split is evaluated in full).
    window = a.window or 128
  elif a.size == "cpu":
    # The LRA data (trees of 500-2,000 tokens, max_length 2,000) with 48K training trees, and a
    # 2-layer band model read through a CLS token: its output depends on the first
    # layers * window = 16 tokens only, so phase 1 trains on the first 32 tokens of each tree
    # (cheap steps, the same function) and phase 2 continues at the full 2,000 tokens, where
    # the validation and test splits are evaluated.
    c.data.update(num_train=48_000, num_val=500)
    common.set_model(c.model, layers=2, width=64, heads=4, mlp=128, classifier=128,
                     dropout=0.0, pos_emb="sinusoidal", pool="cls")
    common.cpu_schedule(c, steps=1620, batch=128, eval_batch=200, learning_rate=4e-3,
                        warmup=50, weight_decay=0.01, eval_every=100_000,
                        checkpoint_every=500)
    c.phases = (
        {"steps": 1600, "max_length": 32, "window_scale": 1.0, "learning_rate": 4e-3,
         "batch_size": 128, "warmup_steps": 50},
        {"steps": 20, "max_length": 2000, "window_scale": 1.0, "learning_rate": 1e-4,
         "batch_size": 32, "warmup_steps": 5})
    window = a.window or 8
  else:
    c.data.update(max_length=128, gen_min_length=16, gen_max_length=129, num_train=20_000,
                  num_val=1_000, num_test=2_000)
    common.set_model(c.model, layers=2, width=64, heads=4, mlp=128, classifier=128,
                     dropout=0.0, pos_emb="sinusoidal", pool="mean")
    common.cpu_schedule(c, steps=800, batch=32, eval_batch=200, learning_rate=2e-3,
                        warmup=50, weight_decay=0.01, eval_every=200, checkpoint_every=200)
    window = a.window or 16
  common.set_attention(c, a, window)
  return c


def sweep(add) -> None:
  """The LRA comparison: every attention kind on ListOps base, three seeds."""
  common.lra_sweep(add)


def sweep_every_kind_small(add) -> None:
  """Every attention kind at size small, seeds 0 and 1 (`lra sweep listops --sweep
  every_kind_small --workdir DIR --parallel 2`): the accuracy axis of the speed-vs-accuracy plot
  in docs/efficiency.md."""
  common.lra_sweep(add, size="small", seeds=(0, 1))


def sweep_kinds_small(add) -> None:
  """A sweep for a laptop (`lra sweep listops --sweep kinds_small`): dense and band attention
  at size small, two seeds each, 200 steps per run."""
  for kind in ("dot_product", "band"):
    for seed in (0, 1):
      add(config_arg=f"attention={kind},size=small", seed=seed, num_train_steps=200)
