"""The `tokamax` backend: dense, causal, padded and windowed attention through tokamax's kernels.

tokamax (openxla's Pallas kernel library) has one entry, `tokamax.dot_product_attention`, over
the same `[B, L, H, D]` layout as ours, with several implementations behind it: Mosaic GPU
kernels for Hopper and Blackwell, Triton kernels for other GPUs, cuDNN, and two XLA ones
(`xla`, `xla_chunked`) that run anywhere. On a GPU we let tokamax pick (it falls back in that
order when a kernel does not take the inputs); elsewhere we ask for `xla`, which is what the
tests on the CPU run.

What it expresses of our kinds: dense attention (`dot_product`, `flash`), causal or not, key
padding, and a two-sided window `(left, right)` = Longformer's band without dilation or global
tokens. The functions
below have the keyword interface of the kind's portable function and refuse, in one line, what
tokamax cannot compute exactly (`attention.backends.unable` says beforehand which layers it
takes).

Padding: the key mask goes in as a boolean `[B, 1, 1, L]` mask (any padding, not only trailing),
and padded queries output 0 as in every kind here. A row with no allowed key (an all-padding
example) is finite in tokamax and zeroed here.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from attention import validation

def _implementation() -> str | None:
  """None (tokamax picks its fastest kernel) on a GPU, its XLA implementation elsewhere."""
  return None if jax.default_backend() == "gpu" else "xla"


def _tokamax():
  """tokamax, imported on first use (the portable paths never need it). Its options are absl
  flags read on first use, which parses `sys.argv` unless absl has parsed it: our commands take
  their own arguments (`lra run --config.x=y`), so the flags keep their defaults instead."""
  import tokamax
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
            key_mask: jax.Array | None, query_mask: jax.Array | None,
            window: tuple[int, int] | None) -> jax.Array:
  b_, lq, lk, _, _ = validation.check_qkv(q, k, v)
  query_mask = validation.token_masks(key_mask, query_mask, b_, lq, lk)
  mask = None if key_mask is None else key_mask[:, None, None, :]
  out = _tokamax().dot_product_attention(
      q, k, v, mask=mask, is_causal=causal, local_window_size=window,
      implementation=_implementation())
  if query_mask is not None:
    out = jnp.where(query_mask[:, :, None, None], out, 0)
  return out.astype(q.dtype)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask=None,
                          causal: bool = False, key_mask: jax.Array | None = None,
                          query_mask: jax.Array | None = None) -> jax.Array:
  """`attention.dot_product_attention` through tokamax (no general `mask`: it would be dense)."""
  if mask is not None:
    raise ValueError("the tokamax backend takes no general mask (it would be an L x L array): "
                     "use implementation=xla, or a kind whose pattern tokamax expresses.")
  return _attend(q, k, v, causal=causal, key_mask=key_mask, query_mask=query_mask, window=None)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    key_mask: jax.Array | None = None, query_mask: jax.Array | None = None,
                    causal: bool = False, block_mask=None, block_size: int | None = None
                    ) -> jax.Array:
  """`attention.flash_attention` through tokamax; `block_size` is tokamax's to choose."""
  del block_size
  if block_mask is not None:
    raise ValueError("the tokamax backend takes no block_mask: use implementation=xla.")
  return _attend(q, k, v, causal=causal, key_mask=key_mask, query_mask=query_mask, window=None)


def band_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int,
                   dilation: int | Sequence[int] = 1, causal: bool = False,
                   global_mask: jax.Array | None = None, key_mask: jax.Array | None = None,
                   block_size: int | None = None, max_global: int | None = None) -> jax.Array:
  """`attention.band_attention` without dilation or global tokens, as tokamax's two-sided
  local window `(window, window)` (`(window, 0)` when causal)."""
  del block_size, max_global
  window = validation.check_window(window)
  dilations = dilation if isinstance(dilation, (list, tuple)) else (dilation,)
  reason = None
  if any(int(d) != 1 for d in dilations):
    reason = "tokamax's local window has no dilation."
  elif global_mask is not None:
    reason = "tokamax's local window has no global tokens."
  if reason is not None:
    raise ValueError(f"band attention through the tokamax backend: {reason} Use "
                     f"implementation=pallas (GPU), splash (TPU) or xla.")
  validation.check_qkv(q, k, v, same_length=True)
  return _attend(q, k, v, causal=causal, key_mask=key_mask, query_mask=None,
                 window=(window, 0 if causal else window))
