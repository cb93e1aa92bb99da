"""Adaptive attention span (Sukhbaatar et al. 2019), computed on a band.

Each head h has a span z_h in [0, S]. A key at distance x from its query (x = t - r for a causal
layer, |t - r| for a two-sided one) is weighted by the soft mask

    m_z(x) = clamp((R + z - x) / R, 0, 1)

with ramp R: 1 up to distance z, falling linearly to 0 at z + R. The paper masks the
exponentiated scores and renormalises, a_tr = m(t - r) exp(s_tr) / sum_q m(t - q) exp(s_tq),
which is softmax(s + log m) with log 0 = -inf; that is the form computed here, so the keys with
m = 0 are simply not allowed and the gradient with respect to z reaches only the heads that have
a key on the ramp.

The gradient is the authors' (facebookresearch/adaptive-span, `AdaptiveMask`): their
`torch.clamp` passes the whole slope 1/R where the ramp is exactly at a bound, 0 or 1, which
at an integer span (the paper's start, 0, included) happens at the integer distances z and
z + R. `jnp.clip` splits the tie there and would give half, so the ramp and the span's own
clip use `clamp` (same values, torch's derivative). The key at distance exactly z + R has
m = 0 and is left out of the softmax, yet the paper's form m e^s / sum m e^s has a finite
derivative there, e^s (v - o) / sum m e^s per unit of m; the weights' custom derivative
(`_with_zero_mask_keys`) adds it, so the outputs are those of the log form bit for bit and the
gradient is the paper form's.

No key further than max(z) + R has any weight, so the computation is a band: the sequence is cut
into query blocks, each attending to its own block and the ceil(window / block) blocks on each
side (left only when causal), formed by padding the block axis and taking static slices, with
window = ceil(max z) + R rounded up to a block (`span_window`). A static table of relative
distances `[block, n_key_blocks * block]` gives every in-band (query, key) pair its distance, and
the per-head log-mask is added to the scores there: there is no `[L, L]` array, and the cost
can follow the largest learned span, not the maximum S. The window is a static shape: outside
jit it is computed from the spans given; inside jit the caller passes it (the model's layer
passes S + R, exact at every span; lowering it to `span_window` of the current spans costs a
retrace each time the rounded window changes, not wired into the trainer yet).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from attention.band import default_block_size
from attention.dot_product import masked_softmax_stats

DEFAULT_RAMP = 32


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def clamp(x: jax.Array, lo: float, hi: float) -> jax.Array:
  """`jnp.clip(x, lo, hi)` with `torch.clamp`'s derivative: 1 on [lo, hi], bounds included, 0
  outside. (`jnp.clip`'s is 1/2 at a bound, where it is the minimum or maximum of a tie.)"""
  return jnp.clip(x, lo, hi)


@clamp.defjvp
def _clamp_jvp(lo, hi, primals, tangents):
  (x,), (t,) = primals, tangents
  inside = (x >= lo) & (x <= hi)
  return clamp(x, lo, hi), jnp.where(inside, t, jnp.zeros_like(t))


def span_mask(distance: jax.Array, z: jax.Array, ramp: float) -> jax.Array:
  """The soft mask m_z(x) = clamp((R + z - x) / R, 0, 1); broadcasts `distance` against `z`.

  Its derivative in z is 1/R on the ramp with both ends included (x = z and x = z + R), as
  `torch.clamp` gives the authors' mask, and 0 off it.
  """
  return clamp((ramp + z - distance) / ramp, 0.0, 1.0)


def span_window(span, ramp: int, max_span: int, block: int | None = None) -> int:
  """The band's one-sided window for concrete spans: ceil(max z) + R, rounded up to a block.

  Never more than S + R rounded up. `block` defaults to the band's block for S + R, so the
  rounding grid does not move as the spans change.
  """
  block = block or default_block_size(max_span + ramp)
  top = min(float(np.max(np.asarray(span))), float(max_span))
  need = max(1, int(math.ceil(max(top, 0.0))) + int(ramp))
  return -(-need // block) * block


def span_penalty(spans, weight: float) -> jax.Array:
  """The paper's L1 term: weight * sum of the spans (of every head of every layer given)."""
  return weight * sum(jnp.sum(s) for s in spans)


@jax.custom_jvp
def _with_zero_mask_keys(w: jax.Array, m: jax.Array, e: jax.Array) -> jax.Array:
  """The weights `w` (`[..., h, q, k]`) as they are; their derivative in the mask `m`
  (`[h, q, k]`) adds the keys the log form leaves out, where m = 0: dw_j/dm_i = e_i (d_ij - w_j)
  with `e` the keys' e^s / Z, as the paper's m e^s / sum m e^s has it. The values, and so the
  outputs, stay those of the log form bit for bit."""
  del m, e
  return w


@_with_zero_mask_keys.defjvp
def _with_zero_mask_keys_jvp(primals, tangents):
  w, _, e = primals
  tw, tm, _ = tangents
  dm = tm * e
  return w, tw + dm - w * jnp.sum(dm, axis=-1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("window", "ramp", "causal", "block"))
def _adaptive_span(q, k, v, span, key_mask, *, window: int, ramp: float, causal: bool,
                   block: int):
  b_, length, h, d = q.shape
  block = min(block, max(8, -(-length // 8) * 8))
  nb = -(-length // block)
  padded = nb * block
  radius = min(-(-window // block), nb - 1)
  left, right = radius, (0 if causal else radius)
  nk = left + right + 1

  def to_blocks(x):  # [B, L, h, D] -> [nb, B, h, block, D]
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, padded - length), (0, 0), (0, 0)))
    return x.reshape(b_, nb, block, h, x.shape[-1]).transpose(1, 0, 3, 2, 4)

  def key_blocks(x):  # [nb + left + right, ...] -> [nb, ..., nk * block, D] by static slices
    x = jnp.pad(x, [(left, right)] + [(0, 0)] * (x.ndim - 1))
    return jnp.concatenate([x[c:c + nb] for c in range(nk)], axis=-2)

  real = jnp.ones((b_, length), bool) if key_mask is None else key_mask
  ok = jnp.pad(real, ((0, 0), (0, padded - length))).reshape(b_, nb, block).transpose(1, 0, 2)
  ok = jnp.pad(ok, [(left, right), (0, 0), (0, 0)])
  ok = jnp.concatenate([ok[c:c + nb] for c in range(nk)], axis=-1)    # [nb, B, nk * block]

  qb, kb, vb = to_blocks(q), key_blocks(to_blocks(k)), key_blocks(to_blocks(v))
  # Key minus query position for every in-band pair, a static table.
  rel = (np.arange(nk * block)[None, :] - left * block) - np.arange(block)[:, None]
  dist = jnp.asarray(-rel if causal else np.abs(rel), jnp.float32)    # [block, nk * block]
  m = span_mask(dist[None], span.astype(jnp.float32)[:, None, None], ramp)   # [h, blk, nk*blk]
  real_key = ok[:, :, None, None, :]
  if causal:
    real_key = real_key & jnp.asarray(rel <= 0)
  allowed = (m > 0)[None, None] & real_key
  bias = jnp.log(jnp.where(m > 0, m, 1.0))
  scale = 1.0 / math.sqrt(d)
  logits = jnp.einsum("nbhqd,nbhkd->nbhqk", qb, kb) * scale + bias[None, None]
  p, row_max, row_sum = masked_softmax_stats(logits, allowed)
  has = row_sum > 0
  w = p / jnp.where(has, row_sum, 1.0)
  # The keys with m = 0 (not allowed): e^s / Z with Z = e^row_max * row_sum, their weight's
  # derivative per unit of m (used only where dm/dz != 0: the ramp's far end).
  off = (m == 0)[None, None] & real_key
  e = jnp.exp(jnp.minimum(jnp.where(off, logits - row_max, 0.0), 60.0))
  e = jax.lax.stop_gradient(jnp.where(off, e, 0.0) / jnp.where(has, row_sum, 1.0))
  o = jnp.einsum("nbhqk,nbhkd->nbhqd", _with_zero_mask_keys(w, m, e), vb)
  o = o.transpose(1, 0, 3, 2, 4).reshape(b_, padded, h, v.shape[-1])[:, :length]
  o = jnp.where(real[:, :, None, None], o, 0.0)
  return o.astype(q.dtype)


def adaptive_span_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, span: jax.Array,
                            max_span: int, ramp: int = DEFAULT_RAMP, causal: bool = False,
                            key_mask: jax.Array | None = None, window: int | None = None,
                            block_size: int | None = None) -> jax.Array:
  """Attention with a learned soft span per head, on a band of the current largest span.

  Args:
    q, k, v: `[B, L, H, D]`.
    span: `[H]` float, z per head; clipped to [0, S] here (the paper clips after each update),
      with `clamp`'s derivative (1 at 0 and at S).
    max_span: S. ramp: R.
    causal: distances t - r >= 0 only (character LMs); otherwise |t - r|.
    key_mask: optional `[B, L]` bool, True = real token.
    window: the band's one-sided window; default `span_window(span, ramp, max_span)`, which
      needs concrete spans (outside jit). Inside jit pass it (static).
    block_size: query block size; default the band's block for S + R.
  Returns:
    `[B, L, H, Dv]`; padded queries and queries with no allowed key give 0.
  """
  block = block_size or default_block_size(max_span + ramp)
  if window is None:
    window = span_window(span, ramp, max_span, block)
  span = clamp(jnp.asarray(span, jnp.float32), 0.0, float(max_span))
  return _adaptive_span(q, k, v, span, key_mask, window=int(window), ramp=float(ramp),
                        causal=causal, block=int(block))
