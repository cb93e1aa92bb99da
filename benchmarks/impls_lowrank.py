"""Linformer, Reformer LSH and Synthesizer attention for `benchmarks/attention.py` (group "linear").

Implementations (float32, inputs `[batch, n, heads, head_dim]`, fixed random parameters):
  * `linformer`: `attention.linformer_attention` with separate `[n, 256]` key and value
    projections shared by the heads (the paper's headwise sharing), no padding.
  * `lsh`: `attention.lsh_attention(qk=q, v)`, 4 hash rounds, chunks of 128, n / 64 buckets
    (the Reformer default 2 n / chunk), non-causal; k is unused (shared query-key), so its
    gradient is zero.
  * `lsh_causal`: the same, causal (buckets laid out on chunk boundaries: up to n / 64 extra
    chunks of work, the price of exact causality).
  * `synthesizer_random`: `attention.synthesizer_attention` with one `[n, n]` random logits
    table shared by the heads; q and k are unused. Quadratic, like dense attention.
  * `synthesizer_dense`: the dense synthesizer, per-head MLP head_dim -> 64 -> n on q.

FLOPs count the matmuls of the exact computation: Linformer's projections and its n x 256
attention; LSH's hashing and its chunk-window scores (each query scores 2 * chunk keys per
round); Synthesizer's MLP and its n x n probability-value product.
"""

from __future__ import annotations

import math

from benchmarks import impls_band

PROJECTED = 256       # Linformer projected length k
LSH_HASHES = 4
LSH_CHUNK = 128
SYN_HIDDEN = 64       # hidden width of the dense synthesizer MLP
SEED = 0


def lsh_buckets_for(n: int) -> int:
  """Reformer's default bucket count 2 n / chunk (even, at least 2)."""
  return max(2, 2 * max(1, n // LSH_CHUNK))


def linformer_flops(n: int, batch: int, heads: int, head_dim: int) -> float:
  """Key and value projections (2 n k D each) plus attention over k slots (4 D per pair)."""
  return float(batch * heads) * (2 * 2.0 * n * PROJECTED * head_dim
                                 + 4.0 * head_dim * n * PROJECTED)


def lsh_flops(n: int, batch: int, heads: int, head_dim: int) -> float:
  """Per round: hashing (2 n D nb/2) and 4 D per (query, window key), 2 * chunk keys a query."""
  chunk = min(LSH_CHUNK, n)
  per_round = 2.0 * n * head_dim * (lsh_buckets_for(n) // 2) + 4.0 * head_dim * n * 2 * chunk
  return float(batch * heads * LSH_HASHES) * per_round


def synthesizer_random_flops(n: int, batch: int, heads: int, head_dim: int) -> float:
  """Probabilities times values: 2 D per (query, key) pair."""
  return 2.0 * head_dim * batch * heads * float(n) * float(n)


def synthesizer_dense_flops(n: int, batch: int, heads: int, head_dim: int) -> float:
  """MLP (2 n D F + 2 n F n) and probabilities times values (2 D n n)."""
  per_head = 2.0 * n * head_dim * SYN_HIDDEN + 2.0 * n * SYN_HIDDEN * n + 2.0 * head_dim * n * n
  return float(batch * heads) * per_head


_jax_step = impls_band.jax_step


def _normal(seed: int, shape, scale: float):
  import jax

  return jax.random.normal(jax.random.key(seed), shape) * scale


def build_linformer(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of `linformer_attention` with `[n, 256]` key and value projections."""
  from attention import linformer_attention

  e = _normal(1, (n, PROJECTED), 1.0 / math.sqrt(n))
  f = _normal(2, (n, PROJECTED), 1.0 / math.sqrt(n))
  return _jax_step(lambda q, k, v: linformer_attention(q, k, v, proj_k=e, proj_v=f), n, mode,
                   batch, heads, head_dim)


def _build_lsh(n, mode, batch, heads, head_dim, causal):
  import jax

  from attention import lsh_attention

  key = jax.random.key(3)
  return _jax_step(
      lambda q, k, v: lsh_attention(q, v, key=key, num_hashes=LSH_HASHES,
                                    num_buckets=lsh_buckets_for(n), chunk_size=LSH_CHUNK,
                                    causal=causal),
      n, mode, batch, heads, head_dim)


def build_lsh(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of non-causal `lsh_attention` (4 rounds, chunk 128, 2 n / 128 buckets)."""
  return _build_lsh(n, mode, batch, heads, head_dim, causal=False)


def build_lsh_causal(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of causal `lsh_attention` (4 rounds, chunk 128, 2 n / 128 buckets)."""
  return _build_lsh(n, mode, batch, heads, head_dim, causal=True)


def build_synthesizer_random(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of the random synthesizer with one `[n, n]` logits table."""
  from attention import synthesizer_attention

  table = _normal(4, (n, n), 1.0)
  return _jax_step(lambda q, k, v: synthesizer_attention(q, k, v, random=table), n, mode, batch,
                   heads, head_dim)


def build_synthesizer_dense(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of the dense synthesizer: per-head MLP head_dim -> 64 -> n on the queries."""
  from attention import synthesizer_attention

  params = dict(w1=_normal(5, (heads, head_dim, SYN_HIDDEN), 1.0 / math.sqrt(head_dim)),
                b1=_normal(6, (heads, SYN_HIDDEN), 0.0),
                w2=_normal(7, (heads, SYN_HIDDEN, n), 1.0 / math.sqrt(SYN_HIDDEN)),
                b2=_normal(8, (heads, n), 0.0))
  return _jax_step(lambda q, k, v: synthesizer_attention(q, k, v, dense=params), n, mode, batch,
                   heads, head_dim)


IMPLS = {
    "linformer": dict(
        framework="jax", build=build_linformer, flops_fwd=linformer_flops, max_n=None,
        group="linear",
        note="attention.linformer_attention, separate [n, 256] key/value projections shared "
             "by the heads"),
    "lsh": dict(
        framework="jax", build=build_lsh, flops_fwd=lsh_flops, max_n=None, group="linear",
        note="attention.lsh_attention(qk=q, v), 4 rounds, chunk 128, 2n/128 buckets, "
             "non-causal"),
    "lsh_causal": dict(
        framework="jax", build=build_lsh_causal, flops_fwd=lsh_flops, max_n=None, group="linear",
        note="attention.lsh_attention, causal (bucket-aligned chunks), 4 rounds, chunk 128, "
             "2n/128 buckets"),
    "synthesizer_random": dict(
        framework="jax", build=build_synthesizer_random, flops_fwd=synthesizer_random_flops,
        max_n=8192, group="linear",
        note="attention.synthesizer_attention(random=[n, n] table shared by heads), n x n"),
    "synthesizer_dense": dict(
        framework="jax", build=build_synthesizer_dense, flops_fwd=synthesizer_dense_flops,
        max_n=8192, group="linear",
        note="attention.synthesizer_attention(dense=per-head MLP D -> 64 -> n on q), n x n"),
}
