"""Longformer band attention as a Pallas GPU kernel: two-sided window, per-head dilation, globals.

No public GPU kernel computes this pattern (FlashAttention windows have neither dilation nor
global tokens, and jax's cuDNN path refuses a right window), so this module writes one in the
Triton style of `jax.experimental.pallas` (`pallas_call`, `pl.BlockSpec`, a grid of programs).
It computes exactly what `attention.band.band_attention` computes, whose keyword interface it
shares; the semantics are those of `attention.masks.longformer_mask`.

Layout. Dilation d is a reshape: positions with the same residue mod d form a contiguous
sequence of length Lc = ceil(L / d), on which a dilated band is an ordinary band of window w.
`[B, L, h, D]` is viewed as `[B, Lp, d, h, D]` (Lp = Lc padded to a multiple of the blocks), a
free reshape, and the kernels' BlockSpecs read the tiles of row n = (batch, residue, head) out
of it directly: no transpose of q, k, v, the output or the gradients. Padding (of the length to
Lp * d, of the head dimension to a power of two >= 16) is the only copy, and only when needed.
Each run of heads sharing a dilation is one set of kernel launches. The kernels themselves are
in `attention.pallas_band_kernel`.

Forward kernel, grid (N, Lp / block_q). Program (n, i) keeps its `block_q` queries in registers
and runs the online softmax (float32 running max, sum and output accumulator, whatever the input
dtype) over the key blocks of `block_k` keys that intersect the window of the query block, key
blocks lo..hi computed from the program id: about (block_q + 2w) / block_k blocks, never the
whole sequence. Inside a key block at the edge of the band the exact band is a relative-position
test; in every key block a per-key validity vector removes padding, the sequence end and the
global keys. The G global keys of the
batch row are gathered outside into static slots (`max_global`, padded to a power of two) and
given to the kernel as one extra key block; each slot carries its position in the residue class
coordinates (the first class position at or after it), so the causal rule for globals is one
comparison. The global query rows (each attends to every real key) are a small dense attention
outside the kernel, scattered over the kernel's rows, as band.py does.

Backward (custom_vjp, FlashAttention-2 recipe): the forward saves only its output and the
log-sum-exp per query; the backward recomputes the probabilities from q, k and that log-sum-exp.
Two kernels: dq per query block (the same key-block range as the forward, plus the global
block, whose dk/dv share it writes for the wrapper to sum over the query blocks in float32),
and dk/dv per key block over the query blocks whose window reaches it. In every kernel only the
blocks at the edges of the band apply the band test; the blocks wholly inside it apply only the
key validity (`attention.pallas_band_kernel` says why that is exact). No `[L, L]` array exists
anywhere, in either pass.

On a machine without a GPU the kernels run through Pallas's interpreter (`interpret=None` picks
it when `jax.default_backend() != "gpu"`), which is how the tests check them.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attention import pallas_band_kernel as kernel
from attention import pallas_online, validation
from attention.dot_product import dot_product_attention

# Smallest matmul side (and block) Triton takes; every block shape is a power of two.
MIN_TILE = 16


_pow2 = validation.pow2_at_least


def _to_classes(x: jax.Array, dilation: int, padded: int, width: int) -> jax.Array:
  """`[B, L, h, D]` -> `[B, padded, d, h, width]`, zero padded; a free reshape when nothing
  needs padding (position p = t * d + r goes to class position t of residue class r)."""
  b_, length, h, d = x.shape
  x = jnp.pad(x, ((0, 0), (0, padded * dilation - length), (0, 0), (0, width - d)))
  return x.reshape(b_, padded, dilation, h, width)


def _from_classes(x: jax.Array, length: int, d: int) -> jax.Array:
  """Inverse of `_to_classes`: `[B, padded, d, h, width]` -> `[B, L, h, D]`."""
  b_, padded, dilation, h, width = x.shape
  return x.reshape(b_, padded * dilation, h, width)[:, :length, :, :d]


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
  """Run-length encoding of a tuple: [(value, count), ...] in order."""
  runs: list[list[int]] = []
  for x in values:
    if runs and runs[-1][0] == x:
      runs[-1][1] += 1
    else:
      runs.append([x, 1])
  return [(a, c) for a, c in runs]


@functools.partial(jax.jit, static_argnames=("window", "dilations", "causal", "block_q",
                                             "block_k", "num_warps", "num_stages", "num_global",
                                             "interpret"))
def _pallas_band(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None,
                 global_mask: jax.Array | None, *, window: int, dilations: tuple[int, ...],
                 causal: bool, block_q: int, block_k: int, num_warps: int, num_stages: int,
                 num_global: int, interpret: bool) -> jax.Array:
  b_, length, h, d = q.shape
  dv = v.shape[-1]
  dp, dvp = max(MIN_TILE, _pow2(d)), max(MIN_TILE, _pow2(dv))
  real = jnp.ones((b_, length), bool) if key_mask is None else key_mask
  glob = None if num_global == 0 else (global_mask & real)
  band_keys = real if glob is None else real & ~glob

  if glob is not None:
    # Slot g of row b holds the g-th global token (position `length` when there is none).
    pos = jax.vmap(lambda g: jnp.nonzero(g, size=num_global, fill_value=length)[0])(glob)
    slot_ok = pos < length                                                 # [B, G]
    take = lambda x: jnp.take_along_axis(x, jnp.minimum(pos, length - 1)[:, :, None, None],
                                         axis=1)                           # [B, G, h, D]
    slots = max(MIN_TILE, _pow2(num_global))

  outs = []
  start = 0
  for dilation, heads in _runs(dilations):
    sl = slice(start, start + heads)
    start += heads
    class_len = -(-length // dilation)
    bq = min(block_q, max(MIN_TILE, _pow2(class_len)))
    bk = min(block_k, max(MIN_TILE, _pow2(class_len)))
    padded = -(-class_len // max(bq, bk)) * max(bq, bk)
    cfg = kernel.Tiles(window=window, causal=causal, block_q=bq, block_k=bk,
                       scale=1.0 / math.sqrt(d), interpret=interpret, num_warps=num_warps,
                       num_stages=num_stages)
    classes = functools.partial(_to_classes, dilation=dilation, padded=padded)
    ok = classes(band_keys[:, :, None, None].astype(jnp.int32), width=1)[:, :, :, 0, 0]
    kg = vg = gpos = None
    if glob is not None:
      def slot_rows(x, width):  # [B, G, heads, D] -> [N, slots, width] f32, shared by residues
        x = jnp.broadcast_to(x.transpose(0, 2, 1, 3)[:, None],
                             (b_, dilation, heads, num_global, x.shape[-1]))
        x = x.reshape(-1, num_global, x.shape[-1]).astype(jnp.float32)
        return jnp.pad(x, ((0, 0), (0, slots - num_global), (0, width - x.shape[-1])))
      kg, vg = slot_rows(take(k[:, :, sl]), dp), slot_rows(take(v[:, :, sl]), dvp)
      # First class position of residue r at or after global position p: ceil((p - r) / d).
      first = -((jnp.arange(dilation)[None, :, None] - pos[:, None, :]) // dilation)
      first = jnp.where(slot_ok[:, None, :], first, kernel.FAR)                  # [B, d, G]
      gpos = jnp.broadcast_to(first[:, :, None], (b_, dilation, heads, num_global))
      gpos = jnp.pad(gpos.reshape(-1, num_global).astype(jnp.int32),
                     ((0, 0), (0, slots - num_global)), constant_values=kernel.FAR)
    o = kernel.attend(cfg, classes(q[:, :, sl], width=dp), classes(k[:, :, sl], width=dp),
                      classes(v[:, :, sl], width=dvp), ok, kg, vg, gpos)
    outs.append(_from_classes(o, length, dv))
  out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]       # [B, L, H, Dv]

  if glob is not None:
    # Global queries attend to every real key (only earlier ones when causal): dense, G x L.
    positions = jnp.arange(length)
    allowed = jnp.ones((1, 1, 1, length), bool)
    if causal:
      allowed = positions[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, G, L]
    oq = dot_product_attention(take(q), k, v, mask=allowed, key_mask=real, query_mask=slot_ok)
    rows_b = jnp.broadcast_to(jnp.arange(b_)[:, None], pos.shape)
    out = out.at[rows_b, pos].set(oq.astype(out.dtype), mode="drop")
    # A row with more global tokens than slots cannot be represented: poison it visibly.
    overflow = jnp.sum(glob, axis=1) > num_global
    out = jnp.where(overflow[:, None, None, None], jnp.nan, out)
  out = jnp.where(real[:, :, None, None], out, 0)
  return out.astype(q.dtype)


def band_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int,
                   dilation: int | Sequence[int] = 1, causal: bool = False,
                   global_mask: jax.Array | None = None, key_mask: jax.Array | None = None,
                   block_size: int | None = None, max_global: int | None = None,
                   interpret: bool | None = None, block_q: int | None = None,
                   block_k: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> jax.Array:
  """Longformer attention through the Pallas kernel: `attention.band.band_attention`'s interface.

  Args:
    q, k, v: `[B, L, H, D]` (v may have its own last dimension).
    window: one-sided window w >= 0: query i sees keys j with |i - j| <= w * dilation and
      (i - j) a multiple of the dilation; with `causal`, only j <= i.
    dilation: an int >= 1, or a sequence of one int per head.
    causal: autoregressive attention (also applied to global pairs).
    global_mask: optional bool `[B, L]`: global tokens attend to every real key and every
      query attends to them.
    key_mask: optional bool `[B, L]`, True = real token. Padded queries output 0.
    block_size: band.py's block knob; here the default of `block_q` and `block_k`, rounded up
      to a power of two of at least 16.
    max_global: static upper bound on the number of global tokens per row. Inferred from a
      concrete `global_mask`; required when `global_mask` is traced (inside `jax.jit`). Under
      jit, a row with more global tokens than `max_global` outputs NaN.
    interpret: run the kernels in Pallas's interpreter; None: when the default backend is not
      a GPU.
    block_q, block_k: queries per program and keys per inner step (powers of two >= 16,
      reduced to fit short sequences); None: `block_size` when given, else the entry of
      `attention.pallas_online.TILE_TABLE` for the dtype and head dimension.
    num_warps, num_stages: the Triton launch's warps per program (a power of two <= 32) and
      pipelining stages (1 to 8); None: `TILE_TABLE`'s entry. No effect in interpret mode.

  Returns:
    `[B, L, H, Dv]` in q's dtype, equal to `dot_product_attention` with
    `masks.longformer_mask(...)`.
  """
  b_, length, _, h, _ = validation.check_qkv(q, k, v, same_length=True)
  window = validation.check_window(window)
  dilations = validation.head_dilations(dilation, h)
  validation.check_token_mask("key_mask", key_mask, b_, length)
  validation.check_token_mask("global_mask", global_mask, b_, length)
  if block_size is not None:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
        or block_size < 1:
      raise ValueError(f"block_size must be a positive int or None, got {block_size!r}.")
    block_size = max(MIN_TILE, _pow2(block_size))
    block_q = block_size if block_q is None else block_q
    block_k = block_size if block_k is None else block_k
  block_q, block_k, num_warps, num_stages = pallas_online.launch_settings(
      max(MIN_TILE, _pow2(q.shape[-1])), q.dtype, block_q, block_k, num_warps, num_stages,
      MIN_TILE)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  num_global = validation.global_slots(global_mask, max_global)
  return _pallas_band(q, k, v, key_mask, global_mask if num_global else None, window=window,
                      dilations=dilations, causal=bool(causal), block_q=block_q,
                      block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                      num_global=num_global, interpret=bool(interpret))
