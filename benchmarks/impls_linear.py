"""FAVOR+ and linear attention for `benchmarks/attention.py` (group "linear").

Implementations (float32, inputs `[batch, n, heads, head_dim]`):
  * `favor`: `attention.favor_attention` with 256 orthogonal random features (drawn once in
    `build`, as a model holds them between redraws), softmax kernel, bidirectional.
  * `favor_causal`: the same, causal (chunked prefix sums, chunks of 128).
  * `linear`: `attention.linear_attention` (elu + 1 features), bidirectional.
  * `linear_causal`: the same, causal (chunks of 128).
  * `dense_jax_peer`, `torch_sdpa_peer`: `dense_jax` and `torch_sdpa` of
    `benchmarks/impls_band.py` (full n x n softmax attention), listed again under their own
    names so the "linear" group's table compares against them in the same run.

FLOPs count the matmuls that are computed: FAVOR+'s feature projections of q and k
(2 n D m each), the state phi(k)^T v and the readout phi(q) S (2 n m Dv each) and the
normaliser sums (2 n m each). Causally the per-chunk states and their readout cost the same, and
the `[C, C]` chunk matmuls are added as computed, masked half included (2 n C m for the scores,
2 n C Dv for the values, n C for the row sums). Linear attention has no projection and
m = head_dim. The dense peers count the full n x n pattern, as in the band group.
"""

from __future__ import annotations

from benchmarks import impls_band

NUM_FEATURES = 256
CHUNK = 128
SEED = 0


def _kernel_flops(n: int, m: int, dv: int, causal: bool) -> float:
  """State, readout and normaliser matmuls of one (batch, head); plus the chunk matmuls."""
  flops = 4.0 * n * m * dv + 4.0 * n * m
  if causal:
    chunk = min(CHUNK, -(-n // 8) * 8)
    flops += 2.0 * n * chunk * m + 2.0 * n * chunk * dv + 1.0 * n * chunk
  return flops


def favor_flops(n: int, batch: int, heads: int, head_dim: int, causal: bool = False) -> float:
  """Feature projections of q and k (2 n D m each) and the kernel sums."""
  m = NUM_FEATURES
  return float(batch * heads) * (4.0 * n * head_dim * m + _kernel_flops(n, m, head_dim, causal))


def favor_causal_flops(n: int, batch: int, heads: int, head_dim: int) -> float:
  return favor_flops(n, batch, heads, head_dim, causal=True)


def linear_flops(n: int, batch: int, heads: int, head_dim: int, causal: bool = False) -> float:
  """elu + 1 features (m = head_dim, no projection) and the kernel sums."""
  return float(batch * heads) * _kernel_flops(n, head_dim, head_dim, causal)


def linear_causal_flops(n: int, batch: int, heads: int, head_dim: int) -> float:
  return linear_flops(n, batch, heads, head_dim, causal=True)


_jax_step = impls_band.jax_step


def _build_favor(causal: bool):
  def build(n: int, mode: str, batch: int, heads: int, head_dim: int):
    import jax

    from attention import favor_attention, favor_features

    features = favor_features(jax.random.key(SEED + 1), NUM_FEATURES, head_dim)  # [m, D]
    return _jax_step(lambda q, k, v: favor_attention(q, k, v, features=features, causal=causal,
                                                     chunk_size=CHUNK),
                     n, mode, batch, heads, head_dim)
  return build


def _build_linear(causal: bool):
  def build(n: int, mode: str, batch: int, heads: int, head_dim: int):
    from attention import linear_attention

    return _jax_step(lambda q, k, v: linear_attention(q, k, v, causal=causal, chunk_size=CHUNK),
                     n, mode, batch, heads, head_dim)
  return build


IMPLS = {
    "favor": dict(
        framework="jax", build=_build_favor(False), flops_fwd=favor_flops, max_n=None,
        group="linear",
        note="attention.favor_attention, 256 orthogonal features (fixed), softmax kernel"),
    "favor_causal": dict(
        framework="jax", build=_build_favor(True), flops_fwd=favor_causal_flops, max_n=None,
        group="linear",
        note="attention.favor_attention causal=True, 256 features, chunked prefix sums (C=128)"),
    "linear": dict(
        framework="jax", build=_build_linear(False), flops_fwd=linear_flops, max_n=None,
        group="linear", note="attention.linear_attention (elu + 1 features), bidirectional"),
    "linear_causal": dict(
        framework="jax", build=_build_linear(True), flops_fwd=linear_causal_flops, max_n=None,
        group="linear",
        note="attention.linear_attention causal=True, chunked prefix sums (C=128)"),
    "dense_jax_peer": dict(
        framework="jax", build=impls_band.build_dense_jax, flops_fwd=impls_band.dense_flops,
        max_n=8192, group="linear",
        note='jax.nn.dot_product_attention(implementation="xla"), full n x n (= dense_jax)'),
    "torch_sdpa_peer": dict(
        framework="torch", build=impls_band.build_torch_sdpa, flops_fwd=impls_band.dense_flops,
        max_n=None, group="linear",
        note="torch scaled_dot_product_attention on CPU (flash kernel), full n x n "
             "(= torch_sdpa)"),
}

