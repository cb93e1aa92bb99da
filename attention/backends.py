"""Which implementation computes a layer's attention, chosen per kind, pattern and platform.

A kind's record (`attention.kinds`) lists the backends that compute it (`Kind.backends`); each
backend is a module with one function per kind, with the keyword interface of the kind's
portable function, so the layer calls either the same way:

| backend | module | computes | where it is fast |
|---|---|---|---|
| `xla` | the kind's own module | every kind: blocked einsums composed by XLA | everywhere; the CPU default |
| `cudnn` | `attention.cudnn_backend` | dense, causal, padded; causal band (per-head dilation, no global tokens) | GPU, bfloat16/float16 (jax's own cuDNN flash attention) |
| `tokamax` | `attention.tokamax_backend` | dense, causal, padded, band without dilation or globals | GPU, when its kernels build (an optional extra, never picked by `auto`) |
| `splash` | `attention.splash` | every pattern that is a block mask: band (per-head dilation, globals), BigBird, strided/fixed, block-local, block-sparse, dense | TPU (splash attention skips empty blocks) |
| `pallas` | `attention.pallas_band`, `attention.pallas_block_sparse` | band with per-head dilation and global tokens; BigBird, strided/fixed, block-local, block-sparse | GPU (our Pallas kernels) |

`config.model.attention.implementation` is `auto` (the default) or one of those names. `auto`
resolves per layer, at build time, from the platform (`choose`):
- GPU: cudnn for dense layers (`dot_product`, `flash`) and for causal band layers without
  global tokens (the character LMs; dilation included); our Pallas kernels for the other band
  layers (two-sided, or with global tokens) and for the block-pattern kinds (bigbird, sparse,
  block_local, block_sparse); `xla` for the rest. The cudnn functions decide at call time, when
  the dtype is known: float32, a head dimension cuDNN refuses, or padding that is not trailing
  runs the kind's `xla` function (`attention.cudnn_backend`).
- TPU: splash for every kind it computes, `xla` for the rest;
- anywhere else (the CPU): `xla`.
`auto` never picks tokamax: tokamax 0.0.12's Mosaic GPU and Triton kernels do not build on the
jax of our GPU machine (docs/gpu.md), and no tokamax kernel has been measured to beat cuDNN
there; tokamax runs when named, if installed (`pip install .[tokamax]`).
A backend named explicitly must compute the layer's pattern exactly (`check`): asking tokamax
for a dilated band, or cudnn for a two-sided band, is refused in one line, not approximated. On
a platform without the backend's kernels, `splash` and `pallas` run in Pallas interpret mode
(slow; for tests), tokamax runs its XLA implementation and cudnn the kind's `xla` function.

Paths that compute attention their own way use `xla` whatever `auto` says: relative positions
(Transformer-XL), a memory of past segments, the sequence split over devices, MPNet's permutation
masks; naming another backend with those is refused by the config check (`lra.schema`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, Mapping

from attention import kinds

AUTO = "auto"
IMPLEMENTATIONS = (AUTO,) + kinds.BACKENDS

# backend -> module holding its functions (the `xla` functions are the kinds' own), or, for a
# backend split over modules, kind -> module.
MODULES = {"cudnn": "attention.cudnn_backend", "tokamax": "attention.tokamax_backend",
           "splash": "attention.splash",
           "pallas": {"band": "attention.pallas_band",
                      **{kind: "attention.pallas_block_sparse"
                         for kind in ("bigbird", "block_local", "block_sparse", "sparse")}}}
PLATFORMS = ("cpu", "gpu", "tpu")


def _dilated(args: Mapping[str, Any]) -> bool:
  dilation = args.get("dilation", 1)
  values = dilation if isinstance(dilation, (list, tuple)) else (dilation,)
  return any(int(d) != 1 for d in values)


def _tokamax_installed() -> bool:
  return importlib.util.find_spec("tokamax") is not None


def unable(kind: str, backend: str, args: Mapping[str, Any], *, global_tokens: bool = False,
           causal: bool | None = None) -> str | None:
  """None when `backend` computes kind `kind` with config arguments `args` exactly; otherwise
  the reason (one sentence). `global_tokens`: the layer has global tokens (LED's encoder);
  `causal`: the layer is causal (None: not known here, as in the config check, which then
  lets the layer refuse when it is built)."""
  record = kinds.get(kind)
  if backend not in kinds.BACKENDS:
    return f"unknown implementation {backend!r}; valid: {', '.join(IMPLEMENTATIONS)}."
  if backend not in record.backends:
    return (f"attention {kind!r} has no {backend} implementation (it has "
            f"{', '.join(record.backends)}).")
  if backend == "tokamax" and not _tokamax_installed():
    return "tokamax is not installed (it is the optional extra: pip install '.[tokamax]')."
  if backend == "cudnn" and kind == "band":
    if global_tokens:
      return "cuDNN's sliding window has no global tokens."
    if causal is False:
      return "cuDNN's sliding window is one-sided: it computes causal band layers only."
  if backend == "tokamax" and kind == "band":
    if _dilated(args):
      return "tokamax's local window has no dilation."
    if global_tokens:
      return "tokamax's local window has no global tokens."
  if backend == "splash" and kind == "band" and global_tokens and causal:
    return "splash computes global tokens of bidirectional band layers only."
  if kind == "bigbird" and args.get("random_blocks", "drawn") != "drawn" and backend != "xla":
    return "only xla computes bigbird's random_blocks='first' (Hugging Face's inference)."
  # pallas refuses nothing it lists: the band kernel takes every band layer (causal globals
  # included), the block-sparse kernel every argument of bigbird, sparse, block_local and
  # block_sparse (their patterns, causal, padding; sparse's xla block_size is not needed).
  return None


def choose(kind: str, args: Mapping[str, Any] | None = None, *, implementation: str = AUTO,
           platform: str | None = None, global_tokens: bool = False,
           causal: bool | None = None) -> str:
  """The backend of a layer of kind `kind` with config arguments `args` on `platform` (default:
  jax's default backend). `implementation` other than `auto` is checked and returned; an
  impossible one raises ValueError saying what to use instead. `auto` gives a band layer to
  cudnn only when it is known to be causal (`causal=True`)."""
  args = dict(args or {})
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation {implementation!r} is unknown; valid: "
                     f"{', '.join(IMPLEMENTATIONS)}.")
  if implementation != AUTO:
    reason = unable(kind, implementation, args, global_tokens=global_tokens, causal=causal)
    if reason is not None:
      raise ValueError(f"implementation={implementation} for attention {kind!r}: {reason} "
                       f"Use implementation=auto to pick one that does.")
    return implementation
  if platform is None:
    import jax
    platform = jax.default_backend()
  if platform == "gpu":
    if (unable(kind, "cudnn", args, global_tokens=global_tokens, causal=causal) is None
        and (kind != "band" or causal is True)):
      return "cudnn"
    if unable(kind, "pallas", args, global_tokens=global_tokens, causal=causal) is None:
      return "pallas"
  elif platform == "tpu":
    if unable(kind, "splash", args, global_tokens=global_tokens, causal=causal) is None:
      return "splash"
  return "xla"


def function(kind: str, implementation: str = AUTO, *, args: Mapping[str, Any] | None = None,
             platform: str | None = None, global_tokens: bool = False,
             causal: bool | None = None) -> Callable:
  """The function computing kind `kind` through `implementation` (resolved by `choose`), with
  the keyword interface of the kind's portable function."""
  backend = choose(kind, args, implementation=implementation, platform=platform,
                   global_tokens=global_tokens, causal=causal)
  record = kinds.get(kind)
  if backend == "xla":
    import attention
    return attention.get(kind)
  module = MODULES[backend]
  module = module[kind] if isinstance(module, dict) else module
  return getattr(importlib.import_module(module), record.function)


__all__ = ["AUTO", "IMPLEMENTATIONS", "MODULES", "PLATFORMS", "choose", "function", "unable"]
