"""Exact dense attention computed block by block, for `benchmarks/attention.py` (group "flash").

Implementations (float32, inputs `[batch, n, heads, head_dim]`):
  * `flash`: `attention.flash_attention` (online softmax over key blocks of 128, custom VJP
    recomputing the block scores), bidirectional: full n x n attention in O(n) memory.
  * `flash_causal`: the same, causal; block pairs above the diagonal are skipped.
  * `dense_ours_flash`: `attention.dot_product_attention`, the dense reference that materialises
    the `[B, H, n, n]` scores (= `dense_ours` of `benchmarks/impls_band.py`).
  * `torch_sdpa_flash`: `torch.nn.functional.scaled_dot_product_attention` on CPU (its flash
    kernel), full n x n (= `torch_sdpa`).

FLOPs: the full n x n pattern for the bidirectional impls; the causal one counts the block
pairs it computes (the diagonal blocks whole).
"""

from __future__ import annotations

from benchmarks import impls_band

BLOCK = 128


def causal_flops(n: int, batch: int, heads: int, head_dim: int) -> float:
  """4 * head_dim per (query, key) pair of the block pairs on or below the diagonal."""
  nb = -(-n // BLOCK)
  return 4.0 * head_dim * heads * batch * BLOCK * BLOCK * nb * (nb + 1) / 2


def _build_flash(causal: bool):
  def build(n: int, mode: str, batch: int, heads: int, head_dim: int):
    from attention import flash_attention

    return impls_band.jax_step(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, block_size=BLOCK),
        n, mode, batch, heads, head_dim)
  return build


IMPLS = {
    "flash": dict(
        framework="jax", build=_build_flash(False), flops_fwd=impls_band.dense_flops,
        max_n=None, group="flash",
        note="attention.flash_attention(block_size=128): exact n x n attention, O(n) memory"),
    "flash_causal": dict(
        framework="jax", build=_build_flash(True), flops_fwd=causal_flops, max_n=None,
        group="flash", note="attention.flash_attention causal=True, upper block pairs skipped"),
    "dense_ours_flash": dict(
        framework="jax", build=impls_band.build_dense_ours, flops_fwd=impls_band.dense_flops,
        max_n=8192, group="flash",
        note="attention.dot_product_attention (dense reference), [B, H, n, n] scores "
             "(= dense_ours)"),
    "torch_sdpa_flash": dict(
        framework="torch", build=impls_band.build_torch_sdpa, flops_fwd=impls_band.dense_flops,
        max_n=None, group="flash",
        note="torch scaled_dot_product_attention on CPU (flash kernel), full n x n "
             "(= torch_sdpa)"),
}
