"""Per-attention-kind extra state owned by the multi-head layer, as one literal table.

Most primitives in `attention.REGISTRY` need only q, k, v and their config arguments. A few need
arrays that belong to the layer: FAVOR+ random features (fixed, non-trainable), Linformer's
length projections, Synthesizer's synthetic logits, LSH's hashing key. `EXTRAS` maps such a kind
to a small module that creates them; at call time `extra_kwargs(...)` returns the keyword
arguments handed to the primitive. Config arguments a module consumes itself (for example
`num_features` or `sharing`) are listed in its `CONSUMES` and are not forwarded.

`NOT_CAUSAL` names the kinds that cannot be causal, with the reason (used by the language-model
config validation).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import attention
from models.sharding import param

NOT_CAUSAL = {
    "linformer": "Linformer projects keys and values along the length axis, so every "
                 "compressed key mixes future positions; it cannot be causal.",
}


class Buffer(nnx.Variable):
  """A non-trainable array that belongs to the model (kept out of the optimizer)."""


class FavorFeatures(nnx.Module):
  """FAVOR+ random features `[num_features, head_dim]`, drawn once from the layer's key."""

  CONSUMES = ("num_features",)

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs):
    del num_heads, max_length
    num_features = int(args.get("num_features", 256))
    self.features = Buffer(attention.favor_features(rngs.params(), num_features, head_dim))

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length, rng
    return {"features": self.features[...]}


class LinformerProjections(nnx.Module):
  """Linformer length projections E (keys) and F (values), `[max_length, k]` each.

  `sharing` (config): "none" (separate E and F, shared by the heads), "headwise" (separate E and
  F per head, `[H, max_length, k]`), "kv" (E = F), "layer" (one E = F shared by every layer; the
  encoder hands the same module to each layer). `k` is the projected length.
  """

  CONSUMES = ("k", "sharing")
  SHARINGS = ("none", "headwise", "kv", "layer")

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs):
    del head_dim
    sharing = args.get("sharing", "none")
    if sharing not in self.SHARINGS:
      raise ValueError(
          f"unknown Linformer sharing {sharing!r}; valid: {', '.join(self.SHARINGS)}.")
    rank = int(args.get("k", 32))
    init = nnx.initializers.normal(max_length ** -0.5)
    if sharing == "headwise":
      shape, names = (num_heads, max_length, rank), ("heads", "length", None)
    else:
      shape, names = (max_length, rank), ("length", None)
    self.proj_k = param(rngs, init, shape, names)
    self.proj_v = param(rngs, init, shape, names) if sharing in ("none", "headwise") else None

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length, rng  # the primitive uses the first L rows of the [.., max_length, k] arrays
    proj_k = self.proj_k[...]
    return {"proj_k": proj_k, "proj_v": proj_k if self.proj_v is None else self.proj_v[...]}


class SynthesizerLogits(nnx.Module):
  """Synthesizer's learned attention logits: dense random `[H, L, L]` or factorised `[H, L, k]`.

  `mode` (config): "random" or "factorized_random" (with rank `k`).
  """

  CONSUMES = ("k",)

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs):
    del head_dim
    self.factorized = args.get("mode", "random") == "factorized_random"
    init = nnx.initializers.normal(1.0)
    names = ("heads", "length", None)
    if self.factorized:
      rank = int(args.get("k", 32))
      self.factor_a = param(rngs, init, (num_heads, max_length, rank), names)
      self.factor_b = param(rngs, init, (num_heads, max_length, rank), names)
    else:
      self.logits = param(rngs, init, (num_heads, max_length, max_length), names)

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del rng
    if self.factorized:
      return {"factor_a": self.factor_a[...][:, :length], "factor_b": self.factor_b[...][:, :length]}
    return {"logits": self.logits[...][:, :length, :length]}


class LshKey(nnx.Module):
  """LSH hashes with fresh rotations each step (from the step key) and a fixed key in eval."""

  CONSUMES = ()

  def __init__(self, args: dict, *, num_heads: int, head_dim: int, max_length: int,
               rngs: nnx.Rngs):
    del args, num_heads, head_dim, max_length
    self.eval_key = Buffer(jax.random.key_data(rngs.params()))

  def __call__(self, *, length: int, rng) -> dict[str, Any]:
    del length
    key = jax.random.wrap_key_data(self.eval_key[...]) if rng is None else rng
    return {"key": key}


# Kind name in attention.REGISTRY -> module creating the layer-owned arrays that kind needs.
EXTRAS = {
    "favor": FavorFeatures,
    "linformer": LinformerProjections,
    "synthesizer": SynthesizerLogits,
    "lsh": LshKey,
}

# Kinds whose query and key projections are one shared projection (Reformer's shared-QK).
SHARED_QK = ("lsh",)


def make_extras(kind: str, args: dict, *, num_heads: int, head_dim: int, max_length: int,
                rngs: nnx.Rngs) -> nnx.Module | None:
  """Builds the extras module for `kind`, or None when the kind needs none."""
  cls = EXTRAS.get(kind)
  if cls is None:
    return None
  return cls(args, num_heads=num_heads, head_dim=head_dim, max_length=max_length, rngs=rngs)


def consumed_args(kind: str) -> tuple[str, ...]:
  """Config arguments of `kind` that the layer consumes instead of forwarding."""
  cls = EXTRAS.get(kind)
  return cls.CONSUMES if cls is not None else ()
