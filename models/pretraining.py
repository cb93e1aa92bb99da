"""Self-pretraining forwards over a task model's own encoder (no parameters of their own).

The pretraining objectives (`lra.tasks.pretraining`) train the encoder of the model the task
fine-tunes (`Classifier`, `DualEncoder`), so a pretraining run's parameters have exactly the
fine-tuning model's structure and `config.init_from` loads them as they are; the classifier or
dual-encoder head is never reached by a pretraining gradient and enters fine-tuning as it was
initialised. The output layer is the token embedding transposed (tied, scaled by
1/sqrt(emb_dim) as `models.LanguageModel`), and the [MASK] input is the embedding row of the
padding id 0, which the task models never read (padded tokens are never attended and their
features are zeroed), so no vocabulary entry is added.

  * `masked_logits`: BERT's masked LM, the encoder over inputs whose masked positions show the
    [MASK] embedding.
  * `causal_logits`: next-token logits of an encoder built with `causal=True`.
  * `mpnet_logits`: MPNet's two streams (Song et al. 2020) with the masks of
    `attention.masks.mpnet_position_masks`, composed with the pattern of each layer's attention
    kind (`permutation_pattern`, the builder its record names in `Kind.pattern`); kinds whose
    attention is not a pattern over positions are refused (`Kind.no_pattern` says why).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

import attention
from attention import kinds, masks, rotary
from models.embeddings import sinusoidal_table
from models.encoder import dropout, run_blocks


def _fold(rng, i: int):
  return None if rng is None else jax.random.fold_in(rng, i)


def _tied_logits(encoder, x: jax.Array) -> jax.Array:
  x = x * (x.shape[-1] ** -0.5)
  return encoder.embed.attend(x).astype(jnp.float32)                      # [B, L, V]


def _embed(encoder, tokens: jax.Array, shown_as_mask: jax.Array | None):
  """Token embeddings `[B, L', E]` (the CLS vector first when the encoder has one), the
  [MASK] embedding where `shown_as_mask`, and the real-token mask `[B, L']`."""
  real = tokens > 0
  x = encoder.embed(tokens)                                                # [B, L, E]
  if shown_as_mask is not None:
    x = jnp.where(shown_as_mask[..., None], encoder.embed.embedding[...][0], x)
  if encoder.cls_token:
    cls = jnp.broadcast_to(encoder.cls[...], (x.shape[0], 1, x.shape[2])).astype(x.dtype)
    x = jnp.concatenate([cls, x], axis=1)
    real = jnp.concatenate([jnp.ones_like(real[:, :1]), real], axis=1)
  return x, real


def masked_logits(encoder, tokens: jax.Array, shown_as_mask: jax.Array, *, rng=None
                  ) -> jax.Array:
  """tokens `[B, L]` (0 = padding), `shown_as_mask` bool `[B, L]` -> logits `[B, L, V]`."""
  x, _ = encoder(tokens, rng=rng, shown_as_mask=shown_as_mask)
  x = x[:, int(encoder.cls_token):]
  if getattr(encoder, "lm_head", None) is not None:   # BERT's head (models/pretrained.py)
    return encoder.mlm_logits(x)
  return _tied_logits(encoder, x)


def causal_logits(encoder, tokens: jax.Array, *, rng=None) -> jax.Array:
  """A causal encoder's logits `[B, L, V]`; position i predicts token i + 1."""
  x, _ = encoder(tokens, rng=rng)
  return _tied_logits(encoder, x[:, int(encoder.cls_token):])


def permutation_pattern(spec: Mapping[str, Any], length: int, num_heads: int) -> np.ndarray:
  """bool `[H|1, L, L]`: the pairs attention `spec` allows over `length` positions, to be
  composed with the permutation masks; raises ValueError for the kinds that have no such
  pattern (`Kind.no_pattern` says why)."""
  args = dict(spec)
  kind = kinds.get(args.pop("kind"))
  if kind.pattern is None:
    raise ValueError(f"attention {kind.name!r} cannot be composed with MPNet's permutation "
                     f"masks: {kind.no_pattern}")
  return getattr(masks, kind.pattern)(length, num_heads, args)


def _streams_attention(layer, xc, xq, content_mask, query_mask, positions):
  """One layer's attention for both streams: queries from each stream, keys and values from
  the content stream only. xc `[B, 2L, E]`, xq `[B, L, E]`; masks `[B, H|1, Lq, 2L]`."""
  if layer.pos_kind == "relative":
    raise ValueError("pos_emb='relative' is not available with the MPNet objective; use "
                     "rotary, sinusoidal, learned or infused positions.")
  pos_c = np.concatenate([positions, positions])
  v = jnp.einsum("ble,ehd->blhd", xc, layer.value[...].astype(xc.dtype))
  if layer.pos_kind == "infused":
    table = jnp.asarray(sinusoidal_table(len(positions), xc.shape[-1]))
    xc, xq = xc + table[pos_c][None], xq + table[positions][None]
  kernel = layer.query[...].astype(xc.dtype)
  qc = jnp.einsum("ble,ehd->blhd", xc, kernel)
  qq = jnp.einsum("ble,ehd->blhd", xq, kernel)
  key_kernel = kernel if layer.shared_qk else layer.key[...].astype(xc.dtype)
  k = jnp.einsum("ble,ehd->blhd", xc, key_kernel)
  if layer.pos_kind == "rotary":
    qc, k = (rotary.apply_rotary(t, layer.rotary_base, positions=pos_c) for t in (qc, k))
    qq = rotary.apply_rotary(qq, layer.rotary_base, positions=positions)
  outs = []
  for q, mask in ((qc, content_mask), (qq, query_mask)):
    o = attention.dot_product_attention(q, k, v, mask=mask)
    outs.append(jnp.einsum("blhd,hde->ble", o, layer.out[...].astype(o.dtype)))
  return outs


def mpnet_logits(encoder, specs, tokens: jax.Array, ranks: jax.Array, predicted: jax.Array,
                 *, rng=None) -> jax.Array:
  """MPNet's query-stream logits `[B, L, V]` (row i predicts token i where `predicted`).

  `specs`: each attention sublayer's spec (`models.encoder.layer_specs`); `ranks` int `[B, L]`
  each token's place in its permutation, `predicted` bool `[B, L]` the permutation's last part.
  """
  offset = int(encoder.cls_token)
  x, real = _embed(encoder, tokens, None)                                 # [B, L', E]
  length = x.shape[1]
  if offset:   # the CLS token: a real, never predicted token ranked before every other
    ranks = jnp.concatenate([jnp.full_like(ranks[:, :1], -1), ranks], axis=1)
    predicted = jnp.concatenate([jnp.zeros_like(predicted[:, :1]), predicted], axis=1)
  content_mask, query_mask = masks.mpnet_position_masks(ranks, predicted, real)
  content_mask, query_mask = content_mask[:, None], query_mask[:, None]   # [B, 1, Lq, 2L']
  mask_vec = jnp.broadcast_to(encoder.embed.embedding[...][0], x.shape).astype(x.dtype)
  slots = encoder.positions(mask_vec)                                     # [M] + position
  xc = jnp.concatenate([encoder.positions(x), slots], axis=1)             # [B, 2L', E]
  xq = slots                                                              # [B, L', E]
  xc = dropout(xc, encoder.dropout_rate, _fold(rng, 0)).astype(encoder.dtype)
  xq = dropout(xq, encoder.dropout_rate, _fold(rng, 1)).astype(encoder.dtype)
  positions = np.arange(length)
  pos_c = np.concatenate([positions, positions])
  spec_iter = iter(specs)
  for i, block in enumerate(encoder.blocks):
    key = _fold(rng, i + 2)
    if hasattr(block, "attention"):
      spec = next(spec_iter)
      pattern = jnp.asarray(permutation_pattern(spec, length, block.attention.num_heads))
      cm = content_mask & pattern[None][:, :, pos_c][..., pos_c]
      qm = query_mask & pattern[None][..., pos_c]
      hc, hq = _streams_attention(block.attention, block.ln_attn(xc), block.ln_attn(xq),
                                  cm, qm, positions)
      xc = xc + dropout(hc, block.dropout_rate, _fold(key, 1))
      xq = xq + dropout(hq, block.dropout_rate, _fold(key, 2))
    if hasattr(block, "mlp"):
      xc = xc + dropout(block.mlp(block.ln_mlp(xc), rng=_fold(key, 3)), block.dropout_rate,
                        _fold(key, 4))
      xq = xq + dropout(block.mlp(block.ln_mlp(xq), rng=_fold(key, 5)), block.dropout_rate,
                        _fold(key, 6))
  xq = encoder.ln_final(xq)
  return _tied_logits(encoder, xq[:, offset:])
