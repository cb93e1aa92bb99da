"""Exact softmax attention in memory linear in the length: online softmax over key blocks.

The algorithm of FlashAttention (Dao et al., 2022; the backward pass of FlashAttention-2), in
plain jnp. Queries and keys are cut into blocks of `block_size` tokens. For each query block, a
`lax.scan` over the key blocks keeps a running row maximum m, row sum l and unnormalised output
acc (all float32); a key block's scores s rescale them:

    m' = max(m, rowmax(s)),  p = exp(s - m'),  l' = l exp(m - m') + rowsum(p),
    acc' = acc exp(m - m') + p v,

and the output is acc / l. The forward pass keeps only the output and the per-row log-sum-exp
lse = m + log(l). The backward pass (a `jax.custom_vjp`) recomputes each block's
probabilities p = exp(s - lse) from q, k and lse, with delta = rowsum(dO * O):

    dv += p^T dO,  ds = p * (dO v^T - delta) / sqrt(D),  dq += ds k,  dk += ds^T q,

scanning over key blocks outside and query blocks inside, so dk and dv of a key block are one
carry and dq one `[Lq, D]` accumulator. No `[Lq, Lk]` array exists in either pass: the largest
temporaries are one block pair's `[B, H, block, block]` scores and the O(L) statistics.

A block pair in which no query may see any key (the causal upper triangle, padding, a False
entry of `block_mask`) is skipped by `lax.cond`, so the kind doubles as the exact dense path of
block-sparse layouts (`block_mask` is an array and may be traced, unlike the static layouts of
`attention.block_sparse`).

Masking follows `attention.dot_product_attention` exactly: float32 softmax statistics whatever
the input dtype, masked probabilities exactly 0, a query with no allowed key outputs 0 and gets
zero gradients, padded queries output 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from attention import validation
from attention.dot_product import NEG_INF

DEFAULT_BLOCK_SIZE = 128


def _check_block_size(block_size: int) -> int:
  if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
      or block_size < 1:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}.")
  return int(block_size)


def _check_block_mask(block_mask: ArrayLike, b: int, h: int, nq: int, nk: int, block_size: int,
                      lq: int, lk: int) -> jax.Array:
  """`block_mask` as bool `[B|1, H|1, nq, nk]`; raises with the expected shape."""
  block_mask = jnp.asarray(block_mask, bool)
  shape = tuple(block_mask.shape)
  if block_mask.ndim < 2 or block_mask.ndim > 4 or shape[-2:] != (nq, nk):
    raise ValueError(
        f"block_mask has shape {shape}, but Lq = {lq} and Lk = {lk} with block_size "
        f"{block_size} give [num_q_blocks, num_k_blocks] = [{nq}, {nk}] (ceil(L / block_size)): "
        f"pass a bool [{nq}, {nk}], optionally with leading [batch, heads] dims.")
  block_mask = block_mask.reshape((1,) * (4 - block_mask.ndim) + shape)
  if block_mask.shape[0] not in (1, b) or block_mask.shape[1] not in (1, h):
    raise ValueError(
        f"block_mask of shape {shape} does not broadcast to [batch, heads, num_q_blocks, "
        f"num_k_blocks] = {(b, h, nq, nk)}.")
  return block_mask


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    key_mask: jax.Array | None = None, query_mask: jax.Array | None = None,
                    causal: bool = False, block_mask: ArrayLike | None = None,
                    block_size: int = DEFAULT_BLOCK_SIZE) -> jax.Array:
  """Exact dense attention, computed block by block with an online softmax (O(L) memory).

  Args:
    q: `[B, Lq, H, D]` queries.
    k: `[B, Lk, H, D]` keys.
    v: `[B, Lk, H, Dv]` values.
    key_mask: optional bool `[B, Lk]`, True = real key.
    query_mask: optional bool `[B, Lq]`, True = real query; padded queries output 0. Defaults
      to `key_mask` when q and k have the same length (self-attention).
    causal: allow key j for query i only when j <= i (positions aligned at the start).
    block_mask: optional bool `[nq, nk]`, broadcastable to `[B, H, nq, nk]` with
      nq = ceil(Lq / block_size) and nk = ceil(Lk / block_size): query i may attend key j only
      when `block_mask[..., i // block_size, j // block_size]`. May be a traced array.
    block_size: tokens per block of queries and of keys (the last block may be partial). It
      sets the granularity of `block_mask` and the size of the score tile held at once.

  Returns:
    `[B, Lq, H, Dv]` in q's dtype, equal to `dot_product_attention` with the same `causal`,
    `key_mask`, `query_mask` and `mask=masks.block_layout_mask(block_mask, block_size, L)`.
  """
  b, lq, lk, h, _ = validation.check_qkv(q, k, v)
  query_mask = validation.token_masks(key_mask, query_mask, b, lq, lk)
  block_size = _check_block_size(block_size)
  if block_mask is not None:
    nq, nk = -(-lq // block_size), -(-lk // block_size)
    block_mask = _check_block_mask(block_mask, b, h, nq, nk, block_size, lq, lk)
  if lq == 0 or lk == 0:  # no query, or no key at all: every query outputs 0
    return jnp.zeros((b, lq, h, v.shape[-1]), q.dtype)
  return _flash(q, k, v, key_mask, query_mask, block_mask, block_size=block_size,
                causal=bool(causal))


def _blocks(x: jax.Array, n: int, blk: int) -> jax.Array:
  """`[B, L, H, E]` -> `[n, B, H, blk, E]`, zero-padding the length to n * blk."""
  b, length, h, e = x.shape
  x = jnp.pad(x, ((0, 0), (0, n * blk - length), (0, 0), (0, 0)))
  return x.reshape(b, n, blk, h, e).transpose(1, 0, 3, 2, 4)


def _token_blocks(ok: jax.Array | None, b: int, length: int, n: int, blk: int) -> jax.Array:
  """bool `[B, L]` or None -> `[n, B, blk]`, False past the length."""
  ok = jnp.ones((b, length), bool) if ok is None else jnp.asarray(ok, bool)
  ok = jnp.pad(ok, ((0, 0), (0, n * blk - length)))
  return ok.reshape(b, n, blk).transpose(1, 0, 2)


@functools.partial(jax.jit, static_argnames=("block_size", "causal"))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None,
           query_mask: jax.Array | None, block_mask: jax.Array | None, *, block_size: int,
           causal: bool) -> jax.Array:
  b, lq, h, _ = q.shape
  lk, dv = k.shape[1], v.shape[-1]
  # A sequence shorter than one block is one block of its own length (same block grid).
  bq, bk = min(block_size, lq), min(block_size, lk)
  nq, nk = -(-lq // bq), -(-lk // bk)
  qb, kb, vb = _blocks(q, nq, bq), _blocks(k, nk, bk), _blocks(v, nk, bk)
  q_ok = _token_blocks(query_mask, b, lq, nq, bq)                        # [nq, B, bq]
  k_ok = _token_blocks(key_mask, b, lk, nk, bk)                          # [nk, B, bk]
  live = jnp.any(q_ok, axis=(1, 2))[:, None] & jnp.any(k_ok, axis=(1, 2))[None, :]
  if causal:  # some query of block n at or after some key of block m
    live = live & jnp.asarray(np.arange(nk)[None, :] * bk <= np.arange(nq)[:, None] * bq + bq - 1)
  bm = None
  if block_mask is not None:
    bm = block_mask.transpose(2, 3, 0, 1)                                # [nq, nk, B|1, H|1]
    live = live & jnp.any(bm, axis=(2, 3))
  out = _core((causal, bq, bk), qb, kb, vb, q_ok, k_ok, bm, live)      # [nq, B, H, bq, Dv]
  out = out.transpose(1, 0, 3, 2, 4).reshape(b, nq * bq, h, dv)[:, :lq]
  return out.astype(q.dtype)


def _scores(qblk: jax.Array, kblk: jax.Array) -> jax.Array:
  """`[B, H, bq, D] x [B, H, bk, D]` -> float32 `[B, H, bq, bk]` logits (dot_product's scale)."""
  scale = 1.0 / jnp.sqrt(jnp.float32(qblk.shape[-1]))
  return jnp.einsum("bhqd,bhkd->bhqk", qblk, kblk, preferred_element_type=jnp.float32) * scale


def _allowed(static: tuple[bool, int, int], qi: jax.Array, ki: jax.Array, qok: jax.Array,
             kok: jax.Array, bm_pair: jax.Array | None) -> jax.Array:
  """bool `[B, H|1, bq, bk]`: the allowed pairs of query block qi and key block ki."""
  causal, bq, bk = static
  allowed = qok[:, None, :, None] & kok[:, None, None, :]
  if causal:
    qpos = qi * bq + jnp.arange(bq)
    kpos = ki * bk + jnp.arange(bk)
    allowed = allowed & (qpos[:, None] >= kpos[None, :])
  if bm_pair is not None:
    allowed = allowed & bm_pair[:, :, None, None]
  return allowed


def _forward(static: tuple[bool, int, int], qb: jax.Array, kb: jax.Array, vb: jax.Array,
             q_ok: jax.Array, k_ok: jax.Array, bm: jax.Array | None,
             live: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Online softmax: (out `[nq, B, H, bq, Dv]`, lse `[nq, B, H, bq]`), float32."""
  nq, nk = qb.shape[0], kb.shape[0]
  b, h, bq = qb.shape[1], qb.shape[2], qb.shape[3]
  dv = vb.shape[-1]

  def q_step(_, xs):
    qi, qblk, qok, live_row, bm_row = xs

    def k_step(carry, ys):
      ki, kblk, vblk, kok, live_pair, bm_pair = ys

      def compute(carry):
        m, l, acc = carry
        allowed = _allowed(static, qi, ki, qok, kok, bm_pair)
        s = jnp.where(allowed, _scores(qblk, kblk), NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bhqk,bhkd->bhqd", p, vblk.astype(jnp.float32))
        return m_new, l, acc * corr[..., None] + pv

      return jax.lax.cond(live_pair, compute, lambda c: c, carry), None

    init = (jnp.full((b, h, bq), NEG_INF, jnp.float32), jnp.zeros((b, h, bq), jnp.float32),
            jnp.zeros((b, h, bq, dv), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(k_step, init, (jnp.arange(nk), kb, vb, k_ok, live_row, bm_row))
    has = l > 0
    safe_l = jnp.where(has, l, 1.0)
    return None, (acc / safe_l[..., None], jnp.where(has, m + jnp.log(safe_l), NEG_INF))

  _, (out, lse) = jax.lax.scan(q_step, None, (jnp.arange(nq), qb, q_ok, live, bm))
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(static: tuple[bool, int, int], qb: jax.Array, kb: jax.Array, vb: jax.Array,
          q_ok: jax.Array, k_ok: jax.Array, bm: jax.Array | None, live: jax.Array) -> jax.Array:
  """Block-major attention: qb `[nq, B, H, bq, D]`, kb/vb `[nk, B, H, bk, .]`, q_ok
  `[nq, B, bq]`, k_ok `[nk, B, bk]`, bm `[nq, nk, B|1, H|1]` or None, live `[nq, nk]` (pairs
  worth computing). Returns float32 `[nq, B, H, bq, Dv]`."""
  return _forward(static, qb, kb, vb, q_ok, k_ok, bm, live)[0]


def _core_fwd(static, qb, kb, vb, q_ok, k_ok, bm, live):
  out, lse = _forward(static, qb, kb, vb, q_ok, k_ok, bm, live)
  return out, (qb, kb, vb, q_ok, k_ok, bm, live, out, lse)


def _core_bwd(static, res, dout):
  qb, kb, vb, q_ok, k_ok, bm, live, out, lse = res
  dout = dout.astype(jnp.float32)
  scale = 1.0 / jnp.sqrt(jnp.float32(qb.shape[-1]))
  delta = jnp.sum(dout * out, axis=-1)                                   # [nq, B, H, bq]
  lse = jnp.where(lse > 0.5 * NEG_INF, lse, 0.0)  # rows with no key: p is 0 anyway
  bm_cols = None if bm is None else bm.transpose(1, 0, 2, 3)             # [nk, nq, B|1, H|1]

  def k_step(dq, xs):
    ki, kblk, vblk, kok, live_col, bm_col = xs
    kf, vf = kblk.astype(jnp.float32), vblk.astype(jnp.float32)

    def q_step(carry, ys):
      qi, qblk, doblk, lse_b, delta_b, qok, live_pair, bm_pair = ys

      def compute(_):
        allowed = _allowed(static, qi, ki, qok, kok, bm_pair)
        p = jnp.where(allowed, jnp.exp(_scores(qblk, kblk) - lse_b[..., None]), 0.0)
        dp = jnp.einsum("bhqd,bhkd->bhqk", doblk, vf)
        ds = p * (dp - delta_b[..., None]) * scale
        return (jnp.einsum("bhqk,bhkd->bhqd", ds, kf),
                jnp.einsum("bhqk,bhqd->bhkd", ds, qblk.astype(jnp.float32)),
                jnp.einsum("bhqk,bhqd->bhkd", p, doblk))

      def skip(_):
        return (jnp.zeros(qblk.shape, jnp.float32), jnp.zeros(kblk.shape, jnp.float32),
                jnp.zeros(vblk.shape, jnp.float32))

      dq_c, dk_c, dv_c = jax.lax.cond(live_pair, compute, skip, None)
      return (carry[0] + dk_c, carry[1] + dv_c), dq_c

    init = (jnp.zeros(kblk.shape, jnp.float32), jnp.zeros(vblk.shape, jnp.float32))
    (dk, dv), dq_blocks = jax.lax.scan(
        q_step, init, (jnp.arange(qb.shape[0]), qb, dout, lse, delta, q_ok, live_col, bm_col))
    return dq + dq_blocks, (dk, dv)

  dq0 = jnp.zeros(qb.shape, jnp.float32)
  dq, (dk, dv) = jax.lax.scan(k_step, dq0, (jnp.arange(kb.shape[0]), kb, vb, k_ok, live.T,
                                            bm_cols))
  return (dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), None, None, None, None)


_core.defvjp(_core_fwd, _core_bwd)
