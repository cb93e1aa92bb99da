"""Adaptively sparse attention (Correia et al. 2019): alpha-entmax over the keys instead of softmax.

For the scaled scores z of one query (`q . k / sqrt(D)` over its allowed keys) alpha-entmax
(Peters, Niculae & Martins 2019) gives

  p_i = [(alpha - 1) z_i - tau]_+ ^ (1 / (alpha - 1)),   tau such that sum_i p_i = 1,

softmax in the limit alpha -> 1 and sparsemax (Martins & Astudillo 2016) at alpha = 2. For
alpha > 1 keys whose score is below the threshold get exactly zero weight. `alpha` is a scalar
or one value per head in [1, 2]; the model learns one per head (`models.attention_extras.
EntmaxAlpha`, alpha = 1 + sigmoid(a)).

Threshold. With eps = alpha - 1, m the row's largest score and tau = eps (m + t) - 1, the
weights are p_i = exp(log1p(eps x_i) / eps) for x_i = z_i - m - t where eps x_i > -1, else 0.
This form is well conditioned as eps -> 0 (it tends to exp(x_i), softmax, and at eps = 0
exactly it is exp(x_i)), and t lies in [0, (1 - d^-eps) / eps] (<= log d) for d allowed keys:
at t = 0 the largest key alone has weight 1, at the upper end no key has more than 1/d. The
total weight falls as t grows, so t is found by bisection, a fixed number of halvings that
takes the interval below the dtype's resolution (31 in float32, 60 in float64), and the
weights are then divided by their sum (a relative change at rounding level; at alpha = 1 it
makes them softmax exactly). At alpha = 2, p_i = max(1 + x_i, 0) is computed without exp/log.
Statistics are float32 for bfloat16 (or float32) inputs and float64 for float64 inputs.

Backward pass (`jax.custom_vjp`, never through the bisection loop), from the closed form of
Correia et al. (2019, Proposition 1 and its appendix). With s_i = p_i^(2 - alpha) on the
support (0 elsewhere; s_i = p_i / (1 + eps x_i)):

  dL/dz_i = s_i (g_i - sum_j s_j g_j / sum_j s_j),
  dp_i/dalpha = a_i - s_i sum_j a_j / sum_j s_j,   a_i = p_i x_i^2 f(eps x_i),
  f(w) = (w / (1 + w) - log1p(w)) / w^2,

for g = dL/dp. The alpha derivative is the paper's, rewritten in x so that it stays accurate as
alpha -> 1: f(w) is summed as its power series (-1/2 + 2w/3 - 3w^2/4 + ...) for |w| < 0.1, and
at alpha = 1 the formula is the limit -p_i (x_i^2 - sum_j p_j x_j^2) / 2 with x_i = log p_i.

Masks follow `attention.dot_product`: masked keys (padding, causal, an explicit `mask`) get
exactly 0, padded queries and rows with no allowed key output 0.

Cost: dense, the `[B, H, Lq, Lk]` scores and about 31 passes over them for the bisection, plus
two score-sized residuals for the backward pass. A blocked version would help at long lengths
in two places: the bisection only needs each row's total weight at a trial threshold, which a
flash-style pass over key blocks can accumulate without materialising the scores (one pass per
halving, or fewer with a per-block sort giving the exact support), and once the threshold is
known whole key blocks whose scores all fall below it contribute nothing, so the output and the
backward pass could skip them as `block_sparse` skips empty blocks: the sparser the learned
heads, the more is skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from attention import validation
from attention.dot_product import NEG_INF, allowed_mask

# |w| below which f(w) is summed as its power series (terms up to w^15: error below 1e-16).
_SERIES_BELOW = 0.1
_SERIES_TERMS = 16


def _stats_dtype(dtype) -> jnp.dtype:
  """float64 for float64 inputs, float32 otherwise (bfloat16 statistics are float32)."""
  return jnp.promote_types(dtype, jnp.float32)


def _halvings(dtype) -> int:
  """Bisection steps that take an interval of width <= log(d) below the dtype's resolution."""
  return int(jnp.finfo(dtype).nmant) + 8


def _weights(x: jax.Array, eps: jax.Array, allowed: jax.Array) -> jax.Array:
  """Unnormalised entmax weights exp(log1p(eps x) / eps), 0 off the support or not allowed."""
  w = eps * x
  support = allowed & (w > -1)
  w_in = jnp.where(support, w, 0.0)
  softmax = eps == 0
  ratio = jnp.where(softmax, x, jnp.log1p(w_in) / jnp.where(softmax, 1.0, eps))
  p = jnp.where(eps == 1, 1.0 + w_in, jnp.exp(jnp.where(support, ratio, 0.0)))
  return jnp.where(support, p, 0.0)


def _threshold(z: jax.Array, eps: jax.Array, allowed: jax.Array) -> jax.Array:
  """x = z - m - t for the t that makes the weights sum to one (bisection), `[B, H, Lq, Lk]`."""
  m = jnp.max(jnp.where(allowed, z, NEG_INF), axis=-1, keepdims=True)
  m = jnp.where(m > NEG_INF / 2, m, 0.0)
  x0 = jnp.where(allowed, z - m, 0.0)
  log_d = jnp.log(jnp.maximum(jnp.sum(allowed, axis=-1, keepdims=True), 1).astype(z.dtype))
  softmax = eps == 0
  hi = jnp.where(softmax, log_d, -jnp.expm1(-eps * log_d) / jnp.where(softmax, 1.0, eps))
  lo = jnp.zeros_like(hi)

  def halve(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    heavy = jnp.sum(_weights(x0 - mid, eps, allowed), axis=-1, keepdims=True) >= 1
    return jnp.where(heavy, mid, lo), jnp.where(heavy, hi, mid)

  lo, hi = jax.lax.fori_loop(0, _halvings(z.dtype), halve, (lo, hi))
  return x0 - 0.5 * (lo + hi)


def _series_f(w: jax.Array) -> jax.Array:
  """f(w) = (w / (1 + w) - log1p(w)) / w^2 for w > -1, by its series near 0."""
  direct = (w / (1 + w) - jnp.log1p(w)) / jnp.where(w == 0, 1.0, w) ** 2
  series = jnp.zeros_like(w)
  for n in range(_SERIES_TERMS + 1, 1, -1):      # Horner: sum_n (-1)^(n+1) (1 - 1/n) w^(n-2)
    series = series * w + (-1) ** (n + 1) * (1 - 1 / n)
  return jnp.where(jnp.abs(w) < _SERIES_BELOW, series, direct)


@jax.custom_vjp
def _entmax(z: jax.Array, alpha: jax.Array, allowed: jax.Array) -> jax.Array:
  return _entmax_fwd(z, alpha, allowed)[0]


def _entmax_fwd(z, alpha, allowed):
  eps = (alpha - 1)[None, :, None, None]                                # [1, H, 1, 1]
  x = _threshold(z, eps, allowed)
  p = _weights(x, eps, allowed)
  total = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(total > 0, total, 1.0)
  return p, (p, x, eps)


def _entmax_bwd(residuals, g):
  p, x, eps = residuals
  on = p > 0
  s = jnp.where(on, p / jnp.where(on, 1 + eps * x, 1.0), 0.0)          # p^(2 - alpha)
  s_sum = jnp.sum(s, axis=-1, keepdims=True)
  s_sum = jnp.where(s_sum > 0, s_sum, 1.0)
  dz = s * (g - jnp.sum(s * g, axis=-1, keepdims=True) / s_sum)
  f = _series_f(jnp.where(on, eps * x, 0.0))
  a = jnp.where(on, p * x * x * f, 0.0)
  dp_dalpha = a - s * jnp.sum(a, axis=-1, keepdims=True) / s_sum
  dalpha = jnp.sum(g * dp_dalpha, axis=(0, 2, 3))                        # [H]
  return dz, dalpha, None


_entmax.defvjp(_entmax_fwd, _entmax_bwd)


def entmax(z: jax.Array, alpha: ArrayLike, allowed: jax.Array | None = None) -> jax.Array:
  """alpha-entmax over the last axis of scores `[B, H, Lq, Lk]` (statistics in z's dtype).

  Args:
    z: scores, float32 or float64.
    alpha: a scalar or `[H]`, in [1, 2] (1 is softmax, 2 sparsemax).
    allowed: optional bool broadcastable to z; disallowed entries get exactly 0 and a row with
      none allowed is all 0.

  Returns:
    the weights, z's shape and dtype, each row summing to 1 over its allowed entries.
  """
  heads = z.shape[1]
  alpha = jnp.broadcast_to(jnp.asarray(alpha, z.dtype), (heads,))
  allowed = jnp.ones(z.shape, bool) if allowed is None else jnp.broadcast_to(allowed, z.shape)
  return _entmax(z, alpha, allowed)


def _check_alpha(alpha: ArrayLike, heads: int) -> None:
  """Refuses a concrete alpha of the wrong shape or below 1 (a traced one is taken as given)."""
  shape = jnp.shape(alpha)
  if shape not in ((), (1,), (heads,)):
    raise ValueError(f"entmax alpha must be a scalar or one value per head ({heads}), got "
                     f"shape {shape}.")
  try:
    values = np.asarray(alpha, np.float64)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return
  if not np.all(values >= 1):
    raise ValueError(f"entmax alpha must be >= 1 (1 is softmax, 2 sparsemax), got {values}.")


def entmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, alpha: ArrayLike = 1.5,
                     key_mask: jax.Array | None = None, causal: bool = False, *,
                     query_mask: jax.Array | None = None,
                     mask: ArrayLike | None = None) -> jax.Array:
  """Multi-head attention with alpha-entmax weights (Correia et al. 2019).

  Args:
    q: `[B, Lq, H, D]` queries.
    k: `[B, Lk, H, D]` keys.
    v: `[B, Lk, H, Dv]` values.
    alpha: a scalar or one value per head (`[H]`) in [1, 2]: 1 is softmax attention, 2
      sparsemax; may be traced (the model's learned alpha), and gets a gradient.
    key_mask: optional bool `[B, Lk]`, True = real key.
    causal: allow key j for query i only when j <= i.
    query_mask: optional bool `[B, Lq]`, True = real query; padded queries output 0. Defaults
      to `key_mask` when q and k have the same length (self-attention).
    mask: optional bool, broadcastable to `[B, H, Lq, Lk]`, True = allowed.

  Returns:
    `[B, Lq, H, Dv]` in q's dtype.
  """
  b, lq, lk, h, d = validation.check_qkv(q, k, v)
  _check_alpha(alpha, h)
  query_mask = validation.token_masks(key_mask, query_mask, b, lq, lk)
  allowed = allowed_mask(b, h, lq, lk, mask=mask, causal=causal, key_mask=key_mask,
                         query_mask=query_mask)                          # [B|1, H|1, Lq, Lk]
  dtype = _stats_dtype(q.dtype)
  scale = 1.0 / jnp.sqrt(jnp.asarray(d, dtype))
  z = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=dtype) * scale
  p = entmax(z, jnp.reshape(alpha, (-1,)) if jnp.ndim(alpha) else alpha, allowed)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(dtype))
  return out.astype(q.dtype)
