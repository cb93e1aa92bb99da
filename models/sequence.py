"""The sequence axis of the mesh: attention over a sequence split across devices.

When the trainer traces a step with a mesh whose `sequence` axis has more than one device (it
enters the mesh with `jax.sharding.use_abstract_mesh`), the encoder pads the length to a
multiple of that size (padding tokens, so nothing changes), constrains the activations to be
split along the length, and every attention layer runs its kind's sequence-parallel primitive
(`attention.sequence_parallel`) under `jax.shard_map`: band attention exchanges halos with its
neighbours, FAVOR+ and linear attention their feature states. Parameters are not split along
the axis. The kind's record names that primitive (`Kind.sequence_parallel`); kinds without one
cannot run split, and the config check refuses them.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "sequence"
BATCH_AXES = ("data", "fsdp")


def devices() -> int:
  """Devices on the sequence axis of the mesh being traced with (1 when there is none)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or AXIS not in mesh.axis_names:
    return 1
  return int(mesh.shape[AXIS])


def _batch_axes(mesh) -> tuple[str, ...] | None:
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
  return axes or None


def split_length(x: jax.Array) -> jax.Array:
  """Constrains `[B, L, ...]` activations to be split along L over the sequence axis."""
  mesh = jax.sharding.get_abstract_mesh()
  spec = P(_batch_axes(mesh), AXIS, *([None] * (x.ndim - 2)))
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def pad_length(x: jax.Array, key_mask: jax.Array, multiple: int):
  """Pads `[B, L, E]` and its `[B, L]` mask with padding positions up to a multiple of
  `multiple`; returns (x, key_mask, L)."""
  length = x.shape[1]
  extra = -length % multiple
  if extra:
    x = jnp.pad(x, ((0, 0), (0, extra), (0, 0)))
    key_mask = jnp.pad(key_mask, ((0, 0), (0, extra)))
  return x, key_mask, length


def attend(kind: str, q, k, v, key_mask, args: Mapping[str, Any]) -> jax.Array:
  """`kind`'s attention of q, k, v `[B, L, H, D]` with L split over the sequence axis."""
  from attention import kinds, sequence_parallel
  name = kinds.get(kind).sequence_parallel
  if name is None:
    split = kinds.names_where(lambda k: k.sequence_parallel)
    raise ValueError(f"attention {kind!r} cannot run with the sequence split over devices; "
                     f"use one of {', '.join(split)}, or mesh.sequence=1.")
  fn = getattr(sequence_parallel, name)
  mesh = jax.sharding.get_abstract_mesh()
  batch = _batch_axes(mesh)
  tokens, mask = P(batch, AXIS, None, None), P(batch, AXIS)
  arrays = {name: value for name, value in args.items() if isinstance(value, jax.Array)}
  static = {name: value for name, value in args.items() if name not in arrays}
  if key_mask is None:
    key_mask = jnp.ones(q.shape[:2], bool)

  def local(q, k, v, key_mask, arrays):
    return fn(q, k, v, key_mask=key_mask, axis_name=AXIS, **static, **arrays)

  return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, mask, P()),
                       out_specs=tokens, check_vma=False)(q, k, v, key_mask, arrays)
