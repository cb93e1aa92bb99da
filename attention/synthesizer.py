"""Synthesizer attention (Tay et al. 2020): attention weights synthesised without query-key dots.

The logits of a head are a weighted sum of components, all `[Lq, Lk]`:
  * dense: a per-token two-layer MLP maps each query vector to logits over key positions,
    `relu(q_i W1 + b1) W2 + b2`, with `W2: [F, N]` sliced to the first Lk columns. The MLP reads
    the head's query vector, the model's per-head projection of the token (the paper's MLP on
    the token, with its first layer factored through the query projection).
  * random: a learned (or fixed) logits matrix `R: [N, N]`, sliced to `[:Lq, :Lk]`;
    input-independent.
  * factorized dense: two small per-token maps `A_i = q_i Wa + ba` (a values) and
    `B_i = q_i Wb + bb` (b values), with a * b >= Lk; the logit of key j is
    `A_i[j mod a] * B_i[j // a]` (the paper's tiling of A and B to length a * b).
  * factorized random: `R = R1 R2^T` with `R1, R2: [N, k]`.
  * dot product: the usual `q_i . k_j / sqrt(D)`, for the paper's mixtures (e.g. random + vanilla).
The weights of the present components, in that order, are `mix` (`[C]` or one row per head
`[H, C]`); the paper learns them under a softmax, which is the model layer's business: they are
used here as given. With one component `mix` may be omitted.

Every parameter is an explicit array owned by the model layer, shared by all heads (no leading
head axis) or one per head (a leading axis of size H). N is the longest sequence the parameters
were built for; longer inputs are refused.

Masking follows the codebase's rules on the synthetic logits exactly as on dot-product logits:
padded keys are never attended (`key_mask`), causal attention allows key j <= i, padded queries
output 0, and a query with no allowed key outputs exactly 0. Softmax statistics are float32.
The cost is that of dense attention, O(Lq Lk) per head: Synthesizer saves the query-key
product, not the quadratic softmax.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from attention import validation
from attention.dot_product import allowed_mask, masked_softmax_stats

COMPONENTS = ("dense", "random", "factorized_dense", "factorized_random", "dot_product")
# The arrays of one component, by name (e.g. dense: w1, b1, w2, b2).
Params = dict[str, ArrayLike]


def _per_head(name: str, x: ArrayLike, ndim: int, heads: int) -> jax.Array:
  """Returns `x` with a leading head axis: `[H, ...]` (shared parameters are broadcast)."""
  x = jnp.asarray(x)
  if x.ndim == ndim:
    return x[None]
  if x.ndim == ndim + 1 and x.shape[0] == heads:
    return x
  raise ValueError(
      f"{name} must have {ndim} dims (shared by all heads) or {ndim + 1} dims with a leading "
      f"head axis of size {heads}, got shape {tuple(x.shape)}.")


def _check_length(name: str, available: int, needed: int) -> None:
  if available < needed:
    raise ValueError(
        f"{name} covers sequences up to {available} positions but the input needs {needed}: "
        f"build the synthesizer parameters with max_length >= {needed}.")


def _params(name: str, params: Params, keys: tuple[str, ...]) -> Params:
  if not isinstance(params, dict) or set(params) != set(keys):
    got = sorted(params) if isinstance(params, dict) else type(params).__name__
    raise ValueError(f"{name} must be a dict with keys {list(keys)}, got {got}.")
  return params


def _dense_logits(q: jax.Array, params: Params, lk: int) -> jax.Array:
  h = q.shape[2]
  p = _params("dense", params, ("w1", "b1", "w2", "b2"))
  w1, b1 = _per_head("dense['w1']", p["w1"], 2, h), _per_head("dense['b1']", p["b1"], 1, h)
  w2, b2 = _per_head("dense['w2']", p["w2"], 2, h), _per_head("dense['b2']", p["b2"], 1, h)
  _check_length("dense['w2'] (its last axis)", w2.shape[-1], lk)
  hidden = jnp.einsum("bqhd,hdf->bhqf", q, w1, preferred_element_type=jnp.float32)
  hidden = jax.nn.relu(hidden + b1[None, :, None, :])                  # [B, H, Lq, F]
  logits = jnp.einsum("bhqf,hfk->bhqk", hidden, w2[..., :lk].astype(jnp.float32))
  return logits + b2[None, :, None, :lk]                               # [B, H, Lq, Lk]


def _random_logits(table: ArrayLike, h: int, lq: int, lk: int) -> jax.Array:
  r = _per_head("random", table, 2, h)
  _check_length("random", min(r.shape[1], r.shape[2]), max(lq, lk))
  return r[None, :, :lq, :lk].astype(jnp.float32)                     # [1, H, Lq, Lk]


def _factorized_dense_logits(q: jax.Array, params: Params, lk: int) -> jax.Array:
  h = q.shape[2]
  p = _params("factorized_dense", params, ("wa", "ba", "wb", "bb"))
  wa = _per_head("factorized_dense['wa']", p["wa"], 2, h)
  wb = _per_head("factorized_dense['wb']", p["wb"], 2, h)
  ba = _per_head("factorized_dense['ba']", p["ba"], 1, h)
  bb = _per_head("factorized_dense['bb']", p["bb"], 1, h)
  a, b = wa.shape[-1], wb.shape[-1]
  _check_length(f"factorized_dense (a * b = {a} * {b})", a * b, lk)
  fa = jnp.einsum("bqhd,hda->bhqa", q, wa, preferred_element_type=jnp.float32)
  fb = jnp.einsum("bqhd,hdc->bhqc", q, wb, preferred_element_type=jnp.float32)
  fa, fb = fa + ba[None, :, None, :], fb + bb[None, :, None, :]
  j = np.arange(lk)
  return fa[..., j % a] * fb[..., j // a]                              # [B, H, Lq, Lk]


def _factorized_random_logits(params: Params, h: int, lq: int, lk: int) -> jax.Array:
  p = _params("factorized_random", params, ("r1", "r2"))
  r1 = _per_head("factorized_random['r1']", p["r1"], 2, h)
  r2 = _per_head("factorized_random['r2']", p["r2"], 2, h)
  _check_length("factorized_random['r1']", r1.shape[1], lq)
  _check_length("factorized_random['r2']", r2.shape[1], lk)
  return jnp.einsum("hqr,hkr->hqk", r1[:, :lq], r2[:, :lk],
                    preferred_element_type=jnp.float32)[None]          # [1, H, Lq, Lk]


def synthesizer_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                          dense: Params | None = None, random: ArrayLike | None = None,
                          factorized_dense: Params | None = None,
                          factorized_random: Params | None = None, dot_product: bool = False,
                          mix: ArrayLike | None = None, causal: bool = False,
                          key_mask: jax.Array | None = None,
                          query_mask: jax.Array | None = None) -> jax.Array:
  """Synthesizer attention with explicit parameters, alone or mixed with dot-product attention.

  Args:
    q: `[B, Lq, H, D]` queries (input of the dense and factorized-dense maps).
    k: `[B, Lk, H, D]` keys (used only when `dot_product`).
    v: `[B, Lk, H, Dv]` values.
    dense: dict `w1 [(H,) D, F]`, `b1 [(H,) F]`, `w2 [(H,) F, N]`, `b2 [(H,) N]`.
    random: `[(H,) N, N]` logits.
    factorized_dense: dict `wa [(H,) D, a]`, `ba [(H,) a]`, `wb [(H,) D, b]`, `bb [(H,) b]`,
      a * b >= Lk.
    factorized_random: dict `r1 [(H,) N, k]`, `r2 [(H,) N, k]`.
    dot_product: add the dot-product logits `q . k / sqrt(D)` as a component.
    mix: weights of the present components in the order dense, random, factorized_dense,
      factorized_random, dot_product: `[C]` or `[H, C]`. Optional with one component.
    causal: key j is allowed for query i only when j <= i.
    key_mask: optional bool `[B, Lk]`, True = real token.
    query_mask: optional bool `[B, Lq]`; padded queries output 0. Defaults to `key_mask` when
      Lq == Lk.

  Returns:
    `[B, Lq, H, Dv]` in q's dtype.
  """
  b_, lq, lk, h, d = validation.check_qkv(q, k, v)
  query_mask = validation.token_masks(key_mask, query_mask, b_, lq, lk)

  parts = []
  if dense is not None:
    parts.append(_dense_logits(q, dense, lk))
  if random is not None:
    parts.append(_random_logits(random, h, lq, lk))
  if factorized_dense is not None:
    parts.append(_factorized_dense_logits(q, factorized_dense, lk))
  if factorized_random is not None:
    parts.append(_factorized_random_logits(factorized_random, h, lq, lk))
  if dot_product:
    parts.append(jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
                 / math.sqrt(d))
  if not parts:
    raise ValueError(
        f"synthesizer_attention needs at least one component: pass one or more of "
        f"{', '.join(COMPONENTS[:-1])} (parameter arrays) or dot_product=True.")
  if mix is None:
    if len(parts) > 1:
      raise ValueError(
          f"{len(parts)} components are present, so mix must give their weights: shape "
          f"[{len(parts)}] or [{h}, {len(parts)}], in the order {', '.join(COMPONENTS)}.")
    logits = parts[0]
  else:
    mix = jnp.asarray(mix, jnp.float32)
    if mix.shape not in ((len(parts),), (h, len(parts))):
      raise ValueError(
          f"mix must have shape [{len(parts)}] or [{h}, {len(parts)}] (one weight per present "
          f"component, optionally per head), got {tuple(mix.shape)}.")
    mix = jnp.broadcast_to(mix, (h, len(parts)))
    logits = sum(mix[None, :, c, None, None] * part for c, part in enumerate(parts))

  allowed = allowed_mask(b_, h, lq, lk, causal=causal, key_mask=key_mask,
                         query_mask=query_mask)                          # [B|1, 1, Lq, Lk]
  p, _, row_sum = masked_softmax_stats(logits, allowed)
  p = p / jnp.where(row_sum > 0, row_sum, 1.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
  return out.astype(q.dtype)
