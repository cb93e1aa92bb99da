"""Block-sparse attention over a static block layout, computing only the blocks it needs.

A layout is a numpy bool array `[num_query_blocks, num_key_blocks]` (or one per head,
`[heads, nqb, nkb]`): query block n may attend key block m when `layout[n, m]`. The layout is
static (known at trace time), so the work is planned once, in numpy
(`attention.block_sparse_plan`):

  * rows (query blocks) are grouped into a few buckets of similar block count (a causal layout
    has rows of 1 .. nkb blocks), each padded to its own longest row K;
  * per bucket, the K key blocks of every row are assembled gather-free: band diagonals are
    static slices, global columns broadcasts, irregular (random) blocks one one-hot matmul;
    the gradients are the matching static sums;
  * the scores `[rows, block, K * block]` are computed by a scan over chunks of rows, so one
    step's scores stay in cache; a fine mask applies padding slots, key padding and the
    sequence end, the causal diagonal, and an optional token predicate of the pattern fronts
    (`attention.sparse_patterns`);
  * when one row's scores alone fill a scan step (BigBird, block-sparse and block-local at LRA
    sizes), the bucket is streamed instead: one row per step, its key blocks read by dynamic
    slices at the planned block indices and their gradients added into a key-sized
    accumulator, so the assembled `[rows, K * block]` keys and values and the one-hot matmul
    are never formed;
  * the softmax core has a hand-written backward pass (flash-style: recompute the scores from
    the saved log-sum-exp), so probabilities are never stored between forward and backward.

The cost is proportional to the number of non-empty blocks (plus the bucket padding, plus
`rows * slots * nkb` for the one-hot slots of irregular layouts). The semantics are those of
`dot_product_attention` with `masks.block_layout_mask(layout, ...)`.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from attention import compat, validation
from attention.block_sparse_plan import Static, make_plan
from attention.dot_product import NEG_INF
from attention.static_take import static_take


# --- The softmax core on assembled blocks: a scan over row chunks, flash-style backward. ---

# Score elements per scan step: one step's scores (and their exp) stay in cache. On CPU every
# large fresh buffer costs page faults, so the full score tensor is never materialised.
CHUNK_SCORE_ELEMENTS = 1 << 19


def _chunk_mask(spec: Static, ok: jax.Array, start: jax.Array, chunk: int) -> jax.Array:
  """Fine mask `[c, B|1, Hx, bq|1, K*bk]` of rows start .. start + chunk of a bucket."""
  allowed = jax.lax.dynamic_slice_in_dim(ok, start, chunk, axis=0)       # [c, B, Hx, 1, K*bk]
  if spec.causal or spec.pair is not None:
    qpos = jax.lax.dynamic_slice_in_dim(jnp.asarray(spec.qpos), start, chunk, axis=0)
    kpos = jax.lax.dynamic_slice_in_dim(jnp.asarray(spec.kpos), start, chunk, axis=0)
    if spec.causal:
      allowed = allowed & (qpos >= kpos)
    if spec.pair is not None:
      allowed = allowed & spec.pair(qpos, kpos)
  return allowed


def _scores(qc: jax.Array, kc: jax.Array) -> jax.Array:
  scale = 1.0 / math.sqrt(qc.shape[-1])
  return jnp.einsum("cbhqd,cbhkd->cbhqk", qc, kc, preferred_element_type=jnp.float32) * scale


def _slice_rows(start: jax.Array | int, chunk: int, *xs: jax.Array) -> list[jax.Array]:
  return [jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=0) for x in xs]


def _chunk_forward(qc: jax.Array, kc: jax.Array, vc: jax.Array,
                   allowed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of one scan step's rows: (out, lse), f32."""
  s = jnp.where(allowed, _scores(qc, kc), NEG_INF)                       # [c, B, H, bq, K*bk]
  row_max = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(allowed, jnp.exp(s - row_max), 0.0)
  row_sum = jnp.sum(p, axis=-1, keepdims=True)
  has = row_sum > 0
  o = jnp.einsum("cbhqk,cbhkd->cbhqd", p, vc, preferred_element_type=jnp.float32)
  o = o / jnp.where(has, row_sum, 1.0)
  lse = jnp.where(has, row_max + jnp.log(jnp.where(has, row_sum, 1.0)), NEG_INF)[..., 0]
  return o, lse


def _chunk_backward(qc: jax.Array, kc: jax.Array, vc: jax.Array, doc: jax.Array, lc: jax.Array,
                    dc: jax.Array, allowed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gradients (dq, dk, dv) of one scan step's rows, f32, from the saved log-sum-exp `lc` and
  `dc` = rowsum(dO * O) - dlse."""
  scale = 1.0 / math.sqrt(qc.shape[-1])
  p = jnp.where(allowed, jnp.exp(_scores(qc, kc) - lc[..., None]), 0.0)
  dp = jnp.einsum("cbhqd,cbhkd->cbhqk", doc, vc, preferred_element_type=jnp.float32)
  ds = p * (dp - dc[..., None]) * scale
  dq = jnp.einsum("cbhqk,cbhkd->cbhqd", ds, kc, preferred_element_type=jnp.float32)
  dk = jnp.einsum("cbhqk,cbhqd->cbhkd", ds, qc, preferred_element_type=jnp.float32)
  dv = jnp.einsum("cbhqk,cbhqd->cbhkd", p, doc, preferred_element_type=jnp.float32)
  return dq, dk, dv


def _backward_inputs(do: jax.Array, o: jax.Array, lse: jax.Array,
                     dlse: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dO in f32, delta = rowsum(dO * O) - dlse, lse with NEG_INF rows set to 0)."""
  do = do.astype(jnp.float32)
  delta = jnp.sum(do * o, axis=-1) - dlse                                 # [R, B, H, bq]
  return do, delta, jnp.where(lse > 0.5 * NEG_INF, lse, 0.0)


def _forward(spec: Static, qw: jax.Array, kw: jax.Array, vw: jax.Array,
             ok: jax.Array) -> tuple[jax.Array, jax.Array]:
  rows, chunk = qw.shape[0], spec.chunk

  def step(_, j):
    start = j * chunk
    qc, kc, vc = _slice_rows(start, chunk, qw, kw, vw)
    return None, _chunk_forward(qc, kc, vc, _chunk_mask(spec, ok, start, chunk))

  _, (o, lse) = jax.lax.scan(step, None, jnp.arange(rows // chunk))
  return o.reshape((rows,) + o.shape[2:]), lse.reshape((rows,) + lse.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(spec: Static, qw: jax.Array, kw: jax.Array, vw: jax.Array,
            ok: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of assembled rows: qw `[R, B, H, bq, D]`, kw/vw `[R, B, H, K*bk, .]`,
  ok bool `[R, B, Hx, 1, K*bk]`. Returns (out `[R, B, H, bq, Dv]`, lse `[R, B, H, bq]`), f32."""
  return _forward(spec, qw, kw, vw, ok)


def _attend_fwd(spec, qw, kw, vw, ok):
  o, lse = _forward(spec, qw, kw, vw, ok)
  return (o, lse), (qw, kw, vw, ok, o, lse)


def _attend_bwd(spec, res, cts):
  qw, kw, vw, ok, o, lse = res
  rows, chunk = qw.shape[0], spec.chunk
  do, delta, safe_lse = _backward_inputs(cts[0], o, lse, cts[1])

  def step(_, j):
    start = j * chunk
    qc, kc, vc, doc, lc, dc = _slice_rows(start, chunk, qw, kw, vw, do, safe_lse, delta)
    dq, dk, dv = _chunk_backward(qc, kc, vc, doc, lc, dc, _chunk_mask(spec, ok, start, chunk))
    return None, (dq.astype(qw.dtype), dk.astype(kw.dtype), dv.astype(vw.dtype))

  _, grads = jax.lax.scan(step, None, jnp.arange(rows // chunk))
  dq, dk, dv = (g.reshape((rows,) + g.shape[2:]) for g in grads)
  return dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


# --- Streamed buckets: one row per scan step, its key blocks read by dynamic slices. ---

def _read_row(xb: jax.Array, ids: jax.Array, uniform: tuple[bool, ...]) -> jax.Array:
  """The key blocks of one row: xb `[nkb, B, H, bk, E]`, ids int `[Hl, K]` -> `[1, B, H, K*bk, E]`.

  A slot the same for every head is one dynamic slice of all heads, a per-head slot one slice
  per head."""
  _, b_, h, bk, e = xb.shape
  parts = []
  for slot, same in enumerate(uniform):
    if same:
      parts.append(jax.lax.dynamic_slice_in_dim(xb, ids[0, slot], 1, axis=0))
    else:
      parts.append(jnp.concatenate(
          [jax.lax.dynamic_slice(xb, (ids[g, slot], 0, g, 0, 0), (1, b_, 1, bk, e))
           for g in range(h)], axis=2))
  return jnp.stack(parts, axis=3).reshape(1, b_, h, len(uniform) * bk, e)


def _add_row(acc: jax.Array, g: jax.Array, ids: jax.Array,
             uniform: tuple[bool, ...]) -> jax.Array:
  """Transpose of `_read_row`: adds g `[1, B, H, K*bk, E]` into acc `[nkb, B, H, bk, E]`."""
  _, b_, h, bk, e = acc.shape
  g = g.reshape(1, b_, h, len(uniform), bk, e)

  def add(acc, piece, start):
    return jax.lax.dynamic_update_slice(
        acc, jax.lax.dynamic_slice(acc, start, piece.shape) + piece, start)

  for slot, same in enumerate(uniform):
    if same:
      acc = add(acc, g[:, :, :, slot], (ids[0, slot], 0, 0, 0, 0))
    else:
      for head in range(h):
        acc = add(acc, g[:, :, head:head + 1, slot], (ids[head, slot], 0, head, 0, 0))
  return acc


def _stream_forward(spec: Static, qw: jax.Array, kb: jax.Array, vb: jax.Array,
                    ok: jax.Array) -> tuple[jax.Array, jax.Array]:
  idx = jnp.asarray(spec.idx)                                           # [R, Hl, K]

  def step(_, xs):
    j, ids = xs
    qc, = _slice_rows(j, 1, qw)
    kc, vc = (_read_row(x, ids, spec.uniform) for x in (kb, vb))
    return None, _chunk_forward(qc, kc, vc, _chunk_mask(spec, ok, j, 1))

  _, (o, lse) = jax.lax.scan(step, None, (jnp.arange(qw.shape[0]), idx))
  return o[:, 0], lse[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend_stream(spec: Static, qw: jax.Array, kb: jax.Array, vb: jax.Array,
                   ok: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`_attend` of a streamed bucket: qw `[R, B, H, bq, D]`, kb/vb the key blocks `[nkb, B, H,
  bk, .]`, ok bool `[R, B, Hx, 1, K*bk]`; row r reads blocks `spec.idx[r]`."""
  return _stream_forward(spec, qw, kb, vb, ok)


def _attend_stream_fwd(spec, qw, kb, vb, ok):
  o, lse = _stream_forward(spec, qw, kb, vb, ok)
  return (o, lse), (qw, kb, vb, ok, o, lse)


def _attend_stream_bwd(spec, res, cts):
  qw, kb, vb, ok, o, lse = res
  do, delta, safe_lse = _backward_inputs(cts[0], o, lse, cts[1])
  idx = jnp.asarray(spec.idx)

  def step(acc, xs):
    (dk_acc, dv_acc), (j, ids) = acc, xs
    qc, doc, lc, dc = _slice_rows(j, 1, qw, do, safe_lse, delta)
    kc, vc = (_read_row(x, ids, spec.uniform) for x in (kb, vb))
    dq, dk, dv = _chunk_backward(qc, kc, vc, doc, lc, dc, _chunk_mask(spec, ok, j, 1))
    dk_acc = _add_row(dk_acc, dk, ids, spec.uniform)
    dv_acc = _add_row(dv_acc, dv, ids, spec.uniform)
    return (dk_acc, dv_acc), dq[0].astype(qw.dtype)

  zeros = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
  (dk, dv), dq = jax.lax.scan(step, zeros, (jnp.arange(qw.shape[0]), idx))
  return dq, dk.astype(kb.dtype), dv.astype(vb.dtype), None


_attend_stream.defvjp(_attend_stream_fwd, _attend_stream_bwd)


def _assemble(xb: jax.Array, spec: Static, heads: int) -> jax.Array:
  """Key blocks of every row of a bucket: `[nkb, B, Hx, bk, E]` -> `[R, B, heads, K * bk, E]`.

  Shift slots are static slices, constant slots broadcasts, the rest one one-hot matmul; an
  "all" slot is the whole key sequence broadcast to the rows.
  """
  _, b_, hx, bk, e = xb.shape
  r = len(spec.rows)
  parts = []
  for slot in spec.slots:
    if slot[0] == "all":                                                 # every key block
      part = xb.transpose(1, 2, 0, 3, 4)[None]                          # [1, B, Hx, nkb, bk, E]
      parts.append(jnp.broadcast_to(part, (r, b_, heads) + part.shape[3:]))
      continue
    if slot[0] == "shift":
      part = static_take(xb, slot[2], 0)                                 # [R, B, Hx, bk, E]
    else:
      part = jax.lax.slice_in_dim(xb, slot[1], slot[1] + 1, axis=0)
    parts.append(jnp.broadcast_to(part, (r, b_, heads, bk, e))[:, :, :, None])
  if spec.onehot is not None:
    onehot = jnp.asarray(spec.onehot, xb.dtype)                          # [Hl, R, J, nkb]
    if onehot.shape[0] == 1:
      part = jnp.einsum("rjm,mbhte->rbhjte", onehot[0], xb, preferred_element_type=xb.dtype)
    elif hx == 1:
      part = jnp.einsum("hrjm,mbte->rbhjte", onehot, xb[:, :, 0],
                        preferred_element_type=xb.dtype)
    else:
      part = jnp.einsum("hrjm,mbhte->rbhjte", onehot, xb, preferred_element_type=xb.dtype)
    parts.append(jnp.broadcast_to(part, (r, b_, heads) + part.shape[3:]))
  out = jnp.concatenate(parts, axis=3) if len(parts) > 1 else parts[0]   # [R, B, heads, K, bk, E]
  return out.reshape(r, b_, heads, spec.num_slots * bk, e)


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  return x if x.shape[0] == rows else jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def sparse_core(q: jax.Array, k: jax.Array, v: jax.Array, key_ok: jax.Array,
                plan: Static) -> tuple[jax.Array, jax.Array]:
  """Block-sparse attention on padded arrays, returning the softmax statistics.

  Args:
    q: `[B, nqb * q_block, H, D]`; k: `[B, nkb * k_block, H, D]`; v: `[B, nkb * k_block, H, Dv]`.
    key_ok: bool `[B, nkb * k_block]` or `[B, nkb * k_block, H]`, keys that may be attended.
    plan: from `attention.block_sparse_plan.make_plan`.

  Returns:
    out `[B, nqb * q_block, H, Dv]` float32, normalised, 0 for a query with no key; lse
    `[B, nqb * q_block, H]` float32, NEG_INF for a query with no key.
  """
  b_, _, h, d = q.shape
  dv = v.shape[-1]
  bq, bk, nqb, nkb = plan.q_block, plan.k_block, plan.nqb, plan.nkb

  def block_major(x, nb, blk):  # [B, nb*blk, H', E] -> [nb, B, H', blk, E]
    return x.reshape(b_, nb, blk, x.shape[2], x.shape[3]).transpose(1, 0, 3, 2, 4)

  qb, kb, vb = block_major(q, nqb, bq), block_major(k, nkb, bk), block_major(v, nkb, bk)
  ok = key_ok if key_ok.ndim == 3 else key_ok[:, :, None]
  okb = block_major(ok[..., None].astype(jnp.float32), nkb, bk)         # [nkb, B, 1|H, bk, 1]
  ok_heads = max(plan.num_heads, okb.shape[2])
  outs, lses = [], []
  for spec in plan.buckets:
    r = len(spec.rows)
    rows = -(-r // spec.chunk) * spec.chunk
    qw = static_take(qb, spec.rows, 0)                                   # [R, B, H, bq, D]
    okw = _assemble(okb, spec, ok_heads)[..., 0] > 0.5                   # [R, B, Hx, K*bk]
    if not spec.all_slots:
      okw = okw & jnp.asarray(spec.slot_ok)[:, None]                    # [R, 1, Hl, K*bk]
    okw = _pad_rows(okw[:, :, :, None, :], rows)
    if spec.stream:
      o, lse = _attend_stream(spec, _pad_rows(qw, rows), kb, vb, okw)
    else:
      kw = _assemble(kb, spec, h)                                        # [R, B, H, K*bk, D]
      vw = _assemble(vb, spec, h)
      o, lse = _attend(spec, _pad_rows(qw, rows), _pad_rows(kw, rows), _pad_rows(vw, rows), okw)
    outs.append(o[:r])
    lses.append(lse[:r])
  if plan.has_empty:
    outs.append(jnp.zeros((1, b_, h, bq, dv), jnp.float32))
    lses.append(jnp.full((1, b_, h, bq), NEG_INF, jnp.float32))
  out = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
  lse = jnp.concatenate(lses, axis=0) if len(lses) > 1 else lses[0]
  out = static_take(out, plan.unpermute, 0)                              # [nqb, B, H, bq, Dv]
  lse = static_take(lse, plan.unpermute, 0)                              # [nqb, B, H, bq]
  out = out.transpose(1, 0, 3, 2, 4).reshape(b_, nqb * bq, h, dv)
  lse = lse.transpose(1, 0, 3, 2).reshape(b_, nqb * bq, h)
  return out, lse


def merge_parts(
    parts: Sequence[tuple[jax.Array, jax.Array]]) -> tuple[jax.Array, jax.Array]:
  """Combines normalised partial results [(out, lse), ...] over disjoint key sets."""
  if len(parts) == 1:
    return parts[0]
  lses = jnp.stack([lse for _, lse in parts])                          # [P, B, L, H]
  total = jax.lax.stop_gradient(jnp.max(lses, axis=0))
  weights = jnp.exp(lses - total)
  norm = jnp.sum(weights, axis=0)
  out = sum(o * (w / norm)[..., None] for (o, _), w in zip(parts, weights))
  return out, total + jnp.log(norm)


# --- Public entry point. ---

def check_layout(layout: np.ndarray, *, num_blocks: int, num_heads: int, length: int,
                 block_size: int) -> np.ndarray:
  """Checks a block layout against the sequence; returns it as a numpy bool array."""
  if compat.is_tracer(layout) or isinstance(layout, jax.Array):
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


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, layout: np.ndarray,
                           block_size: int, causal: bool = False,
                           key_mask: jax.Array | None = None) -> jax.Array:
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
  plan = make_plan(layout, q_block=int(block_size), k_block=int(block_size), causal=causal,
                   batch_heads=b_ * h)
  return _block_sparse(q, k, v, key_mask, plan=plan)


def pad_tokens(x: jax.Array, padded: int) -> jax.Array:
  """Zero-pads axis 1 (tokens) of `x` to `padded`."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, padded - x.shape[1])
  return jnp.pad(x, pad)


def finish(out: jax.Array, real: jax.Array | None, length: int,
           dtype: DTypeLike) -> jax.Array:
  """`[B, >=L, H, Dv]` float32 -> `[B, L, H, Dv]` in `dtype`, padded queries set to 0."""
  out = out[:, :length]
  if real is not None:
    out = jnp.where(real[:, :, None, None], out, 0.0)
  return out.astype(dtype)


@functools.partial(jax.jit, static_argnames=("plan",))
def _block_sparse(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None, *,
                  plan: Static) -> jax.Array:
  b_, length = q.shape[:2]
  padded = plan.nqb * plan.q_block
  key_ok = jnp.ones((b_, length), bool) if key_mask is None else key_mask
  out, _ = sparse_core(pad_tokens(q, padded), pad_tokens(k, padded), pad_tokens(v, padded),
                       pad_tokens(key_ok, padded), plan)
  return finish(out, key_mask, length, q.dtype)
