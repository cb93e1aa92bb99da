"""The `cudnn` backend: dense attention and the causal band through jax's own cuDNN attention.

`jax.nn.dot_product_attention(..., implementation="cudnn")` is cuDNN's fused flash attention,
shipped with jaxlib's CUDA plugin: nothing to install, nothing that has to build against the
installed jax the way a Pallas kernel library does. Its layout is ours, `[B, L, H, D]`, its scale
1/sqrt(D), and it takes the rules we need as arguments, never as an L x L array:
- key padding as `key_value_seq_lengths` (cuDNN's padding mask type), which can express only
  trailing padding (keys `0 .. n-1` real in each example);
- causality as its causal mask type (top-left aligned: key j for query i when j <= i);
- a causal band as `local_window_size=(w, 0)`: jax keeps keys with `i - w <= j <= i` (its XLA
  mask) and passes cuDNN a sliding window of length w + 1, the same pairs. Our band
  (`attention.masks.band_mask`) allows |i - j| <= w, so a causal band of window w is exactly
  `(w, 0)` (tested at the edge: the key w away is in, w + 1 is out).

What each call does, decided when it is traced (dtype, head dimension and platform are static
under jit):
- On a GPU, in bfloat16 or float16, with a head dimension cuDNN takes (a multiple of 8, at most
  128, at most 256 from Hopper on), causal only over equal query and key lengths: cuDNN.
- Otherwise (float32 above all, the CPU, a head dimension cuDNN refuses): the kind's own `xla`
  function, the portable blocked einsums. So `auto` may give a float32 layer to this backend and
  it runs exactly what `implementation=xla` runs.
- The key mask is an array, known only at run time: a `lax.cond` checks that it is trailing
  padding (`trailing_lengths`) and otherwise runs the kind's `xla` function on the same inputs,
  so any padding is computed exactly; the task data pads at the end, so the check costs one
  comparison of a `[B, L]` mask per call.
Padded queries output 0 and a query with no allowed key outputs 0, as in every kind here; an
example with no real key gets length 1 for cuDNN (its rows are zeroed after, and so are their
cotangents, so nothing of it reaches an output or a gradient).

Dilation: a band of per-head dilation d is d interleaved sequences (positions i = t d + r of
residue class r), each an ordinary band of window w over t. Each group of heads sharing a
dilation is reshaped `[B, L, h, D] -> [B d, ceil(L/d), h, D]` (the length padded to a multiple of
d first) and run as one causal window; trailing padding of n real tokens stays trailing in each
class (ceil((n - r) / d) tokens of class r). That is exact for any length and any per-head
dilation; it costs one transpose of q, k, v and the output per group.

Not here, and why (they go to our Pallas band kernel, `attention.pallas_band`):
- Two-sided bands. cuDNN's sliding window is left-sided: jax refuses a right window without the
  causal mask type. A two-sided band from two one-sided passes merged by log-sum-exp needs (a)
  the log-sum-exp of each pass with its gradient, which `jax.nn.dot_product_attention` returns
  only as a residual under `stop_gradient`, so a merge would have wrong gradients without a VJP
  of our own around cuDNN's; and (b) one pass without the diagonal (keys i+1 .. i+w), which
  neither sequence lengths (trailing only) nor the window can express without an L x L mask,
  while subtracting the diagonal's term from a merged sum loses precision when it dominates.
  We could not test such a merge exactly against the dense reference, so it is not built.
- Global tokens: their rows and columns are a second, dense pattern that cuDNN's masks do not
  express.

Tests on the CPU (`tests/cudnn_backend_test.py`) run every function here with
`implementation="xla"`: the same call of `jax.nn.dot_product_attention` with identical arguments,
computed by jax's XLA implementation, against our dense attention with the explicit mask.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attention import band as band_module
from attention import compat, validation
from attention.dot_product import dot_product_attention as _dense
from attention.flash import flash_attention as _flash

# Input dtypes cuDNN's flash attention takes (fp8 aside).
DTYPES = ("bfloat16", "float16")
IMPLEMENTATIONS = ("cudnn", "xla")


def refuses(dtype, head_dim: int, *, q_length: int, k_length: int, causal: bool,
            platform: str | None = None, capability: tuple[int, int] | None = None
            ) -> str | None:
  """None when cuDNN computes a call of this signature; otherwise why not (one sentence), and
  the call runs the kind's `xla` function. `capability`: the GPU's compute capability (read from
  the device when None)."""
  platform = platform or jax.default_backend()
  if platform != "gpu":
    return f"cuDNN runs on a GPU only (this is {platform})."
  name = jnp.dtype(dtype).name
  if name not in DTYPES:
    return f"cuDNN's flash attention takes bfloat16 or float16, not {name}."
  if capability is None:
    capability = compat.gpu_compute_capability()
  largest = 256 if capability is not None and capability >= (9, 0) else 128
  if head_dim % 8 or head_dim > largest:
    return f"cuDNN takes head dimensions that are multiples of 8 up to {largest}, not {head_dim}."
  if causal and q_length != k_length:
    return "causal cross-attention (query and key lengths differ) is left to xla."
  return None


def trailing_lengths(key_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(lengths int32 `[B]`, trailing bool scalar) of a key mask `[B, L]`: the real keys per
  example, and whether they are exactly the first `lengths` positions (padding only at the
  end, the one kind of padding cuDNN's sequence lengths express)."""
  key_mask = jnp.asarray(key_mask, bool)
  lengths = key_mask.sum(axis=1).astype(jnp.int32)
  trailing = jnp.all(key_mask == (jnp.arange(key_mask.shape[1])[None] < lengths[:, None]))
  return lengths, trailing


def _check_implementation(implementation: str | None) -> None:
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}: use None (cuDNN where it computes "
                     f"the call, else xla), 'cudnn' or 'xla'.")


def _jax_attention(q, k, v, *, lengths, causal: bool, window: int | None,
                   implementation: str) -> jax.Array:
  """jax's attention with our rules as its arguments; rows of examples without a real key are
  not zeroed here (the caller zeroes them)."""
  if lengths is not None:
    lengths = jnp.maximum(lengths, 1).astype(jnp.int32)     # cuDNN never sees an empty row
  return jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, key_value_seq_lengths=lengths,
      local_window_size=None if window is None else (window, 0),
      implementation=implementation)


def _zero_rows(out: jax.Array, query_mask: jax.Array | None, lengths: jax.Array | None
               ) -> jax.Array:
  keep = None if query_mask is None else jnp.asarray(query_mask, bool)
  if lengths is not None:
    has_keys = jnp.broadcast_to((lengths > 0)[:, None], out.shape[:2])
    keep = has_keys if keep is None else keep & has_keys
  return out if keep is None else jnp.where(keep[:, :, None, None], out, 0)


def _with_padding_check(fast, exact, key_mask):
  """`fast(lengths)` when `key_mask` is trailing padding (or None), else `exact()`."""
  if key_mask is None:
    return fast(None)
  lengths, trailing = trailing_lengths(key_mask)
  return jax.lax.cond(trailing, lambda: fast(lengths), exact)


def _dense_call(q, k, v, *, causal, key_mask, query_mask, implementation, exact):
  b, lq, lk, _, d = validation.check_qkv(q, k, v)
  query_mask = validation.token_masks(key_mask, query_mask, b, lq, lk)
  _check_implementation(implementation)
  if implementation is None:
    if refuses(q.dtype, d, q_length=lq, k_length=lk, causal=causal) is not None:
      return exact()
    implementation = "cudnn"

  def fast(lengths):
    out = _jax_attention(q, k, v, lengths=lengths, causal=causal, window=None,
                         implementation=implementation)
    return _zero_rows(out, query_mask, lengths).astype(q.dtype)

  return _with_padding_check(fast, exact, key_mask)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask=None,
                          causal: bool = False, key_mask: jax.Array | None = None,
                          query_mask: jax.Array | None = None,
                          implementation: str | None = None) -> jax.Array:
  """`attention.dot_product_attention` through cuDNN (see the module docstring for when it runs
  the `xla` function instead; a general `mask` always does). `implementation`: None (decide),
  "cudnn" or "xla" (jax's XLA implementation of the same call: the tests)."""
  def exact():
    return _dense(q, k, v, mask=mask, causal=causal, key_mask=key_mask, query_mask=query_mask)

  if mask is not None:
    return exact()
  return _dense_call(q, k, v, causal=causal, key_mask=key_mask, query_mask=query_mask,
                     implementation=implementation, exact=exact)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    key_mask: jax.Array | None = None, query_mask: jax.Array | None = None,
                    causal: bool = False, block_mask=None, block_size: int | None = None,
                    implementation: str | None = None) -> jax.Array:
  """`attention.flash_attention` through cuDNN (itself a flash attention; `block_size` is
  cuDNN's to choose); a `block_mask` runs the `xla` function."""
  def exact():
    sizes = {} if block_size is None else {"block_size": block_size}
    return _flash(q, k, v, key_mask=key_mask, query_mask=query_mask, causal=causal,
                  block_mask=block_mask, **sizes)

  if block_mask is not None:
    return exact()
  return _dense_call(q, k, v, causal=causal, key_mask=key_mask, query_mask=query_mask,
                     implementation=implementation, exact=exact)


def _classes(x: jax.Array, d: int) -> jax.Array:
  """`[B, L, h, D] -> [B d, ceil(L/d), h, D]`: row b d + r holds positions r, r + d, ..."""
  b, length, h, e = x.shape
  n = -(-length // d)
  x = jnp.pad(x, ((0, 0), (0, n * d - length), (0, 0), (0, 0)))
  return x.reshape(b, n, d, h, e).transpose(0, 2, 1, 3, 4).reshape(b * d, n, h, e)


def _unclasses(x: jax.Array, batch: int, length: int, d: int) -> jax.Array:
  """The inverse of `_classes`."""
  _, n, h, e = x.shape
  x = x.reshape(batch, d, n, h, e).transpose(0, 2, 1, 3, 4).reshape(batch, n * d, h, e)
  return x[:, :length]


def _class_lengths(lengths: jax.Array | None, length: int, d: int) -> jax.Array | None:
  """The real tokens of each residue class `[B d]` when the first `lengths` of `length`
  positions are real; None when nothing is padded (no key mask and d divides the length)."""
  if d == 1:
    return lengths
  if lengths is None:
    if length % d == 0:
      return None
    lengths = jnp.full((1,), length, jnp.int32)
  r = jnp.arange(d, dtype=jnp.int32)
  per_class = jnp.maximum(0, (lengths[:, None] - r[None] + d - 1) // d)   # [B|1, d]
  return per_class.reshape(-1)


def _band_group(q, k, v, lengths, *, window: int, d: int, implementation: str) -> jax.Array:
  """The causal band of one dilation group `[B, L, h, D]` through jax's attention."""
  b, length = q.shape[:2]
  class_lengths = _class_lengths(lengths, length, d)
  if class_lengths is not None and class_lengths.shape[0] != b * d:
    class_lengths = jnp.tile(class_lengths, b)
  out = _jax_attention(*(_classes(x, d) for x in (q, k, v)), lengths=class_lengths,
                       causal=True, window=window, implementation=implementation)
  return _unclasses(out, b, length, d)


def band_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int,
                   dilation: int | Sequence[int] = 1, causal: bool = False,
                   global_mask: jax.Array | None = None, key_mask: jax.Array | None = None,
                   block_size: int | None = None, max_global: int | None = None,
                   implementation: str | None = None) -> jax.Array:
  """`attention.band_attention` for causal layers without global tokens, as cuDNN's causal
  sliding window `(window, 0)` per dilation group; the two-sided band and global tokens are
  refused (see the module docstring). `block_size` and `max_global` are the xla function's."""
  window = validation.check_window(window)
  if not causal or global_mask is not None:
    what = "two-sided bands" if not causal else "global tokens"
    raise ValueError(f"band attention through the cudnn backend: cuDNN's sliding window has no "
                     f"{what}. Use implementation=pallas (GPU), splash (TPU) or xla.")
  b, length, _, h, d = validation.check_qkv(q, k, v, same_length=True)
  validation.token_masks(key_mask, None, b, length, length)
  dilations = validation.head_dilations(dilation, h)
  _check_implementation(implementation)

  def exact():
    return band_module.band_attention(q, k, v, window=window, dilation=dilation, causal=True,
                                      key_mask=key_mask, block_size=block_size,
                                      max_global=max_global)

  if implementation is None:
    if refuses(q.dtype, d, q_length=length, k_length=length, causal=True) is not None:
      return exact()
    implementation = "cudnn"

  def fast(lengths):
    groups = {}
    for head, dh in enumerate(dilations):
      groups.setdefault(dh, []).append(head)
    out = jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    for dh, heads in groups.items():
      index = np.asarray(heads)
      part = _band_group(q[:, :, index], k[:, :, index], v[:, :, index], lengths,
                         window=window, d=dh, implementation=implementation)
      if len(groups) == 1:
        out = part.astype(q.dtype)
      else:
        out = out.at[:, :, index].set(part.astype(q.dtype))
    return _zero_rows(out, key_mask, lengths).astype(q.dtype)

  return _with_padding_check(fast, exact, key_mask)


__all__ = ["DTYPES", "IMPLEMENTATIONS", "band_attention", "dot_product_attention",
           "flash_attention", "refuses", "trailing_lengths"]
