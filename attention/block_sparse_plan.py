"""Static planning for block-sparse attention: which key blocks each query block reads, and how.

Everything here runs in numpy before tracing, once per layout (plans are cached by content):

  1. Rows (query blocks) are grouped into at most `MAX_BUCKETS` buckets of similar block count,
     so a causal layout (rows of 1 .. nkb blocks) is not padded to its longest row everywhere.
  2. Inside a bucket, each row's key blocks are assigned to K slots. A slot is either
       * a shift `d`: every row n reads block n + d (a band diagonal) - one static slice;
       * a constant `m`: every row reads block m (a global block) - one broadcast;
       * a one-hot slot: rows read unrelated blocks (BigBird's random blocks) - one matmul with
         a static one-hot `[rows, slots, nkb]` matrix;
       * "all": when every row of the bucket reads at least `ALL_SHARE` of the key blocks (global
         query blocks, the last rows of a causal layout), the bucket reads the whole key
         sequence once, a transpose broadcast to its rows, and masks the blocks it must skip.
         Per-block slots there would each cost a full-size gradient buffer in the backward
         pass (the transpose of a slice is a padded copy), dozens of them per global row.
     Shifts and constants are chosen greedily while they serve at least half of the
     (head, row) pairs; rows they do not serve have that slot masked out.
  3. Static token positions of every query row and key slot feed the causal rule and the
     optional token-level predicate of the pattern fronts.

So the assembled keys cost a few slices per bucket, plus, for irregular blocks only, a one-hot
matmul of `rows * slots * nkb * block * head_dim` multiply-adds.

When one row's scores alone fill a scan step (`STREAM_ROW_ELEMENTS`; BigBird, block-sparse and
block-local at LRA sizes), a bucket is *streamed* instead: its scan takes one row per step and
reads that row's key blocks with dynamic slices at the block indices of `idx` (one slice per
slot, one per head and slot for per-head slots), and the backward pass adds their gradients into
a key-sized accumulator. Nothing of size `rows * slots * block` is materialised, and no one-hot
matmul is needed; the slices are dynamic-slices, not gathers.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any, Callable, Sequence

import numpy as np

MAX_BUCKETS = 4          # most row buckets per layout; each adds one scan to the graph
CHUNK_SCORE_ELEMENTS = 1 << 19  # score elements per scan step, so that they stay in cache
STREAM_ROW_ELEMENTS = 1 << 19   # a bucket whose one row has this many scores reads its key
                                # blocks inside the scan, one row per step (see below)
STRUCTURED_SHARE = 0.5   # a shift/constant slot must serve this share of (head, row) pairs
ALL_SHARE = 0.75         # a bucket whose every row reads this share of the key blocks reads all


class Static:
  """Hashable-by-key holder of static (numpy) data, usable as a jit static argument."""

  def __init__(self, key: Any, **fields: Any) -> None:
    self._key = key
    self.__dict__.update(fields)

  def __hash__(self) -> int:
    return hash(self._key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Static) and self._key == other._key


def digest(*parts: Any) -> str:
  """A content hash of numpy arrays and reprs, used as plan identity."""
  h = hashlib.sha1()
  for p in parts:
    h.update(np.ascontiguousarray(p).tobytes() if isinstance(p, np.ndarray) else repr(p).encode())
    h.update(b"|")
  return h.hexdigest()


def bucket_rows(counts: np.ndarray, max_buckets: int = MAX_BUCKETS) -> list[list[int]]:
  """Splits the non-empty rows, sorted by block count, into <= max_buckets groups.

  Minimises the padded work sum(len(group) * max count in group) by dynamic programming, and
  uses the fewest buckets within 3% of the best.
  """
  rows = [int(n) for n in np.argsort(counts, kind="stable") if counts[n] > 0]
  if not rows:
    return []
  c = [int(counts[n]) for n in rows]
  n = len(rows)
  inf = float("inf")
  best = [[inf] * (n + 1) for _ in range(max_buckets + 1)]
  cut = [[0] * (n + 1) for _ in range(max_buckets + 1)]
  best[0][0] = 0.0
  for g in range(1, max_buckets + 1):
    for end in range(1, n + 1):
      for start in range(end):
        cost = best[g - 1][start] + (end - start) * c[end - 1]
        if cost < best[g][end]:
          best[g][end], cut[g][end] = cost, start
  floor = min(best[g][n] for g in range(1, max_buckets + 1))
  groups = next(g for g in range(1, max_buckets + 1) if best[g][n] <= 1.03 * floor)
  bounds, end = [], n
  for g in range(groups, 0, -1):
    start = cut[g][end]
    bounds.append((start, end))
    end = start
  return [sorted(rows[a:b]) for a, b in reversed(bounds)]


def assign_slots(
    sets: Sequence[Sequence[set[int]]], rows: Sequence[int],
    num_key_blocks: int) -> tuple[tuple, np.ndarray | None, np.ndarray, np.ndarray]:
  """Assigns the key blocks of a bucket to shift, constant and one-hot slots.

  Args:
    sets: `sets[h][i]`, the set of key blocks of head h and row `rows[i]`.
    rows: the query blocks of the bucket.
    num_key_blocks: nkb.

  Returns:
    (slots, onehot, idx, ok): `slots` a tuple of ("shift", d, take_indices) / ("const", m), or
    just (("all",),);
    `onehot` float32 `[Hl, R, J, nkb]` or None; `idx` int `[Hl, R, K]`, the key block read by
    every slot (K = len(slots) + J); `ok` bool `[Hl, R, K]`, whether that block is in the layout.
  """
  hl, r = len(sets), len(rows)
  if min(len(s) for head in sets for s in head) >= ALL_SHARE * num_key_blocks:
    idx = np.broadcast_to(np.arange(num_key_blocks), (hl, r, num_key_blocks))
    ok = np.array([[[m in s for m in range(num_key_blocks)] for s in head] for head in sets])
    return (("all",),), None, idx, ok
  left = [[set(s) for s in head] for head in sets]
  rows_arr = np.asarray(rows)
  slots, cols, oks = [], [], []
  while True:
    shift, const = collections.Counter(), collections.Counter()
    for h in range(hl):
      for i, n in enumerate(rows):
        for m in left[h][i]:
          shift[m - n] += 1
          const[m] += 1
    if not shift:
      break
    (d, n_shift), = shift.most_common(1)
    (m, n_const), = const.most_common(1)
    if max(n_shift, n_const) < STRUCTURED_SHARE * hl * r:
      break
    if n_shift >= n_const:
      col = np.clip(rows_arr + d, 0, num_key_blocks - 1)
      slots.append(("shift", int(d), tuple(int(c) for c in col)))
    else:
      col = np.full(r, m)
      slots.append(("const", int(m)))
    want = rows_arr + d if n_shift >= n_const else col                   # [R], may leave 0..nkb
    ok = np.zeros((hl, r), bool)
    for h in range(hl):
      for i in range(r):
        ok[h, i] = int(want[i]) in left[h][i]
        if ok[h, i]:
          left[h][i].discard(int(want[i]))
    cols.append(np.broadcast_to(col, (hl, r)))
    oks.append(ok)
  extra = max(len(s) for head in left for s in head)
  onehot = None
  if extra:
    onehot = np.zeros((hl, r, extra, num_key_blocks), np.float32)
    col = np.zeros((hl, r, extra), np.int64)
    ok = np.zeros((hl, r, extra), bool)
    for h in range(hl):
      for i in range(r):
        for j, m in enumerate(sorted(left[h][i])):
          onehot[h, i, j, m] = 1.0
          col[h, i, j], ok[h, i, j] = m, True
    cols.extend(np.moveaxis(col, 2, 0))
    oks.extend(np.moveaxis(ok, 2, 0))
  idx = np.stack(cols, axis=-1)                                           # [Hl, R, K]
  return tuple(slots), onehot, idx, np.stack(oks, axis=-1)


_PLANS: dict = {}


def make_plan(layout: np.ndarray, *, q_block: int, k_block: int, causal: bool = False,
              q_pos: np.ndarray | None = None, k_pos: np.ndarray | None = None,
              pair: Callable[[Any, Any], Any] | None = None, batch_heads: int = 1,
              max_buckets: int = MAX_BUCKETS) -> Static:
  """Plans block-sparse attention for a static layout `[nqb, nkb]` or `[H, nqb, nkb]`.

  `q_pos`/`k_pos` are the token positions of the blocked query and key sequences (default:
  0, 1, ...); `causal` (query position >= key position) and `pair` (a hashable callable
  `(qpos, kpos) -> bool` on broadcastable int arrays) act on them. `batch_heads` (batch size
  times heads) sets how many rows one scan step handles.
  """
  layout = np.asarray(layout, bool)
  if layout.ndim == 2:
    layout = layout[None]
  if layout.shape[0] > 1 and (layout == layout[:1]).all():
    layout = layout[:1]
  hl, nqb, nkb = layout.shape
  q_pos = np.arange(nqb * q_block) if q_pos is None else np.asarray(q_pos)
  k_pos = np.arange(nkb * k_block) if k_pos is None else np.asarray(k_pos)
  key = digest(layout, q_block, k_block, causal, q_pos, k_pos, pair, batch_heads, max_buckets,
               CHUNK_SCORE_ELEMENTS, STREAM_ROW_ELEMENTS)
  if key not in _PLANS:
    _PLANS[key] = _build(key, layout, q_block, k_block, causal, q_pos, k_pos, pair, batch_heads,
                         max_buckets)
  return _PLANS[key]


def _build(key, layout, q_block, k_block, causal, q_pos, k_pos, pair, batch_heads, max_buckets):
  hl, nqb, nkb = layout.shape
  qpos_b = q_pos.reshape(nqb, q_block).astype(np.int32)
  kpos_b = k_pos.reshape(nkb, k_block).astype(np.int32)
  counts = layout.sum(axis=2).max(axis=0)                                 # [nqb]
  buckets = []
  for rows in bucket_rows(counts, max_buckets):
    sets = [[set(np.flatnonzero(layout[h, n]).tolist()) for n in rows] for h in range(hl)]
    slots, onehot, idx, ok = assign_slots(sets, rows, nkb)
    r, k = len(rows), idx.shape[-1]
    row_scores = batch_heads * q_block * k * k_block
    stream = slots != (("all",),) and row_scores >= STREAM_ROW_ELEMENTS
    chunk = 1 if stream else max(1, min(r, CHUNK_SCORE_ELEMENTS // row_scores))
    rows_padded = -(-r // chunk) * chunk
    pad = [(0, rows_padded - r)]
    kpos = kpos_b[idx].reshape(hl, r, k * k_block).transpose(1, 0, 2)   # [R, Hl, K*bk]
    buckets.append(Static(
        (key, len(buckets)), rows=tuple(rows), slots=slots, onehot=onehot, num_slots=k,
        chunk=chunk, all_slots=bool(ok.all()), causal=causal, pair=pair, stream=stream,
        idx=np.pad(idx.transpose(1, 0, 2), pad + [(0, 0)] * 2).astype(np.int32),  # [R', Hl, K]
        uniform=tuple(bool((idx[:, :, s] == idx[:1, :, s]).all()) for s in range(k)),
        slot_ok=np.repeat(ok, k_block, axis=-1).transpose(1, 0, 2),         # [R, Hl, K*bk]
        qpos=np.pad(qpos_b[list(rows)], pad + [(0, 0)])[:, None, None, :, None],  # [R', 1, 1, bq, 1]
        kpos=np.pad(kpos, pad + [(0, 0)] * 2)[:, None, :, None, :]))       # [R', 1, Hl, 1, K*bk]
  order = [n for b in buckets for n in b.rows]
  position = {n: i for i, n in enumerate(order)}
  unpermute = tuple(position.get(n, len(order)) for n in range(nqb))     # empty rows: filler
  return Static(key, num_heads=hl, nqb=nqb, nkb=nkb, q_block=q_block, k_block=k_block,
                buckets=tuple(buckets), has_empty=len(order) < nqb, unpermute=unpermute,
                num_blocks=int(layout.sum()),
                computed_blocks=sum(len(b.rows) * b.num_slots for b in buckets) * hl)
