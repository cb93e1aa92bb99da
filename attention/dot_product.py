"""Dense softmax attention: the reference every other primitive is tested against.

It materialises the full `[batch, heads, Lq, Lk]` score matrix, so it is O(L^2) in time and
memory. Its masking rules are the codebase's conventions:
  * softmax statistics in float32 whatever the input dtype;
  * masked logits get a finite large negative value, and masked probabilities are then set to
    exactly 0, so a query with no allowed key outputs exactly 0 (never NaN, never a uniform
    average over masked keys);
  * padded queries output 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention import masks, validation

# Finite large negative for masked logits (float32 statistics).
NEG_INF = -1e30


def masked_softmax_stats(logits: jax.Array,
                         allowed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Numerically safe masked softmax pieces over the last axis, in float32.

  Returns (p, row_max, row_sum) with `p = exp(logits - row_max)` where allowed and exactly 0
  elsewhere. A row with nothing allowed has p = 0 and row_sum = 0.
  """
  logits = jnp.where(allowed, logits, NEG_INF)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  p = jnp.where(allowed, jnp.exp(logits - row_max), 0.0)
  return p, row_max, jnp.sum(p, axis=-1, keepdims=True)


def allowed_mask(batch: int, heads: int, q_length: int, k_length: int, *,
                 mask: ArrayLike | None = None, causal: bool = False,
                 key_mask: jax.Array | None = None,
                 query_mask: jax.Array | None = None) -> jax.Array:
  """The (query, key) pairs dense attention may use: every given rule at once.

  The conjunction of an explicit pattern, the causal rule, real keys and real queries, as every
  dense primitive applies them before its softmax (`dot_product_attention`,
  `relative_attention`, `synthesizer_attention`).

  Args:
    batch, heads, q_length, k_length: B, H, Lq, Lk (the shape `mask` must broadcast to).
    mask: optional bool, broadcastable to `[B, H, Lq, Lk]`, True = allowed.
    causal: allow key j for query i only when j <= i (positions aligned at the start).
    key_mask: optional bool `[B, Lk]`, True = real key.
    query_mask: optional bool `[B, Lq]`, True = real query. Taken as given: the self-attention
      default (`key_mask` when Lq == Lk) is `validation.token_masks`'s, applied by the caller.

  Returns:
    bool `[1|B, 1|H, Lq, Lk]`: a mask dimension of 1 stays 1 unless `mask` has more.

  Raises:
    ValueError: `mask` does not broadcast to `[B, H, Lq, Lk]`.
  """
  shape = (batch, heads, q_length, k_length)
  allowed = jnp.ones((1, 1, q_length, k_length), bool)                 # [1, 1, Lq, Lk]
  if mask is not None:
    mask = jnp.asarray(mask, bool)
    try:
      jnp.broadcast_shapes(mask.shape, shape)
    except ValueError:
      raise ValueError(
          f"mask of shape {tuple(mask.shape)} does not broadcast to [batch, heads, Lq, Lk] = "
          f"{shape}.")
    allowed = allowed & mask
  if causal:
    allowed = allowed & masks.causal_mask(q_length, k_length)          # [Lq, Lk]
  if key_mask is not None:
    allowed = allowed & jnp.asarray(key_mask, bool)[:, None, None, :]  # [B, 1, 1, Lk]
  if query_mask is not None:
    allowed = allowed & jnp.asarray(query_mask, bool)[:, None, :, None]  # [B, 1, Lq, 1]
  return allowed


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                          mask: ArrayLike | None = None, causal: bool = False,
                          key_mask: jax.Array | None = None,
                          query_mask: jax.Array | None = None) -> jax.Array:
  """Dense multi-head attention with the codebase's masking rules.

  Args:
    q: `[B, Lq, H, D]` queries.
    k: `[B, Lk, H, D]` keys.
    v: `[B, Lk, H, Dv]` values.
    mask: optional bool, broadcastable to `[B, H, Lq, Lk]`, True = allowed (for example a
      pattern from `attention.masks`).
    causal: allow key j for query i only when j <= i.
    key_mask: optional bool `[B, Lk]`, True = real key.
    query_mask: optional bool `[B, Lq]`, True = real query; padded queries output 0. Defaults
      to `key_mask` when q and k have the same length (self-attention).

  Returns:
    `[B, Lq, H, Dv]` in q's dtype.
  """
  b, lq, lk, h, d = validation.check_qkv(q, k, v)
  query_mask = validation.token_masks(key_mask, query_mask, b, lq, lk)
  allowed = allowed_mask(b, h, lq, lk, mask=mask, causal=causal, key_mask=key_mask,
                         query_mask=query_mask)                          # [B|1, H|1, Lq, Lk]

  scale = 1.0 / jnp.sqrt(jnp.float32(d))
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  p, _, row_sum = masked_softmax_stats(logits, allowed)
  p = p / jnp.where(row_sum > 0, row_sum, 1.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
  return out.astype(q.dtype)
