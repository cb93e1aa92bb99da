"""Retrieval (LRA): AAN citation matching of two byte-level documents, one config for every kind.

`arg` keys: `attention` (any name in `attention.kinds`), `size` (`base`: the LRA settings;
`small`: sized to train on a laptop CPU), `window` (one-sided window of the local kinds).

Needs the AAN TSVs of the LRA release (`new_aan_pairs.{train,eval,test}.tsv`) under
`$LRA_DATA/manual/lra_release/tsv_data/` (or `.../aan/`), or `lra_release.gz` (8.2 GB, from
https://storage.googleapis.com/long-range-arena/lra_release.gz) in `$LRA_DATA/manual/`, from
which the TSV folder is extracted on first use.

Main command (256 bytes per document, a 2-layer, 64-wide shared encoder, 800 steps of batch
16, validation and test evaluated at the end; its time is in docs/text_and_retrieval.md):

  .venv/bin/lra run retrieval --size small

Expected: not measured on AAN yet (the release is not on the development machine). LRA's base
Transformer reached 57.46%; see docs/text_and_retrieval.md.

LRA base: `lra run retrieval --size base --attention band --workdir DIR` (5,000 steps, batch 32,
4,000 bytes per document; LRA reports 52.27-59.59% test accuracy).
"""

from __future__ import annotations

import ml_collections

from configs import common

LRA_DOC_BYTES = 10_000      # bytes per document LRA kept before max_length (the dataset's cap)


def data_config() -> ml_collections.ConfigDict:
  """The LRA data settings: the first 4,000 bytes of each document."""
  return common.data_fields(
      "retrieval",
      max_length=4000,        # bytes per document after truncation (first bytes) / padding
      doc_bytes=LRA_DOC_BYTES)  # bytes per document kept in the prepared dataset


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The Retrieval config for `arg` = "attention=NAME,size=base|small,window=W"."""
  a = common.task_arg(arg, attention="dot_product")
  c = common.task_config("retrieval", data_config())
  if a.size == "base":
    # LRA base_match_config; LRA's warmup (8,000) is longer than its training (5,000), so the
    # learning rate only ramps up. The towers combine as [u, v, u*v, u-v] with a real CLS token
    # each (the paper; LRA's code used [u, v] and the first byte). docs/text_and_retrieval.md.
    common.set_model(c.model, layers=4, width=128, heads=4, mlp=512, classifier=512,
                     dropout=0.1, pos_emb="sinusoidal", pool="cls")
    common.set_schedule(c, steps=5000, batch=32, eval_batch=64, learning_rate=0.05,
                        schedule="rsqrt", warmup=8000, weight_decay=0.1, log_every=100,
                        eval_every=500, checkpoint_every=500)
    window = a.window or 128
  else:
    c.data.max_length = 256
    common.set_model(c.model, layers=2, width=64, heads=4, mlp=128, classifier=128,
                     dropout=0.1, pos_emb="sinusoidal", pool="mean")
    # validation (18,090 pairs) only at the end: it costs more than training
    common.cpu_schedule(c, steps=800, batch=16, eval_batch=200, learning_rate=2e-3,
                        warmup=80, weight_decay=0.01, eval_every=800, checkpoint_every=200)
    window = a.window or 32
  common.set_attention(c, a, window)
  return c


def sweep(add) -> None:
  """The LRA comparison: every attention kind on Retrieval base, three seeds."""
  common.lra_sweep(add)
