"""The blocked band-attention kernel: a scan over chunks of query blocks with a custom VJP.

Layout: a sequence is split into `nb` blocks of `block` positions; arrays are stored block-major
as `[nb, B, h, dil, block, D]` (dil = the residue classes of a dilated band, see band.py). Query
block n attends to key blocks n - left .. n + right, concatenated by static slices into a window
of W = (left + right + 1) * block keys; a static `[block, W]` relative-position table applies the
exact band and a per-key validity vector applies padding and global-key removal.

Why a scan and a custom VJP: the score tensor of the whole sequence is (2R+1) times larger than
the input, and on CPU every large fresh buffer costs page faults (a freshly allocated buffer is
written at ~6 GB/s instead of ~50 GB/s). So the kernel walks over chunks of `chunk` query blocks
whose scores stay in cache, keeps only the output and its log-sum-exp for the backward pass, and
recomputes the scores there (the FlashAttention recipe). The forward pass and backward pass both
use two einsums per chunk (four in the backward), with no gather: chunk operands are dynamic
slices at the loop offset and key windows are static slices of them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from attention.dot_product import NEG_INF

# Score elements per scan step: keeps the per-chunk score tensor (and its exp) in cache.
CHUNK_SCORE_ELEMENTS = 1 << 18


def choose_chunk(num_blocks: int, rows: int, block: int, width: int) -> int:
  """Query blocks per scan step, so that one step's scores hold ~CHUNK_SCORE_ELEMENTS floats."""
  per_block = max(1, rows * block * width)
  return int(max(1, min(num_blocks, CHUNK_SCORE_ELEMENTS // per_block)))


def _band_bias(block: int, left: int, right: int, window: int, causal: bool) -> np.ndarray:
  """Static `[block, W]` additive bias: 0 where query t of a block may see key column c of its
  window, NEG_INF elsewhere."""
  rel = np.arange(block)[:, None] - (np.arange((left + right + 1) * block)[None, :] - left * block)
  allowed = (rel <= window) & (rel >= (0 if causal else -window))
  return np.where(allowed, 0.0, NEG_INF).astype(np.float32)


def _windows(x: jax.Array, chunk: int, spread: int, axis: int) -> jax.Array:
  """`x` holds chunk + spread - 1 consecutive blocks along axis 0; returns, for each of the first
  `chunk` blocks, the concatenation (along `axis`) of it and the next spread - 1 blocks."""
  parts = [jax.lax.slice_in_dim(x, o, o + chunk, axis=0) for o in range(spread)]
  return jnp.concatenate(parts, axis=axis)


def _fold_windows(x: jax.Array, chunk: int, spread: int, block: int) -> jax.Array:
  """Transpose of `_windows` along the in-block axis 4: `[chunk, B, h, dil, spread*block, D]` ->
  `[chunk + spread - 1, B, h, dil, block, D]`, summing the overlapping contributions."""
  total = None
  for o in range(spread):
    part = jax.lax.slice_in_dim(x, o * block, (o + 1) * block, axis=4)
    part = jnp.pad(part, [(o, spread - 1 - o)] + [(0, 0)] * (part.ndim - 1))
    total = part if total is None else total + part
  return total


def _chunk_logits(qc: jax.Array, kc: jax.Array, okc: jax.Array, bias: np.ndarray, chunk: int,
                  spread: int) -> tuple[jax.Array, jax.Array]:
  """Biased logits of one chunk: qc `[c, B, h, dil, block, D]` (already scaled by 1/sqrt(D)),
  kc `[c+s-1, B, h, dil, block, D]`, okc `[c+s-1, B, dil, block]` bool. Returns the key windows
  `[c, B, h, dil, W, D]` and logits `[c, B, h, dil, block, W]` with NEG_INF added where masked."""
  kw = _windows(kc, chunk, spread, axis=4)
  key_bias = jnp.where(_windows(okc, chunk, spread, axis=3), 0.0, NEG_INF)  # [c, B, dil, W]
  logits = jnp.einsum("cbhrqd,cbhrkd->cbhrqk", qc, kw, preferred_element_type=jnp.float32)
  return kw, logits + bias + key_bias[:, :, None, :, None, :]


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, ok: jax.Array, window: int, causal: bool,
             left: int, right: int, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q `[nbq, B, h, dil, block, D]` scaled by 1/sqrt(D) (nbq a multiple of chunk); k, v
  `[nbq + left + right, ...]` (padded with `left` zero blocks before); ok `[nbq + left + right,
  B, dil, block]`. Returns out, lse and the lse used by the backward pass (+|NEG_INF| on rows
  with no allowed key, so that exp(logit - lse) is 0 there)."""
  nbq, block = q.shape[0], q.shape[4]
  spread = left + right + 1
  bias = _band_bias(block, left, right, window, causal)
  span = chunk + spread - 1

  def step(_, j):
    start = j * chunk
    qc = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=0)
    kc = jax.lax.dynamic_slice_in_dim(k, start, span, axis=0)
    vc = jax.lax.dynamic_slice_in_dim(v, start, span, axis=0)
    okc = jax.lax.dynamic_slice_in_dim(ok, start, span, axis=0)
    _, logits = _chunk_logits(qc, kc, okc, bias, chunk, spread)
    row_max = jnp.max(logits, axis=-1)
    # A row with no allowed key has every logit near NEG_INF: it outputs 0.
    has = row_max > 0.5 * NEG_INF
    p = jnp.exp(logits - row_max[..., None])
    row_sum = jnp.sum(p, axis=-1)
    o = jnp.einsum("cbhrqk,cbhrkd->cbhrqd", p, _windows(vc, chunk, spread, axis=4))
    o = jnp.where(has[..., None], o / row_sum[..., None], 0.0)
    lse = row_max + jnp.log(row_sum)
    return None, (o, jnp.where(has, lse, NEG_INF), jnp.where(has, lse, -NEG_INF))

  _, outs = jax.lax.scan(step, None, jnp.arange(nbq // chunk))
  return tuple(x.reshape((nbq,) + x.shape[2:]) for x in outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def band_blocks(q: jax.Array, k: jax.Array, v: jax.Array, ok: jax.Array, window: int,
                causal: bool, left: int, right: int, chunk: int) -> tuple[jax.Array, jax.Array]:
  """Blocked band attention; returns (out `[nbq, B, h, dil, block, Dv]`, lse `[..., block]`).

  Both in float32; rows with no allowed key have out 0 and lse NEG_INF. `q` is unscaled.
  """
  o, lse, _ = _forward(q * (1.0 / math.sqrt(q.shape[-1])), k, v, ok, window, causal, left,
                       right, chunk)
  return o, lse


def _band_blocks_fwd(q, k, v, ok, window, causal, left, right, chunk):
  qs = q * (1.0 / math.sqrt(q.shape[-1]))
  o, lse, lse_bwd = _forward(qs, k, v, ok, window, causal, left, right, chunk)
  return (o, lse), (qs, k, v, ok, o, lse_bwd)


def _band_blocks_bwd(window, causal, left, right, chunk, res, cts):
  qs, k, v, ok, o, lse = res
  do, dlse = cts
  nbq, block = qs.shape[0], qs.shape[4]
  scale = 1.0 / math.sqrt(qs.shape[-1])
  spread = left + right + 1
  span = chunk + spread - 1
  bias = _band_bias(block, left, right, window, causal)
  # d(loss)/d(logit) = p * (dP - delta) with delta = rowsum(dO * O) - dlse.
  delta = jnp.sum(do * o, axis=-1) - dlse                            # [nbq, B, h, dil, block]

  def step(carry, j):
    dk, dv = carry
    start = j * chunk
    qc = jax.lax.dynamic_slice_in_dim(qs, start, chunk, axis=0)
    kc = jax.lax.dynamic_slice_in_dim(k, start, span, axis=0)
    vc = jax.lax.dynamic_slice_in_dim(v, start, span, axis=0)
    okc = jax.lax.dynamic_slice_in_dim(ok, start, span, axis=0)
    doc = jax.lax.dynamic_slice_in_dim(do, start, chunk, axis=0)
    lc = jax.lax.dynamic_slice_in_dim(lse, start, chunk, axis=0)
    dc = jax.lax.dynamic_slice_in_dim(delta, start, chunk, axis=0)
    kw, logits = _chunk_logits(qc, kc, okc, bias, chunk, spread)
    p = jnp.exp(logits - lc[..., None])                              # 0 where masked
    vw = _windows(vc, chunk, spread, axis=4)
    dp = jnp.einsum("cbhrqd,cbhrkd->cbhrqk", doc, vw)
    ds = p * (dp - dc[..., None])
    dqc = jnp.einsum("cbhrqk,cbhrkd->cbhrqd", ds, kw)
    dkw = jnp.einsum("cbhrqk,cbhrqd->cbhrkd", ds, qc)
    dvw = jnp.einsum("cbhrqk,cbhrqd->cbhrkd", p, doc)
    dk_c = jax.lax.dynamic_slice_in_dim(dk, start, span, axis=0)
    dv_c = jax.lax.dynamic_slice_in_dim(dv, start, span, axis=0)
    dk = jax.lax.dynamic_update_slice_in_dim(
        dk, dk_c + _fold_windows(dkw, chunk, spread, block), start, axis=0)
    dv = jax.lax.dynamic_update_slice_in_dim(
        dv, dv_c + _fold_windows(dvw, chunk, spread, block), start, axis=0)
    return (dk, dv), dqc

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  (dk, dv), dq = jax.lax.scan(step, init, jnp.arange(nbq // chunk))
  dq = dq.reshape(qs.shape) * scale
  return dq.astype(qs.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


band_blocks.defvjp(_band_blocks_fwd, _band_blocks_bwd)
