"""Longformer band attention as blocked einsums: sliding window, dilation, global tokens.

The sequence is split into blocks of `block_size` queries. Each query block attends to the keys
of its own block and of the R = ceil(window / block_size) blocks on each side (only the left
ones when causal). Those key blocks are formed by padding the block axis and taking static
slices, so there is no gather, no `[L, L]` mask or score matrix, and the cost is linear in length:
per query, (2R + 1) * block_size keys instead of L. Inside the window, a static relative-position
table of shape `[block, (2R+1) * block]` applies the exact band, and a per-key validity vector
applies padding, global keys and the sequence end.

Dilation d is a reshape-transpose: positions i with the same i mod d form a contiguous sequence,
on which a dilated band is an ordinary band of window w. Per-head dilation runs each group of
heads that shares a dilation value through its own reshape. Global tokens are gathered into a
static number of slots by a one-hot matmul (no data-dependent shapes): every query attends to
the global keys (merged with the band by log-sum-exp), and global queries attend to every key.
Global keys are removed from the band, so a global key inside a window is counted once.

The semantics are those of `attention.masks.longformer_mask`; see that module for the rules.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attention import band_kernel, validation
from attention.dot_product import NEG_INF, masked_softmax_stats


def default_block_size(window: int) -> int:
  """A block size for a one-sided window: small enough to waste little, large enough for BLAS.

  With block b and window w each query computes (2 ceil(w/b) + 1) b scores for its 2w + 1 keys,
  so blocks of w/2 waste 25%. Smaller blocks waste less but make the matmuls too small to run
  well (measured on CPU at w = 256: b = 128 beats 64 and 256; see docs/benchmarks.md).
  """
  return int(min(128, max(32, 2 ** math.ceil(math.log2(max(window, 1) / 2)))))


def _band_core(q: jax.Array, k: jax.Array, v: jax.Array, key_ok: jax.Array, *, window: int,
               dilation: int, causal: bool, block: int) -> tuple[jax.Array, jax.Array]:
  """Band attention of one dilation group.

  Args:
    q, k, v: `[B, L, h, D]`.
    key_ok: `[B, L]` bool, keys the band may use.
  Returns:
    out `[B, L, h, Dv]` float32 (normalised; 0 where no key), lse `[B, L, h]` float32 (NEG_INF
    where no key).
  """
  b_, length, h, _ = q.shape
  class_len = -(-length // dilation)                      # length of each residue class
  block = min(block, max(8, -(-class_len // 8) * 8))       # never more than one padded class
  nb = -(-class_len // block)
  padded = nb * block * dilation
  radius = min(-(-window // block) if window > 0 else 0, nb - 1)
  left, right = radius, (0 if causal else radius)
  chunk = band_kernel.choose_chunk(nb, b_ * h * dilation, block, (left + right + 1) * block)
  nbq = -(-nb // chunk) * chunk

  def to_blocks(x, before=0, after=0):  # [B, L, h, D] -> [before + nb + after, B, h, dil, block, D]
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, padded - length), (0, 0), (0, 0)))
    x = x.reshape(b_, nb, block, dilation, h, x.shape[-1]).transpose(1, 0, 4, 3, 2, 5)
    return jnp.pad(x, [(before, after)] + [(0, 0)] * 5)

  key_pad = (left, nbq - nb + right)
  qb = to_blocks(q, 0, nbq - nb)
  kb, vb = to_blocks(k, *key_pad), to_blocks(v, *key_pad)
  ok = jnp.pad(key_ok, ((0, 0), (0, padded - length)))
  ok = ok.reshape(b_, nb, block, dilation).transpose(1, 0, 3, 2)   # [nb, B, dil, block]
  ok = jnp.pad(ok, [key_pad, (0, 0), (0, 0), (0, 0)])

  o, lse = band_kernel.band_blocks(qb, kb, vb, ok, window, causal, left, right, chunk)

  def from_blocks(x):  # [nbq, B, h, dil, block, ...] -> [B, L, h, ...]
    x = x[:nb]
    perm = (1, 0, 4, 3, 2) + tuple(range(5, x.ndim))
    x = x.transpose(perm).reshape((b_, padded, h) + x.shape[5:])
    return x[:, :length]

  return from_blocks(o), from_blocks(lse)


def _global_slots(global_mask: jax.Array, num_slots: int) -> jax.Array:
  """One-hot `[B, G, L]` float32 selecting the global tokens of each row, in order."""
  rank = jnp.cumsum(global_mask, axis=1) - 1                         # [B, L]
  slots = jnp.arange(num_slots)[None, :, None]
  return ((rank[:, None, :] == slots) & global_mask[:, None, :]).astype(jnp.float32)


def _attend_dense(q: jax.Array, k: jax.Array, v: jax.Array,
                  allowed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Small dense attention returning (normalised out f32, lse f32); q `[B,Lq,H,D]`."""
  scale = 1.0 / math.sqrt(q.shape[-1])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  p, row_max, row_sum = masked_softmax_stats(logits, allowed)
  has = row_sum > 0
  o = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(has, row_sum, 1.0), v.astype(jnp.float32))
  lse = jnp.where(has, row_max + jnp.log(jnp.where(has, row_sum, 1.0)), NEG_INF)[..., 0]
  return o, lse.transpose(0, 2, 1)                                   # lse [B, Lq, H]


@functools.partial(jax.jit, static_argnames=("window", "dilations", "causal", "block",
                                             "num_global"))
def _band_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None,
                    global_mask: jax.Array | None, *, window: int, dilations: tuple[int, ...],
                    causal: bool, block: int, num_global: int) -> jax.Array:
  b_, length, h, d = q.shape
  real = jnp.ones((b_, length), bool) if key_mask is None else key_mask
  glob = None if num_global == 0 else (global_mask & real)
  band_keys = real if glob is None else real & ~glob

  # Band part, one pass per run of heads sharing a dilation value.
  outs, lses = [], []
  start = 0
  for run_dilation, run_len in _runs(dilations):
    sl = slice(start, start + run_len)
    o, lse = _band_core(q[:, :, sl], k[:, :, sl], v[:, :, sl], band_keys, window=window,
                        dilation=run_dilation, causal=causal, block=block)
    outs.append(o)
    lses.append(lse)
    start += run_len
  out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]   # [B, L, H, Dv]
  lse = jnp.concatenate(lses, axis=2) if len(lses) > 1 else lses[0]   # [B, L, H]

  if glob is not None:
    sel = _global_slots(glob, num_global)                             # [B, G, L]
    slot_ok = jnp.sum(sel, axis=2) > 0                                # [B, G]
    positions = jnp.arange(length)
    slot_pos = jnp.einsum("bgl,l->bg", sel, positions.astype(jnp.float32))
    gather = lambda x: jnp.einsum("bgl,blhd->bghd", sel, x.astype(jnp.float32))
    kg, vg, qg = gather(k), gather(v), gather(q)
    # Every query attends to the global keys; merge with the band by log-sum-exp.
    allowed = slot_ok[:, None, None, :]
    if causal:
      allowed = allowed & (slot_pos[:, None, None, :] <= positions[None, None, :, None])
    og, lseg = _attend_dense(q.astype(jnp.float32), kg, vg, allowed)
    total = jnp.logaddexp(lse, lseg)
    out = (out * jnp.exp(lse - total)[..., None] + og * jnp.exp(lseg - total)[..., None])
    # Global queries attend to every real key.
    allowed = real[:, None, None, :]
    if causal:
      allowed = allowed & (positions[None, None, None, :] <= slot_pos[:, None, :, None])
    oq, _ = _attend_dense(qg, k, v, allowed)                          # [B, G, H, Dv]
    scattered = jnp.einsum("bgl,bghd->blhd", sel, oq)
    out = jnp.where(glob[:, :, None, None], scattered, out)
    # A row with more global tokens than slots cannot be represented: poison it visibly.
    overflow = jnp.sum(glob, axis=1) > num_global                     # [B]
    out = jnp.where(overflow[:, None, None, None], jnp.nan, out)

  out = jnp.where(real[:, :, None, None], out, 0.0)
  return out.astype(q.dtype)


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
  """Run-length encoding of a tuple: [(value, count), ...] in order."""
  runs = []
  for x in values:
    if runs and runs[-1][0] == x:
      runs[-1][1] += 1
    else:
      runs.append([x, 1])
  return [tuple(r) for r in runs]


def band_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int,
                   dilation: int | Sequence[int] = 1, causal: bool = False,
                   global_mask: jax.Array | None = None, key_mask: jax.Array | None = None,
                   block_size: int | None = None, max_global: int | None = None) -> jax.Array:
  """Longformer attention: sliding window with dilation and global tokens, linear in length.

  Args:
    q, k, v: `[B, L, H, D]` (v may have its own last dimension).
    window: one-sided window w >= 0: query i sees keys j with |i - j| <= w * dilation and
      (i - j) a multiple of the dilation; with `causal`, only j <= i.
    dilation: an int >= 1, or a sequence of one int per head.
    causal: autoregressive attention (also applied to global pairs).
    global_mask: optional bool `[B, L]`: global tokens attend to every real key and every
      query attends to them.
    key_mask: optional bool `[B, L]`, True = real token. Padded queries output 0.
    block_size: queries per block; None picks one from the window (`default_block_size`).
    max_global: static upper bound on the number of global tokens per row. Inferred from a
      concrete `global_mask`; required when `global_mask` is traced (inside `jax.jit`). Under
      jit, a row with more global tokens than `max_global` outputs NaN.

  Returns:
    `[B, L, H, Dv]` in q's dtype, equal to `dot_product_attention` with
    `masks.longformer_mask(...)`.
  """
  b_, length, _, h, _ = validation.check_qkv(q, k, v, same_length=True)
  window = validation.check_window(window)
  dilations = validation.head_dilations(dilation, h)
  validation.check_token_mask("key_mask", key_mask, b_, length)
  validation.check_token_mask("global_mask", global_mask, b_, length)
  if block_size is None:
    block_size = default_block_size(window)
  elif isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
      or block_size < 1:
    raise ValueError(f"block_size must be a positive int or None, got {block_size!r}.")
  num_global = validation.global_slots(global_mask, max_global)
  return _band_attention(q, k, v, key_mask, global_mask if num_global else None, window=window,
                         dilations=dilations, causal=causal, block=int(block_size),
                         num_global=num_global)
