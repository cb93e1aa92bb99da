"""Transformer-XL relative positions: logits (q + u).k_j + (q + v).R[i - j], scaled by 1/sqrt(D).

`R[d] = s(d) @ w_r` is a sinusoid `s(d)` of the distance d = i - j (features [sin(d w),
cos(d w)], w_f = 10000^(-2f/E)) projected per layer by `w_r: [E, H, D]`; u and v are learned per
head. Two exact ways of computing the position term, both used:

* dense (`relative_attention`): the scores against every distance, `[B, H, Lq, 2L - 1]`, are
  moved to `[B, H, Lq, Lk]` by `rel_shift` with an explicit index table (column (L-1) - (i-j) for
  entry (i, j)), right for causal and bidirectional attention alike. Transformer-XL's
  pad-reshape-drop shift (`rel_shift_xl`) is right only on and below the diagonal (j <= i), so
  only under a causal mask; it is kept here for the tests, with the `[:-1]` slip for the tests to
  catch.
* factorised (`factorised_qk`): since sin((i-j)w) and cos((i-j)w) expand into products of sines
  and cosines of i and of j, the position term is a dot product of a query-side vector of E
  features (depending on q + v and i) with the key-side vector [cos(j w), sin(j w)]. Appending
  those features to q and k makes the whole relative logit one dot product, so any exact kind
  (band: inside its blocked einsums, with no L x L tensor) computes it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from attention import validation
from attention.dot_product import allowed_mask, masked_softmax_stats

BASE = 10000.0


def _freqs(dim: int) -> np.ndarray:
  if dim % 2:
    raise ValueError(f"relative positions need an even sinusoid dimension, got {dim}.")
  return BASE ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)              # [E/2]


def sinusoid(distances: ArrayLike, dim: int) -> np.ndarray:
  """`[n, dim]` float32 features [sin(d w), cos(d w)] of the integer distances `d: [n]`."""
  angles = np.asarray(distances, np.float64)[:, None] * _freqs(dim)[None, :]
  return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


def distance_table(length: int, dim: int) -> np.ndarray:
  """`[2L - 1, dim]`: row m holds distance (L - 1) - m (from L - 1 down to -(L - 1))."""
  return sinusoid(np.arange(length - 1, -length, -1), dim)


def shift_index(lq: int, lk: int) -> np.ndarray:
  """`[Lq, Lk]` int: the column of distance i - j in a `distance_table(max(Lq, Lk))` row."""
  length = max(lq, lk)
  return (length - 1) - (np.arange(lq)[:, None] - np.arange(lk)[None, :])


def rel_shift(x: jax.Array, lk: int) -> jax.Array:
  """`x[..., i, m]` (scores of query i against distance row m) -> `[..., Lq, Lk]` at i - j."""
  index = shift_index(x.shape[-2], lk)
  index = jnp.broadcast_to(jnp.asarray(index), x.shape[:-2] + index.shape)
  return jnp.take_along_axis(x, index, axis=-1)


def rel_shift_xl(x: jax.Array, slip: bool = False) -> jax.Array:
  """Transformer-XL's shift of `x[..., i, m]` with rows m = distances L-1 .. 0 (`[..., L, L]`).

  Pad one zero column on the left, view as `[L + 1, L]`, drop the first row (`[1:]`), view back.
  Equals the distance-(i - j) score only for j <= i. `slip=True` drops the last row (`[:-1]`).
  """
  *lead, lq, lr = x.shape
  padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])
  padded = padded.reshape(*lead, lr + 1, lq)
  padded = padded[..., :-1, :] if slip else padded[..., 1:, :]
  return padded.reshape(*lead, lq, lr)


def projected_table(w_r: jax.Array, length: int) -> jax.Array:
  """`R: [2L - 1, H, D]` = distance_table @ w_r, with w_r `[E, H, D]`."""
  table = jnp.asarray(distance_table(length, w_r.shape[0]))
  return jnp.einsum("me,ehd->mhd", table, w_r.astype(jnp.float32))


def position_scores(q_v: jax.Array, w_r: jax.Array, lk: int) -> jax.Array:
  """`[B, H, Lq, Lk]` float32: (q + v)_i . R[i - j], `q_v` = q + v `[B, Lq, H, D]`."""
  r = projected_table(w_r, max(q_v.shape[1], lk))                            # [2L-1, H, D]
  scores = jnp.einsum("bqhd,mhd->bhqm", q_v.astype(jnp.float32), r)          # [B, H, Lq, 2L-1]
  return rel_shift(scores, lk)


def relative_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, u: jax.Array,
                       v_bias: jax.Array, w_r: jax.Array, key_mask: jax.Array | None = None,
                       causal: bool = False, mask: ArrayLike | None = None) -> jax.Array:
  """Dense attention with Transformer-XL relative logits; masking as `dot_product_attention`.

  q, k: `[B, L, H, D]`; v: `[B, L, H, Dv]`; u, v_bias: `[H, D]`; w_r: `[E, H, D]`.
  """
  b, lq, lk, h, d = validation.check_qkv(q, k, v)
  query_mask = validation.token_masks(key_mask, None, b, lq, lk)
  allowed = allowed_mask(b, h, lq, lk, mask=mask, causal=causal, key_mask=key_mask,
                         query_mask=query_mask)                          # [B|1, H|1, Lq, Lk]
  qf = q.astype(jnp.float32)
  content = jnp.einsum("bqhd,bkhd->bhqk", qf + u, k.astype(jnp.float32))
  logits = (content + position_scores(qf + v_bias, w_r, lk)) / math.sqrt(d)
  p, _, row_sum = masked_softmax_stats(logits, allowed)
  p = p / jnp.where(row_sum > 0, row_sum, 1.0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)


def factorised_qk(q: jax.Array, k: jax.Array, *, u: jax.Array, v_bias: jax.Array,
                  w_r: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(q', k') with q'_i . k'_j / sqrt(D') = ((q+u)_i . k_j + (q+v)_i . R[i-j]) / sqrt(D).

  q, k `[B, L, H, D]` -> `[B, L, H, D + E]`, E = w_r.shape[0]; for any exact kind that scales
  its logits by 1/sqrt(last dim), e.g. band (then v keeps its own D).
  """
  length, d = q.shape[1], q.shape[-1]
  e = w_r.shape[0]
  inv = _freqs(e)
  angles = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]       # [L, E/2]
  sin = jnp.asarray(np.sin(angles), jnp.float32)[None, :, None, :]
  cos = jnp.asarray(np.cos(angles), jnp.float32)[None, :, None, :]
  qf = q.astype(jnp.float32)
  a = jnp.einsum("blhd,ehd->blhe", qf + v_bias, w_r.astype(jnp.float32))    # [B, L, H, E]
  a_sin, a_cos = jnp.split(a, 2, axis=-1)
  q_extra = jnp.concatenate([a_sin * sin + a_cos * cos, a_cos * sin - a_sin * cos], axis=-1)
  k_extra = jnp.broadcast_to(jnp.concatenate([cos, sin], axis=-1), k.shape[:3] + (e,))
  scale = math.sqrt((d + e) / d)
  q_aug = jnp.concatenate([qf + u, q_extra], axis=-1) * scale
  k_aug = jnp.concatenate([k.astype(jnp.float32), k_extra], axis=-1)
  return q_aug.astype(q.dtype), k_aug.astype(k.dtype)
