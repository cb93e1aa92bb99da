"""Block-sparse layouts (BigBird, Sparse Transformer, block-local, block-sparse) as a Pallas GPU
kernel: the `pallas` backend of those kinds.

A sibling of `attention.pallas_band` (same Triton style: `pallas_call`, `pl.BlockSpec`, a grid of
programs, interpret mode where there is no GPU) for the kinds whose pattern is a block mask. Each
kind's function here has exactly the keyword interface of the kind's portable (`xla`) function,
plus `interpret` (None: Pallas's interpreter when `jax.default_backend() != "gpu"`, which is how
the tests run it) and the kernel's launch: tiles `block_q`, `block_k` (powers of two >= 16,
reduced to fit short sequences), `num_warps` (a power of two <= 32) and `num_stages` (1 to 8),
each None for its entry in `attention.pallas_online.TILE_TABLE` (by dtype and head dimension).
The kind's own block parameters keep their meaning (the pattern); the xla compute block of
`sparse` (`block_size`) is checked and ignored.

The pattern. Each head's allowed pairs are one `attention.splash_masks` pattern object, the same
ones the splash backend uses (`BigBird` and `block_sparse` are `LayoutPattern`s, one per head for
BigBird's per-head random blocks; `StridedPattern`, `FixedPattern` with per-head summary offsets,
`BlockLocalPattern`), so the two backends share one description of each kind. Their tile
classification (`splash_masks`: every `[block_q, block_k]` tile empty, full or partial, partial
tiles deduplicated by content, from the pattern's rule at tile granularity, never an `L x L`
array) is turned here, in numpy, once per static configuration (cached), into lists:
  * per (head, query tile): the key tiles to visit, its full tiles first and its partial ones
    after (a pointer marks the split), and, for each, the index of its tile in a small table of
    distinct boolean tiles (entry 0: all ones, for full tiles);
  * per (head, key tile): the query tiles that visit it, the transposed lists, for dk/dv.
The lists of all tiles are stored one after another with row pointers (compressed sparse rows),
so their size is the number of visited tiles (a global query tile that visits every key tile
makes no other row longer), and once for all heads when the heads share the pattern.
Global rows and columns (BigBird's global blocks, `fixed`'s summary columns) are nothing special:
a global query tile simply lists every key tile. Causality is part of the pattern.

The kernels (`attention.pallas_block_sparse_kernel`): forward, grid (B * H, query tiles), online
softmax over the program's list (float32 statistics, whatever the input dtype), keys and values
loaded at offsets read from the list, in two loops: the full tiles masked by the key validity
alone, the partial ones by their table tile and the key validity; backward as FlashAttention-2 (custom_vjp, the forward
saves its output and log-sum-exp): a dq kernel over the same lists and a dk/dv kernel over the
transposed ones. Padding (of the length to a multiple of the tiles, of the head dimension to a
power of two >= 16) is the only copy; padded and masked keys are a per-key validity vector.
A query with no allowed real key outputs 0, as the xla path and `dot_product_attention` do (a
block layout can leave a query block with nothing; padding can empty a row); padded queries
output 0.

The strided pattern is not one list of tiles in token order: there a tile far from the diagonal
holds a single diagonal of the pairs stride | (i - j), 1 / tile side of its pairs, and such tiles
grow as L^2. It runs as `attention.sparse_patterns.strided_parts`, two calls of the kernel with
their log-sum-exps (`kernel.attend_with_lse`) merged exactly: those pairs as block-local
attention in residue-class order (a reshape, each class padded to whole tiles, so every tile it
visits is full, or causal on its diagonal), and the band 0 < |i - j| < stride (`NearPattern`) in
token order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attention import pallas_online, sparse_patterns, splash_masks, validation
from attention import pallas_block_sparse_kernel as kernel
from attention.block_sparse import check_layout
from attention.splash_masks import Pattern

# Smallest matmul side (and tile) Triton takes; every block shape is a power of two.
MIN_TILE = 16


_pow2 = validation.pow2_at_least


class Lists(NamedTuple):
  """The tile lists of one static configuration (numpy), rows stored one after another, two
  segments a row: for tile i of head h, entries ptr[h, 2i] to ptr[h, 2i + 1] of idx[h] and
  tid[h] are its full tiles (tid 0), entries ptr[h, 2i + 1] to ptr[h, 2i + 2] its partial ones,
  each segment in increasing order. The head axis is H, or 1 when every head has the same
  pattern."""
  fwd_ptr: np.ndarray   # int32 [Hl, P]: segment pointers over the query tiles
  fwd_idx: np.ndarray   # int32 [Hl, E]: the key tiles each query tile visits
  fwd_tid: np.ndarray   # int32 [Hl, E]: their entries in `tiles`
  bwd_ptr: np.ndarray   # int32 [Hl, P']: segment pointers over the key tiles
  bwd_idx: np.ndarray   # int32 [Hl, E]: the query tiles that visit each key tile
  bwd_tid: np.ndarray   # int32 [Hl, E]
  tiles: np.ndarray     # int8 [T, bq, bk]: entry 0 all ones (full tiles), then partial tiles


def _rows(cls: np.ndarray, tid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(segment pointers, tiles, table entries) of the visited tiles (`cls > 0`) of `[Hl, n, m]`,
  row after row, each row its full tiles (`cls == 2`) then its partial ones, each in increasing
  order; sizes padded to powers of two (pointers with the total, tiles with -1)."""
  hl, n, _ = cls.shape
  segments = np.stack([(cls == 2).sum(axis=-1), (cls == 1).sum(axis=-1)], axis=-1)
  ptr = np.zeros((hl, max(MIN_TILE, _pow2(2 * n + 1))), np.int32)
  ptr[:, 1:2 * n + 1] = np.cumsum(segments.reshape(hl, 2 * n), axis=-1)
  ptr[:, 2 * n + 1:] = ptr[:, 2 * n:2 * n + 1]
  size = max(MIN_TILE, _pow2(int(ptr[:, -1].max(initial=0))))
  idx = np.full((hl, size), -1, np.int32)
  ids = np.zeros((hl, size), np.int32)
  for h in range(hl):
    rows, cols = np.nonzero(cls[h] > 0)                  # row-major: rows in order
    order = np.lexsort((cols, cls[h, rows, cols] == 1, rows))   # per row: full, then partial
    rows, cols = rows[order], cols[order]
    idx[h, :rows.size] = cols
    ids[h, :rows.size] = tid[h, rows, cols]
  return ptr, idx, ids


def padded_length(length: int, bq: int, bk: int) -> int:
  """The length the kernels run on: `length` rounded up to a multiple of both tiles."""
  return -(-length // max(bq, bk)) * max(bq, bk)


@functools.lru_cache(maxsize=32)
def tile_lists(patterns: tuple[Pattern, ...], length: int, bq: int, bk: int) -> Lists:
  """The lists of one pattern per head over `length` positions, padded to `padded_length`.

  Tiles that hold no allowed pair are not listed: the all-masked tile splash_masks gives a row
  of tiles with nothing allowed (splash needs one per row; here such a row's list is empty and
  its queries output 0), and every tile lying wholly in the padding past `length`.
  """
  padded = padded_length(length, bq, bk)
  nq, nk = padded // bq, padded // bk
  # splash_masks' classification: class 0 empty, 1 partial (ids: its stored tile), 2 full.
  cls, ids, stored, head_to_unique = splash_masks.classify(patterns, nq, nk, nk, bq, bk)
  if cls.shape[0] > 1:                                   # heads differ: one list per head
    cls, ids = cls[head_to_unique], ids[head_to_unique]
  if stored:
    blank = np.array([not t.any() for t in stored])
    cls = np.where((cls == 1) & blank[np.maximum(ids, 0)], 0, cls)
  cls[:, np.arange(nq) * bq >= length, :] = 0
  cls[:, :, np.arange(nk) * bk >= length] = 0
  tid = np.where(cls == 1, ids + 1, 0).astype(np.int32)
  tiles = np.zeros((_pow2(len(stored) + 1), bq, bk), np.int8)     # a power of two, for Triton
  tiles[0] = 1
  if stored:
    tiles[1:len(stored) + 1] = np.stack(stored)
  return Lists(*_rows(cls, tid), *_rows(cls.transpose(0, 2, 1), tid.transpose(0, 2, 1)), tiles)


def _kernel_args(q: jax.Array, k: jax.Array, v: jax.Array, key_ok: jax.Array,
                 patterns: tuple[Pattern, ...], block_q: int, block_k: int, num_warps: int,
                 num_stages: int, interpret: bool) -> tuple:
  """The arguments of the kernel on `[B, L, H, .]` inputs with the keys `key_ok [B, L]`: its
  configuration (tiles reduced to fit short sequences), then q, k, v padded to the
  tiles and to head dimensions that are powers of two >= 16, the key validity and the lists."""
  _, length, h, d = q.shape
  bq, bk = (min(t, max(MIN_TILE, _pow2(length))) for t in (block_q, block_k))
  padded = padded_length(length, bq, bk)
  lists = tile_lists(patterns, length, bq, bk)
  ok = jnp.pad(key_ok, ((0, 0), (0, padded - length))).astype(jnp.int32)

  def pad(x):
    width = max(MIN_TILE, _pow2(x.shape[-1]))
    return jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, width - x.shape[-1])))

  cfg = kernel.Tiles(block_q=bq, block_k=bk, heads=h, list_heads=lists.fwd_ptr.shape[0],
                     scale=1.0 / math.sqrt(d), interpret=interpret, num_warps=num_warps,
                     num_stages=num_stages)
  return (cfg, pad(q), pad(k), pad(v), ok, *(jnp.asarray(x) for x in lists))


@functools.partial(jax.jit, static_argnames=("patterns", "block_q", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def _attend(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None, *,
            patterns: tuple[Pattern, ...], block_q: int, block_k: int, num_warps: int,
            num_stages: int, interpret: bool) -> jax.Array:
  b_, length = q.shape[:2]
  real = jnp.ones((b_, length), bool) if key_mask is None else key_mask
  out = kernel.attend(*_kernel_args(q, k, v, real, patterns, block_q, block_k, num_warps,
                                    num_stages, interpret))
  out = out[:, :length, :, :v.shape[-1]]
  if key_mask is not None:
    out = jnp.where(real[:, :, None, None], out, 0)
  return out.astype(q.dtype)


def _with_lse(q: jax.Array, k: jax.Array, v: jax.Array, key_ok: jax.Array,
              patterns: tuple[Pattern, ...], block_q: int, block_k: int, num_warps: int,
              num_stages: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """(out `[B, L, H, Dv]` in q's dtype, lse float32 `[B, L, H]`) of the patterns over the keys
  with `key_ok [B, L]`: `kernel.attend_with_lse`, one part of a pattern merged by log-sum-exp
  (`attention.sparse_patterns.strided_parts`). A query with no allowed key: 0 and NEG_INF."""
  b_, length, h = q.shape[:3]
  out, lse = kernel.attend_with_lse(*_kernel_args(q, k, v, key_ok, patterns, block_q, block_k,
                                                  num_warps, num_stages, interpret))
  lse = lse.reshape(b_, h, -1)[:, :, :length].transpose(0, 2, 1)
  return out[:, :length, :, :v.shape[-1]], lse


@dataclasses.dataclass(frozen=True)
class NearPattern(Pattern):
  """The strided pattern's local part: 0 < |i - j| < stride (causal: 0 < i - j < stride); the
  pairs stride | (i - j) are the other part (`_strided`)."""
  stride: int
  causal: bool = False

  def allowed(self, i, j):
    rel = i - j
    ok = (np.abs(rel) < self.stride) & (rel != 0)
    return ok & (rel > 0) if self.causal else ok

  def keys(self, q0, k0, bq, bkv):
    delta = q0.astype(np.int64) - k0.astype(np.int64)    # a tile's pairs depend on it alone
    lo, hi = delta - (bkv - 1), delta + (bq - 1)         # its smallest and largest i - j
    empty = (lo >= self.stride) | (hi <= (0 if self.causal else -self.stride))
    return np.where(empty, splash_masks.EMPTY, delta + (1 << 32))   # keys >= 0


@functools.partial(jax.jit, static_argnames=("stride", "causal", "block_q", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def _strided(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None, *,
             stride: int, causal: bool, block_q: int, block_k: int, num_warps: int,
             num_stages: int, interpret: bool) -> jax.Array:
  """The strided pattern as `sparse_patterns.strided_parts` on the kernel: the pairs
  stride | (i - j) as block-local attention in residue-class order, each class padded to whole
  tiles (every tile visited is full, or causal on its diagonal, at any length), and the band
  0 < |i - j| < stride in token order, its tiles no longer than the band needs."""
  h = q.shape[2]
  launch = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret)
  fit = lambda n: max(MIN_TILE, _pow2(n))
  cq, ck = (min(t, fit(-(-q.shape[1] // stride))) for t in (block_q, block_k))
  nq, nk = min(block_q, fit(stride)), min(block_k, fit(stride))

  def near(q, k, v, key_ok):
    return _with_lse(q, k, v, key_ok, (NearPattern(stride, causal),) * h, nq, nk, **launch)

  def diagonal(q, k, v, key_ok, block):
    patterns = (splash_masks.BlockLocalPattern(block, causal),) * h
    return _with_lse(q, k, v, key_ok, patterns, cq, ck, **launch)

  return sparse_patterns.strided_parts(q, k, v, key_mask, stride=stride, local=near,
                                       diagonal=diagonal, multiple=max(cq, ck))


def _launch(q, interpret, block_q, block_k, num_warps, num_stages) -> dict:
  """The launch settings (given, or `pallas_online.TILE_TABLE`'s) and interpret mode."""
  block_q, block_k, num_warps, num_stages = pallas_online.launch_settings(
      max(MIN_TILE, _pow2(q.shape[-1])), q.dtype, block_q, block_k, num_warps, num_stages,
      MIN_TILE)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return dict(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
              interpret=bool(interpret))


def _run(q, k, v, key_mask, patterns, interpret, block_q, block_k, num_warps,
         num_stages) -> jax.Array:
  return _attend(q, k, v, key_mask, patterns=tuple(patterns),
                 **_launch(q, interpret, block_q, block_k, num_warps, num_stages))


# --- The kinds. ---

def block_local_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_size: int,
                          causal: bool = False, key_mask: jax.Array | None = None,
                          interpret: bool | None = None, block_q: int | None = None,
                          block_k: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None) -> jax.Array:
  """Contiguous-block local attention (`masks.block_local_mask`) on the Pallas kernel;
  arguments as `attention.sparse_patterns.block_local_attention`."""
  _, _, h = validation.check_self_qkv(q, k, v, key_mask)
  return _run(q, k, v, key_mask, splash_masks.block_local_patterns(block_size, causal, h),
              interpret, block_q, block_k, num_warps, num_stages)


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, pattern: str, stride: int,
                     summary_width: int | None = None, causal: bool = False,
                     key_mask: jax.Array | None = None, block_size: int | None = None,
                     num_summary_offsets: int | None = None, interpret: bool | None = None,
                     block_q: int | None = None, block_k: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
  """Sparse Transformer strided / fixed attention on the Pallas kernel; arguments as
  `attention.sparse_patterns.sparse_attention` (`block_size`, the xla compute block, is checked
  and ignored). Equal to `dot_product_attention` with `masks.strided_mask` /
  `masks.fixed_mask(..., num_heads=H)`."""
  _, _, h = validation.check_self_qkv(q, k, v, key_mask)
  patterns = splash_masks.sparse_patterns(pattern, stride, summary_width, num_summary_offsets,
                                          block_size, causal, h)
  if pattern == "strided":
    return _strided(q, k, v, key_mask, stride=int(stride), causal=bool(causal),
                    **_launch(q, interpret, block_q, block_k, num_warps, num_stages))
  return _run(q, k, v, key_mask, patterns, interpret, block_q, block_k, num_warps, num_stages)


def bigbird_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_size: int,
                      num_global_blocks: int = 2, num_random_blocks: int = 3, seed: int,
                      key_mask: jax.Array | None = None, random_blocks: str = "drawn",
                      interpret: bool | None = None, block_q: int | None = None,
                      block_k: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None) -> jax.Array:
  """BigBird ITC attention on the Pallas kernel, per-head random blocks; arguments as
  `attention.sparse_patterns.bigbird_attention` (drawn random blocks only). Equal to
  `dot_product_attention` with `masks.bigbird_mask(..., num_heads=H)`."""
  validation.drawn_random_blocks(random_blocks, "pallas")
  _, length, h = validation.check_self_qkv(q, k, v, key_mask)
  patterns = splash_masks.bigbird_patterns(length, block_size, num_global_blocks,
                                           num_random_blocks, seed, h)
  return _run(q, k, v, key_mask, patterns, interpret, block_q, block_k, num_warps, num_stages)


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, layout: np.ndarray,
                           block_size: int, causal: bool = False,
                           key_mask: jax.Array | None = None, interpret: bool | None = None,
                           block_q: int | None = None, block_k: int | None = None,
                           num_warps: int | None = None,
                           num_stages: int | None = None) -> jax.Array:
  """Attention over a static block layout on the Pallas kernel; arguments as
  `attention.block_sparse.block_sparse_attention`. Equal to `dot_product_attention` with
  `masks.block_layout_mask(layout, block_size, L)` (and causal, key_mask); a query with no
  allowed real key outputs 0."""
  _, length, h = validation.check_self_qkv(q, k, v, key_mask)
  block = validation.positive_int("block_size", block_size)
  layout = check_layout(layout, num_blocks=-(-length // block), num_heads=h, length=length,
                        block_size=block)
  per_head = np.broadcast_to(layout, (h,) + layout.shape[-2:])
  return _run(q, k, v, key_mask, splash_masks.layout_patterns(per_head, block, bool(causal)),
              interpret, block_q, block_k, num_warps, num_stages)


__all__ = ["bigbird_attention", "block_local_attention", "block_sparse_attention",
           "padded_length", "sparse_attention", "tile_lists"]
