"""Needle retrieval: the value of one key-value pair hidden in filler at distance d before a final
query of its key; a 2-layer causal LM or bidirectional encoder, any attention kind.

`arg` keys: `attention` (default dot_product), `size` (`base`: sequences of 1,024 tokens;
`small`: sized to train on a 2-core CPU), `window` (one-sided window of the local kinds: 64 at
base, 16 at small), `variant` (`causal`, the default: kinds that cannot be causal are refused;
`bidirectional`: every kind, BigBird and Linformer included), `global` (1: the query is a global
token of every band layer), `distance` (one distance, `distance=128`, or an inclusive range drawn
uniformly per example, `distance=64-255`), `spread` (`uniform`, the default, or `log`: each
power-of-two bin of the distances [2^k, 2^(k+1)) drawn equally often), `distractors` (N other
key-value pairs with other keys in the filler, at most num_keys - 1: the query must match its
key, not merely find the one value; `--config.data.num_distractors`), `length` (the sequence
length; 65,536 in principle, memory permitting). The same fields are `--config.model.variant`, `--config.model.global_query`,
`--config.data.distances` (any tuple of distances, drawn uniformly per example) and
`--config.data.max_length`. Runs that differ only in these arguments share the default workdir
(`workdirs/needle-ATTENTION-SIZE`): give each its own `--workdir`.

Distance d is the query's position (the last, L - 1) minus the key's; the value follows the
key. Band attention's reach is window x layers (a causal query sees window tokens back per layer,
so 2 x 16 = 32 at small and 2 x 64 = 128 at base): the defaults draw d beyond it, from
[L / 4, L - 1], where a plain band model sees neither key nor value.

Main command (generates 20,000 training examples of 256 tokens, d drawn from 64 .. 255, trains
a causal 2-layer model of width 64 with rotary positions for 600 steps of batch 32):

  .venv/bin/lra run needle --size small

It ends with `test needle accuracy` (the fraction of needles retrieved), in
`workdirs/needle-dot_product-small/results.json`; docs/recall.md has the measured values, times
and the generator's settings. Band beyond its reach: `--attention band`; with the query global:
`--attention band --arg global=1`; the bidirectional variant: `--arg variant=bidirectional`.
"""

from __future__ import annotations

import math

import ml_collections

from attention import kinds
from configs import common
from lra.data import needle_generator

SIZES = ("base", "small")
VARIANTS = ("causal", "bidirectional")          # lra.tasks.needle.VARIANTS
MAX_VOCAB = 8192                                # lra.tasks.needle.MAX_VOCAB (the embedding rows)


SPREADS = ("uniform", "log")
MAX_DISTANCE_LIST = 100_000     # entries of data.distances that `spread=log` may write


def spread_by_bins(distances: tuple[int, ...]) -> tuple[int, ...]:
  """`distances` repeated so that each power-of-two bin [2^k, 2^(k+1)) they fall in is drawn
  equally often (each distance of a bin as often as the others of its bin): a distance of a bin
  of s distances appears m / s times, m the least common multiple of the bins' sizes."""
  bins: dict[int, list[int]] = {}
  for d in distances:
    bins.setdefault(int(d).bit_length(), []).append(int(d))
  m = math.lcm(*(len(b) for b in bins.values()))
  if m * len(bins) > MAX_DISTANCE_LIST:
    raise ValueError(f"config argument spread=log: the distances' bins would need "
                     f"{m * len(bins):,} entries; give a range whose bins are whole powers of "
                     f"two, such as distance=2-255.")
  return tuple(d for _, b in sorted(bins.items()) for d in b for _ in range(m // len(b)))


def parse_distances(text: str, length: int, spread: str = "uniform") -> tuple[int, ...]:
  """`"128"` -> (128,); `"64-255"` -> (64, ..., 255); `""` -> L / 4 .. L - 1; with `spread`
  `log`, each power-of-two bin of them equally often (`spread_by_bins`)."""
  if spread not in SPREADS:
    raise ValueError(f"config argument spread={spread}: must be one of {', '.join(SPREADS)}.")
  if spread == "log":
    return spread_by_bins(parse_distances(text, length))
  if not text:
    return tuple(range(length // 4, length))
  lo, dash, hi = text.partition("-")
  try:
    lo_d, hi_d = int(lo), int(hi if dash else lo)
  except ValueError:
    raise ValueError(f"config argument distance={text}: expected D or LO-HI (integers)."
                     ) from None
  if hi_d < lo_d:
    raise ValueError(f"config argument distance={text}: the range is empty.")
  return tuple(range(lo_d, hi_d + 1))


def data_config() -> ml_collections.ConfigDict:
  """The base data: 1,024 tokens, 128 keys, 128 values and 768 filler tokens."""
  return common.data_fields(
      "needle",
      max_length=1024,          # L; the query is at L - 1
      vocab_size=1024,          # keys, then values, then filler tokens
      num_keys=128,             # keys [0, num_keys)
      num_values=128,           # values [num_keys, num_keys + num_values): the answers
      distances=(512,),         # d, drawn uniformly per example (get_config sets the range)
      num_distractors=0,        # other key-value pairs the query's key must be told from
      num_train=100_000, num_val=2_000, num_test=2_000, seed=0,
      download=False)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The needle config for `arg` = "attention=NAME,size=base|small,window=W,variant=causal|
  bidirectional,global=0|1,distance=D|LO-HI,spread=uniform|log,distractors=N,length=L" (0 or
  absent: the size's value)."""
  p = common.parse_arg(arg, attention="", size=SIZES[0], window=0, variant="causal", length=0,
                       distance="", spread="uniform", distractors=0, **{"global": False})
  a = common.task_arg(",".join(f"{k}={p[k]}" for k in ("attention", "size", "window")
                               if p[k]), attention="dot_product", sizes=SIZES)
  if p.variant not in VARIANTS:
    raise ValueError(f"config argument variant={p.variant}: must be one of "
                     f"{', '.join(VARIANTS)}.")
  c = common.task_config("needle", data_config())
  c.model.memory_length = 0
  c.model.variant = p.variant
  c.model.global_query = bool(p["global"])
  if a.size == "base":
    # 2 layers of width 128 with rotary positions (relative offsets, at any length L), AdamW
    # 1e-3 with a cosine schedule.
    common.set_model(c.model, layers=2, width=128, heads=2, mlp=4 * 128, classifier=128,
                     dropout=0.0, pos_emb="rotary", pool="mean")
    common.set_schedule(c, steps=20_000, batch=32, eval_batch=100, learning_rate=1e-3,
                        schedule="cosine", warmup=1000, weight_decay=0.1, log_every=200,
                        eval_every=2000, checkpoint_every=2000, grad_clip=1.0)
    window = a.window or 64
  else:
    # 256 tokens, 16 keys and 16 values among 32 filler tokens; mqar small's model (2 layers,
    # width 64, rotary positions) and optimiser, 600 steps (dense reached validation accuracy
    # 1.0 by step 250 in a first run).
    c.data.update(max_length=256, vocab_size=64, num_keys=16, num_values=16,
                  num_train=20_000, num_val=500, num_test=1_000)
    common.set_model(c.model, layers=2, width=64, heads=2, mlp=128, classifier=64,
                     dropout=0.0, pos_emb="rotary", pool="mean")
    common.cpu_schedule(c, steps=600, batch=32, eval_batch=250, learning_rate=1e-2,
                        warmup=100, weight_decay=0.01, eval_every=100, checkpoint_every=300)
    window = a.window or 16
  if p.length:
    c.data.max_length = p.length
  c.data.distances = parse_distances(p.distance, c.data.max_length, p.spread)
  c.data.num_distractors = p.distractors
  # The run's identity is its kind and size only (lra.identity): `lra results` compares a run
  # with the default config of that identity, so the other arguments show as the fields they
  # set (model.variant, model.global_query, data.distances, ...).
  common.set_attention(c, a, window)
  return c


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError (one line) for settings that make no example, a vocabulary larger than
  the model's or a global query without band layers (`configs.build_config` calls it after the
  overrides). A causal model of a kind that cannot be causal is refused when the run builds it
  (`lra.tasks.needle`), as MQAR's are: every kind's config builds."""
  d, m = config.data, config.model
  needle_generator.check(vocab_size=d.vocab_size, seq_len=d.max_length, num_keys=d.num_keys,
                         num_values=d.num_values, distances=tuple(d.distances),
                         num_distractors=d.get("num_distractors", 0))
  if d.vocab_size > MAX_VOCAB:
    raise ValueError(f"config.data.vocab_size = {d.vocab_size}: the model has rows for at most "
                     f"{MAX_VOCAB} tokens.")
  if m.variant not in VARIANTS:
    raise ValueError(f"config.model.variant = {m.variant!r}: must be one of "
                     f"{', '.join(VARIANTS)}.")
  names = [kinds.get(e["kind"] if "kind" in e else m.attention.kind).name
           for e in (m.attention, *(m.get("layer_attention") or ()))]
  if m.global_query:
    if "band" not in names:
      raise ValueError("config.model.global_query needs band layers: it makes the query a "
                       "global token of band attention.")
    if m.pos_emb in ("relative", "infused"):
      raise ValueError(f"config.model.global_query with pos_emb={m.pos_emb!r}: the global-query "
                       f"layer applies rotary or added positions only.")
  if m.pool != "mean":
    raise ValueError(f"config.model.pool = {m.pool!r}: the needle models read the query "
                     f"position and pool nothing (no CLS token): leave it mean.")


def sweep(add) -> None:
  """Dense, band and band with a global query at size small, causal, one seed."""
  for arg in ("attention=dot_product", "attention=band", "attention=band,global=1"):
    add(config_arg=f"{arg},size=small", seed=0)


# The distance figure's kinds: causal dense, band (reach 2 x 16 = 32 at small), band with the
# query global, strided sparse, FAVOR+, linear and LSH; bidirectional dense, BigBird, Linformer.
DISTANCE_KINDS = ("attention=dot_product", "attention=band", "attention=band,global=1",
                  "attention=sparse", "attention=favor", "attention=linear", "attention=lsh",
                  # the kinds that cannot be causal, in the bidirectional variant, with dense
                  "attention=dot_product,variant=bidirectional",
                  "attention=bigbird,variant=bidirectional",
                  "attention=linformer,variant=bidirectional")


def sweep_distance(add) -> None:
  """Accuracy against distance (`lra sweep needle --sweep distance --workdir DIR --parallel 2`,
  then `python benchmarks/recall_plot.py DIR --plot PNG --reach 32`): each kind of
  `DISTANCE_KINDS` at size small, trained and tested on distances 2 .. 255 with each
  power-of-two bin drawn equally often (`spread=log`: the test's accuracy per bin is the curve,
  about 143 needles per bin), seeds 0 and 1. Drawn uniformly instead, 7 in 8 needles lie beyond
  band's reach of 32, and band learned no retrieval even within it (600 steps, seeds 0 and 1)."""
  for arg in DISTANCE_KINDS:
    for seed in (0, 1):
      add(config_arg=f"{arg},size=small,distance=2-255,spread=log", seed=seed)


def sweep_distractors(add) -> None:
  """Key matching among 15 other pairs (`lra sweep needle --sweep distractors --workdir DIR
  --parallel 2`): dense, linear, FAVOR+ and band with a global query at size small, distances
  2 .. 255 spread by bins, seeds 0 and 1. With one pair the value is the only value in the row,
  and linear and FAVOR+ retrieved every needle of the distance sweep."""
  for arg in ("attention=dot_product", "attention=linear", "attention=favor",
              "attention=band,global=1"):
    for seed in (0, 1):
      add(config_arg=f"{arg},size=small,distance=2-255,spread=log,distractors=15", seed=seed)
