"""The `splash` backend: the TPU splash-attention kernel running the block-pattern kinds.

`jax.experimental.pallas.ops.tpu.splash_attention` is a flash-attention kernel that visits only
the (query tile, key tile) pairs a static block mask marks non-empty, applies a stored boolean
tile where a tile is partly allowed, and has its own backward pass. This module gives it one
function per kind with exactly the keyword interface of the kind's portable function (`xla`),
plus `interpret` (None: Pallas interpret mode when the default backend is not a TPU, which is
how the CPU tests run it) and the kernel's tiles: `tiles` (a `Tiles`, or a mapping of its fields
such as `config.model.splash`: `block_q`, `block_kv`, `block_kv_compute`, the dK/dV pass's
`block_q_dkv`, `block_kv_dkv`, `block_kv_dkv_compute`, and `use_fused_bwd_kernel`; multiples of
128, defaults in `DEFAULT_TILES`), with `block_q` / `block_kv` overriding it. The kind's own
block parameters keep their meaning (the pattern) and the xla compute block (`band`'s and
`sparse`'s `block_size`) is accepted and ignored.

How the kinds map onto the kernel:
  * The mask of every head comes from the kind's pattern: through splash's public mask classes
    where they express it (dense, causal, band without dilation: `splash_masks.public_mask`),
    else at tile granularity (`attention.splash_masks`); never an `L x L` array, built once per
    static configuration and cached. Per-head patterns (dilation, BigBird's random blocks, `fixed`'s
    summary offsets) are one mask per head.
  * Padding is data, so it goes through segment ids: every query has segment 0, a usable key
    0, a padded key 1. Lengths are padded to a multiple of the tiles the same way. Padded
    queries output exactly 0, and so do queries with no allowed key (the reference's rule;
    the kernel would average masked keys there), which only a block-sparse layout can produce.
  * Band global tokens (`global_mask [B, L]`): global keys are removed from the band by their
    segment id and appended, gathered into `G` static slots (one-hot matmul), as extra key
    columns that every query sees (empty slots carry segment 1); the `G` global query rows
    attend to every real key in a small dense attention outside the kernel and are scattered
    back, as `attention.band` does. With `causal=True` a global key may only be seen from
    later positions, which a static mask over gathered slots cannot express, so causal band
    attention with global tokens is refused.
  * The kernel does not scale: q is multiplied by 1/sqrt(head_dim) before it.
Outputs are `[B, L, H, Dv]` in q's dtype, equal to `dot_product_attention` with the kind's mask
(`tests/splash_test.py`, outputs and gradients).
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _splash
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask_info as _splash_info)

from attention import splash_masks, validation
from attention.dot_product import masked_softmax_stats
from attention.splash_masks import Pattern
# The kernel's tiles as config fields (jax-free, so that the config check reads them).
from attention.splash_tiles import DEFAULT_TILES, LANES, TILE_FIELDS, Tiles, _round_up, splash_tiles


def _interpret(interpret: bool | None) -> bool:
  return jax.default_backend() != "tpu" if interpret is None else bool(interpret)


def _kernel(patterns: tuple[Pattern, ...], q_len: int, kv_len: int, main_len: int, t: Tiles,
            interpret: bool) -> _splash.SplashAttentionKernel:
  """The splash kernel of one static configuration: the forward (and unfused dQ) `MaskInfo` at
  the forward tiles, the dK/dV one at the dK/dV tiles, built from the patterns. The fused
  backward writes dQ at every step of its grid, so its dK/dV grid is not shrunk (as
  `make_splash_mha` does; shrunk, its dQ is wrong)."""
  public = splash_masks.public_mask(patterns, q_len, kv_len, main_len)
  if public is not None:                 # splash builds the MaskInfo of its own mask classes
    return _splash.make_splash_mha(public, block_sizes=t.block_sizes(), head_shards=1,
                                   q_seq_shards=1, interpret=interpret)
  fwd = splash_masks.mask_infos(patterns, q_len, kv_len, main_len, t.block_q, t.block_kv)[0]
  dkv = splash_masks.mask_infos(patterns, q_len, kv_len, main_len, t.block_q_dkv,
                                t.block_kv_dkv, not t.use_fused_bwd_kernel)[1]

  def info(x: splash_masks.MaskInfo) -> _splash_info.MaskInfo:
    return _splash_info.MaskInfo(
        data_next=jnp.asarray(x.data_next), block_mask=jnp.asarray(x.block_mask),
        mask_next=None if x.mask_next is None else jnp.asarray(x.mask_next),
        partial_mask_blocks=None if x.partial_mask_blocks is None
        else jnp.asarray(x.partial_mask_blocks), q_sequence=None)

  return _splash.SplashAttentionKernel(
      info(fwd), None if t.use_fused_bwd_kernel else info(fwd), info(dkv),
      block_sizes=t.block_sizes(), is_mqa=False, save_residuals=False,
      mask_value=_splash.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None,
      residual_checkpoint_name=None, mask_function=None, interpret=interpret)


def _pad(x: jax.Array, length: int, value=0) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, length - x.shape[1])
  return jnp.pad(x, pad, constant_values=value)


def _run(q: jax.Array, k: jax.Array, v: jax.Array, key_ok: jax.Array, *,
         patterns: tuple[Pattern, ...], tiles: Tiles, interpret: bool,
         extra: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
  """Splash attention of q `[B, Lq, H, D]` over keys k, v `[B, Lk, H, .]` that `key_ok [B, Lk]`
  allows, with one pattern per head; `extra` = (k, v, ok) of appended key columns every query
  sees. Returns `[B, Lq, H, Dv]` in q's dtype (rows with no allowed key are unspecified)."""
  b_, lq, h, d = q.shape
  t = tiles.fit(lq, k.shape[1])
  key_tile = math.lcm(t.block_kv, t.block_kv_dkv)
  q_len = _round_up(lq, math.lcm(t.block_q, t.block_q_dkv))
  main_len = _round_up(k.shape[1], key_tile)
  ks, vs = [_pad(k, main_len)], [_pad(v, main_len)]
  oks = [_pad(key_ok, main_len, False)]
  if extra is not None:
    g = _round_up(extra[0].shape[1], key_tile)
    ks.append(_pad(extra[0], g))
    vs.append(_pad(extra[1], g))
    oks.append(_pad(extra[2], g, False))
  kv_len = main_len + sum(x.shape[1] for x in ks[1:])
  kernel = _kernel(patterns, q_len, kv_len, main_len, t, interpret)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)                    # [B, H, L, .]
  scale = 1.0 / math.sqrt(d)
  qh = heads_major(_pad((q.astype(jnp.float32) * scale).astype(q.dtype), q_len))
  kh = heads_major(jnp.concatenate(ks, axis=1).astype(q.dtype))
  vh = heads_major(jnp.concatenate(vs, axis=1))
  segments = _splash.SegmentIds(q=jnp.zeros((b_, q_len), jnp.int32),
                                kv=jnp.where(jnp.concatenate(oks, axis=1), 0, 1).astype(jnp.int32))
  out = jax.vmap(kernel)(qh, kh, vh, segment_ids=segments)        # [B, H, q_len, Dv]
  return jnp.swapaxes(out, 1, 2)[:, :lq]


def _finish(out: jax.Array, keep: jax.Array | None, dtype) -> jax.Array:
  """Zeroes the rows outside `keep` (`[B, L]` or `[B, L, H]`) and casts."""
  if keep is not None:
    keep = keep[:, :, None, None] if keep.ndim == 2 else keep[..., None]
    out = jnp.where(keep, out, 0)
  return out.astype(dtype)


def _real(key_mask: jax.Array | None, b_: int, length: int) -> jax.Array:
  return jnp.ones((b_, length), bool) if key_mask is None else jnp.asarray(key_mask, bool)


# --- Dense and band. ---

def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                          key_mask: jax.Array | None = None, interpret: bool | None = None,
                          block_q: int | None = None, block_kv: int | None = None,
                          tiles: Tiles | Mapping | None = None) -> jax.Array:
  """Dense attention (causal: j <= i, positions aligned at the start) on the splash kernel.

  q `[B, Lq, H, D]`, k and v `[B, Lk, H, .]`; `key_mask [B, Lk]`, True = real key; with q and k
  of one length, padded queries output 0. Equal to `attention.dot_product_attention`.
  """
  b_, lq, lk, h, _ = validation.check_qkv(q, k, v)
  validation.check_token_mask("key_mask", key_mask, b_, lk)
  tiles = splash_tiles(tiles, block_q=block_q, block_kv=block_kv)
  keep = None
  if key_mask is not None:
    real = jnp.asarray(key_mask, bool)
    if lq == lk:
      keep = real
    else:                                                # a query needs an allowed real key
      seen = jnp.cumsum(real, axis=1)
      keep = (seen[:, np.minimum(np.arange(lq), lk - 1)] if causal else seen[:, -1:]) > 0
      keep = jnp.broadcast_to(keep, (b_, lq))
  return _patterned(q, k, v, key_mask, keep, patterns=(splash_masks.DensePattern(bool(causal)),)
                    * h, tiles=tiles, interpret=_interpret(interpret))


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    key_mask: jax.Array | None = None, causal: bool = False,
                    block_mask=None, block_size: int | None = None,
                    interpret: bool | None = None, block_q: int | None = None,
                    block_kv: int | None = None,
                    tiles: Tiles | Mapping | None = None) -> jax.Array:
  """`attention.flash_attention` (dense attention) on the splash kernel; `block_size` is the
  xla path's block and is not used here (the kernel's tiles are `tiles`)."""
  del block_size
  if block_mask is not None:
    raise ValueError("the splash backend takes no block_mask for flash: use a block-sparse kind "
                     "(block_sparse) or implementation=xla.")
  return dot_product_attention(q, k, v, causal=causal, key_mask=key_mask, interpret=interpret,
                               block_q=block_q, block_kv=block_kv, tiles=tiles)


def _global_slots(glob: jax.Array, num_slots: int) -> jax.Array:
  """One-hot `[B, G, L]` float32 of each row's global tokens, in order of position."""
  rank = jnp.cumsum(glob, axis=1) - 1
  return ((rank[:, None, :] == jnp.arange(num_slots)[None, :, None])
          & glob[:, None, :]).astype(jnp.float32)


def _dense_rows(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
  """Small dense attention, q `[B, G, H, D]`, allowed `[B, 1, 1, L]`: `[B, G, H, Dv]` f32."""
  logits = jnp.einsum("bghd,blhd->bhgl", q, k.astype(jnp.float32),
                      preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
  p, _, total = masked_softmax_stats(logits, allowed)
  p = p / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("bhgl,blhd->bghd", p, v.astype(jnp.float32))


def band_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int,
                   dilation: int | Sequence[int] = 1, causal: bool = False,
                   global_mask: jax.Array | None = None, key_mask: jax.Array | None = None,
                   block_size: int | None = None, max_global: int | None = None,
                   interpret: bool | None = None, block_q: int | None = None,
                   block_kv: int | None = None, tiles: Tiles | Mapping | None = None) -> jax.Array:
  """Longformer attention on the splash kernel; arguments as `attention.band.band_attention`
  (`block_size`, the xla compute block, is checked and ignored).

  Raises ValueError for `causal=True` with a `global_mask` (not exact on this kernel: use the
  xla backend). Equal to `dot_product_attention` with `masks.longformer_mask(...)`.
  """
  b_, length, h = validation.check_self_qkv(q, k, v, key_mask)
  window = validation.check_window(window)
  dilations = validation.head_dilations(dilation, h)
  validation.check_token_mask("global_mask", global_mask, b_, length)
  if block_size is not None:
    validation.positive_int("block_size", block_size)
  tiles = splash_tiles(tiles, block_q=block_q, block_kv=block_kv)
  if global_mask is not None and causal:
    raise ValueError(
        "the splash backend cannot run causal band attention with global tokens exactly (a "
        "global key is seen only from later positions); use implementation='xla' for it.")
  num_global = validation.global_slots(global_mask, max_global)
  patterns = tuple(splash_masks.BandPattern(window, d, bool(causal)) for d in dilations)
  return _band(q, k, v, key_mask, global_mask if num_global else None, patterns=patterns,
               num_global=num_global, tiles=tiles, interpret=_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("patterns", "num_global", "tiles",
                                             "interpret"))
def _band(q, k, v, key_mask, global_mask, *, patterns, num_global, tiles, interpret):
  b_, length = q.shape[:2]
  real = _real(key_mask, b_, length)
  if global_mask is None:
    out = _run(q, k, v, real, patterns=patterns, tiles=tiles, interpret=interpret)
    return _finish(out, None if key_mask is None else real, q.dtype)
  glob = global_mask & real
  sel = _global_slots(glob, num_global)                               # [B, G, L]
  gather = lambda x: jnp.einsum("bgl,blhd->bghd", sel, x.astype(jnp.float32)).astype(x.dtype)
  slot_ok = jnp.sum(sel, axis=2) > 0                                  # [B, G]
  out = _run(q, k, v, real & ~glob, patterns=patterns, tiles=tiles, interpret=interpret,
             extra=(gather(k), gather(v), slot_ok))
  rows = _dense_rows(gather(q), k, v, real[:, None, None, :])         # [B, G, H, Dv]
  scattered = jnp.einsum("bgl,bghd->blhd", sel, rows)
  out = jnp.where(glob[:, :, None, None], scattered, out.astype(jnp.float32))
  overflow = jnp.sum(glob, axis=1) > num_global      # more global tokens than slots: poison
  out = jnp.where(overflow[:, None, None, None], jnp.nan, out)
  return _finish(out, real, q.dtype)


# --- Block patterns. ---

@functools.partial(jax.jit, static_argnames=("patterns", "tiles", "interpret"))
def _patterned(q, k, v, key_mask, keep, *, patterns, tiles, interpret):
  """Splash attention with one pattern per head; `keep [B, Lq(, H)]`: the rows to output
  (None: the real tokens, for self-attention)."""
  real = _real(key_mask, *k.shape[:2])
  out = _run(q, k, v, real, patterns=patterns, tiles=tiles, interpret=interpret)
  if keep is None and key_mask is not None:
    keep = real
  return _finish(out, keep, q.dtype)


def block_local_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_size: int,
                          causal: bool = False, key_mask: jax.Array | None = None,
                          interpret: bool | None = None, block_q: int | None = None,
                          block_kv: int | None = None,
                          tiles: Tiles | Mapping | None = None) -> jax.Array:
  """Contiguous-block local attention on the splash kernel (`masks.block_local_mask`)."""
  _, _, h = validation.check_self_qkv(q, k, v, key_mask)
  patterns = splash_masks.block_local_patterns(block_size, causal, h)
  tiles = splash_tiles(tiles, block_q=block_q, block_kv=block_kv)
  return _patterned(q, k, v, key_mask, None, patterns=patterns, tiles=tiles,
                    interpret=_interpret(interpret))


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, pattern: str, stride: int,
                     summary_width: int | None = None, causal: bool = False,
                     key_mask: jax.Array | None = None, block_size: int | None = None,
                     num_summary_offsets: int | None = None, interpret: bool | None = None,
                     block_q: int | None = None, block_kv: int | None = None,
                          tiles: Tiles | Mapping | None = None) -> jax.Array:
  """Sparse Transformer strided / fixed attention on the splash kernel; arguments as
  `attention.sparse_patterns.sparse_attention` (`block_size` is checked and ignored).
  Equal to `dot_product_attention` with `masks.strided_mask` / `masks.fixed_mask(...,
  num_heads=H)`."""
  _, _, h = validation.check_self_qkv(q, k, v, key_mask)
  patterns = splash_masks.sparse_patterns(pattern, stride, summary_width, num_summary_offsets,
                                          block_size, causal, h)
  tiles = splash_tiles(tiles, block_q=block_q, block_kv=block_kv)
  return _patterned(q, k, v, key_mask, None, patterns=patterns, tiles=tiles,
                    interpret=_interpret(interpret))


def bigbird_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_size: int,
                      num_global_blocks: int = 2, num_random_blocks: int = 3, seed: int,
                      key_mask: jax.Array | None = None, random_blocks: str = "drawn",
                      interpret: bool | None = None, block_q: int | None = None,
                      block_kv: int | None = None,
                      tiles: Tiles | Mapping | None = None) -> jax.Array:
  """BigBird ITC attention on the splash kernel; arguments as
  `attention.sparse_patterns.bigbird_attention` (drawn random blocks only). Equal to
  `dot_product_attention` with `masks.bigbird_mask(..., num_heads=H)`."""
  validation.drawn_random_blocks(random_blocks, "splash")
  _, length, h = validation.check_self_qkv(q, k, v, key_mask)
  patterns = splash_masks.bigbird_patterns(length, block_size, num_global_blocks,
                                           num_random_blocks, seed, h)
  tiles = splash_tiles(tiles, block_q=block_q, block_kv=block_kv)
  return _patterned(q, k, v, key_mask, None, patterns=patterns, tiles=tiles,
                    interpret=_interpret(interpret))


def _layout_keep(layout: np.ndarray, block: int, real: jax.Array, causal: bool) -> jax.Array:
  """bool `[B, L, H|1]`: the queries that have an allowed real key under a block layout."""
  b_, length = real.shape
  nb = layout.shape[-1]
  blocks = _pad(real, nb * block, False).reshape(b_, nb, block).astype(jnp.float32)
  per_block = blocks.sum(axis=2)                                       # [B, nb]
  owner = np.arange(length) // block                                   # query -> its block
  if not causal:
    return (jnp.einsum("hnm,bm->bnh", layout.astype(np.float32), per_block)[:, owner] > 0)
  earlier = jnp.einsum("hnm,bm->bnh", (layout & np.tri(nb, k=-1, dtype=bool)).astype(
      np.float32), per_block)[:, owner]                                # [B, L, H]
  within = jnp.cumsum(blocks, axis=2).reshape(b_, nb * block)[:, :length]   # real keys <= i
  diagonal = layout[:, np.arange(nb), np.arange(nb)].T[owner]          # [L, H]
  return (earlier + within[:, :, None] * diagonal[None]) > 0


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, layout: np.ndarray,
                           block_size: int, causal: bool = False,
                           key_mask: jax.Array | None = None, interpret: bool | None = None,
                           block_q: int | None = None, block_kv: int | None = None,
                          tiles: Tiles | Mapping | None = None) -> jax.Array:
  """Attention over a static block layout on the splash kernel; arguments as
  `attention.block_sparse.block_sparse_attention`. Equal to `dot_product_attention` with
  `masks.block_layout_mask(layout, block_size, L)` (and causal, key_mask); a query with no
  allowed real key outputs 0."""
  b_, length, h = validation.check_self_qkv(q, k, v, key_mask)
  block = validation.positive_int("block_size", block_size)
  if isinstance(layout, jax.Array):
    raise ValueError("layout must be a static numpy bool array (it decides which blocks are "
                     "computed), got a jax array; pass np.asarray(layout).")
  layout = np.asarray(layout)
  nb = -(-length // block)
  if layout.dtype != np.bool_:
    raise ValueError(f"layout must be boolean (True = compute this block), got {layout.dtype}.")
  if layout.shape not in ((nb, nb), (h, nb, nb)):
    raise ValueError(
        f"layout has shape {layout.shape}, but length {length} with block_size {block} has "
        f"ceil({length}/{block}) = {nb} blocks: pass a layout of shape {(nb, nb)} (or "
        f"{(h, nb, nb)}, one per head), or change block_size.")
  tiles = splash_tiles(tiles, block_q=block_q, block_kv=block_kv)
  per_head = layout if layout.ndim == 3 else np.broadcast_to(layout, (h, nb, nb))
  patterns = splash_masks.layout_patterns(per_head, block, bool(causal))
  layout3 = layout if layout.ndim == 3 else layout[None]
  keep = _layout_keep(layout3, block, _real(key_mask, b_, length), bool(causal))
  if key_mask is not None:
    keep = keep & jnp.asarray(key_mask)[:, :, None]
  return _patterned(q, k, v, key_mask, keep, patterns=patterns, tiles=tiles,
                    interpret=_interpret(interpret))


__all__ = ["DEFAULT_TILES", "TILE_FIELDS", "Tiles", "band_attention", "bigbird_attention",
           "block_local_attention", "block_sparse_attention", "dot_product_attention",
           "flash_attention", "sparse_attention", "splash_tiles"]
