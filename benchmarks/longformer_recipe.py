"""Longformer's recipe on this CPU: a short RoBERTa-shaped model made long by copying positions.

Longformer (Beltagy et al. 2020, section 5) did not pretrain from scratch: it took RoBERTa
(512 positions), swapped in band attention, copied the 512 learned position embeddings over
4,096 positions and continued masked-LM pretraining. Its Table 5 shows why the copy matters:
before any further training, the model at 4,096 tokens has 1.957 BPC with copied positions
against 10.299 with freshly initialised ones (RoBERTa itself 1.846 at 512).

This script repeats that at a size this CPU trains in minutes, through the Hugging Face format
both ways (`models.pretrained`):

  1. pretrains a small RoBERTa-shaped encoder (post-LayerNorm, biases, exact GELU, embedding
     LayerNorm, positions after RoBERTa's offset of 2, learned but started from sinusoids) with
     our masked-LM objective (`lra.tasks.pretraining.bert_corruption`, 15%, 80/10/10) and our
     tied output at 128 positions on the fallback corpus's bytes (Python's reference manual,
     `lra.data.charlm.fallback_text`);
  2. exports it as a Hugging Face RoBERTa checkpoint (`pretrained.export`);
  3. imports that checkpoint with band attention at 512 positions (one-sided window 64: a
     two-sided window of 128, the source length, as Longformer-base's 512 was RoBERTa's),
     the positions copied (`pretrained.load(path, max_length=512, attention=...)`), and
     again with the 384 new position rows drawn afresh (N(0, the trained rows' std), and
     N(0, 0.02), RoBERTa's initializer_range), and with all 512 rows drawn afresh;
  4. evaluates the masked-LM loss of all of them on the same corrupted validation windows of
     512 bytes: the short model on each window cut into four pieces of 128, the long ones on
     the whole window; and the short model once more with every position row replaced by the
     rows' mean (no order: each piece read as a bag of bytes), which says how much of its loss
     the order is worth.

  python benchmarks/longformer_recipe.py [--steps 3000] [--corpus text|pairs|runs]
      [--dropout 0.1] [--json FILE] [--export DIR]
  # about 10 minutes alone, 16 beside another run

`--corpus pairs` trains on random symbols each written twice instead (`pairs_corpus`), and
`--corpus runs` on random symbols in runs of 2-4 (`runs_corpus`): reading a masked symbol's
neighbour is all there is to learn, and finding the neighbour needs the positions. With
RoBERTa's dropout of 0.1 (on the embeddings too) this model did not learn to read a neighbour
through its learned positions; `--dropout 0 --corpus runs` does (docs/pretrained.md).

Prints a table (loss in nats per masked byte, and bits per masked byte) and the ratio of each
long model's loss to the short model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from lra.data import charlm  # noqa: E402
from lra.tasks.pretraining import bert_corruption  # noqa: E402
from models import pretrained, pretraining  # noqa: E402
from models.embeddings import sinusoidal_table  # noqa: E402
from models.encoder import Encoder  # noqa: E402

SHORT, LONG = 128, 512
VOCAB = 257                    # byte b is id b + 1; id 0 is padding and the [MASK] row
RATE = 0.15


def settings(layers: int, width: int, dropout: float = 0.1) -> dict:
  """A RoBERTa-shaped encoder (what `pretrained.encoder_settings` makes of a RoBERTa config)."""
  return dict(vocab_size=VOCAB, max_length=SHORT, num_layers=layers, num_heads=4,
              emb_dim=width, qkv_dim=width, mlp_dim=4 * width, dropout=dropout,
              pos_emb="learned",
              attention={"kind": "dot_product"}, attention_bias=True, norm="post",
              layer_norm_eps=1e-5, activation="gelu", embed_norm=True, type_vocab_size=1,
              position_offset=2, lm_head=False)


def corpus() -> tuple[np.ndarray, np.ndarray]:
  """(train ids, validation ids) of the fallback corpus's bytes, split 95/5 by position."""
  data = np.frombuffer(charlm.fallback_text(charlm.CORPORA["enwik8"]), np.uint8)
  ids = data.astype(np.int32) + 1
  cut = len(ids) * 95 // 100
  return ids[:cut], ids[cut:]


def pairs_corpus(alphabet: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(train ids, validation ids), 95/5, of random symbols (ids 1..alphabet) each written twice:
  a masked symbol is its pair's, which sits before or after it by the parity of its position
  (windows start at even offsets). Context is worth all there is to learn, and reading it needs
  the positions."""
  symbols = np.random.default_rng(seed).integers(1, alphabet + 1, n // 2).astype(np.int32)
  ids = np.repeat(symbols, 2)
  cut = (len(ids) * 95 // 100) // 2 * 2
  return ids[:cut], ids[cut:]


def runs_corpus(alphabet: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(train ids, validation ids), 95/5, of random symbols (ids 1..alphabet) in runs of 2 to 4
  equal symbols, neighbouring runs different: every symbol equals at least one neighbour, and a
  bag of them says almost nothing. Reading a masked symbol from either side needs the positions
  (but not their parity, as `pairs_corpus` does)."""
  rng = np.random.default_rng(seed)
  count = n // 2 + 1
  steps = rng.integers(1, alphabet, count)                 # never 0: runs differ from the last
  symbols = (rng.integers(0, alphabet) + np.cumsum(steps)) % alphabet + 1
  ids = np.repeat(symbols, rng.integers(2, 5, count))[:n].astype(np.int32)
  cut = len(ids) * 95 // 100
  return ids[:cut], ids[cut:]


def orderless(table: np.ndarray, offset: int = 2) -> np.ndarray:
  """The position table with every row after the offset replaced by those rows' mean: every
  position looks alike, so the encoder reads its input as a bag of tokens."""
  mean = table[offset:].mean(axis=0, keepdims=True)
  return np.concatenate([table[:offset], np.repeat(mean, table.shape[0] - offset, axis=0)])


def masked_loss(logits, targets, chosen):
  """Mean cross-entropy (nats) over the chosen positions."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  w = chosen.astype(jnp.float32)
  return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def train(model, ids: np.ndarray, steps: int, batch: int, lr: float, seed: int) -> list:
  """Our masked-LM objective on random windows of SHORT bytes; returns (step, loss) records."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(500, steps // 10), steps, lr / 10)
  opt = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, tokens, key):
    k_mask, k_drop = jax.random.split(key)
    inputs, shown, chosen = bert_corruption(tokens, RATE, VOCAB, k_mask)

    def loss_fn(model):
      logits = pretraining.masked_logits(model, inputs, shown, rng=k_drop)
      return masked_loss(logits, tokens, chosen)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  rng = np.random.default_rng(seed)
  key = jax.random.PRNGKey(seed)
  records, t0, window = [], time.time(), []
  for i in range(steps):
    starts = rng.integers(0, (len(ids) - SHORT) // 2, batch) * 2   # even: keeps pairs aligned
    tokens = jnp.asarray(np.stack([ids[s:s + SHORT] for s in starts]))
    window.append(float(step(model, opt, tokens, jax.random.fold_in(key, i))))
    if (i + 1) % 100 == 0 or i + 1 == steps:
      records.append((i + 1, float(np.mean(window))))
      print(f"  step {i + 1:5d}  train loss {records[-1][1]:.4f}  ({time.time() - t0:.0f} s)",
            flush=True)
      window = []
  return records


def evaluate(model, tokens, inputs, shown, chosen, piece: int) -> float:
  """The masked-LM loss over windows `[N, LONG]`, each read as pieces of `piece` tokens."""
  n = tokens.shape[0] * (LONG // piece)
  cut = lambda x: x.reshape(n, piece)  # noqa: E731
  total, count = 0.0, 0.0
  for i in range(0, n, 16):
    sl = slice(i, i + 16)
    logits = pretraining.masked_logits(model, cut(inputs)[sl], cut(shown)[sl])
    w = cut(chosen)[sl].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, cut(tokens)[sl])
    total += float(jnp.sum(ce * w))
    count += float(jnp.sum(w))
  return total / count


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=3000)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--windows", type=int, default=32, help="validation windows of 512 bytes")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--position_std", type=float, default=1.0,
                 help="the initial positions' standard deviation (the fresh rows' too)")
  p.add_argument("--position_init", choices=("normal", "sinusoid"), default="sinusoid",
                 help="the learned positions' start: N(0, position_std) or sinusoids")
  p.add_argument("--corpus", choices=("text", "pairs", "runs"), default="text",
                 help="the fallback corpus's bytes, random symbols each written twice, or "
                      "random symbols in runs of 2-4")
  p.add_argument("--alphabet", type=int, default=16,
                 help="--corpus pairs|runs: how many symbols")
  p.add_argument("--dropout", type=float, default=0.1,
                 help="dropout of the encoder (0.1: RoBERTa's)")
  p.add_argument("--json", default="", help="also write the numbers to this file")
  p.add_argument("--export", default="",
                 help="also keep the short model as a RoBERTa checkpoint in this new folder "
                      "(for `--config.init_from_hf`)")
  args = p.parse_args(argv)
  if args.export and os.path.exists(args.export) and (not os.path.isdir(args.export)
                                                      or os.listdir(args.export)):
    p.error(f"--export {args.export}: exists and is not an empty folder; give a new folder.")
  if not 2 <= args.alphabet <= 256:
    p.error(f"--alphabet {args.alphabet}: give 2 to 256 symbols (they are bytes).")
  if not 0.0 <= args.dropout < 1.0:
    p.error(f"--dropout {args.dropout}: give a rate in [0, 1).")
  if args.corpus == "text":
    train_ids, val_ids = corpus()
  else:
    make = pairs_corpus if args.corpus == "pairs" else runs_corpus
    train_ids, val_ids = make(args.alphabet, 466_000, args.seed)
  print(f"corpus ({args.corpus}): {len(train_ids):,} training and {len(val_ids):,} validation "
        f"bytes")
  model = Encoder(settings(args.layers, args.width, args.dropout), rngs=nnx.Rngs(args.seed))
  # The learned positions start from sinusoids (or N(0, position_std)): at our default
  # N(0, 0.02) they vanish beside the N(0, 1) tokens after the embedding LayerNorm, the model
  # learns to ignore them, and copying them changes nothing (docs/pretrained.md).
  table = model.positions.table
  if args.position_init == "sinusoid":   # learned, started from sinusoids (rows after the offset)
    init = np.concatenate([np.zeros((2, args.width)), sinusoidal_table(SHORT, args.width)])
  else:
    init = np.random.default_rng(args.seed + 1).normal(0.0, args.position_std, table.shape)
  table.set_value(jnp.asarray(init, jnp.float32))
  t0 = time.time()
  records = train(model, train_ids, args.steps, args.batch, args.lr, args.seed)
  train_seconds = time.time() - t0
  starts = np.linspace(0, (len(val_ids) - LONG) // 2, args.windows).astype(int) * 2
  tokens = jnp.asarray(np.stack([val_ids[s:s + LONG] for s in starts]))
  inputs, shown, chosen = bert_corruption(tokens, RATE, VOCAB, jax.random.PRNGKey(12345))
  rows = {}
  rows["short model, 128 positions, dense, pieces of 128"] = evaluate(
      model, tokens, inputs, shown, chosen, SHORT)
  if args.export:
    pretrained.export(model, args.export, "roberta")
    print(f"The short model is a RoBERTa checkpoint in {args.export}.")
  with tempfile.TemporaryDirectory() as folder:
    pretrained.export(model, folder, "roberta")
    band = {"kind": "band", "window": SHORT // 2}
    copied, report = pretrained.load(folder, max_length=LONG, attention=band)
    rows["imported, 512 positions copied, band w=64"] = evaluate(
        copied, tokens, inputs, shown, chosen, LONG)
    fresh, _ = pretrained.load(folder, max_length=LONG, attention=band)
  table = np.asarray(fresh.positions.table.get_value())
  std = float(np.std(table[2:2 + SHORT])) if args.position_init == "sinusoid" else \
      args.position_std
  for scale in (std, 0.02):   # the trained rows' spread; RoBERTa's initializer_range
    init = np.random.default_rng(args.seed).normal(0.0, scale, table[2 + SHORT:].shape)
    fresh.positions.table.set_value(jnp.asarray(
        np.concatenate([table[:2 + SHORT], init.astype(np.float32)])))
    rows[f"imported, 384 new positions fresh N(0, {scale:.2g}), band w=64"] = evaluate(
        fresh, tokens, inputs, shown, chosen, LONG)
  # Every row fresh, the 128 trained ones too (a new position table that nothing was copied
  # into), with the trained rows' spread.
  init = np.random.default_rng(args.seed).normal(0.0, std, table[2:].shape)
  fresh.positions.table.set_value(jnp.asarray(
      np.concatenate([table[:2], init.astype(np.float32)])))
  rows[f"imported, all 512 positions fresh N(0, {std:.2g}), band w=64"] = evaluate(
      fresh, tokens, inputs, shown, chosen, LONG)
  # No order at all: every position row of the short model replaced by the rows' mean, so
  # each piece of 128 is read as a bag of bytes. What the model gains over this is what it
  # draws from the order, and the most a position start can take away without misleading it.
  short_table = np.asarray(model.positions.table.get_value())
  model.positions.table.set_value(jnp.asarray(orderless(short_table)))
  rows["short model, no order (every position its rows' mean), pieces of 128"] = evaluate(
      model, tokens, inputs, shown, chosen, SHORT)
  model.positions.table.set_value(jnp.asarray(short_table))
  base = rows["short model, 128 positions, dense, pieces of 128"]
  print(f"\n{args.steps} steps in {train_seconds:.0f} s; {int(jnp.sum(chosen))} masked bytes in "
        f"{args.windows} validation windows of {LONG}; {'; '.join(report.notes)}\n")
  print("| model | masked-LM loss (nats) | bits per masked byte | ratio to the short model |")
  print("|---|---|---|---|")
  for name, loss in rows.items():
    print(f"| {name} | {loss:.4f} | {loss / np.log(2):.4f} | {loss / base:.3f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "train": records, "train_seconds": train_seconds,
                 "loss": rows}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
