"""The online-softmax pieces both Triton kernels share (`attention.pallas_band_kernel`,
`attention.pallas_block_sparse_kernel`): float32 matmuls, one softmax update by a block of keys,
the forward's final division and log-sum-exp, the backward's recomputed probabilities, the
`pallas_call` with the kernels' warps and stages, and the table of default launch settings.
`cfg` is either kernel's `Tiles` (its `scale`, `interpret`, `num_warps` and `num_stages` are
read)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attention import validation
from attention.dot_product import NEG_INF

# Default launch settings of both kernels, by dtype and head dimension (padded to a power of
# two >= 16): (block_q, block_k, num_warps, num_stages) of the first row whose head dimension is
# at least the input's. A device sweep (benchmarks/device_speed.py) fills these in; the values
# here are the ones the first H100 run measured with (docs/gpu.md).
TILE_TABLE: dict[str, tuple[tuple[int, tuple[int, int, int, int]], ...]] = {
    dtype: ((64, (64, 64, 4, 2)), (1 << 30, (64, 64, 8, 2)))
    for dtype in ("float32", "bfloat16", "float16")
}


def launch_settings(head_dim: int, dtype, block_q: int | None, block_k: int | None,
                    num_warps: int | None, num_stages: int | None,
                    min_tile: int) -> tuple[int, int, int, int]:
  """(block_q, block_k, num_warps, num_stages): each one given, checked (one-line ValueError),
  or None for `TILE_TABLE`'s entry for `dtype` (float32's for a dtype it lacks) and
  `head_dim`."""
  given = (validation.tile_side("block_q", block_q, min_tile),
           validation.tile_side("block_k", block_k, min_tile),
           validation.num_warps(num_warps), validation.num_stages(num_stages))
  rows = TILE_TABLE.get(jnp.dtype(dtype).name, TILE_TABLE["float32"])
  table = next(row for top, row in rows if head_dim <= top)
  return tuple(t if g is None else g for g, t in zip(given, table))


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
  """2-D matmul contracting axis contract[0] of a with axis contract[1] of b, float32 out."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def softmax_step(carry, scores, allowed, v):
  """One online-softmax update of (acc, running max, running sum) by a block of keys."""
  acc, m, l = carry
  scores = jnp.where(allowed, scores, NEG_INF)
  m_new = jnp.maximum(m, jnp.max(scores, axis=1))
  p = jnp.where(allowed, jnp.exp(scores - m_new[:, None]), 0.0)
  correction = jnp.exp(m - m_new)
  l = l * correction + jnp.sum(p, axis=1)
  acc = acc * correction[:, None] + dot(p.astype(v.dtype), v, (1, 0))
  return acc, m_new, l


def finish(carry, o_ref, lse_ref) -> None:
  """Writes the output acc / sum and the log-sum-exp; a query with no allowed key gets 0 and
  NEG_INF."""
  acc, m, l = carry
  has = l > 0
  safe = jnp.where(has, l, 1.0)
  o_ref[...] = jnp.where(has[:, None], acc / safe[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has, m + jnp.log(safe), NEG_INF)


def probs_and_dscores(q, k, v, do, lse, delta, allowed, cfg):
  """Recomputed probabilities p and score gradients ds = p * (do v^T - delta), [bq, bk]."""
  scores = dot(q, k, (1, 1)) * cfg.scale
  p = jnp.where(allowed, jnp.exp(scores - lse[:, None]), 0.0)
  ds = p * (dot(do, v, (1, 1)) - delta[:, None])
  return p, ds


def tile(rows: int) -> pl.BlockSpec:
  """Tile i of an `[N, Lp]` array, for program (n, i)."""
  return pl.BlockSpec((None, rows), lambda n, i: (n, i))


def call(kernel, cfg, grid, in_specs, out_specs, out_shape, name: str):
  """`pallas_call` of `kernel` with `cfg`'s warps and stages."""
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
  )
