"""MQAR (Zoology's multi-query associative recall): a causal 2-layer language model recalls the
value paired with each queried key; every attention kind that can be causal.

`arg` keys: `attention` (default dot_product; kinds that cannot be causal are refused at the
start of a run), `size` (`base`: Zoology's settings; `small`: sized to train on a 2-core CPU),
`window` (one-sided window of the local kinds, default 32), and Zoology's swept axes: `width`
(model width, 64-512 in the paper), `length` (sequence length, 64-512) and `pairs` (key-value
pairs; by default Zoology's 4, 8, 16, 64 for lengths 64, 128, 256, 512, else length // 16).
The same fields are `--config.model.emb_dim` (and qkv_dim), `--config.data.max_length` and
`--config.data.num_kv_pairs`.

Main command (generates 20,000 training examples of 256 tokens with 16 pairs over a vocabulary
of 512 tokens, trains 2 layers of width 64 with rotary positions for 1,200 steps of batch 32 at a
constant learning rate):

  .venv/bin/lra run mqar --size small

It ends with `test MQAR accuracy` (the fraction of answers recalled), in
`workdirs/mqar-dot_product-small/results.json`; docs/recall.md has the measured value, the time
and the generator's settings. Another kind: `--attention band`. Zoology's base at another point
of its grid: `lra run mqar --size base --arg width=256,length=512 --workdir DIR`.
"""

from __future__ import annotations

import ml_collections

from configs import common
from lra.data import mqar_generator

SIZES = ("base", "small")
MAX_VOCAB = 8192                               # lra.tasks.mqar.MAX_VOCAB (the embedding rows)
ZOOLOGY_PAIRS = {64: 4, 128: 8, 256: 16, 512: 64}   # Zoology's figure 2: pairs per length


def data_config() -> ml_collections.ConfigDict:
  """Zoology's MQAR data: vocabulary 8,192, power law a = 0.01, noise between the queries,
  100,000 training and 3,000 test examples."""
  return common.data_fields(
      "mqar",
      max_length=256,           # the sequence length (even; Zoology sweeps 64-512)
      vocab_size=MAX_VOCAB,     # tokens 0 .. vocab_size - 1; keys below vocab_size // 2
      num_kv_pairs=16,          # key-value pairs, then one query per key
      power_a=mqar_generator.POWER_A,   # query gaps: P(g) ~ (g + 1) ** (power_a - 1)
      noise=True,               # Zoology's random_non_queries: uniform tokens between queries
      num_train=100_000, num_val=3_000, num_test=3_000, seed=0,
      download=False)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The MQAR config for `arg` = "attention=NAME,size=base|small,window=W,width=D,length=L,
  pairs=K" (0 or absent: the size's value)."""
  p = common.parse_arg(arg, attention="", size=SIZES[0], window=0, width=0, length=0, pairs=0)
  a = common.task_arg(",".join(f"{k}={p[k]}" for k in ("attention", "size", "window")
                               if p[k]), attention="dot_product", sizes=SIZES)
  c = common.task_config("mqar", data_config())
  c.model.memory_length = 0
  if a.size == "base":
    # Zoology (Arora et al. 2023, section 3 and appendix): 2 layers, widths 64-512, each layer
    # a sequence mixer and an MLP of 4x the width, learned positions, AdamW with a cosine
    # schedule, learning rate swept (1e-4 .. 1e-2; 1e-3 here), 64 epochs of 100,000 examples
    # (batch 64: 100,000 steps), test on 3,000 examples.
    width = p.width or 128
    common.set_model(c.model, layers=2, width=width, heads=1, mlp=4 * width,
                     classifier=width, dropout=0.0, pos_emb="learned", pool="mean")
    common.set_schedule(c, steps=100_000, batch=64, eval_batch=250, learning_rate=1e-3,
                        schedule="cosine", warmup=1000, weight_decay=0.1, log_every=200,
                        eval_every=5000, checkpoint_every=5000, grad_clip=1.0)
  else:
    # The CPU point: width 64, length 256, 16 pairs, 2 layers, on 20,000 training
    # examples over a vocabulary of 512 tokens (with 8,192 this model had 1.4% accuracy after
    # 800 steps: every token's embedding is learnt from 16 times fewer occurrences), rotary
    # positions (the previous-token attention that recall builds on is a relative offset),
    # 1,200 steps of batch 32 at a constant learning rate after 100 of warmup: recall forms
    # near step 1,000 (a cosine decay over 1,500 steps had lowered the rate too far by then for
    # it to form; docs/recall.md has the measured accuracy and time).
    c.data.update(vocab_size=512, num_train=20_000, num_val=500, num_test=1_000)
    width = p.width or 64
    common.set_model(c.model, layers=2, width=width, heads=2, mlp=2 * width,
                     classifier=width, dropout=0.0, pos_emb="rotary", pool="mean")
    common.set_schedule(c, steps=1200, batch=32, eval_batch=250, learning_rate=1e-2,
                        schedule="constant", warmup=100, weight_decay=0.01, grad_clip=1.0,
                        log_every=50, eval_every=250, checkpoint_every=500)
  if p.length:
    c.data.max_length = p.length
  c.data.num_kv_pairs = p.pairs or ZOOLOGY_PAIRS.get(c.data.max_length,
                                                     max(1, c.data.max_length // 16))
  # The run's identity is its kind and size only (lra.identity): `lra results` compares a run
  # with the default config of that identity, so width, length and pairs show as the fields
  # they set (model.emb_dim, data.max_length, data.num_kv_pairs).
  common.set_attention(c, a, a.window or 32)
  return c


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError (one line) for data settings that make no example or a vocabulary larger
  than the model's (`configs.build_config` calls it after the overrides)."""
  d = config.data
  mqar_generator.check(vocab_size=d.vocab_size, seq_len=d.max_length, num_pairs=d.num_kv_pairs,
                       power_a=d.power_a)
  if d.vocab_size > MAX_VOCAB:
    raise ValueError(f"config.data.vocab_size = {d.vocab_size}: the model has rows for at most "
                     f"{MAX_VOCAB} tokens (Zoology's vocabulary).")


def sweep(add) -> None:
  """Dense against band attention at size small, two seeds."""
  for kind in ("dot_product", "band"):
    for seed in (0, 1):
      add(config_arg=f"attention={kind},size=small", seed=seed)


# Zoology's figure on this CPU: every causal-capable kind the issue names, three widths, at the
# one point where recall forms within size small's schedule here (256 tokens, 16 pairs;
# docs/recall.md). Widths 16-64: at 128 size small's learning rate left dense attention at the
# uniform guess (no tried rate gave it recall in 2,000 cosine steps, the earlier schedule), so
# that column would measure the schedule, not capacity, and its runs cost about 7 times width
# 32's (docs/recall.md).
ZOOLOGY_KINDS = ("dot_product", "band", "sparse", "favor", "linear", "lsh")
ZOOLOGY_WIDTHS = (64, 32, 16)


def sweep_zoology(add) -> None:
  """Accuracy against model width, one line per kind (Zoology's main figure; `lra sweep mqar
  --sweep zoology --workdir DIR --parallel 2`, then `python benchmarks/recall_plot.py DIR --task
  mqar --plot PNG`): each kind of `ZOOLOGY_KINDS` at the widths of `ZOOLOGY_WIDTHS`, size small
  (256 tokens, 16 pairs, 1,200 steps), seeds 0 and 1: 36 runs, widest column first (the one
  where dense attention recalls), so a sweep stopped early has whole columns. Shorter sequences
  did not form recall within 2,000 steps here (docs/recall.md), so the sweep has this one
  length; `--arg length=L` moves all of it."""
  for width in ZOOLOGY_WIDTHS:
    for kind in ZOOLOGY_KINDS:
      for seed in (0, 1):
        add(config_arg=f"attention={kind},size=small,width={width}", seed=seed)
