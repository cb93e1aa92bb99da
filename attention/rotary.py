"""Rotary position embeddings (RoFormer, Su et al. 2021) for queries and keys.

Feature pairs (f, f + D/2) of a head vector at position i are rotated by the angle i * theta_f
with theta_f = base^(-2f/D). This is the half-split pairing of GPT-NeoX (and of Hugging Face's
`rotate_half`); RoFormer's paper and code pair neighbouring features (2f, 2f + 1) instead.
The two differ only by a fixed permutation of each head's features, so weights trained with
interleaved pairs load by permuting the output features of their query and key projections
(`half_split_order`, docs/positions.md). Then `rotate(q, i) . rotate(k, j) = q . R(j - i) k`:
the logits depend on the positions only through i - j, whatever attention kind consumes the
rotated q and k.

Angles are computed in float64 on the host on every path, so position 100,000 is as exact as
position 1 (computing i * theta in float32 would lose about i * 1e-7 radians, 4e-3 at 100,000):
* positions 0 .. L-1 (no `positions`): a float64 table of cosines and sines, stored as float32.
* explicit `positions` (MPNet's permuted positions; concrete or traced integers in
  [0, 2^20)): each position is split as p = 1024 a + b, and the rotation by p theta is the
  rotation by 1024 a theta composed with the rotation by b theta, both read from float64 tables
  of 1024 rows (the angle-addition formulas, one float32 product each: about 1e-7 from the exact
  cosine at any position).
`base` sets the longest wavelength, 2 pi base: 10,000 (RoFormer) covers tens of thousands of
positions; raise it for longer sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from attention import compat

DEFAULT_BASE = 10000.0
# Explicit positions are split as p = _SPLIT * a + b (a, b < _SPLIT): exact below _SPLIT ** 2.
_SPLIT = 1024
MAX_POSITION = _SPLIT * _SPLIT - 1


def _frequencies(dim: int, base: float) -> np.ndarray:
  """theta_f = base^(-2f/D), f = 0 .. D/2 - 1, in float64."""
  if dim % 2:
    raise ValueError(f"rotary positions need an even head dimension, got {dim}.")
  return base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


def rotary_tables(length: int, dim: int, base: float = DEFAULT_BASE,
                  offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(cos, sin), each `[length, dim // 2]` float32, for positions offset .. offset + length - 1."""
  inv = _frequencies(dim, base)                                            # [D/2]
  angles = (np.arange(length, dtype=np.float64) + offset)[:, None] * inv[None, :]
  return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _integer_positions(positions: ArrayLike) -> jax.Array:
  """`positions` as int32; concrete ones are checked to be integers in [0, MAX_POSITION]."""
  if compat.is_tracer(positions):
    if not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"rotary positions must be integers, got dtype {positions.dtype}; pass "
                       f"them as int32.")
    return positions.astype(jnp.int32)
  p = np.asarray(positions)
  if p.size and (not np.all(p == np.round(p)) or p.min() < 0 or p.max() > MAX_POSITION):
    raise ValueError(f"rotary positions must be integers in [0, {MAX_POSITION}], got values "
                     f"from {p.min()} to {p.max()}.")
  return jnp.asarray(p.astype(np.int32))


def position_cos_sin(positions: ArrayLike, dim: int,
                     base: float = DEFAULT_BASE) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) `[L, dim // 2]` float32 of the angles p * theta_f for integer `positions` `[L]`
  (concrete or traced), from float64 tables by angle addition (p = 1024 a + b)."""
  pos = _integer_positions(positions)
  inv = _frequencies(dim, base)
  steps = np.arange(_SPLIT, dtype=np.float64)[:, None]
  low, high = steps * inv[None, :], steps * _SPLIT * inv[None, :]         # [1024, D/2] each
  as32 = lambda t: jnp.asarray(t.astype(np.float32))
  cos_b, sin_b = as32(np.cos(low))[pos % _SPLIT], as32(np.sin(low))[pos % _SPLIT]
  cos_a, sin_a = as32(np.cos(high))[pos // _SPLIT], as32(np.sin(high))[pos // _SPLIT]
  return cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b


def half_split_order(dim: int) -> np.ndarray:
  """The feature order that takes a head vector with interleaved rotary pairs (2f, 2f + 1) to
  this module's half-split pairs (f, f + D/2): `ours = theirs[..., half_split_order(D)]`.

  Applied to the output features of both the query and the key projection (per head), it loads
  weights trained with RoFormer's interleaved rotation: the logits are unchanged.
  """
  if dim % 2:
    raise ValueError(f"rotary positions need an even head dimension, got {dim}.")
  return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


def apply_rotary(x: jax.Array, base: float = DEFAULT_BASE,
                 positions: ArrayLike | None = None) -> jax.Array:
  """Rotates `x: [B, L, H, D]` by its positions (0 .. L-1 unless integer `positions` `[L]`)."""
  length, dim = x.shape[1], x.shape[-1]
  if positions is None:
    cos, sin = (jnp.asarray(t) for t in rotary_tables(length, dim, base))    # [L, D/2]
  else:
    cos, sin = position_cos_sin(positions, dim, base)                        # [L, D/2]
  cos, sin = cos[None, :, None, :], sin[None, :, None, :]                    # [1, L, 1, D/2]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)
