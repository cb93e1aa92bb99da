"""Longformer band attention as a Pallas GPU kernel: two-sided window, per-head dilation, globals.

No public GPU kernel computes this pattern (FlashAttention windows have neither dilation nor
global tokens, and jax's cuDNN path refuses a right window), so this module writes one in the
Triton style of `jax.experimental.pallas` (`pallas_call`, `pl.BlockSpec`, a grid of programs).
It computes exactly what `attention.band.band_attention` computes, whose keyword interface it
shares; the semantics are those of `attention.masks.longformer_mask`.

Layout. Dilation d is a reshape: positions with the same residue mod d form a contiguous
sequence of length Lc = ceil(L / d), on which a dilated band is an ordinary band of window w.
Each run of heads sharing a dilation is reshaped to `[N, Lp, D]` with N = B * d * heads (one
row per batch, residue class and head) and Lp = Lc padded to a multiple of the blocks.

Forward kernel, grid (N, Lp / block_q). Program (n, i) keeps its `block_q` queries in registers
and runs the online softmax (float32 running max, sum and output accumulator, whatever the input
dtype) over the key blocks of `block_k` keys that intersect the window of the query block, key
blocks lo..hi computed from the program id: about (block_q + 2w) / block_k blocks, never the
whole sequence. Inside a key block the exact band is a relative-position test and a per-key
validity vector removes padding, the sequence end and the global keys. The G global keys of the
batch row are gathered outside into static slots (`max_global`, padded to a power of two) and
given to the kernel as one extra key block; each slot carries its position in the residue class
coordinates (the first class position at or after it), so the causal rule for globals is one
comparison. The global query rows (each attends to every real key) are a small dense attention
outside the kernel, scattered over the kernel's rows, as band.py does.

Backward (custom_vjp, FlashAttention-2 recipe): the forward saves only its output and the
log-sum-exp per query; the backward recomputes the probabilities from q, k and that log-sum-exp.
Three kernels: dq per query block (the same key-block range as the forward, plus the global
block), dk/dv per key block over the query blocks whose window reaches it, and dk/dv of the
global slots, one program per row n looping over all query blocks. No `[L, L]` array exists
anywhere, in either pass.

On a machine without a GPU the kernels run through Pallas's interpreter (`interpret=None` picks
it when `jax.default_backend() != "gpu"`), which is how the tests check them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attention import validation
from attention.dot_product import NEG_INF, dot_product_attention

# Class position of an empty global slot: after every query, so no query ever attends it.
_FAR = 1 << 30
# Smallest matmul side (and block) Triton takes; every block shape is a power of two.
MIN_TILE = 16
DEFAULT_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class _Tiles:
  """Static configuration of one kernel launch."""
  window: int
  causal: bool
  block_q: int
  block_k: int
  scale: float
  interpret: bool

  @property
  def right(self) -> int:
    """How far to the right of a query its band reaches."""
    return 0 if self.causal else self.window


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
  """2-D matmul contracting axis contract[0] of a with axis contract[1] of b, float32 out."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _band_allowed(t: jax.Array, s: jax.Array, ok: jax.Array, cfg: _Tiles) -> jax.Array:
  """[bq, bk] bool: query class positions t may see key class positions s (valid keys only)."""
  rel = t[:, None] - s[None, :]
  return (rel <= cfg.window) & (rel >= -cfg.right) & (ok[None, :] != 0)


def _global_allowed(t: jax.Array, gpos: jax.Array, cfg: _Tiles) -> jax.Array:
  """[bq, G] bool: the global slots each query sees (empty slots sit at _FAR)."""
  limit = t[:, None] if cfg.causal else _FAR - 1
  return gpos[None, :] <= limit


def _key_blocks(i: jax.Array, cfg: _Tiles, num_k: int) -> tuple[jax.Array, jax.Array]:
  """Key blocks [lo, hi) that intersect the window of query block i."""
  first = i * cfg.block_q
  lo = lax.div(jnp.maximum(first - cfg.window, 0), cfg.block_k)
  hi = jnp.minimum(lax.div(first + cfg.block_q - 1 + cfg.right, cfg.block_k) + 1, num_k)
  return lo, hi


def _query_blocks(j: jax.Array, cfg: _Tiles, num_q: int) -> tuple[jax.Array, jax.Array]:
  """Query blocks [lo, hi) whose window reaches key block j."""
  first = j * cfg.block_k
  lo = lax.div(jnp.maximum(first - cfg.right, 0), cfg.block_q)
  hi = jnp.minimum(lax.div(first + cfg.block_k - 1 + cfg.window, cfg.block_q) + 1, num_q)
  return lo, hi


def _softmax_step(carry, scores, allowed, v):
  """One online-softmax update of (acc, running max, running sum) by a block of keys."""
  acc, m, l = carry
  scores = jnp.where(allowed, scores, NEG_INF)
  m_new = jnp.maximum(m, jnp.max(scores, axis=1))
  p = jnp.where(allowed, jnp.exp(scores - m_new[:, None]), 0.0)
  correction = jnp.exp(m - m_new)
  l = l * correction + jnp.sum(p, axis=1)
  acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v, (1, 0))
  return acc, m_new, l


def _forward_kernel(*refs, cfg: _Tiles, has_global: bool):
  if has_global:
    q_ref, k_ref, v_ref, ok_ref, kg_ref, vg_ref, gpos_ref, o_ref, lse_ref = refs
  else:
    q_ref, k_ref, v_ref, ok_ref, o_ref, lse_ref = refs
  bq, bk = cfg.block_q, cfg.block_k
  i = pl.program_id(1)
  q = q_ref[...]
  t = i * bq + jnp.arange(bq)

  def body(j, carry):
    keys = pl.ds(j * bk, bk)
    k = k_ref[keys, :]
    scores = _dot(q, k, (1, 1)) * cfg.scale
    allowed = _band_allowed(t, j * bk + jnp.arange(bk), ok_ref[keys], cfg)
    return _softmax_step(carry, scores, allowed, v_ref[keys, :])

  carry = (jnp.zeros((bq, o_ref.shape[-1]), jnp.float32),
           jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32))
  lo, hi = _key_blocks(i, cfg, k_ref.shape[0] // bk)
  carry = lax.fori_loop(lo, hi, body, carry)
  if has_global:
    scores = _dot(q, kg_ref[...].astype(q.dtype), (1, 1)) * cfg.scale
    allowed = _global_allowed(t, gpos_ref[...], cfg)
    carry = _softmax_step(carry, scores, allowed, vg_ref[...].astype(v_ref.dtype))
  acc, m, l = carry
  has = l > 0
  safe = jnp.where(has, l, 1.0)
  o_ref[...] = jnp.where(has[:, None], acc / safe[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has, m + jnp.log(safe), NEG_INF)


def _probs_and_dscores(q, k, v, do, lse, delta, allowed, cfg: _Tiles):
  """Recomputed probabilities p and score gradients ds = p * (do v^T - delta), [bq, bk]."""
  scores = _dot(q, k, (1, 1)) * cfg.scale
  p = jnp.where(allowed, jnp.exp(scores - lse[:, None]), 0.0)
  ds = p * (_dot(do, v, (1, 1)) - delta[:, None])
  return p, ds


def _dq_kernel(*refs, cfg: _Tiles, has_global: bool):
  if has_global:
    q_ref, k_ref, v_ref, ok_ref, kg_ref, vg_ref, gpos_ref, do_ref, lse_ref, delta_ref, \
        dq_ref = refs
  else:
    q_ref, k_ref, v_ref, ok_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
  bq, bk = cfg.block_q, cfg.block_k
  i = pl.program_id(1)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  t = i * bq + jnp.arange(bq)

  def body(j, dq):
    keys = pl.ds(j * bk, bk)
    k = k_ref[keys, :]
    allowed = _band_allowed(t, j * bk + jnp.arange(bk), ok_ref[keys], cfg)
    _, ds = _probs_and_dscores(q, k, v_ref[keys, :], do, lse, delta, allowed, cfg)
    return dq + _dot(ds.astype(k.dtype), k, (1, 0))

  lo, hi = _key_blocks(i, cfg, k_ref.shape[0] // bk)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(dq_ref.shape, jnp.float32))
  if has_global:
    kg = kg_ref[...].astype(q.dtype)
    allowed = _global_allowed(t, gpos_ref[...], cfg)
    _, ds = _probs_and_dscores(q, kg, vg_ref[...].astype(do.dtype), do, lse, delta, allowed,
                               cfg)
    dq = dq + _dot(ds.astype(kg.dtype), kg, (1, 0))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, ok_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                cfg: _Tiles):
  bq, bk = cfg.block_q, cfg.block_k
  j = pl.program_id(1)
  k, v, ok = k_ref[...], v_ref[...], ok_ref[...]
  s = j * bk + jnp.arange(bk)

  def body(i, carry):
    dk, dv = carry
    rows = pl.ds(i * bq, bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    allowed = _band_allowed(i * bq + jnp.arange(bq), s, ok, cfg)
    p, ds = _probs_and_dscores(q, k, v, do, lse_ref[rows], delta_ref[rows], allowed, cfg)
    return (dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv + _dot(p.astype(do.dtype), do, (0, 0)))

  lo, hi = _query_blocks(j, cfg, q_ref.shape[0] // bq)
  dk, dv = lax.fori_loop(lo, hi, body, (jnp.zeros(dk_ref.shape, jnp.float32),
                                        jnp.zeros(dv_ref.shape, jnp.float32)))
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _global_dkv_kernel(q_ref, kg_ref, vg_ref, gpos_ref, do_ref, lse_ref, delta_ref, dkg_ref,
                       dvg_ref, *, cfg: _Tiles):
  bq = cfg.block_q
  kg = kg_ref[...].astype(q_ref.dtype)
  vg = vg_ref[...].astype(do_ref.dtype)
  gpos = gpos_ref[...]

  def body(i, carry):
    dk, dv = carry
    rows = pl.ds(i * bq, bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    allowed = _global_allowed(i * bq + jnp.arange(bq), gpos, cfg)
    p, ds = _probs_and_dscores(q, kg, vg, do, lse_ref[rows], delta_ref[rows], allowed, cfg)
    return (dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv + _dot(p.astype(do.dtype), do, (0, 0)))

  dk, dv = lax.fori_loop(0, q_ref.shape[0] // bq, body,
                         (jnp.zeros(dkg_ref.shape, jnp.float32),
                          jnp.zeros(dvg_ref.shape, jnp.float32)))
  dkg_ref[...] = dk * cfg.scale
  dvg_ref[...] = dv


def _call(kernel, cfg: _Tiles, grid, in_specs, out_specs, out_shape, name: str, head_dim: int):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2),
  )


def _row(shape):
  """BlockSpec of a whole `[N, *shape]` row n, for any program (n, ...)."""
  return pl.BlockSpec((None, *shape), lambda n, i: (n,) + (0,) * len(shape))


def _tile(rows: int, *rest: int):
  """BlockSpec of the i-th block of `rows` along axis 1, for program (n, i)."""
  return pl.BlockSpec((None, rows, *rest), lambda n, i: (n, i) + (0,) * len(rest))


def _forward(cfg: _Tiles, q, k, v, ok, kg, vg, gpos):
  n, length, dp = q.shape
  dvp = v.shape[-1]
  has_global = kg is not None
  bq = cfg.block_q
  in_specs = [_tile(bq, dp), _row((length, dp)), _row((length, dvp)), _row((length,))]
  args = [q, k, v, ok]
  if has_global:
    g = kg.shape[1]
    in_specs += [_row((g, dp)), _row((g, dvp)), _row((g,))]
    args += [kg, vg, gpos]
  out, lse = _call(
      functools.partial(_forward_kernel, cfg=cfg, has_global=has_global), cfg,
      (n, length // bq), in_specs, [_tile(bq, dvp), _tile(bq)],
      [jax.ShapeDtypeStruct((n, length, dvp), q.dtype),
       jax.ShapeDtypeStruct((n, length), jnp.float32)], "pallas_band_forward", dp)(*args)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_attention(cfg: _Tiles, q, k, v, ok, kg, vg, gpos):
  """`[N, Lp, Dvp]` band (and global-key) attention of the prepared rows; see the module doc."""
  return _forward(cfg, q, k, v, ok, kg, vg, gpos)[0]


def _kernel_attention_fwd(cfg, q, k, v, ok, kg, vg, gpos):
  out, lse = _forward(cfg, q, k, v, ok, kg, vg, gpos)
  return out, (q, k, v, ok, kg, vg, gpos, out, lse)


def _kernel_attention_bwd(cfg, res, do):
  q, k, v, ok, kg, vg, gpos, out, lse = res
  n, length, dp = q.shape
  dvp = v.shape[-1]
  bq, bk = cfg.block_q, cfg.block_k
  has_global = kg is not None
  do = do.astype(q.dtype)
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)   # [N, Lp]

  in_specs = [_tile(bq, dp), _row((length, dp)), _row((length, dvp)), _row((length,))]
  args = [q, k, v, ok]
  if has_global:
    g = kg.shape[1]
    in_specs += [_row((g, dp)), _row((g, dvp)), _row((g,))]
    args += [kg, vg, gpos]
  in_specs += [_tile(bq, dvp), _tile(bq), _tile(bq)]
  dq = _call(functools.partial(_dq_kernel, cfg=cfg, has_global=has_global), cfg,
             (n, length // bq), in_specs, _tile(bq, dp),
             jax.ShapeDtypeStruct(q.shape, q.dtype), "pallas_band_dq", dp)(*args, do, lse, delta)

  dk, dv = _call(
      functools.partial(_dkv_kernel, cfg=cfg), cfg, (n, length // bk),
      [_row((length, dp)), _tile(bk, dp), _tile(bk, dvp), _tile(bk), _row((length, dvp)),
       _row((length,)), _row((length,))],
      [_tile(bk, dp), _tile(bk, dvp)],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      "pallas_band_dkv", dp)(q, k, v, ok, do, lse, delta)

  dkg = dvg = None
  if has_global:
    g = kg.shape[1]
    whole = lambda *shape: pl.BlockSpec((None, *shape), lambda n: (n,) + (0,) * len(shape))
    dkg, dvg = _call(
        functools.partial(_global_dkv_kernel, cfg=cfg), cfg, (n,),
        [whole(length, dp), whole(g, dp), whole(g, dvp), whole(g), whole(length, dvp),
         whole(length), whole(length)],
        [whole(g, dp), whole(g, dvp)],
        [jax.ShapeDtypeStruct(kg.shape, jnp.float32), jax.ShapeDtypeStruct(vg.shape, jnp.float32)],
        "pallas_band_global_dkv", dp)(q, kg, vg, gpos, do, lse, delta)
  return dq, dk, dv, None, dkg, dvg, None


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def _pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def _to_rows(x: jax.Array, dilation: int, width: int, padded: int) -> jax.Array:
  """`[B, L, h, D]` -> `[B * d * h, padded, width]`: one row per (batch, residue, head)."""
  b_, length, h, d = x.shape
  class_len = -(-length // dilation)
  x = jnp.pad(x, ((0, 0), (0, class_len * dilation - length), (0, 0), (0, 0)))
  x = x.reshape(b_, class_len, dilation, h, d).transpose(0, 2, 3, 1, 4)
  x = x.reshape(b_ * dilation * h, class_len, d)
  return jnp.pad(x, ((0, 0), (0, padded - class_len), (0, width - d)))


def _from_rows(x: jax.Array, b_: int, length: int, h: int, dilation: int, d: int) -> jax.Array:
  """Inverse of `_to_rows`: `[B * d * h, padded, width]` -> `[B, L, h, D]`."""
  class_len = -(-length // dilation)
  x = x[:, :class_len, :d].reshape(b_, dilation, h, class_len, d).transpose(0, 3, 1, 2, 4)
  return x.reshape(b_, class_len * dilation, h, d)[:, :length]


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
                                             "block_k", "num_global", "interpret"))
def _pallas_band(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None,
                 global_mask: jax.Array | None, *, window: int, dilations: tuple[int, ...],
                 causal: bool, block_q: int, block_k: int, num_global: int,
                 interpret: bool) -> jax.Array:
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
    cfg = _Tiles(window=window, causal=causal, block_q=bq, block_k=bk,
                 scale=1.0 / math.sqrt(d), interpret=interpret)
    rows = functools.partial(_to_rows, dilation=dilation, padded=padded)
    ok = rows(band_keys[:, :, None, None].astype(jnp.int32), width=1)      # [B*d, Lp, 1]
    ok = jnp.repeat(ok[:, :, 0].reshape(b_, dilation, 1, padded), heads, axis=2)
    ok = ok.reshape(-1, padded)                                            # [N, Lp]
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
      first = jnp.where(slot_ok[:, None, :], first, _FAR)                  # [B, d, G]
      gpos = jnp.broadcast_to(first[:, :, None], (b_, dilation, heads, num_global))
      gpos = jnp.pad(gpos.reshape(-1, num_global).astype(jnp.int32),
                     ((0, 0), (0, slots - num_global)), constant_values=_FAR)
    o = _kernel_attention(cfg, rows(q[:, :, sl], width=dp), rows(k[:, :, sl], width=dp),
                          rows(v[:, :, sl], width=dvp), ok, kg, vg, gpos)
    outs.append(_from_rows(o, b_, length, heads, dilation, dv))
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


def _block(name: str, value) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < MIN_TILE \
      or value & (value - 1):
    raise ValueError(
        f"{name} must be a power of two >= {MIN_TILE} (a Triton tile side) or None, "
        f"got {value!r}.")
  return int(value)


def band_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int,
                   dilation: int | Sequence[int] = 1, causal: bool = False,
                   global_mask: jax.Array | None = None, key_mask: jax.Array | None = None,
                   block_size: int | None = None, max_global: int | None = None,
                   interpret: bool | None = None, block_q: int | None = None,
                   block_k: int | None = None) -> jax.Array:
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
    block_q, block_k: queries per program and keys per inner step (powers of two >= 16;
      default 64, reduced to fit short sequences).

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
  default = DEFAULT_BLOCK if block_size is None else block_size
  block_q = _block("block_q", block_q) or default
  block_k = _block("block_k", block_k) or default
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  num_global = 0
  if global_mask is not None:
    traced = isinstance(global_mask, jax.core.Tracer)
    counts = None if traced else np.asarray(global_mask).sum(axis=1)
    if max_global is not None:
      if isinstance(max_global, bool) or not isinstance(max_global, (int, np.integer)) \
          or max_global < 0:
        raise ValueError(f"max_global must be a non-negative int or None, got {max_global!r}.")
      num_global = int(max_global)
      if counts is not None and counts.size and counts.max() > num_global:
        raise ValueError(
            f"global_mask has {int(counts.max())} global tokens in a row but max_global is "
            f"{num_global}: raise max_global.")
    elif traced:
      raise ValueError(
          "global_mask is traced (band_attention is called inside jax.jit), so the number of "
          "global tokens is not known at trace time: pass max_global=<upper bound on global "
          "tokens per row>.")
    else:
      num_global = int(counts.max()) if counts.size else 0
  return _pallas_band(q, k, v, key_mask, global_mask if num_global else None, window=window,
                      dilations=dilations, causal=bool(causal), block_q=block_q,
                      block_k=block_k, num_global=num_global, interpret=bool(interpret))
