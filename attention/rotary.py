"""Rotary position embeddings (RoFormer, Su et al. 2021) for queries and keys.

Feature pairs (f, f + D/2) of a head vector at position i are rotated by the angle i * theta_f
with theta_f = base^(-2f/D) (the GPT-NeoX half-split layout). Then
`rotate(q, i) . rotate(k, j) = q . R(j - i) k`: the logits depend on the positions only through
i - j, whatever attention kind consumes the rotated q and k. The angles are computed in float64
on the host and stored as float32 cosines and sines, so position 100,000 is as exact as position
1 (computing i * theta in float32 would lose about i * 1e-7 radians). `base` sets the longest
wavelength, 2 pi base: 10,000 (RoFormer) covers tens of thousands of positions; raise it for
longer sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

DEFAULT_BASE = 10000.0


def rotary_tables(length: int, dim: int, base: float = DEFAULT_BASE,
                  offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(cos, sin), each `[length, dim // 2]` float32, for positions offset .. offset + length - 1."""
  if dim % 2:
    raise ValueError(f"rotary positions need an even head dimension, got {dim}.")
  inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)             # [D/2]
  angles = (np.arange(length, dtype=np.float64) + offset)[:, None] * inv[None, :]
  return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rotary(x: jax.Array, base: float = DEFAULT_BASE,
                 positions: ArrayLike | None = None) -> jax.Array:
  """Rotates `x: [B, L, H, D]` by its positions (0 .. L-1 unless `positions` `[L]` given)."""
  length, dim = x.shape[1], x.shape[-1]
  if positions is None:
    cos, sin = (jnp.asarray(t) for t in rotary_tables(length, dim, base))    # [L, D/2]
  else:
    inv = jnp.asarray(base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim), jnp.float32)
    angles = jnp.asarray(positions, jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
  cos, sin = cos[None, :, None, :], sin[None, :, None, :]                    # [1, L, 1, D/2]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)
