"""Band (Longformer) attention and its peers for `benchmarks/attention.py`.

The comparison is the issue's: one-sided window 256 (each query sees up to 513 keys), float32,
inputs `[batch, n, heads, head_dim]`. Implementations:
  * `band`: `attention.band_attention` (blocked einsums, linear in n).
  * `dense_jax`: `jax.nn.dot_product_attention(implementation="xla")`, full n x n attention.
  * `dense_ours`: `attention.dot_product_attention`, our dense reference, full n x n.
  * `torch_sdpa`: `torch.nn.functional.scaled_dot_product_attention` on CPU, full n x n (its CPU
    flash kernel does not materialise the scores, so memory is linear).
  * `hf_longformer`: the attention core of Hugging Face `LongformerSelfAttention` (window 256
    each side, `attention_window=512`). The module's query/key/value `Linear` layers are
    replaced by modules that return the fixed q, k, v, so everything else in its `forward`
    runs unchanged: its scaling, sliding-chunks score matmul, its own padding mask (built by a
    second sliding-chunks matmul), float32 softmax, masked-row fill and sliding-chunks
    probability x value matmul. The query module returns a copy of q because `forward` scales
    the query in place (one `[n, 512]` copy, well under 1% of the time).

Every `build` imports its framework lazily, so the harness process itself never loads JAX or
PyTorch. The dense peers count the FLOPs of the full n x n pattern (what they compute); band and
HF Longformer count the exact band pattern.
"""

from __future__ import annotations

import math

import numpy as np

WINDOW = 256  # one-sided window, as in the Longformer paper's character LM (HF attention_window=512)
SEED = 0


def band_pairs(n: int, window: int = WINDOW) -> int:
  """Number of allowed (query, key) pairs of the non-causal band |i - j| <= window at length n.

  Counted per query analytically (no n x n array): query i sees keys max(0, i - w) ..
  min(n - 1, i + w).
  """
  i = np.arange(n, dtype=np.int64)
  return int(np.sum(np.minimum(n - 1, i + window) - np.maximum(0, i - window) + 1))


def band_flops(n: int, batch: int, heads: int, head_dim: int) -> float:
  """Forward FLOPs of the exact window-256 band: 4 * head_dim per allowed pair per head."""
  return 4.0 * head_dim * heads * batch * band_pairs(n)


def dense_flops(n: int, batch: int, heads: int, head_dim: int) -> float:
  """Forward FLOPs of full attention: 4 * head_dim per (query, key) pair per head."""
  return 4.0 * head_dim * heads * batch * float(n) * float(n)


# ------------------------------------------------------------------------------------------------
# JAX


def jax_step(attend, n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Compiles `attend(q, k, v)` (mode "fwd") or its VJP w.r.t. q, k, v (mode "fwdbwd")."""
  import jax
  import jax.numpy as jnp

  kq, kk, kv, kc = jax.random.split(jax.random.key(SEED), 4)
  shape = (batch, n, heads, head_dim)                                # [B, L, H, D]
  q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in (kq, kk, kv))
  if mode == "fwd":
    fn = jax.jit(attend)
    args = (q, k, v)
  elif mode == "fwdbwd":
    ct = jax.random.normal(kc, shape, jnp.float32)                  # output cotangent

    def fwd_bwd(q, k, v, ct):
      out, vjp = jax.vjp(attend, q, k, v)
      return out, vjp(ct)                                            # (out, (dq, dk, dv))

    fn = jax.jit(fwd_bwd)
    args = (q, k, v, ct)
  else:
    raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}.")
  compiled = fn.lower(*args).compile()                               # compile inside build

  def step():
    jax.block_until_ready(compiled(*args))

  return step


def build_band(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of `attention.band_attention` with window 256."""
  from attention import band_attention

  return jax_step(lambda q, k, v: band_attention(q, k, v, window=WINDOW), n, mode, batch,
                   heads, head_dim)


def build_dense_jax(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of `jax.nn.dot_product_attention(implementation="xla")`, full attention."""
  import jax

  return jax_step(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
                   n, mode, batch, heads, head_dim)


def build_dense_ours(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of `attention.dot_product_attention`, full attention."""
  from attention import dot_product_attention

  return jax_step(dot_product_attention, n, mode, batch, heads, head_dim)


# ------------------------------------------------------------------------------------------------
# PyTorch


def _torch_inputs(n: int, batch: int, heads: int, head_dim: int, layout: str):
  """Fixed random float32 q, k, v and output cotangent; layout "bhld" or "lbe" (HF)."""
  import torch

  gen = torch.Generator().manual_seed(SEED)
  if layout == "bhld":
    shape = (batch, heads, n, head_dim)
  else:  # HF LongformerSelfAttention works on [L, B, H * D] after its transpose
    shape = (n, batch, heads * head_dim)
  q, k, v, ct = (torch.randn(shape, generator=gen, dtype=torch.float32) for _ in range(4))
  if layout != "bhld":
    ct = ct.transpose(0, 1).reshape(batch, n, heads * head_dim)      # module output [B, L, E]
  return q, k, v, ct


def _torch_step(attend, q, k, v, ct, mode: str):
  """Runs `attend(q, k, v)` without autograd ("fwd") or with grads w.r.t. q, k, v ("fwdbwd")."""
  import torch

  if mode == "fwd":
    def step():
      with torch.inference_mode():
        attend(q, k, v)
  elif mode == "fwdbwd":
    for x in (q, k, v):
      x.requires_grad_(True)

    def step():
      out = attend(q, k, v)
      torch.autograd.grad(out, (q, k, v), ct)
  else:
    raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}.")
  return step


def build_torch_sdpa(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of `torch.nn.functional.scaled_dot_product_attention` (CPU), full attention."""
  import torch

  q, k, v, ct = _torch_inputs(n, batch, heads, head_dim, "bhld")
  return _torch_step(torch.nn.functional.scaled_dot_product_attention, q, k, v, ct, mode)


def build_hf_longformer(n: int, mode: str, batch: int, heads: int, head_dim: int):
  """Step of HF `LongformerSelfAttention` with its q/k/v projections replaced by the inputs."""
  import torch
  from transformers import LongformerConfig
  from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

  attention_window = 2 * WINDOW
  if n % attention_window:
    raise ValueError(f"HF LongformerSelfAttention needs n to be a multiple of attention_window="
                     f"{attention_window} (LongformerModel pads to it); got n={n}.")
  config = LongformerConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                            attention_window=[attention_window], attention_probs_dropout_prob=0.0)
  module = LongformerSelfAttention(config, layer_id=0).eval()
  q, k, v, ct = _torch_inputs(n, batch, heads, head_dim, "lbe")    # [L, B, E]

  class Fixed(torch.nn.Module):
    """Stands in for a projection: returns a fixed tensor (copied when `forward` mutates it)."""

    def __init__(self, index: int, copy: bool):
      super().__init__()
      self.index, self.copy = index, copy
      self.tensors = None

    def forward(self, hidden_states):
      x = self.tensors[self.index]
      return x.clone() if self.copy else x

  fixed = [Fixed(0, copy=True), Fixed(1, copy=False), Fixed(2, copy=False)]
  module.query, module.key, module.value = fixed
  hidden = torch.zeros(batch, n, heads * head_dim)                   # only its shape is used
  attention_mask = torch.zeros(batch, n)                             # 0 = local attention
  no = torch.zeros(batch, n, dtype=torch.bool)

  def attend(q, k, v):
    for f in fixed:
      f.tensors = (q, k, v)
    return module(hidden, attention_mask=attention_mask, is_index_masked=no,
                  is_index_global_attn=no, is_global_attn=False)[0]  # [B, L, E]

  return _torch_step(attend, q, k, v, ct, mode)


IMPLS = {
    "band": dict(
        framework="jax", build=build_band, flops_fwd=band_flops, max_n=None, group="band",
        note="attention.band_attention(q, k, v, window=256), jit-compiled in build"),
    "dense_jax": dict(
        framework="jax", build=build_dense_jax, flops_fwd=dense_flops, max_n=8192, group="band",
        note='jax.nn.dot_product_attention(implementation="xla"), full n x n attention'),
    "dense_ours": dict(
        framework="jax", build=build_dense_ours, flops_fwd=dense_flops, max_n=8192, group="band",
        note="attention.dot_product_attention (dense reference), full n x n attention"),
    "torch_sdpa": dict(
        framework="torch", build=build_torch_sdpa, flops_fwd=dense_flops, max_n=None,
        group="band",
        note="torch scaled_dot_product_attention on CPU (flash kernel), full n x n attention"),
    "hf_longformer": dict(
        framework="torch", build=build_hf_longformer, flops_fwd=band_flops, max_n=None,
        group="band",
        note="HF LongformerSelfAttention (attention_window=512) with q/k/v Linear layers "
             "replaced by the inputs: its own masking, fp32 softmax, sliding-chunks matmuls"),
}
