"""Splash-attention masks built at block granularity from a kind's own pattern.

The TPU splash kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) reads a mask as a
`MaskInfo`: per (head, query tile, key tile) a class (0 empty: skipped, 1 partial: a stored
`[block_q, block_kv]` boolean tile is applied, 2 full), the key tile to fetch at each grid step
and the index of the stored tile. Splash's own `process_mask` builds it by slicing a mask object
tile by tile in a Python loop over every (head mask, query tile, key tile), which at 65,536
tokens and eight heads is millions of slices, and a `NumpyMask` would hold `L x L` booleans.

Here each head's pattern is a small hashable object (`BandPattern`, `LayoutPattern`, ...) that
knows its (query, key) rule and, vectorised over all tiles at once, gives every tile a key:
EMPTY or FULL when that is clear from the tile's position (the band is out of reach, the tile
lies inside the band), else an integer such that two tiles with the same key have the same
contents (for translation-invariant patterns the tile's diagonal offset; for block layouts a
hash of the tile). Only one tile per distinct key is evaluated, so a band at any length costs
a few dozen tile evaluations per dilation value. The `MaskInfo` arrays (the "next non-empty
tile" pointers, the grid shrunk to the longest row, the transposed version of the dK/dV pass)
are then derived with numpy array operations, following `process_mask`'s conventions exactly
(`tests/splash_test.py` compares the two). Rows of tiles that hold no allowed pair are given one
all-masked tile, so every query row runs at least one tile and stays finite; the attention
fronts (`attention.splash`) zero the rows that have no allowed key.

Built masks are cached per static configuration (`mask_infos` is an `lru_cache` on the
hashable patterns and sizes).

Where splash's public mask classes express every head's pattern, they are used instead
(`public_mask`): dense (`FullMask`), causal (`CausalMask`) and the band without dilation
(`LocalMask`), one per head in a `MultiHeadMask`, for a layer without appended columns (band
global tokens). Splash then builds the `MaskInfo` itself (`make_splash_mha`), deduplicating
equal heads, and for a single causal or local mask computes the partial tiles' mask inside the
kernel from positions instead of storing tiles. Dilated bands, appended global columns,
block-local, strided, fixed, BigBird and block layouts have no public class short of an
`L x L` `NumpyMask`, so they keep the `MaskInfo` built here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _public

from attention import masks, validation

EMPTY, FULL = -1, -2
_OFF = 1 << 32   # shifts a diagonal offset (|offset| < 2^32) to a non-negative key


def _diagonals(q0: np.ndarray, k0: np.ndarray, bq: int,
               bkv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(offset q0 - k0, smallest i - j, largest i - j) of every tile, `[nq, nk]` int64."""
  delta = q0.astype(np.int64) - k0.astype(np.int64)
  return delta, delta - (bkv - 1), delta + (bq - 1)


class Pattern:
  """One head's allowed (query, key) pairs on positions, and tile keys for deduplication."""

  def allowed(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """bool, broadcast of `i` (query positions) and `j` (key positions)."""
    raise NotImplementedError

  def keys(self, q0: np.ndarray, k0: np.ndarray, bq: int, bkv: int) -> np.ndarray:
    """int64 `[nq, nk]` for tiles starting at `q0 [nq, 1]`, `k0 [1, nk]`: EMPTY, FULL, or a
    key >= 0 with equal keys meaning equal tile contents."""
    raise NotImplementedError

  def tile(self, q0: int, k0: int, bq: int, bkv: int) -> np.ndarray:
    return np.asarray(self.allowed(q0 + np.arange(bq)[:, None], k0 + np.arange(bkv)[None, :]))


@dataclasses.dataclass(frozen=True)
class DensePattern(Pattern):
  """Every pair (causal: j <= i)."""
  causal: bool = False

  def allowed(self, i, j):
    return (i >= j) if self.causal else np.ones(np.broadcast_shapes(np.shape(i), np.shape(j)),
                                                 bool)

  def keys(self, q0, k0, bq, bkv):
    delta, lo, hi = _diagonals(q0, k0, bq, bkv)
    if not self.causal:
      return np.full(delta.shape, FULL, np.int64)
    return np.where(hi < 0, EMPTY, np.where(lo >= 0, FULL, delta + _OFF))


@dataclasses.dataclass(frozen=True)
class BandPattern(Pattern):
  """Longformer band: |i - j| <= window * dilation, dilation | (i - j) (causal: j <= i)."""
  window: int
  dilation: int = 1
  causal: bool = False

  def allowed(self, i, j):
    rel = i - j
    ok = (np.abs(rel) <= self.window * self.dilation) & (rel % self.dilation == 0)
    return ok & (rel >= 0) if self.causal else ok

  def keys(self, q0, k0, bq, bkv):
    delta, lo, hi = _diagonals(q0, k0, bq, bkv)
    reach = self.window * self.dilation
    empty = (hi < -reach) | (lo > reach) | ((hi < 0) if self.causal else False)
    full = (lo >= (0 if self.causal else -reach)) & (hi <= reach) & (self.dilation == 1)
    return np.where(empty, EMPTY, np.where(full, FULL, delta + _OFF))


@dataclasses.dataclass(frozen=True)
class BlockLocalPattern(Pattern):
  """Contiguous blocks: i // size == j // size (causal: j <= i)."""
  size: int
  causal: bool = False

  def allowed(self, i, j):
    ok = (i // self.size) == (j // self.size)
    return ok & (i >= j) if self.causal else ok

  def keys(self, q0, k0, bq, bkv):
    delta, lo, hi = _diagonals(q0, k0, bq, bkv)
    empty = (lo >= self.size) | (hi <= -self.size) | ((hi < 0) if self.causal else False)
    # The tile is fixed by its offset and where its first query falls inside a block.
    return np.where(empty, EMPTY, (delta + _OFF) * self.size + q0 % self.size)


@dataclasses.dataclass(frozen=True)
class StridedPattern(Pattern):
  """Sparse Transformer strided: |i - j| < stride or stride | (i - j) (causal: j <= i)."""
  stride: int
  causal: bool = False

  def allowed(self, i, j):
    rel = i - j
    ok = (np.abs(rel) < self.stride) | (rel % self.stride == 0)
    return ok & (rel >= 0) if self.causal else ok

  def keys(self, q0, k0, bq, bkv):
    delta, lo, hi = _diagonals(q0, k0, bq, bkv)
    near = (lo < self.stride) & (hi > -self.stride)
    # Away from the diagonal only stride | (i - j) is left: the offset mod stride fixes it.
    key = np.where(near, 2 * (delta + _OFF), 2 * (delta % self.stride) + 1)
    return np.where((hi < 0) if self.causal else False, EMPTY, key)


@dataclasses.dataclass(frozen=True)
class FixedPattern(Pattern):
  """Sparse Transformer fixed: same stride group, or j mod stride in [lo, lo + width)."""
  stride: int
  width: int
  lo: int
  causal: bool = False

  def allowed(self, i, j):
    col = j % self.stride
    ok = ((i // self.stride) == (j // self.stride)) | ((col >= self.lo)
                                                       & (col < self.lo + self.width))
    return ok & (i >= j) if self.causal else ok

  def keys(self, q0, k0, bq, bkv):
    delta, lo, hi = _diagonals(q0, k0, bq, bkv)
    near = (lo < self.stride) & (hi > -self.stride)   # a same-group pair is possible
    key = np.where(near, 2 * ((delta + _OFF) * self.stride + q0 % self.stride),
                   2 * (k0 % self.stride) + 1)        # far: summary columns only
    return np.broadcast_to(np.where((hi < 0) if self.causal else False, EMPTY, key),
                           delta.shape)


@dataclasses.dataclass(frozen=True)
class LayoutPattern(Pattern):
  """A block layout of `num_blocks` blocks of `block` tokens, stored as bytes (hashable):
  i and j below num_blocks * block, layout[i // block, j // block] (causal: j <= i)."""
  layout_bytes: bytes
  num_blocks: int
  block: int
  causal: bool = False

  @functools.cached_property
  def layout(self) -> np.ndarray:
    return np.frombuffer(self.layout_bytes, bool).reshape(self.num_blocks, self.num_blocks)

  def allowed(self, i, j):
    end = self.num_blocks * self.block
    bi = np.minimum(i // self.block, self.num_blocks - 1)
    bj = np.minimum(j // self.block, self.num_blocks - 1)
    ok = self.layout[bi, bj] & (i < end) & (j < end)
    return ok & (i >= j) if self.causal else ok

  def keys(self, q0, k0, bq, bkv):
    nb, s = self.num_blocks, self.block
    _, lo, hi = _diagonals(q0, k0, bq, bkv)
    r0, r1 = np.minimum(q0 // s, nb), np.minimum((q0 + bq - 1) // s, nb - 1)
    c0, c1 = np.minimum(k0 // s, nb), np.minimum((k0 + bkv - 1) // s, nb - 1)
    prefix = np.zeros((nb + 1, nb + 1), np.int64)
    prefix[1:, 1:] = np.cumsum(np.cumsum(self.layout, 0), 1)
    count = (prefix[r1 + 1, c1 + 1] - prefix[r0, c1 + 1] - prefix[r1 + 1, c0] + prefix[r0, c0])
    count = np.where((r0 < nb) & (c0 < nb), count, 0)
    inside = (q0 + bq <= nb * s) & (k0 + bkv <= nb * s)
    full = inside & (count == (r1 - r0 + 1) * (c1 - c0 + 1))
    if self.causal:
      full &= lo >= 0
    empty = (count == 0) | ((hi < 0) if self.causal else False)
    keys = np.where(empty, EMPTY, np.where(full, FULL, 0)).astype(np.int64)
    qi, ki = np.nonzero(keys == 0)                  # mixed tiles: key by what fixes them
    if qi.size:
      keys[qi, ki] = self._signatures(q0[qi, 0], k0[0, ki], bq, bkv)
    return keys

  def _signatures(self, q0: np.ndarray, k0: np.ndarray, bq: int, bkv: int) -> np.ndarray:
    """Ids of tiles starting at `q0`, `k0` (1-D): equal for tiles with equal contents, from
    where their first query and key fall in a block, the layout entries they cover and, for
    a causal tile across the diagonal, its offset."""
    nb, s = self.num_blocks, self.block
    rows, cols = (bq - 1) // s + 2, (bkv - 1) // s + 2     # most blocks a tile can touch
    padded = np.zeros((nb + rows, nb + cols), bool)
    padded[:nb, :nb] = self.layout
    r = q0[:, None] // s + np.arange(rows)
    c = k0[:, None] // s + np.arange(cols)
    used_r = np.arange(rows) <= ((q0 % s + bq - 1) // s)[:, None]
    used_c = np.arange(cols) <= ((k0 % s + bkv - 1) // s)[:, None]
    bits = padded[r[:, :, None], c[:, None, :]] & used_r[:, :, None] & used_c[:, None, :]
    delta, lo, hi = _diagonals(q0, k0, bq, bkv)
    across = np.where((lo < 0) & (hi >= 0), delta + _OFF, 0) if self.causal else 0 * delta
    fields = np.stack([q0 % s, k0 % s, across], axis=1).astype(np.int64)
    rows_bytes = np.concatenate([fields.view(np.uint8).reshape(len(q0), -1),
                                 np.packbits(bits.reshape(len(q0), -1), axis=1)], axis=1)
    return np.unique(rows_bytes, axis=0, return_inverse=True)[1].reshape(-1)


def layout_patterns(layout: np.ndarray, block: int, causal: bool) -> tuple[LayoutPattern, ...]:
  """One `LayoutPattern` per head of a bool `[H, nb, nb]` layout."""
  layout = np.ascontiguousarray(layout, bool)
  return tuple(LayoutPattern(x.tobytes(), x.shape[0], int(block), bool(causal)) for x in layout)


# --- Each kind's patterns from its arguments (shared by the splash and Pallas fronts). ---

def block_local_patterns(block_size: int, causal: bool, num_heads: int
                         ) -> tuple[BlockLocalPattern, ...]:
  """Contiguous-block local attention (`masks.block_local_mask`), every head alike."""
  return (BlockLocalPattern(validation.positive_int("block_size", block_size), bool(causal)),) * num_heads


def sparse_patterns(pattern: str, stride: int, summary_width: int | None,
                    num_summary_offsets: int | None, block_size: int | None, causal: bool,
                    num_heads: int) -> tuple[Pattern, ...]:
  """Sparse Transformer strided or fixed heads, with the arguments of
  `attention.sparse_patterns.sparse_attention` checked (`block_size`, the xla path's compute
  block, is checked and not used)."""
  if pattern not in ("strided", "fixed"):
    raise ValueError(f"unknown sparse pattern {pattern!r}; valid patterns: strided, fixed.")
  stride = validation.positive_int("stride", stride)
  if block_size is not None:
    validation.positive_int("block_size", block_size)
  if pattern == "strided":
    if summary_width is not None or num_summary_offsets is not None:
      raise ValueError("summary_width and num_summary_offsets apply to pattern='fixed' only.")
    return (StridedPattern(stride, bool(causal)),) * num_heads
  width = max(1, stride // 8) if summary_width is None else validation.positive_int(
      "summary_width", summary_width)
  offsets = masks.fixed_summary_offsets(stride=stride, summary_width=width, num_heads=num_heads,
                                        num_summary_offsets=num_summary_offsets)
  return tuple(FixedPattern(stride, width, lo, bool(causal)) for lo in offsets)


def bigbird_patterns(length: int, block_size: int, num_global_blocks: int,
                     num_random_blocks: int, seed: int, num_heads: int
                     ) -> tuple[LayoutPattern, ...]:
  """BigBird's ITC layout (`masks.bigbird_block_pattern`, random blocks per head) as patterns."""
  block = validation.positive_int("block_size", block_size)
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed must be an int (it fixes the random blocks), got {seed!r}.")
  return _bigbird_patterns(-(-length // block), block, num_global_blocks, num_random_blocks,
                           int(seed), num_heads)


@functools.lru_cache(maxsize=32)
def _bigbird_patterns(num_blocks: int, block: int, num_global_blocks: int,
                      num_random_blocks: int, seed: int,
                      num_heads: int) -> tuple[LayoutPattern, ...]:
  layout = masks.bigbird_block_pattern(num_blocks, num_global_blocks=num_global_blocks,
                                       num_random_blocks=num_random_blocks, seed=seed,
                                       num_heads=num_heads)
  return layout_patterns(layout, block, causal=False)


def public_mask(patterns: tuple[Pattern, ...], q_len: int, kv_len: int,
                main_len: int) -> _public.MultiHeadMask | None:
  """Splash's public mask of one pattern per head over padded lengths `q_len x kv_len`, or None
  when a head's pattern has no public class (or there are appended columns, `main_len <
  kv_len`)."""
  if main_len != kv_len:
    return None
  shape, heads = (q_len, kv_len), []
  for p in patterns:
    if type(p) is DensePattern:
      heads.append(_public.CausalMask(shape) if p.causal else _public.FullMask(shape))
    elif type(p) is BandPattern and p.dilation == 1:      # |i - j| <= w (causal: j <= i)
      heads.append(_public.LocalMask(shape, (p.window, 0 if p.causal else p.window), 0))
    else:
      return None
  return _public.MultiHeadMask(tuple(heads))


class MaskInfo(NamedTuple):
  """The fields of splash's `MaskInfo` that this module builds, as numpy arrays."""
  data_next: np.ndarray
  mask_next: np.ndarray | None
  block_mask: np.ndarray
  partial_mask_blocks: np.ndarray | None


def _downcast(x: np.ndarray) -> np.ndarray:
  top = int(x.max()) if x.size else 0
  for dtype in (np.int8, np.int16):
    if top <= np.iinfo(dtype).max:
      return x.astype(dtype)
  return x.astype(np.int32)


def classify(patterns: tuple[Pattern, ...], nq: int, nk: int, nk_main: int, bq: int,
             bkv: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], np.ndarray]:
  """Tile classes and stored-tile ids of each distinct pattern.

  Returns (class int8 `[U, nq, nk]`, tile id int32 `[U, nq, nk]` (-1: none), the stored tiles,
  head -> distinct pattern index). Key tiles from `nk_main` on are full (appended columns).
  """
  unique = list(dict.fromkeys(patterns))
  head_to_unique = np.array([unique.index(p) for p in patterns])
  cls = np.zeros((len(unique), nq, nk), np.int8)
  ids = np.full((len(unique), nq, nk), -1, np.int32)
  stored: dict[bytes, int] = {}
  tiles: list[np.ndarray] = []

  def store(tile: np.ndarray) -> int:
    key = tile.tobytes()
    if key not in stored:
      stored[key] = len(tiles)
      tiles.append(tile)
    return stored[key]

  q0 = (np.arange(nq) * bq)[:, None]
  k0 = (np.arange(nk_main) * bkv)[None, :]
  for u, pattern in enumerate(unique):
    keys = np.broadcast_to(pattern.keys(q0, k0, bq, bkv), (nq, nk_main)).reshape(-1)
    cls[u, :, :nk_main] = np.where(keys == FULL, 2, 0).reshape(nq, nk_main)
    cls[u, :, nk_main:] = 2
    where = np.flatnonzero(keys >= 0)
    if where.size:
      distinct, first, inverse = np.unique(keys[where], return_index=True, return_inverse=True)
      kcls = np.zeros(len(distinct), np.int8)
      kid = np.full(len(distinct), -1, np.int32)
      for t in np.argsort(first, kind="stable"):          # first appearance, row-major
        qi, ki = divmod(int(where[first[t]]), nk_main)
        tile = pattern.tile(int(q0[qi, 0]), int(k0[0, ki]), bq, bkv)
        if tile.all():
          kcls[t] = 2
        elif tile.any():
          kcls[t], kid[t] = 1, store(tile)
      rows, cols = np.divmod(where, nk_main)
      cls[u, rows, cols] = kcls[inverse]
      ids[u, rows, cols] = kid[inverse]
    # A row of tiles with nothing allowed still runs one all-masked tile (finite outputs).
    for qi in np.flatnonzero(~cls[u].any(axis=1)):
      ki = min(qi * bq // bkv, nk - 1)
      cls[u, qi, ki], ids[u, qi, ki] = 1, store(np.zeros((bq, bkv), bool))
  return cls, ids, tiles, head_to_unique


def _info(cls: np.ndarray, ids: np.ndarray, tiles: list[np.ndarray], *, dkv: bool,
          shrink: bool) -> MaskInfo:
  """`MaskInfo` of tile classes `[Hm, nq, nk]`.

  The kernel's grid runs in order (head, q, kv), or (kv, head, q) for the dK/dV pass, whose
  pointers name query tiles and whose stored tiles are transposed. At each grid step
  `data_next` is the tile to fetch: the first non-empty one at or after the step, wrapping
  around, and `mask_next` likewise the first partial one's stored tile. `shrink` keeps only
  the non-empty steps of each row (column for dK/dV, padded in front), padded to the longest.
  """
  hm, nq, nk = cls.shape
  order = (2, 0, 1) if dkv else (0, 1, 2)
  grid = tuple(cls.shape[a] for a in order)
  c = np.ascontiguousarray(cls.transpose(order)).reshape(-1)
  t = np.ascontiguousarray(ids.transpose(order)).reshape(-1)
  hits = np.flatnonzero(c)
  partial = np.flatnonzero(c == 1)
  steps = hits if shrink else np.arange(c.size)

  def first_at_or_after(among: np.ndarray) -> np.ndarray:
    return among[np.searchsorted(among, steps) % among.size]

  data_next = first_at_or_after(hits) % grid[2]            # the tile's coordinate on its axis
  mask_next = t[first_at_or_after(partial)] if tiles else None
  block_mask = c[steps]
  if not shrink:
    back = np.argsort(order)
    unflat = lambda x: x.reshape(grid).transpose(back)
    block_mask, data_next = unflat(block_mask), unflat(data_next)
    mask_next = None if mask_next is None else unflat(mask_next)
  else:
    row = hits // grid[2]                                     # (head, q) or (kv, head)
    start = np.searchsorted(row, row, side="left")
    rank = np.arange(hits.size) - start
    count = np.searchsorted(row, row, side="right") - start
    width = int(count.max())
    if dkv:
      kv, head = np.divmod(row, hm)
      index = (head, width - count + rank, kv)                # padding before the tiles
      shape = (hm, width, nk)
    else:
      head, q = np.divmod(row, nq)
      index, shape = (head, q, rank), (hm, nq, width)

    def scatter(x):
      out = np.zeros(shape, np.int32)
      out[index] = x
      return out

    block_mask, data_next = scatter(block_mask), scatter(data_next)
    mask_next = None if mask_next is None else scatter(mask_next)
  blocks = None
  if tiles:
    blocks = np.stack(tiles).astype(bool)
    blocks = np.swapaxes(blocks, -1, -2) if dkv else blocks
  return MaskInfo(_downcast(data_next.astype(np.int32)),
                  None if mask_next is None else _downcast(mask_next.astype(np.int32)),
                  _downcast(block_mask.astype(np.int32)), blocks)


@functools.lru_cache(maxsize=32)
def mask_infos(patterns: tuple[Pattern, ...], q_len: int, kv_len: int, main_len: int, bq: int,
               bkv: int, shrink: bool = True) -> tuple[MaskInfo, MaskInfo]:
  """(forward and dQ `MaskInfo`, dK/dV `MaskInfo`) of one pattern per head.

  Args:
    patterns: one `Pattern` per head (equal patterns share their arrays; when all heads are
      equal the arrays have a head dimension of 1, broadcast by the kernel).
    q_len, kv_len: padded lengths, multiples of `bq` and `bkv`.
    main_len: keys from `main_len` on are appended columns every query may attend (their
      validity comes from segment ids); `kv_len` when there are none.
    bq, bkv: the kernel's query and key tile sizes.
    shrink: drop empty tiles from the grid (`process_mask`'s grid shrinking, here per head).
  """
  if q_len % bq or kv_len % bkv or main_len % bkv:
    raise ValueError(f"lengths ({q_len}, {kv_len}, {main_len}) must be multiples of the tiles "
                     f"({bq}, {bkv}).")
  cls, ids, tiles, head_to_unique = classify(patterns, q_len // bq, kv_len // bkv,
                                              main_len // bkv, bq, bkv)
  if cls.shape[0] > 1:
    cls, ids = cls[head_to_unique], ids[head_to_unique]
  return (_info(cls, ids, tiles, dkv=False, shrink=shrink),
          _info(cls, ids, tiles, dkv=True, shrink=shrink))


def dense_mask(info: MaskInfo, num_heads: int, q_len: int, kv_len: int, bq: int,
               bkv: int) -> np.ndarray:
  """bool `[H, q_len, kv_len]`: the pairs a forward `MaskInfo` lets through (for tests and
  small inputs; the inverse of `mask_infos`)."""
  out = np.zeros((num_heads, q_len, kv_len), bool)
  for h in range(num_heads):
    hh = 0 if info.block_mask.shape[0] == 1 else h
    for qi in range(info.block_mask.shape[1]):
      for step in range(info.block_mask.shape[2]):
        kind = int(info.block_mask[hh, qi, step])
        if kind == 0:
          continue
        ki = int(info.data_next[hh, qi, step])
        rows, cols = slice(qi * bq, (qi + 1) * bq), slice(ki * bkv, (ki + 1) * bkv)
        out[h, rows, cols] = (True if kind == 2 else
                              info.partial_mask_blocks[int(info.mask_next[hh, qi, step])])
  return out
