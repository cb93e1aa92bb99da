"""Block-sparse attention over a static block layout, computing only the blocks it needs.

A layout is a numpy bool array `[num_query_blocks, num_key_blocks]` (or one per head,
`[heads, nqb, nkb]`): query block n may attend key block m when `layout[n, m]`. The layout is
static (known at trace time), so the work is planned once, in numpy:

  * every query block gets the static list of its key blocks; rows are grouped into a few
    buckets of similar length (a causal layout has rows of 1 .. nkb blocks), and each bucket is
    padded to its own longest row K, so the padding waste stays small;
  * per bucket, the K key blocks of every query block are assembled by static slices and one
    concatenate (`static_take`: runs of consecutive blocks become one slice, repeated blocks a
    broadcast); its gradient is the matching static sum of slices. There is no gather and no
    `[L, L]` mask;
  * one batched einsum `[rows, block, K * block]` computes the scores; a fine mask inside the
    blocks applies padding slots, key padding and the sequence end, the causal diagonal, and an
    optional token-level predicate used by the pattern fronts (`attention.sparse_patterns`);
  * the softmax core has a hand-written backward pass (flash-style: recompute the scores, use the
    saved log-sum-exp), so the probabilities are never stored between forward and backward.

The cost is proportional to the number of non-empty blocks (plus the bucket padding). The
semantics are those of `dot_product_attention` with `masks.block_layout_mask(layout, ...)`.
"""

from __future__ import annotations

import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from attention import validation
from attention.dot_product import NEG_INF

MAX_BUCKETS = 4  # most row buckets per layout; each adds one einsum to the graph


# --- Static selection along an axis: slices, broadcasts and concatenates, never a gather. ---

def _take_pieces(x, idx: tuple, axis: int):
  """x taken at the static positions `idx` along `axis`, as one concatenate of slices."""
  pieces, i, n = [], 0, len(idx)
  while i < n:
    start, j = idx[i], i + 1
    if j < n and idx[j] == start:                       # repeated position: broadcast
      while j < n and idx[j] == start:
        j += 1
      piece = jax.lax.slice_in_dim(x, start, start + 1, axis=axis)
      piece = jnp.repeat(piece, j - i, axis=axis)
    else:                                               # consecutive positions: one slice
      while j < n and idx[j] == idx[j - 1] + 1:
        j += 1
      piece = jax.lax.slice_in_dim(x, start, start + (j - i), axis=axis)
    pieces.append(piece)
    i = j
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=axis)


def _untake(ct, idx: tuple, num_src: int, axis: int):
  """Transpose of `_take_pieces`: sums the cotangent slices back onto their source positions."""
  dests = [[] for _ in range(num_src)]
  for d, s in enumerate(idx):
    dests[s].append(d)
  shape = list(ct.shape)
  pieces, j = [], 0
  while j < num_src:
    first = dests[j]
    k = j + 1
    if not first:                                       # never taken: zeros
      while k < num_src and not dests[k]:
        k += 1
      shape[axis] = k - j
      pieces.append(jnp.zeros(shape, ct.dtype))
      j = k
      continue
    while (k < num_src and len(dests[k]) == len(first)
           and all(a == b + (k - j) for a, b in zip(dests[k], first))):
      k += 1
    length = k - j
    terms = []
    if length == 1:                                     # group contiguous destinations
      a = 0
      while a < len(first):
        b = a + 1
        while b < len(first) and first[b] == first[b - 1] + 1:
          b += 1
        part = jax.lax.slice_in_dim(ct, first[a], first[b - 1] + 1, axis=axis)
        terms.append(jnp.sum(part, axis=axis, keepdims=True) if b - a > 1 else part)
        a = b
    else:
      terms = [jax.lax.slice_in_dim(ct, d, d + length, axis=axis) for d in first]
    pieces.append(functools.reduce(jnp.add, terms))
    j = k
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _static_take_vjp(x, idx, axis, num_src):
  return _take_pieces(x, idx, axis)


def _static_take_fwd(x, idx, axis, num_src):
  return _take_pieces(x, idx, axis), None


def _static_take_bwd(idx, axis, num_src, _, ct):
  return (_untake(ct, idx, num_src, axis),)


_static_take_vjp.defvjp(_static_take_fwd, _static_take_bwd)


def static_take(x, idx, axis: int):
  """`jnp.take(x, idx, axis)` for a static index list, built from slices (gradient included)."""
  idx = tuple(int(i) for i in idx)
  if idx == tuple(range(x.shape[axis])):
    return x
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return _take_pieces(x, idx, axis)
  return _static_take_vjp(x, idx, axis, x.shape[axis])


# --- The plan: everything about a layout that is known before tracing. ---

class _Static:
  """Hashable-by-key holder of static (numpy) data, usable as a jit static argument."""

  def __init__(self, key, **fields):
    self._key = key
    self.__dict__.update(fields)

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _Static) and self._key == other._key


def _digest(*parts) -> str:
  h = hashlib.sha1()
  for p in parts:
    h.update(np.ascontiguousarray(p).tobytes() if isinstance(p, np.ndarray) else repr(p).encode())
    h.update(b"|")
  return h.hexdigest()


def _bucket_rows(counts: np.ndarray, max_buckets: int) -> list[list[int]]:
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


def make_plan(layout, *, q_block: int, k_block: int, causal: bool = False, q_pos=None,
              k_pos=None, pair=None, max_buckets: int = MAX_BUCKETS):
  """Plans block-sparse attention for a static layout `[nqb, nkb]` or `[H, nqb, nkb]`.

  `q_pos`/`k_pos` are the token positions of the blocked query and key sequences (default:
  0, 1, ...); `causal` and `pair` (a hashable callable `(qpos, kpos) -> bool`) act on them.
  """
  layout = np.asarray(layout, bool)
  if layout.ndim == 2:
    layout = layout[None]
  if layout.shape[0] > 1 and (layout == layout[:1]).all():
    layout = layout[:1]
  hl, nqb, nkb = layout.shape
  q_pos = np.arange(nqb * q_block) if q_pos is None else np.asarray(q_pos)
  k_pos = np.arange(nkb * k_block) if k_pos is None else np.asarray(k_pos)
  key = _digest(layout, q_block, k_block, causal, q_pos, k_pos, pair, max_buckets)
  return _make_plan_cached(key, layout, q_block, k_block, causal, q_pos, k_pos, pair,
                           max_buckets)


_PLANS: dict = {}


def _make_plan_cached(key, layout, q_block, k_block, causal, q_pos, k_pos, pair, max_buckets):
  if key in _PLANS:
    return _PLANS[key]
  hl, nqb, nkb = layout.shape
  qpos_b = q_pos.reshape(nqb, q_block).astype(np.int32)
  kpos_b = k_pos.reshape(nkb, k_block).astype(np.int32)
  lists = [[np.flatnonzero(layout[h, n]) for n in range(nqb)] for h in range(hl)]
  counts = np.array([max(len(lists[h][n]) for h in range(hl)) for n in range(nqb)])
  buckets = []
  for rows in _bucket_rows(counts, max_buckets):
    r, k = len(rows), int(counts[rows].max())
    idx = np.zeros((hl, r, k), np.int64)
    slot_ok = np.zeros((hl, r, k), bool)
    for h in range(hl):
      for i, n in enumerate(rows):
        blocks = lists[h][n]
        fill = blocks[-1] if len(blocks) else 0
        idx[h, i] = np.concatenate([blocks, np.full(k - len(blocks), fill)])
        slot_ok[h, i, :len(blocks)] = True
    kpos = kpos_b[idx].reshape(hl, r, k * k_block)                       # [Hl, R, K*bk]
    buckets.append(_Static(
        (key, len(buckets)), rows=tuple(rows), idx=idx, num_slots=k,
        slot_ok=np.repeat(slot_ok, k_block, axis=-1)[:, :, None, :],       # [Hl, R, 1, K*bk]
        qpos=qpos_b[list(rows)][None, :, :, None],                        # [1, R, bq, 1]
        kpos=kpos[:, :, None, :],                                          # [Hl, R, 1, K*bk]
        all_slots=bool(slot_ok.all()), causal=causal, pair=pair))
  order = [n for b in buckets for n in b.rows]
  empty = [n for n in range(nqb) if counts[n] == 0]
  position = {n: i for i, n in enumerate(order)}
  unpermute = tuple(position.get(n, len(order)) for n in range(nqb))     # filler at the end
  plan = _Static(key, layout=layout, num_heads=hl, nqb=nqb, nkb=nkb, q_block=q_block,
                 k_block=k_block, buckets=tuple(buckets), has_empty=bool(empty),
                 unpermute=unpermute, num_blocks=int(layout.sum()))
  _PLANS[key] = plan
  return plan


# --- The softmax core on assembled blocks, with a flash-style backward pass. ---

def _allowed(spec, key_ok):
  """Fine mask `[B|1, Hl|1, R, bq, K*bk]`: slot, key validity, causal and pair rules."""
  allowed = key_ok if spec.all_slots else key_ok & spec.slot_ok
  if spec.causal:
    allowed = allowed & (spec.qpos >= spec.kpos)
  if spec.pair is not None:
    allowed = allowed & spec.pair(spec.qpos, spec.kpos)
  return allowed


def _scores(qw, kw):
  scale = 1.0 / math.sqrt(qw.shape[-1])
  return jnp.einsum("bhrqd,bhrkd->bhrqk", qw, kw, preferred_element_type=jnp.float32) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(spec, qw, kw, vw, key_ok):
  return _attend_fwd(spec, qw, kw, vw, key_ok)[0]


def _attend_fwd(spec, qw, kw, vw, key_ok):
  allowed = _allowed(spec, key_ok)
  s = jnp.where(allowed, _scores(qw, kw), NEG_INF)                 # [B, H, R, bq, K*bk]
  row_max = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(allowed, jnp.exp(s - row_max), 0.0)
  row_sum = jnp.sum(p, axis=-1, keepdims=True)
  has = row_sum > 0
  o = jnp.einsum("bhrqk,bhrkd->bhrqd", p, vw, preferred_element_type=jnp.float32)
  o = o / jnp.where(has, row_sum, 1.0)                              # [B, H, R, bq, Dv]
  lse = jnp.where(has, row_max + jnp.log(jnp.where(has, row_sum, 1.0)), NEG_INF)[..., 0]
  return (o, lse), (qw, kw, vw, key_ok, o, lse)


def _attend_bwd(spec, res, cts):
  qw, kw, vw, key_ok, o, lse = res
  do, dlse = cts
  allowed = _allowed(spec, key_ok)
  has = lse > 0.5 * NEG_INF
  safe_lse = jnp.where(has, lse, 0.0)[..., None]
  p = jnp.where(allowed, jnp.exp(_scores(qw, kw) - safe_lse), 0.0)    # normalised probabilities
  do = do.astype(jnp.float32)
  dv = jnp.einsum("bhrqk,bhrqd->bhrkd", p, do, preferred_element_type=jnp.float32)
  dp = jnp.einsum("bhrqd,bhrkd->bhrqk", do, vw, preferred_element_type=jnp.float32)
  delta = jnp.sum(do * o, axis=-1, keepdims=True) - dlse[..., None]
  ds = p * (dp - delta) * (1.0 / math.sqrt(qw.shape[-1]))
  dq = jnp.einsum("bhrqk,bhrkd->bhrqd", ds, kw, preferred_element_type=jnp.float32)
  dk = jnp.einsum("bhrqk,bhrqd->bhrkd", ds, qw, preferred_element_type=jnp.float32)
  return (dq.astype(qw.dtype), dk.astype(kw.dtype), dv.astype(vw.dtype),
          np.zeros(key_ok.shape, jax.dtypes.float0))


_attend.defvjp(_attend_fwd, _attend_bwd)


def sparse_core(q, k, v, key_ok, plan):
  """Block-sparse attention on padded, head-major arrays, returning the softmax statistics.

  Args:
    q: `[B, H, nqb * q_block, D]`; k: `[B, H, nkb * k_block, D]`; v: `[B, H, nkb * k_block, Dv]`.
    key_ok: bool `[B, nkb * k_block]` or `[B, H, nkb * k_block]`, keys that may be attended.
    plan: from `make_plan`.

  Returns:
    out `[B, H, nqb * q_block, Dv]` float32, normalised, 0 for a query with no key; lse
    `[B, H, nqb * q_block]` float32, NEG_INF for a query with no key.
  """
  b_, h, _, d = q.shape
  dv = v.shape[-1]
  bq, bk, nqb, nkb, hl = plan.q_block, plan.k_block, plan.nqb, plan.nkb, plan.num_heads
  qb = q.reshape(b_, h, nqb, bq, d)
  kb = k.reshape(b_, h * nkb, bk, d) if hl > 1 else k.reshape(b_, h, nkb, bk, d)
  vb = v.reshape(b_, h * nkb, bk, dv) if hl > 1 else v.reshape(b_, h, nkb, bk, dv)
  hk = 1 if key_ok.ndim == 2 else h
  okb = key_ok.reshape(b_, hk * nkb, bk)
  outs, lses = [], []
  for spec in plan.buckets:
    r, kk = len(spec.rows), spec.num_slots
    qw = static_take(qb, spec.rows, 2)                                 # [B, H, R, bq, D]
    if hl > 1:                                                         # per-head key lists
      flat = (spec.idx + nkb * np.arange(h)[:, None, None]).reshape(-1)
      kw = static_take(kb, flat, 1).reshape(b_, h, r, kk * bk, d)
      vw = static_take(vb, flat, 1).reshape(b_, h, r, kk * bk, dv)
    else:
      flat = spec.idx.reshape(-1)
      kw = static_take(kb, flat, 2).reshape(b_, h, r, kk * bk, d)
      vw = static_take(vb, flat, 2).reshape(b_, h, r, kk * bk, dv)
    heads = max(hl, hk)
    ok_idx = np.broadcast_to(spec.idx, (heads,) + spec.idx.shape[1:])
    if hk > 1:
      ok_idx = ok_idx + nkb * np.arange(h)[:, None, None]
    ok = static_take(okb, ok_idx.reshape(-1), 1).reshape(b_, heads, r, 1, kk * bk)
    o, lse = _attend(spec, qw, kw, vw, ok)
    outs.append(o)
    lses.append(lse)
  if plan.has_empty:
    outs.append(jnp.zeros((b_, h, 1, bq, dv), jnp.float32))
    lses.append(jnp.full((b_, h, 1, bq), NEG_INF, jnp.float32))
  out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]
  lse = jnp.concatenate(lses, axis=2) if len(lses) > 1 else lses[0]
  out = static_take(out, plan.unpermute, 2).reshape(b_, h, nqb * bq, dv)
  lse = static_take(lse, plan.unpermute, 2).reshape(b_, h, nqb * bq)
  return out, lse


def merge_parts(parts):
  """Combines normalised partial results [(out, lse), ...] over disjoint key sets."""
  if len(parts) == 1:
    return parts[0]
  lses = jnp.stack([lse for _, lse in parts])                          # [P, B, H, L]
  total = jax.lax.stop_gradient(jnp.max(lses, axis=0))
  weights = jnp.exp(lses - total)
  norm = jnp.sum(weights, axis=0)
  out = sum(o * (w / norm)[..., None] for (o, _), w in zip(parts, weights))
  return out, total + jnp.log(norm)


# --- Public entry point. ---

def check_layout(layout, *, num_blocks: int, num_heads: int, length: int,
                 block_size: int) -> np.ndarray:
  """Checks a block layout against the sequence; returns it as a numpy bool array."""
  if isinstance(layout, jax.core.Tracer) or isinstance(layout, jax.Array):
    raise ValueError(
        "layout must be a static numpy bool array (it decides which blocks are computed), got "
        "a jax array; pass np.asarray(layout).")
  layout = np.asarray(layout)
  if layout.dtype != np.bool_:
    raise ValueError(f"layout must be boolean (True = compute this block), got {layout.dtype}.")
  want = (num_blocks, num_blocks)
  if layout.shape != want and layout.shape != (num_heads,) + want:
    raise ValueError(
        f"layout has shape {layout.shape}, but length {length} with block_size {block_size} "
        f"has ceil({length}/{block_size}) = {num_blocks} blocks: pass a layout of shape {want} "
        f"(or {(num_heads,) + want}, one per head), or change block_size.")
  return layout


def block_sparse_attention(q, k, v, *, layout, block_size: int, causal: bool = False,
                           key_mask=None):
  """Attention over a static block layout, computing only the non-empty blocks.

  Args:
    q, k, v: `[B, L, H, D]` (v may have its own last dimension); self-attention.
    layout: numpy bool `[nb, nb]` or `[H, nb, nb]` with nb = ceil(L / block_size): query block
      n may attend key block m when `layout[n, m]` (per head when 3-D).
    block_size: tokens per block; the last block may be partial.
    causal: additionally only keys j <= i.
    key_mask: optional bool `[B, L]`, True = real token. Padded queries output 0.

  Returns:
    `[B, L, H, Dv]` in q's dtype, equal to `dot_product_attention` with
    `masks.block_layout_mask(layout, block_size, L)` (and `causal`, `key_mask`).
  """
  b_, length, _, h, _ = validation.check_qkv(q, k, v, same_length=True)
  validation.check_token_mask("key_mask", key_mask, b_, length)
  if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
      or block_size < 1:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}.")
  nb = -(-length // block_size)
  layout = check_layout(layout, num_blocks=nb, num_heads=h, length=length,
                        block_size=block_size)
  plan = make_plan(layout, q_block=int(block_size), k_block=int(block_size), causal=causal)
  return _block_sparse(q, k, v, key_mask, plan=plan)


def to_blocked(x, padded: int):
  """`[B, L, H, D]` -> head-major `[B, H, padded, D]`, zero padded at the end."""
  x = jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0)))
  return x.transpose(0, 2, 1, 3)


def finish(out, real, length: int, dtype):
  """Head-major `[B, H, >=L, Dv]` float32 -> `[B, L, H, Dv]`, padded queries set to 0."""
  out = out[:, :, :length].transpose(0, 2, 1, 3)
  if real is not None:
    out = jnp.where(real[:, :, None, None], out, 0.0)
  return out.astype(dtype)


@functools.partial(jax.jit, static_argnames=("plan",))
def _block_sparse(q, k, v, key_mask, *, plan):
  b_, length = q.shape[:2]
  padded = plan.nqb * plan.q_block
  real = None if key_mask is None else key_mask
  key_ok = jnp.ones((b_, length), bool) if key_mask is None else key_mask
  key_ok = jnp.pad(key_ok, ((0, 0), (0, padded - length)))
  out, _ = sparse_core(to_blocked(q, padded), to_blocked(k, padded), to_blocked(v, padded),
                       key_ok, plan)
  return finish(out, real, length, q.dtype)
