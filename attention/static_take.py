"""`static_take`: `jnp.take` along an axis for an index list known at trace time, built from
static slices, broadcasts and concatenates, never a gather, with a backward pass of static sums
(the gather-free selection the block-sparse kinds use; gathers are slow on TPU).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp


# --- Static selection along an axis: slices, broadcasts and concatenates, never a gather. ---

def _take_pieces(x: jax.Array, idx: tuple[int, ...], axis: int) -> jax.Array:
  """x taken at the static positions `idx` along `axis`, as one concatenate of slices."""
  pieces, i, n = [], 0, len(idx)
  while i < n:
    start, j = idx[i], i + 1
    if j < n and idx[j] == start:                       # repeated position: broadcast
      while j < n and idx[j] == start:
        j += 1
      piece = jax.lax.slice_in_dim(x, start, start + 1, axis=axis)
      piece = jnp.repeat(piece, j - i, axis=axis)
    else:                                               # consecutive positions: one slice
      while j < n and idx[j] == idx[j - 1] + 1:
        j += 1
      piece = jax.lax.slice_in_dim(x, start, start + (j - i), axis=axis)
    pieces.append(piece)
    i = j
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=axis)


def _untake(ct: jax.Array, idx: tuple[int, ...], num_src: int, axis: int) -> jax.Array:
  """Transpose of `_take_pieces`: sums the cotangent slices back onto their source positions."""
  dests = [[] for _ in range(num_src)]
  for d, s in enumerate(idx):
    dests[s].append(d)
  shape = list(ct.shape)
  pieces, j = [], 0
  while j < num_src:
    first = dests[j]
    k = j + 1
    if not first:                                       # never taken: zeros
      while k < num_src and not dests[k]:
        k += 1
      shape[axis] = k - j
      pieces.append(jnp.zeros(shape, ct.dtype))
      j = k
      continue
    while (k < num_src and len(dests[k]) == len(first)
           and all(a == b + (k - j) for a, b in zip(dests[k], first))):
      k += 1
    length = k - j
    terms = []
    if length == 1:                                     # group contiguous destinations
      a = 0
      while a < len(first):
        b = a + 1
        while b < len(first) and first[b] == first[b - 1] + 1:
          b += 1
        part = jax.lax.slice_in_dim(ct, first[a], first[b - 1] + 1, axis=axis)
        terms.append(jnp.sum(part, axis=axis, keepdims=True) if b - a > 1 else part)
        a = b
    else:
      terms = [jax.lax.slice_in_dim(ct, d, d + length, axis=axis) for d in first]
    pieces.append(functools.reduce(jnp.add, terms))
    j = k
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _static_take_vjp(x, idx, axis, num_src):
  return _take_pieces(x, idx, axis)


def _static_take_fwd(x, idx, axis, num_src):
  return _take_pieces(x, idx, axis), None


def _static_take_bwd(idx, axis, num_src, _, ct):
  return (_untake(ct, idx, num_src, axis),)


_static_take_vjp.defvjp(_static_take_fwd, _static_take_bwd)


def static_take(x: jax.Array, idx: Sequence[int], axis: int) -> jax.Array:
  """`jnp.take(x, idx, axis)` for a static index list, built from slices (gradient included)."""
  idx = tuple(int(i) for i in idx)
  if idx == tuple(range(x.shape[axis])):
    return x
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return _take_pieces(x, idx, axis)
  return _static_take_vjp(x, idx, axis, x.shape[axis])
