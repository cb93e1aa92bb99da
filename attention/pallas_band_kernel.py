"""The Pallas kernels of `attention.pallas_band`: forward, dq (with the global slots' dk/dv) and
dk/dv.

Layout (no transposes). A run of h heads sharing a dilation d is seen as a 5-D array
`[B, Lp, d, h, D]`, a free reshape of `[B, Lp * d, h, D]`: position p = t * d + r sits at class
position t of residue class r. A program works on one row n = (b, r, head) of N = B * d * h and
its BlockSpecs pick the `[block, D]` tiles of that row out of the 5-D array directly (a strided
load, rows d * h * D elements apart, as jax's own GPU attention reads `[B, L, H, D]`), so q, k,
v, the output and every gradient stay in the caller's `[B, L, H, D]` order. Per-row vectors
(log-sum-exp, delta, global slots) are `[N, ...]`; the key validity is `[B, Lp, d]`.

Grids: forward and dq (N, Lp / block_q), each program looping over the key blocks that
intersect the window of its query block (`key_blocks`) and then the global slots as one extra
key block; dk/dv (N, Lp / block_k), each program looping over the query blocks whose window
reaches its key block (`query_blocks`). The global slots' dk/dv come out of the dq kernel: its
program (n, i) has the probabilities p and score gradients ds of its queries against the global
block at hand (it needs them for dq), so it also writes its share ds^T q, p^T do `[G, D]` of
that block's dk, dv, float32, into `[N, Lp / block_q, G, D]`, and the wrapper sums the shares
over the query blocks in float32: no serial loop over a row, no recomputed matmul.

Loops: the key blocks [lo, hi) of a query block are three `fori_loop`s, [lo, a) and [b, hi)
with the band test (a relative-position comparison per pair) and [a, b) without it; [a, b) are
the blocks wholly inside the band of every query of the block (`key_blocks`: key block j is in
when first + block_q - 1 - j * block_k <= window and j * block_k + block_k - 1 - first <= right,
first = i * block_q, the nearest and farthest pairs of the tile). For a window of 256 and
blocks of 64, 7 of a row's 9 key blocks are inside. Why it is exact: on a block of [a, b) every
pair passes the band test, so the test is the constant True there and leaving it out changes
nothing; what is still applied there is the per-key validity (padding, the sequence end, the
global keys removed from the band, one select by a `[1, block_k]` vector), so padding and
global keys are exact wherever they sit. A query with a valid key in such a block has an
allowed key, so its log-sum-exp is finite and the backward's exp(s - lse) is the probability.
Causality is the band with right = 0 and dilation is the residue-class layout above, so both
move only the bounds. The order of the blocks in the online softmax does not change the result
beyond rounding. dk/dv splits its query blocks the same way (`query_blocks`, the transpose).
The bounds are the ceil and floor of the two inequalities, clipped so that lo <= a <= b <= hi;
tests/pallas_band_test.py checks them against every tile of a brute-force band.

Softmax statistics and accumulators are float32; matmul operands keep the input dtype (bfloat16
stays bfloat16 on the tensor cores). Every block is a power of two >= 16. Block sizes and the
Triton launch (`Tiles.num_warps`, `Tiles.num_stages`) are set by the caller
(`attention.pallas_band.band_attention`; defaults in `attention.pallas_online.TILE_TABLE`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attention.dot_product import NEG_INF
from attention.pallas_online import (call as _call, dot as _dot, finish as _finish,
                                      probs_and_dscores as _probs_and_dscores,
                                      softmax_step as _softmax_step, tile as _tile)

# Class position of an empty global slot: after every query, so no query ever attends it.
FAR = 1 << 30


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Static configuration of one kernel launch."""
  window: int
  causal: bool
  block_q: int
  block_k: int
  scale: float
  interpret: bool
  num_warps: int = 4
  num_stages: int = 2

  @property
  def right(self) -> int:
    """How far to the right of a query its band reaches."""
    return 0 if self.causal else self.window


def _band_allowed(t: jax.Array, s: jax.Array, ok: jax.Array, cfg: Tiles) -> jax.Array:
  """[bq, bk] bool: query class positions t may see key class positions s (valid keys only)."""
  rel = t[:, None] - s[None, :]
  return (rel <= cfg.window) & (rel >= -cfg.right) & (ok[None, :] != 0)


def _valid_keys(ok: jax.Array) -> jax.Array:
  """[1, bk] bool: the valid keys of a block wholly inside the band (no band test needed)."""
  return ok[None, :] != 0


def _global_allowed(t: jax.Array, gpos: jax.Array, cfg: Tiles) -> jax.Array:
  """[bq, G] bool: the global slots each query sees (empty slots sit at FAR)."""
  limit = t[:, None] if cfg.causal else FAR - 1
  return gpos[None, :] <= limit


def _inside(lo: jax.Array, hi: jax.Array, need: jax.Array, top: jax.Array,
            block: int) -> tuple[jax.Array, jax.Array]:
  """The blocks [a, b) of [lo, hi) with first element m * block in [need, top] (need and top may
  be negative; lo >= 0): ceil(need / block) and floor(top / block) + 1, clipped so that
  lo <= a <= b <= hi."""
  a = jnp.clip(lax.div(jnp.maximum(need, 0) + block - 1, block), lo, hi)
  b = jnp.clip(lax.div(jnp.maximum(top + block, 0), block), a, hi)
  return a, b


def key_blocks(i: jax.Array, cfg: Tiles,
               num_k: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Key blocks of query block i: [lo, hi) intersect its window, and [a, b) (lo <= a <= b <= hi)
  lie wholly inside the band of every query of the block."""
  bq, bk = cfg.block_q, cfg.block_k
  first = i * bq
  lo = lax.div(jnp.maximum(first - cfg.window, 0), bk)
  hi = jnp.minimum(lax.div(first + bq - 1 + cfg.right, bk) + 1, num_k)
  # Key block j is inside when its nearest key is within `window` of the last query
  # (first + bq - 1 - j * bk <= window) and its farthest within `right` of the first.
  a, b = _inside(lo, hi, first + bq - 1 - cfg.window, first + cfg.right + 1 - bk, bk)
  return lo, a, b, hi


def query_blocks(j: jax.Array, cfg: Tiles,
                 num_q: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Query blocks of key block j: [lo, hi) have a query whose window reaches it, and [a, b)
  (lo <= a <= b <= hi) see all of it from every query (the transpose of `key_blocks`)."""
  bq, bk = cfg.block_q, cfg.block_k
  first = j * bk
  lo = lax.div(jnp.maximum(first - cfg.right, 0), bq)
  hi = jnp.minimum(lax.div(first + bk - 1 + cfg.window, bq) + 1, num_q)
  a, b = _inside(lo, hi, first + bk - 1 - cfg.right, first + cfg.window + 1 - bq, bq)
  return lo, a, b, hi


def _three_loops(bounds, body, carry):
  """`body(j, carry, masked)` over the edge blocks [lo, a) and [b, hi) with the band test and
  over the inside blocks [a, b) without it."""
  lo, a, b, hi = bounds
  carry = lax.fori_loop(lo, a, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
  return lax.fori_loop(b, hi, functools.partial(body, masked=True), carry)


def _forward_kernel(*refs, cfg: Tiles, has_global: bool):
  if has_global:
    q_ref, k_ref, v_ref, ok_ref, kg_ref, vg_ref, gpos_ref, o_ref, lse_ref = refs
  else:
    q_ref, k_ref, v_ref, ok_ref, o_ref, lse_ref = refs
  bq, bk = cfg.block_q, cfg.block_k
  i = pl.program_id(1)
  q = q_ref[...]
  t = i * bq + jnp.arange(bq)

  def body(j, carry, masked):
    keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
    scores = _dot(q, k_ref[keys, :], (1, 1)) * cfg.scale
    ok = ok_ref[keys]
    allowed = _band_allowed(t, j * bk + jnp.arange(bk), ok, cfg) if masked else _valid_keys(ok)
    return _softmax_step(carry, scores, allowed, v_ref[keys, :])

  carry = (jnp.zeros((bq, o_ref.shape[-1]), jnp.float32),
           jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32))
  carry = _three_loops(key_blocks(i, cfg, k_ref.shape[0] // bk), body, carry)
  if has_global:
    scores = _dot(q, kg_ref[...].astype(q.dtype), (1, 1)) * cfg.scale
    allowed = _global_allowed(t, gpos_ref[...], cfg)
    carry = _softmax_step(carry, scores, allowed, vg_ref[...].astype(v_ref.dtype))
  _finish(carry, o_ref, lse_ref)


def _dq_kernel(*refs, cfg: Tiles, has_global: bool):
  """dq of a query block; with globals also this block's share of the global slots' dk and dv
  (its probabilities and score gradients of the global block are at hand: no recomputation)."""
  if has_global:
    q_ref, k_ref, v_ref, ok_ref, kg_ref, vg_ref, gpos_ref, do_ref, lse_ref, delta_ref, \
        dq_ref, dkg_ref, dvg_ref = refs
  else:
    q_ref, k_ref, v_ref, ok_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
  bq, bk = cfg.block_q, cfg.block_k
  i = pl.program_id(1)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  t = i * bq + jnp.arange(bq)

  def body(j, dq, masked):
    keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
    k = k_ref[keys, :]
    ok = ok_ref[keys]
    allowed = _band_allowed(t, j * bk + jnp.arange(bk), ok, cfg) if masked else _valid_keys(ok)
    _, ds = _probs_and_dscores(q, k, v_ref[keys, :], do, lse, delta, allowed, cfg)
    return dq + _dot(ds.astype(k.dtype), k, (1, 0))

  dq = _three_loops(key_blocks(i, cfg, k_ref.shape[0] // bk), body,
                    jnp.zeros(dq_ref.shape, jnp.float32))
  if has_global:
    kg = kg_ref[...].astype(q.dtype)
    allowed = _global_allowed(t, gpos_ref[...], cfg)
    p, ds = _probs_and_dscores(q, kg, vg_ref[...].astype(do.dtype), do, lse, delta, allowed,
                               cfg)
    dq = dq + _dot(ds.astype(kg.dtype), kg, (1, 0))
    dkg_ref[...] = _dot(ds.astype(q.dtype), q, (0, 0))
    dvg_ref[...] = _dot(p.astype(do.dtype), do, (0, 0))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, ok_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                cfg: Tiles):
  bq, bk = cfg.block_q, cfg.block_k
  j = pl.program_id(1)
  k, v, ok = k_ref[...], v_ref[...], ok_ref[...]
  s = j * bk + jnp.arange(bk)
  inside = _valid_keys(ok)

  def body(i, carry, masked):
    dk, dv = carry
    rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    allowed = _band_allowed(i * bq + jnp.arange(bq), s, ok, cfg) if masked else inside
    p, ds = _probs_and_dscores(q, k, v, do, lse_ref[rows], delta_ref[rows], allowed, cfg)
    return (dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv + _dot(p.astype(do.dtype), do, (0, 0)))

  dk, dv = _three_loops(query_blocks(j, cfg, q_ref.shape[0] // bq), body,
                        (jnp.zeros(dk_ref.shape, jnp.float32),
                         jnp.zeros(dv_ref.shape, jnp.float32)))
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where row n = (b, r, head) of a run of `heads` heads with dilation `dilation` lives."""
  dilation: int
  heads: int

  def coords(self, n: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(batch, residue, head) of row n."""
    return (lax.div(n, self.dilation * self.heads), lax.rem(lax.div(n, self.heads),
                                                            self.dilation), lax.rem(n, self.heads))

  def seq(self, rows: int, width: int, whole: bool = False) -> pl.BlockSpec:
    """Tile i (or the whole row when `whole`) of a `[B, Lp, d, h, width]` array."""
    def index(n, *i):
      b, r, head = self.coords(n)
      return b, (0 if whole else i[0]), r, head, 0
    return pl.BlockSpec((None, rows, None, None, width), index)

  def valid(self, rows: int, whole: bool = False) -> pl.BlockSpec:
    """Tile i (or the whole row) of the `[B, Lp, d]` key validity."""
    def index(n, *i):
      b, r, _ = self.coords(n)
      return b, (0 if whole else i[0]), r
    return pl.BlockSpec((None, rows, None), index)


def _row(*shape: int) -> pl.BlockSpec:
  """The whole row n of an `[N, *shape]` array, for any program (n, ...)."""
  return pl.BlockSpec((None, *shape), lambda n, *_: (n,) + (0,) * len(shape))


def _key_side(cfg: Tiles, q, k, v, kg):
  """Layout, sizes and the in_specs shared by the forward and dq kernels (q tile, whole k, v,
  validity and global slots)."""
  b_, length, dilation, heads, dp = q.shape
  dvp = v.shape[-1]
  lay = Layout(dilation, heads)
  specs = [lay.seq(cfg.block_q, dp), lay.seq(length, dp, whole=True),
           lay.seq(length, dvp, whole=True), lay.valid(length, whole=True)]
  if kg is not None:
    g = kg.shape[1]
    specs += [_row(g, dp), _row(g, dvp), _row(g)]
  return lay, b_ * dilation * heads, length, dp, dvp, specs


def _forward(cfg: Tiles, q, k, v, ok, kg, vg, gpos):
  lay, n, length, dp, dvp, specs = _key_side(cfg, q, k, v, kg)
  has_global = kg is not None
  args = [q, k, v, ok] + ([kg, vg, gpos] if has_global else [])
  out, lse = _call(
      functools.partial(_forward_kernel, cfg=cfg, has_global=has_global), cfg,
      (n, length // cfg.block_q), specs, [lay.seq(cfg.block_q, dvp), _tile(cfg.block_q)],
      [jax.ShapeDtypeStruct(q.shape[:-1] + (dvp,), q.dtype),
       jax.ShapeDtypeStruct((n, length), jnp.float32)], "pallas_band_forward")(*args)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(cfg: Tiles, q: jax.Array, k: jax.Array, v: jax.Array, ok: jax.Array,
           kg: jax.Array | None, vg: jax.Array | None, gpos: jax.Array | None) -> jax.Array:
  """Band and global-key attention of one run of heads, with a Pallas backward.

  Args:
    cfg: window, causality, blocks (which must divide Lp), scale, interpret.
    q, k: `[B, Lp, d, h, Dp]`; v `[B, Lp, d, h, Dvp]` (Dp, Dvp powers of two >= 16).
    ok: int32 `[B, Lp, d]`, nonzero where the band may use the key.
    kg, vg: float32 `[N, G, Dp]`, `[N, G, Dvp]` global keys and values of each row, N = B*d*h
      in (b, r, head) order, G a power of two >= 16; or None without global tokens.
    gpos: int32 `[N, G]`: first class position that sees each slot (FAR for an empty slot).

  Returns:
    `[B, Lp, d, h, Dvp]` in q's dtype, 0 for a query with no allowed key.
  """
  return _forward(cfg, q, k, v, ok, kg, vg, gpos)[0]


def _attend_fwd(cfg, q, k, v, ok, kg, vg, gpos):
  out, lse = _forward(cfg, q, k, v, ok, kg, vg, gpos)
  return out, (q, k, v, ok, kg, vg, gpos, out, lse)


def _attend_bwd(cfg, res, do):
  q, k, v, ok, kg, vg, gpos, out, lse = res
  lay, n, length, dp, dvp, specs = _key_side(cfg, q, k, v, kg)
  bq, bk = cfg.block_q, cfg.block_k
  has_global = kg is not None
  do = do.astype(q.dtype)
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, Lp, d, h]
  delta = delta.transpose(0, 2, 3, 1).reshape(n, length)

  args = [q, k, v, ok] + ([kg, vg, gpos] if has_global else [])
  nq = length // bq
  out_specs = [lay.seq(bq, dp)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if has_global:  # each query block's share of the global slots' dk and dv, summed below
    g = kg.shape[1]
    share = lambda width: pl.BlockSpec((None, None, g, width), lambda n, i: (n, i, 0, 0))
    out_specs += [share(dp), share(dvp)]
    out_shape += [jax.ShapeDtypeStruct((n, nq, g, dp), jnp.float32),
                  jax.ShapeDtypeStruct((n, nq, g, dvp), jnp.float32)]
  dq, *shares = _call(functools.partial(_dq_kernel, cfg=cfg, has_global=has_global), cfg,
                      (n, nq), specs + [lay.seq(bq, dvp), _tile(bq), _tile(bq)], out_specs,
                      out_shape, "pallas_band_dq")(*args, do, lse, delta)

  dk, dv = _call(
      functools.partial(_dkv_kernel, cfg=cfg), cfg, (n, length // bk),
      [lay.seq(length, dp, whole=True), lay.seq(bk, dp), lay.seq(bk, dvp), lay.valid(bk),
       lay.seq(length, dvp, whole=True), _row(length), _row(length)],
      [lay.seq(bk, dp), lay.seq(bk, dvp)],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      "pallas_band_dkv")(q, k, v, ok, do, lse, delta)

  dkg = dvg = None
  if has_global:
    dkg = jnp.sum(shares[0], axis=1) * cfg.scale
    dvg = jnp.sum(shares[1], axis=1)
  return dq, dk, dv, None, dkg, dvg, None


attend.defvjp(_attend_fwd, _attend_bwd)
