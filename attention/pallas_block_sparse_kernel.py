"""The Pallas kernels of `attention.pallas_block_sparse`: forward, dq and dk/dv over tile lists.

A block pattern reaches the kernels as lists, never as a mask over pairs, stored row after row
(compressed sparse rows, two segments a row): for query tile i, entries `fwd_ptr[2i]` to
`fwd_ptr[2i + 1]` of `fwd_idx` are the key tiles to visit that are full (every pair allowed),
entries `fwd_ptr[2i + 1]` to `fwd_ptr[2i + 2]` those that are partial, each segment in
increasing order; the same entries of `fwd_tid` are their indices in a small table of distinct
`[block_q, block_k]` tiles `tiles [T, block_q, block_k]` (int8, 1 = allowed); entry 0 of the
table is all ones and is what a full tile points to. `bwd_ptr`, `bwd_idx`, `bwd_tid` list, per
key tile, the query tiles that visit it (the transposed lists, same table, same two segments),
for dk/dv. The lists have a leading head axis of H, or of 1 when every head has the same pattern
(`Tiles.list_heads`); their lengths are padded to powers of two. Storing rows one after another
keeps them the size of the pattern: a global query tile lists every key tile without making
every other row as long. The key validity (padding, the sequence end) is a per-key vector
`ok [B, Lp]`.

Layout (no transposes): q, k, v, the output and every gradient are `[B, Lp, H, D]`; program
(n, .) works on row n = b * H + head and its BlockSpecs cut that row's tiles out directly (a
strided load, rows H * D elements apart). Per-row vectors (log-sum-exp, delta) are `[N, Lp]`.

Grids: forward and dq (N, nq): program (n, i) keeps its `block_q` queries and loops over the
listed key tiles, reading each tile's index from the list refs and loading keys and values at
that dynamic offset; dk/dv (N, nk): program (n, j) keeps its key tile and loops over the listed
query tiles. Each program runs two loops (`_two_loops`): over its full tiles with the key
validity `ok` (one `[1, block_k]` select) as the only mask, never reading the table, and over
its partial tiles with the table tile AND `ok`. Why it is exact: a full tile's table entry is
all ones, so ANDing it changes nothing; the order of the tiles in the online softmax and in
the gradient sums changes the result only by rounding. Most visited tiles are full when the
pattern's blocks are multiples of the tiles (block layouts, BigBird, block-local; the strided
pattern's residue classes always), so most of the work skips the table load and the AND. Softmax
statistics and accumulators are float32 whatever the input dtype; matmul operands keep it
(bfloat16 stays bfloat16 on the tensor cores). A query with no allowed key outputs 0 and gets
log-sum-exp NEG_INF, and its probabilities are recomputed as 0 in the backward (every score of
its row is masked; a query that visits a full tile with a valid key has an allowed key).

`attend` returns the output; `attend_with_lse` also the log-sum-exp, with its cotangent taken
by the same backward (delta = rowsum(dO * O) - dlse), for a pattern computed in parts over
disjoint key sets and merged by log-sum-exp (the strided pattern,
`attention.pallas_block_sparse`).
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


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Static configuration of one kernel launch."""
  block_q: int
  block_k: int
  heads: int
  list_heads: int       # H, or 1 when every head has the same lists
  scale: float
  interpret: bool
  num_warps: int = 4
  num_stages: int = 2


def _spans(ptr_ref) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The entries [lo, mid) (full tiles) and [mid, hi) (partial tiles) of the lists that belong
  to this program's tile."""
  i = pl.program_id(1)
  return ptr_ref[2 * i], ptr_ref[2 * i + 1], ptr_ref[2 * i + 2]


def _two_loops(ptr_ref, body, carry):
  """`body(s, carry, full)` over the program's full entries, then over its partial ones."""
  lo, mid, hi = _spans(ptr_ref)
  carry = lax.fori_loop(lo, mid, functools.partial(body, full=True), carry)
  return lax.fori_loop(mid, hi, functools.partial(body, full=False), carry)


def _allowed(tiles_ref, tid_ref, s: jax.Array, ok: jax.Array, full: bool) -> jax.Array:
  """The pairs of entry s that may be attended: `[1, bk]` the valid keys `ok [bk]` of a full
  tile (no table read), or `[bq, bk]` its table tile restricted to them."""
  valid = ok[None, :] != 0
  return valid if full else (tiles_ref[tid_ref[s]] != 0) & valid


def _forward_kernel(q_ref, k_ref, v_ref, ok_ref, ptr_ref, idx_ref, tid_ref, tiles_ref, o_ref,
                    lse_ref, *, cfg: Tiles):
  bq, bk = cfg.block_q, cfg.block_k
  q = q_ref[...]

  def body(s, carry, full):
    keys = pl.ds(pl.multiple_of(idx_ref[s] * bk, bk), bk)
    scores = _dot(q, k_ref[keys, :], (1, 1)) * cfg.scale
    allowed = _allowed(tiles_ref, tid_ref, s, ok_ref[keys], full)
    return _softmax_step(carry, scores, allowed, v_ref[keys, :])

  carry = (jnp.zeros((bq, o_ref.shape[-1]), jnp.float32),
           jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32))
  _finish(_two_loops(ptr_ref, body, carry), o_ref, lse_ref)


def _dq_kernel(q_ref, k_ref, v_ref, ok_ref, ptr_ref, idx_ref, tid_ref, tiles_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, cfg: Tiles):
  bk = cfg.block_k
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

  def body(s, dq, full):
    keys = pl.ds(pl.multiple_of(idx_ref[s] * bk, bk), bk)
    k = k_ref[keys, :]
    allowed = _allowed(tiles_ref, tid_ref, s, ok_ref[keys], full)
    _, ds = _probs_and_dscores(q, k, v_ref[keys, :], do, lse, delta, allowed, cfg)
    return dq + _dot(ds.astype(k.dtype), k, (1, 0))

  dq = _two_loops(ptr_ref, body, jnp.zeros(dq_ref.shape, jnp.float32))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, ok_ref, ptr_ref, idx_ref, tid_ref, tiles_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, cfg: Tiles):
  bq = cfg.block_q
  k, v, ok = k_ref[...], v_ref[...], ok_ref[...]

  def body(s, carry, full):
    dk, dv = carry
    rows = pl.ds(pl.multiple_of(idx_ref[s] * bq, bq), bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    allowed = _allowed(tiles_ref, tid_ref, s, ok, full)
    p, ds = _probs_and_dscores(q, k, v, do, lse_ref[rows], delta_ref[rows], allowed, cfg)
    return (dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv + _dot(p.astype(do.dtype), do, (0, 0)))

  dk, dv = _two_loops(ptr_ref, body, (jnp.zeros(dk_ref.shape, jnp.float32),
                                      jnp.zeros(dv_ref.shape, jnp.float32)))
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# --- BlockSpecs of row n = b * H + head. ---

def _seq(cfg: Tiles, rows: int, width: int, whole: bool = False) -> pl.BlockSpec:
  """Tile i (or the whole row when `whole`) of row n of a `[B, Lp, H, width]` array."""
  h = cfg.heads
  return pl.BlockSpec((None, rows, None, width),
                      lambda n, i: (lax.div(n, h), 0 if whole else i, lax.rem(n, h), 0))


def _valid(cfg: Tiles, rows: int, whole: bool = False) -> pl.BlockSpec:
  """Tile i (or the whole row) of the `[B, Lp]` key validity."""
  h = cfg.heads
  return pl.BlockSpec((None, rows), lambda n, i: (lax.div(n, h), 0 if whole else i))


def _lists(cfg: Tiles, ptr, idx) -> list[pl.BlockSpec]:
  """The whole lists (row pointers, tiles, table entries) of row n's head."""
  h = cfg.list_heads
  return [pl.BlockSpec((None, x.shape[-1]), lambda n, i: (lax.rem(n, h), 0))
          for x in (ptr, idx, idx)]


def _table(shape: tuple[int, ...]) -> pl.BlockSpec:
  """The whole `[T, bq, bk]` tile table, for every program."""
  return pl.BlockSpec(shape, lambda n, i: (0,) * len(shape))


def _row(length: int) -> pl.BlockSpec:
  """The whole row n of an `[N, Lp]` array."""
  return pl.BlockSpec((None, length), lambda n, i: (n, 0))


def _query_side(cfg: Tiles, q, k, v, ptr, idx, tiles):
  """Sizes and the in_specs shared by the forward and dq kernels (q tile, whole k and v rows,
  key validity, the program's tile list and the table)."""
  b_, length, h, dp = q.shape
  dvp = v.shape[-1]
  specs = [_seq(cfg, cfg.block_q, dp), _seq(cfg, length, dp, whole=True),
           _seq(cfg, length, dvp, whole=True), _valid(cfg, length, whole=True),
           *_lists(cfg, ptr, idx), _table(tiles.shape)]
  return b_ * h, length, dp, dvp, specs


def _forward(cfg: Tiles, q, k, v, ok, fwd_ptr, fwd_idx, fwd_tid, tiles):
  n, length, dp, dvp, specs = _query_side(cfg, q, k, v, fwd_ptr, fwd_idx, tiles)
  return _call(
      functools.partial(_forward_kernel, cfg=cfg), cfg, (n, length // cfg.block_q), specs,
      [_seq(cfg, cfg.block_q, dvp), _tile(cfg.block_q)],
      [jax.ShapeDtypeStruct(q.shape[:-1] + (dvp,), q.dtype),
       jax.ShapeDtypeStruct((n, length), jnp.float32)],
      "pallas_block_sparse_forward")(q, k, v, ok, fwd_ptr, fwd_idx, fwd_tid, tiles)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(cfg: Tiles, q: jax.Array, k: jax.Array, v: jax.Array, ok: jax.Array,
           fwd_ptr: jax.Array, fwd_idx: jax.Array, fwd_tid: jax.Array, bwd_ptr: jax.Array,
           bwd_idx: jax.Array, bwd_tid: jax.Array, tiles: jax.Array) -> jax.Array:
  """Block-sparse attention over tile lists, with a Pallas backward.

  Args:
    cfg: tiles (which must divide Lp), heads, heads of the lists, scale, interpret.
    q, k: `[B, Lp, H, Dp]`; v `[B, Lp, H, Dvp]` (Dp, Dvp powers of two >= 16).
    ok: int32 `[B, Lp]`, nonzero where a key may be attended.
    fwd_ptr, fwd_idx, fwd_tid: int32 `[Hl, P]`, `[Hl, E]`, `[Hl, E]` (Hl: H or 1): per query
      tile i, entries ptr[2i] to ptr[2i + 1] are the full key tiles to visit, ptr[2i + 1] to
      ptr[2i + 2] the partial ones, with their table entries.
    bwd_ptr, bwd_idx, bwd_tid: the same per key tile, listing the query tiles that visit it.
    tiles: int8 `[T, block_q, block_k]`, entry 0 all ones.

  Returns:
    `[B, Lp, H, Dvp]` in q's dtype, 0 for a query with no allowed key.
  """
  return _forward(cfg, q, k, v, ok, fwd_ptr, fwd_idx, fwd_tid, tiles)[0]


def _attend_fwd(cfg, q, k, v, ok, fwd_ptr, fwd_idx, fwd_tid, bwd_ptr, bwd_idx, bwd_tid, tiles):
  out, lse = _forward(cfg, q, k, v, ok, fwd_ptr, fwd_idx, fwd_tid, tiles)
  return out, (q, k, v, ok, fwd_ptr, fwd_idx, fwd_tid, bwd_ptr, bwd_idx, bwd_tid, tiles, out,
               lse)


def _backward(cfg, res, do, dlse):
  """dq, dk, dv of the output cotangent `do` and, when given, the log-sum-exp's `dlse [N, Lp]`
  (d lse / d s = p, so it enters as delta = rowsum(dO * O) - dlse)."""
  q, k, v, ok, fwd_ptr, fwd_idx, fwd_tid, bwd_ptr, bwd_idx, bwd_tid, tiles, out, lse = res
  n, length, dp, dvp, specs = _query_side(cfg, q, k, v, fwd_ptr, fwd_idx, tiles)
  bq, bk = cfg.block_q, cfg.block_k
  do = do.astype(q.dtype)
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)   # [B, Lp, H]
  delta = delta.transpose(0, 2, 1).reshape(n, length)
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)

  dq = _call(functools.partial(_dq_kernel, cfg=cfg), cfg, (n, length // bq),
             specs + [_seq(cfg, bq, dvp), _tile(bq), _tile(bq)], _seq(cfg, bq, dp),
             jax.ShapeDtypeStruct(q.shape, q.dtype), "pallas_block_sparse_dq")(
                 q, k, v, ok, fwd_ptr, fwd_idx, fwd_tid, tiles, do, lse, delta)

  dk, dv = _call(
      functools.partial(_dkv_kernel, cfg=cfg), cfg, (n, length // bk),
      [_seq(cfg, length, dp, whole=True), _seq(cfg, bk, dp), _seq(cfg, bk, dvp),
       _valid(cfg, bk), *_lists(cfg, bwd_ptr, bwd_idx), _table(tiles.shape),
       _seq(cfg, length, dvp, whole=True), _row(length), _row(length)],
      [_seq(cfg, bk, dp), _seq(cfg, bk, dvp)],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      "pallas_block_sparse_dkv")(q, k, v, ok, bwd_ptr, bwd_idx, bwd_tid, tiles, do, lse, delta)
  return dq, dk, dv, None, None, None, None, None, None, None, None


def _attend_bwd(cfg, res, do):
  return _backward(cfg, res, do, None)


attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend_with_lse(cfg: Tiles, q: jax.Array, k: jax.Array, v: jax.Array, ok: jax.Array,
                    fwd_ptr: jax.Array, fwd_idx: jax.Array, fwd_tid: jax.Array,
                    bwd_ptr: jax.Array, bwd_idx: jax.Array, bwd_tid: jax.Array,
                    tiles: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`attend`, also returning each query's log-sum-exp, differentiable too, so that parts of
  a pattern over disjoint key sets can be merged exactly (`block_sparse.merge_parts`).

  Returns:
    (out `[B, Lp, H, Dvp]` in q's dtype, lse float32 `[B * H, Lp]`, row b * H + head; NEG_INF
    for a query with no allowed key).
  """
  return _forward(cfg, q, k, v, ok, fwd_ptr, fwd_idx, fwd_tid, tiles)


def _with_lse_fwd(cfg, *args):
  out, res = _attend_fwd(cfg, *args)
  return (out, res[-1]), res


def _with_lse_bwd(cfg, res, cts):
  return _backward(cfg, res, *cts)


attend_with_lse.defvjp(_with_lse_fwd, _with_lse_bwd)
