"""Needle retrieval: the value of the one key-value pair at distance d before a final query of
its key, read at the query position; causal or bidirectional, with or without a global query.

The data (the tfds dataset and the model's examples, MQAR's format) is `lra.data.needle`, the
generator `lra.data.needle_generator`. `config.model.variant` picks the model:
- `causal`: the character LM's causal `models.LanguageModel`, as MQAR's task (`lra.tasks.mqar`):
  the query position's output, through the tied embedding, predicts the next token, the value.
  Only kinds that can be causal (their `lra list` record) run it: `build_model` refuses others;
- `bidirectional`: a bidirectional `models.Encoder` (`BidirectionalReader`), no CLS token, whose
  output at the query position is read through its own embedding, as the causal variant's and
  a masked LM's. Every kind runs it, BigBird and Linformer included. (The LRA classifier's fresh
  Dense -> ReLU -> Dense head over the ids stalled here: dense attention stayed at 0.13 after
  1,200 steps at size small, and at 64 tokens with the pair next to the query it took 300 steps
  to leave chance where the tied readout took 100 to be exact; docs/recall.md.)
Loss and accuracy count the query position only (the mask), so the accuracy is the fraction of
needles retrieved; the best checkpoint is the one with the highest validation accuracy.

Accuracy by distance: evaluation also sums the needles retrieved per distance bin, the bins
[2, 4), [4, 8), [8, 16), ... (powers of two, `distance_bins`), with the distance read from the
inputs (the query's position minus the position of its key, the only earlier copy of it);
`results.json` holds `test_accuracy_by_distance` ({"LO-HI": accuracy} for the bins with
needles, of the best checkpoint) and the metrics records `correct_dLO` / `weight_dLO`. One run
trained on a range of distances thus gives the whole curve of accuracy against distance.

`config.model.global_query` makes the query position a global token of every band layer: band
attention's own `global_mask` (`attention.band.band_attention`: a global token attends to every
real key, causal pairs only under `causal`, and every query attends to it), the mechanism LED's
encoder uses for its first tokens (`models.seq2seq.GlobalBandAttention`), here on the last real
position instead of the first (`QueryGlobalBandAttention`). Other kinds' layers are unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import models
from attention import backends, rotary
from attention import kinds as attention_kinds
from lra.data import needle as data
from lra.tasks.base import example_weights, predicted, weighted_sums
from lra.tasks.mqar import RecallTask
from models import sequence
from models.attention_layer import split_spec
from models.seq2seq import GlobalBandAttention
from models.settings import ModelSettings

NAME = data.NAME
MAX_VOCAB = 8192          # the largest data.vocab_size; ids are tokens + 1
VARIANTS = ("causal", "bidirectional")


def distance_bins(length: int) -> list[tuple[int, int]]:
  """The distance bins of sequences of `length` tokens: [2, 4), [4, 8), ... up to the largest
  distance, L - 1 (inclusive lower, exclusive upper bounds)."""
  bins, lo = [], 2
  while lo <= length - 1:
    bins.append((lo, 2 * lo))
    lo *= 2
  return bins


def needle_distance(inputs: jax.Array, query: jax.Array) -> jax.Array:
  """`[B, L]` ids and `[B]` query positions -> `[B]` distances: the query's position minus the
  position of the earlier copy of its id (the key; 0 when there is none)."""
  ids = jnp.take_along_axis(inputs, query[:, None], axis=1)                 # [B, 1]
  positions = jnp.arange(inputs.shape[1])[None, :]
  earlier = (inputs == ids) & (positions < query[:, None])
  key = jnp.max(jnp.where(earlier, positions, -1), axis=1)                  # [B]
  return jnp.where(key >= 0, query - key, 0)


def query_position(key_mask: jax.Array) -> jax.Array:
  """`[B, L]` bool -> `[B, L]` bool: the last real position of each row (the query)."""
  last = jnp.sum(key_mask, axis=1, keepdims=True) - 1                      # [B, 1]
  return key_mask & (jnp.arange(key_mask.shape[1])[None, :] == last)


class QueryGlobalBandAttention(GlobalBandAttention):
  """Band self-attention with the query (the last real token of each row) global; rotary
  positions and causal attention as `MultiHeadAttention` applies them."""

  def __call__(self, x: jax.Array, key_mask: jax.Array | None, *, rng=None) -> jax.Array:
    del rng  # band attention draws nothing
    if sequence.devices() > 1:
      raise ValueError("a global query token needs the whole sequence on each device: use "
                       "config.mesh.sequence=1.")
    b, length, _ = x.shape
    proj = lambda w: jnp.einsum("ble,ehd->blhd", x, w[...].astype(x.dtype))  # [B, L, H, Dh]
    q, k, v = proj(self.query), proj(self.key), proj(self.value)
    if self.pos_kind == "rotary":
      q, k = rotary.apply_rotary(q, self.rotary_base), rotary.apply_rotary(k, self.rotary_base)
    if key_mask is None:
      key_mask = jnp.ones((b, length), bool)
    args = {**self.args, "max_global": max(self.args.get("max_global") or 0, 1)}
    if self.causal:
      args["causal"] = True
    if self.tiles is not None:   # splash's tiles (config.model.splash)
      args["tiles"] = self.tiles
    band = backends.function(self.kind, self.implementation)
    out = band(q, k, v, key_mask=key_mask, global_mask=query_position(key_mask), **args)
    return jnp.einsum("blhd,hde->ble", out, self.out[...].astype(out.dtype))  # [B, L, E]


def make_query_global(encoder: models.Encoder, cfg: Mapping[str, Any], *, causal: bool,
                      rngs: nnx.Rngs) -> int:
  """Replaces the attention of `encoder`'s band layers by `QueryGlobalBandAttention` (new
  parameters); returns how many layers it replaced."""
  s = ModelSettings.from_mapping(cfg)
  replaced = 0
  layers = [b for b in encoder.blocks if hasattr(b, "attention")]
  for i, (block, spec) in enumerate(zip(layers, s.layer_specs())):
    if split_spec(spec)[0] == "band":
      block.attention = QueryGlobalBandAttention(
          s.emb_dim, s.num_heads, s.qkv_dim, spec, max_length=s.max_length, causal=causal,
          layer_index=i, positions=s.positions, num_global=1, tiles=s.splash_tiles, rngs=rngs)
      replaced += 1
  return replaced


class BidirectionalReader(nnx.Module):
  """The bidirectional variant's model: an encoder (no CLS token) whose output at the query
  position is read through its token embedding (`NeedleTask.objective`)."""

  def __init__(self, cfg: ModelSettings | Mapping[str, Any], *, rngs: nnx.Rngs):
    self.encoder = models.Encoder(cfg, rngs=rngs)


@dataclasses.dataclass(frozen=True)
class NeedleTask(RecallTask):
  """The value at the query position, by a causal LM or a bidirectional encoder, both read
  through the token embedding."""

  RESULT = ("needle", "needles retrieved")

  def causal_attention(self, model_cfg: Mapping[str, Any]) -> bool | None:
    return str(model_cfg.get("variant") or "causal") == "causal" or None

  def build_model(self, model_cfg: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    variant = str(model_cfg.get("variant") or "causal")
    if variant not in VARIANTS:
      raise ValueError(f"config.model.variant = {variant!r}: must be one of "
                       f"{', '.join(VARIANTS)}.")
    causal = variant == "causal"
    if causal:
      for spec in ModelSettings.from_mapping(model_cfg).layer_specs():
        reason = attention_kinds.get(split_spec(spec)[0]).causal
        if reason is not True:
          raise ValueError(f"attention {split_spec(spec)[0]!r} cannot be causal "
                           f"({str(reason).rstrip('.')}); the needle task runs it with --arg "
                           f"variant=bidirectional.")
    model = (models.LanguageModel if causal else BidirectionalReader)(model_cfg, rngs=rngs)
    if model_cfg.get("global_query"):
      make_query_global(model.encoder, model_cfg, causal=causal, rngs=rngs)
    return model

  def check_layers(self, kinds: Sequence[str]) -> None:
    """Nothing here: which kinds run depends on the variant, a model setting that this check
    does not see; `build_model` refuses a causal model of a kind that cannot be causal."""
    del kinds

  def objective(self, model, batch: Mapping[str, jax.Array], rng) -> dict[str, jax.Array]:
    x, _ = model.encoder(batch["inputs"], rng=rng)                         # [B, L, E]
    index = jnp.argmax(batch["mask"], axis=1)                              # [B]: the query
    h = jnp.take_along_axis(x, index[:, None, None], axis=1)               # [B, 1, E]
    logits = model.encoder.embed.attend(h * (h.shape[-1] ** -0.5))[:, 0]    # [B, V]
    targets = jnp.take_along_axis(batch["targets"], index[:, None], axis=1)[:, 0]
    weights = example_weights(batch) * jnp.max(batch["mask"], axis=1).astype(jnp.float32)
    sums = weighted_sums(logits.astype(jnp.float32), targets, weights)
    if rng is None:      # evaluation: needles retrieved per distance bin
      distance = needle_distance(batch["inputs"], index)
      correct = predicted(logits, targets).astype(jnp.float32) * weights
      for lo, hi in distance_bins(batch["inputs"].shape[1]):
        inside = ((distance >= lo) & (distance < hi)).astype(jnp.float32)
        sums[f"correct_d{lo}"] = jnp.sum(correct * inside)
        sums[f"weight_d{lo}"] = jnp.sum(weights * inside)
    return sums

  def result_fields(self, *, test_best, test_final, final_validation, best) -> dict[str, Any]:
    del test_final, final_validation, best
    by_distance = {}
    for key, weight in test_best.items():
      if key.startswith("weight_d") and weight > 0:
        lo = int(key[len("weight_d"):])
        by_distance[f"{lo}-{2 * lo - 1}"] = test_best[f"correct_d{lo}"] / weight
    return {"test_accuracy_by_distance": by_distance} if by_distance else {}


TASK = NeedleTask(name=NAME, vocab_size=MAX_VOCAB + data.OFFSET,
                  num_classes=MAX_VOCAB + data.OFFSET, get_source=data.get_source,
                  prepare=data.DATA.prepare, status=data.DATA.status)
