"""The `tokamax` backend: dense, causal, padded and windowed attention through tokamax's kernels.

tokamax (openxla's Pallas kernel library) has one entry, `tokamax.dot_product_attention`, over
the same `[B, L, H, D]` layout as ours, with several implementations behind it: Mosaic GPU
kernels for Hopper and Blackwell, Triton kernels for other GPUs, cuDNN, and two XLA ones
(`xla`, `xla_chunked`) that run anywhere. On a GPU we pass tokamax the list mosaic, triton,
cudnn, xla (it takes the first that accepts the inputs, moving on when one raises
NotImplementedError), less those that do not build on this jax (below); elsewhere we ask for
`xla`, which is what the tests on the CPU run.

tokamax is an optional extra (`pip install '.[tokamax]'`), imported on first use, and this backend
runs only when named (`implementation=tokamax`): `auto` sends dense layers and causal band layers
on a GPU to jax's own cuDNN attention (`attention.cudnn_backend`), which needs nothing that has to
build against the installed jax, and no tokamax kernel has been measured to beat it on our GPU.

**Implementations that do not build.** tokamax's Pallas kernels follow jax's Pallas API closely,
and a tokamax release can fail on a newer jax not by refusing the inputs (which tokamax handles)
but with an error of Python or of lowering: tokamax 0.0.12 on jax 0.11.2 (our GPU machine), its
Mosaic GPU kernel raises `TypeError: Mesh.__init__() got an unexpected keyword argument
'out_shape'` and its Triton kernel `AttributeError: pl.dot was deprecated`, so every dense and
band layer failed there (docs/gpu.md). So on a GPU each implementation is first built once, for
the forward and backward pass, on tiny inputs of the call's dtype, head dimension, causality,
window and masking (`implementations`; a few compiles, cached per signature): one that fails with
anything but NotImplementedError is dropped, with one log line naming it and its error, and the
others run in tokamax's order. `fast_kernels()` says whether a Mosaic GPU or Triton kernel
builds: without one, tokamax's window is its XLA implementation, an L x L mask, and naming
tokamax for a band layer there buys nothing over `xla`.

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

import functools
import logging
from typing import Sequence

import jax
import jax.numpy as jnp

from attention import validation

_log = logging.getLogger(__name__)

# tokamax's implementations on a GPU, in the order it tries them; `xla` is never dropped.
GPU_ORDER = ("mosaic", "triton", "cudnn", "xla")
FAST = ("mosaic", "triton")
# The tiny inputs an implementation is built on: [B, L, H] (D is the call's).
_PROBE_SHAPE = (1, 128, 2)


def _builds(implementation: str, dtype: str, head_dim: int, causal: bool,
            window: tuple[int, int] | None, masked: bool) -> BaseException | None:
  """None when tokamax's `implementation` builds (lowers and compiles, forward and backward) on
  tiny inputs of this signature or refuses them with NotImplementedError (tokamax then moves on
  by itself); otherwise the error."""
  b, length, heads = _PROBE_SHAPE
  x = jax.ShapeDtypeStruct((b, length, heads, head_dim), jnp.dtype(dtype))
  mask = jax.ShapeDtypeStruct((b, 1, 1, length), jnp.bool_) if masked else None

  def loss(q, k, v, m):
    out = _tokamax().dot_product_attention(q, k, v, mask=m, is_causal=causal,
                                           local_window_size=window,
                                           implementation=implementation)
    return out.astype(jnp.float32).sum()

  try:
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, x, x, mask).compile()
  except NotImplementedError:
    return None
  except Exception as e:  # noqa: BLE001  any failure to build means: do not use it here
    return e
  return None


@functools.lru_cache(maxsize=None)
def _usable(order: tuple[str, ...], dtype: str, head_dim: int, causal: bool,
            window: tuple[int, int] | None, masked: bool) -> tuple[str, ...]:
  """The implementations of `order` that build for this signature (`_builds`), once each."""
  kept = []
  for implementation in order:
    error = None if implementation == "xla" else _builds(implementation, dtype, head_dim,
                                                          causal, window, masked)
    if error is None:
      kept.append(implementation)
    else:
      message = str(error).splitlines()[0] if str(error) else ""
      _log.warning("tokamax %s does not build here (jax %s; %s, head dim %d): %s: %s; "
                   "using the next of %s", implementation, jax.__version__, dtype, head_dim,
                   type(error).__name__, message[:200], ", ".join(order))
  return tuple(kept)


def implementations(dtype, head_dim: int, *, causal: bool = False,
                    window: tuple[int, int] | None = None, masked: bool = False,
                    platform: str | None = None) -> tuple[str, ...] | str:
  """What we ask tokamax for, for a call of this signature: on a GPU the implementations of
  `GPU_ORDER` that build on this jax (a tuple, in that order); elsewhere "xla"."""
  if (platform or jax.default_backend()) != "gpu":
    return "xla"
  return _usable(GPU_ORDER, jnp.dtype(dtype).name, int(head_dim), bool(causal),
                 None if window is None else tuple(int(w) for w in window), bool(masked))


def fast_kernels(dtype="bfloat16", head_dim: int = 64) -> bool:
  """Whether a tokamax kernel (Mosaic GPU or Triton) builds here for a two-sided window: on a
  GPU, the probe of `implementations`; elsewhere True (there is no kernel to probe)."""
  usable = implementations(dtype, head_dim, window=(8, 8))
  return usable == "xla" or any(i in FAST for i in usable)


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
      implementation=implementations(q.dtype, q.shape[-1], causal=causal, window=window,
                                     masked=mask is not None))
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
