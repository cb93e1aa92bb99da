"""The one place where this codebase meets differences between the jax versions it runs on.

We pin jax 0.10.2 (`setup.py`) and also run on jax 0.11.x, the version of the GPU machine we
measure on, whose jaxlib and CUDA plugin cannot be replaced there. What changed between the two
that this codebase touches, read from jax's CHANGELOG for 0.11.0 and the unreleased notes after
it, and from a diff of jax's public modules between the tags:

- jax 0.11 drops Python 3.11 (our pin supports it; the GPU machine runs 3.12): nothing to shim,
  pip picks the jax that fits the interpreter.
- `jax.numpy.empty` / `empty_like` return uninitialised memory from 0.11 on (zeros before). This
  codebase uses neither; use `jnp.zeros` where zeros are meant.
- `jax.core` loses most of its deprecated names in 0.11 (`Tracer` stays, but `jax.core` is being
  emptied step by step): the tracer test lives here (`is_tracer`).
- `jax.checkpoint_policies` becomes a module instead of a namespace object; attribute access
  (`getattr(jax.checkpoint_policies, name)`) works on both.
- Private modules (`jax._src...`) move freely between releases: the jaxpr pass that the FLOP
  counter uses comes from the public `jax.interpreters.partial_eval` here (`dce_jaxpr`), and the
  jaxpr types from `jax.extend.core` (`jaxpr_types`). One private name is read, here only:
  the coordination client `jax.distributed.initialize` starts (`distributed_client`, for
  barriers with our own timeout), `jax._src.distributed.global_state.client` in 0.10 and 0.11.
- `jax.nn.dot_product_attention` (with `query_seq_lengths`, `key_value_seq_lengths`,
  `local_window_size`, `is_causal` and `implementation="cudnn"`: `attention.cudnn_backend`),
  `jax.shard_map`, `jax.sharding`, `jax.experimental.pallas`
  (`pallas_call`, `BlockSpec`, interpret mode) and the splash attention module keep their
  signatures over that range.

Supported range: jax and jaxlib >= 0.10.2, < 0.12 (`SUPPORTED`). flax, optax and orbax newer
than our pins are not shimmed: `benchmarks/device_check.py env` imports every module of the
codebase on the device and records their versions, so a difference shows there first.

Nothing else in the codebase may branch on a jax version; add the difference here instead.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

import jax

# [lowest, first unsupported) jax version.
SUPPORTED = ((0, 10, 2), (0, 12, 0))


def version_tuple(text: str) -> tuple[int, ...]:
  """(major, minor, patch) of a version string such as "0.11.2" or "0.11.2.dev20260801"."""
  return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


JAX_VERSION = version_tuple(jax.__version__)


def supported(version: tuple[int, ...] = JAX_VERSION) -> bool:
  """Whether `version` of jax is in the supported range."""
  return SUPPORTED[0] <= tuple(version) < SUPPORTED[1]


def is_tracer(x: Any) -> bool:
  """Whether `x` is a jax tracer (an abstract value under jit, grad or vmap), not a concrete
  array or NumPy value."""
  return isinstance(x, jax.core.Tracer)


def dce_jaxpr(jaxpr: Any, used_outputs: list[bool]) -> tuple[Any, list[bool]]:
  """Dead-code elimination of an (open) jaxpr: (pruned jaxpr, which inputs are used)."""
  from jax.interpreters import partial_eval

  return partial_eval.dce_jaxpr(jaxpr, used_outputs)


def jaxpr_types() -> tuple[type, type]:
  """(ClosedJaxpr, Jaxpr), the classes of jaxprs nested in an equation's parameters."""
  from jax.extend import core

  return core.ClosedJaxpr, core.Jaxpr


def distributed_client() -> Any:
  """The coordination service client of `jax.distributed.initialize()` (its `wait_at_barrier`),
  or None before it started."""
  from jax._src import distributed   # no public accessor in 0.10-0.11

  return distributed.global_state.client


def gpu_compute_capability() -> tuple[int, int] | None:
  """(major, minor) CUDA compute capability of the first GPU (9.0 for Hopper), or None when
  jax has no GPU or the device does not say (the attribute is jaxlib's CUDA device's)."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  text = str(getattr(devices[0], "compute_capability", "") or "") if devices else ""
  numbers = re.findall(r"\d+", text)
  return (int(numbers[0]), int(numbers[1] if len(numbers) > 1 else 0)) if numbers else None


def _dist_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def versions() -> dict[str, str | None]:
  """Versions of the numerical stack (None where a package is not installed), the platform jax
  runs on and, on a GPU, the CUDA version its plugin reports."""
  out = {name: _dist_version(name) for name in (
      "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "tokamax",
      "jax-cuda13-plugin", "jax-cuda12-plugin")}
  out["jax"] = jax.__version__
  try:
    from jax.extend import backend as backends
    backend = backends.get_backend()
    out["platform"] = backend.platform
    out["platform_version"] = str(backend.platform_version)
  except Exception:  # no backend could be initialised: the caller reports that
    out["platform"] = out["platform_version"] = None
  return out


__all__ = ["JAX_VERSION", "SUPPORTED", "dce_jaxpr", "gpu_compute_capability", "is_tracer",
           "jaxpr_types", "supported", "version_tuple", "versions"]
