"""Logical axis names on parameters.

Every parameter carries logical names (`vocab, embed, heads, head_dim, mlp, length`, or None)
in its `out_sharding` metadata. The config's rules table (`config.axis_rules`, see
`configs/common.py`) maps them to mesh axes; the trainer turns them into `NamedSharding`s and
initialises the parameters directly sharded with `jax.jit(..., out_shardings=...)`. Eager
sharding at creation is off, so models can also be built with no mesh at all (tests, notebooks).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from flax import nnx


def metadata(names: Sequence[str | None]) -> dict[str, Any]:
  """Variable metadata that records logical axis names without sharding eagerly."""
  return {"out_sharding": tuple(names), "eager_sharding": False}


def param(rngs: nnx.Rngs, init: Callable, shape: Sequence[int],
          names: Sequence[str | None]) -> nnx.Param:
  """A parameter `init(key, shape)` with logical axis names."""
  if len(names) != len(shape):
    raise ValueError(f"{len(names)} axis names {tuple(names)} for a {len(shape)}-d shape {shape}.")
  return nnx.Param(init(rngs.params(), tuple(shape)), **metadata(names))
