"""Block-sparse attention (BigBird, Sparse Transformer) for `benchmarks/attention.py`.

Group "block_sparse". Settings are chosen so that at n = 8192 about 1/8 of the (query, key)
pairs are used (exact shares are printed by `python -m benchmarks.impls_sparse`):
  * `bigbird`: `attention.bigbird_attention`, blocks of 128, 2 global blocks (first and last),
    2 random blocks per (head, query block), 3-block window; per-head random layouts (seed 0).
  * `sparse_fixed`: `attention.sparse_attention(pattern="fixed")`, stride 512, summary width
    32, per-head summary offsets, bidirectional (encoder).
  * `sparse_strided`: `attention.sparse_attention(pattern="strided")`, stride 512,
    bidirectional.
  * `sparse_fixed_causal`, `sparse_strided_causal`: the same patterns, causal (about half the
    pairs).
  * `dense_jax_bs`, `torch_sdpa_bs`: `dense_jax` and `torch_sdpa` of `benchmarks/impls_band.py`
    (full n x n softmax attention), listed under their own names so this group's table compares
    against them in the same run.

FLOPs: 4 * head_dim per allowed (query, key) pair of the exact pattern, per head and batch row,
counted analytically (no n x n array). The dense peers count the full n x n pattern.
"""

from __future__ import annotations

import functools

import numpy as np

from benchmarks import impls_band

STRIDE = 512
SUMMARY = 32
BB_BLOCK, BB_GLOBAL, BB_RANDOM, BB_SEED = 128, 2, 2, 0


def strided_pairs(n: int, causal: bool, stride: int = STRIDE) -> int:
  """Allowed pairs of the strided pattern: |i - j| < stride, or stride | (i - j)."""
  i = np.arange(n, dtype=np.int64)
  if causal:
    return int(np.sum(np.minimum(i, stride - 1) + 1 + i // stride))
  local = np.minimum(n - 1, i + stride - 1) - np.maximum(0, i - stride + 1) + 1
  same_class = -(-(n - i % stride) // stride)                      # j = i mod stride in [0, n)
  return int(np.sum(local + same_class - 1))                         # i itself is in both


def fixed_pairs(n: int, heads: int, causal: bool, stride: int = STRIDE,
                width: int = SUMMARY) -> int:
  """Allowed pairs of the fixed pattern summed over heads (per-head summary offsets)."""
  from attention import masks

  i = np.arange(n, dtype=np.int64)
  group = i // stride
  total = 0
  for lo in masks.fixed_summary_offsets(stride=stride, summary_width=width, num_heads=heads):
    is_summary = (i % stride >= lo) & (i % stride < lo + width)
    per_group = np.bincount(group[is_summary], minlength=group[-1] + 1)  # summary cols per group
    before = np.concatenate([[0], np.cumsum(per_group)[:-1]])          # in earlier groups
    if causal:
      total += int(np.sum(i % stride + 1 + before[group]))
    else:
      size = np.minimum(stride, n - group * stride)
      total += int(np.sum(size + per_group.sum() - per_group[group]))
  return total


@functools.lru_cache(maxsize=None)
def bigbird_pairs(n: int, heads: int) -> int:
  """Allowed pairs of the BigBird layout summed over heads (the last block may be partial)."""
  from attention import masks

  nb = -(-n // BB_BLOCK)
  layout = masks.bigbird_block_pattern(nb, num_global_blocks=BB_GLOBAL,
                                       num_random_blocks=BB_RANDOM, seed=BB_SEED,
                                       num_heads=heads)
  sizes = np.minimum(BB_BLOCK, n - np.arange(nb) * BB_BLOCK)
  return int(np.einsum("hnm,n,m->", layout.astype(np.int64), sizes, sizes))


def _flops(pairs_all_heads: int, batch: int, head_dim: int) -> float:
  return 4.0 * head_dim * batch * float(pairs_all_heads)


def bigbird_flops(n, batch, heads, head_dim):
  return _flops(bigbird_pairs(n, heads), batch, head_dim)


def fixed_flops(n, batch, heads, head_dim, causal=False):
  return _flops(fixed_pairs(n, heads, causal), batch, head_dim)


def strided_flops(n, batch, heads, head_dim, causal=False):
  return _flops(heads * strided_pairs(n, causal), batch, head_dim)


def build_bigbird(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of `attention.bigbird_attention` (block 128, g = 2, r = 2, seed 0)."""
  from attention import bigbird_attention

  return impls_band.jax_step(
      lambda q, k, v: bigbird_attention(q, k, v, block_size=BB_BLOCK,
                                        num_global_blocks=BB_GLOBAL,
                                        num_random_blocks=BB_RANDOM, seed=BB_SEED),
      n, mode, batch, heads, head_dim)


def build_sparse(n: int, mode: str, batch: int, heads: int, head_dim: int, *, pattern: str,
                 causal: bool):
  """Step of `attention.sparse_attention` with stride 512 (summary width 32 for "fixed")."""
  from attention import sparse_attention

  extra = dict(summary_width=SUMMARY) if pattern == "fixed" else {}
  return impls_band.jax_step(
      lambda q, k, v: sparse_attention(q, k, v, pattern=pattern, stride=STRIDE, causal=causal,
                                       **extra),
      n, mode, batch, heads, head_dim)


IMPLS = {
    "bigbird": dict(
        framework="jax", build=build_bigbird, flops_fwd=bigbird_flops, max_n=None,
        group="block_sparse",
        note="attention.bigbird_attention: block 128, 2 global, 2 random, 3-block window"),
    "sparse_fixed": dict(
        framework="jax", build=functools.partial(build_sparse, pattern="fixed", causal=False),
        flops_fwd=fixed_flops, max_n=None, group="block_sparse",
        note="attention.sparse_attention fixed: stride 512, summary 32, per-head offsets"),
    "sparse_strided": dict(
        framework="jax", build=functools.partial(build_sparse, pattern="strided", causal=False),
        flops_fwd=strided_flops, max_n=None, group="block_sparse",
        note="attention.sparse_attention strided: stride 512, bidirectional"),
    "sparse_fixed_causal": dict(
        framework="jax", build=functools.partial(build_sparse, pattern="fixed", causal=True),
        flops_fwd=functools.partial(fixed_flops, causal=True), max_n=None,
        group="block_sparse", note="fixed pattern as sparse_fixed, causal"),
    "sparse_strided_causal": dict(
        framework="jax", build=functools.partial(build_sparse, pattern="strided", causal=True),
        flops_fwd=functools.partial(strided_flops, causal=True), max_n=None,
        group="block_sparse", note="strided pattern as sparse_strided, causal"),
    "dense_jax_bs": dict(
        framework="jax", build=impls_band.build_dense_jax, flops_fwd=impls_band.dense_flops,
        max_n=8192, group="block_sparse",
        note='jax.nn.dot_product_attention(implementation="xla"), full n x n (= dense_jax)'),
    "torch_sdpa_bs": dict(
        framework="torch", build=impls_band.build_torch_sdpa, flops_fwd=impls_band.dense_flops,
        max_n=None, group="block_sparse",
        note="torch scaled_dot_product_attention on CPU (flash kernel), full n x n "
             "(= torch_sdpa)"),
}


if __name__ == "__main__":
  for n in (2048, 8192, 16384):
    shares = dict(bigbird=bigbird_pairs(n, 8) / 8, fixed=fixed_pairs(n, 8, False) / 8,
                  strided=strided_pairs(n, False), fixed_causal=fixed_pairs(n, 8, True) / 8,
                  strided_causal=strided_pairs(n, True))
    print(f"n={n}: " + ", ".join(f"{k} {v / n / n:.3f}" for k, v in shares.items()))
