"""Argument checks shared by the attention primitives.

Every public primitive validates its inputs here before tracing anything heavy, so that a wrong
shape or an impossible setting fails with a message that says what is wrong and what to pass
instead, rather than with an XLA shape error deep inside an einsum.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.typing import ArrayLike

from attention import compat


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, *,
              same_length: bool = False) -> tuple[int, int, int, int, int]:
  """Checks `q, k, v: [batch, length, heads, head_dim]`; returns (B, Lq, Lk, H, D)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have shape [batch, length, heads, head_dim], got shape {tuple(x.shape)} "
          f"({x.ndim} dims).")
  b, lq, h, d = q.shape
  if k.shape[0] != b or k.shape[2] != h or k.shape[3] != d:
    raise ValueError(
        f"q and k must agree in batch, heads and head_dim: q {tuple(q.shape)}, k {tuple(k.shape)}.")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(
        f"k and v must agree in batch, length and heads: k {tuple(k.shape)}, v {tuple(v.shape)}.")
  lk = k.shape[1]
  if same_length and lq != lk:
    raise ValueError(
        f"this attention is self-attention: q and k must have the same length, got {lq} and {lk}.")
  return b, lq, lk, h, d


def check_token_mask(name: str, mask: ArrayLike | None, batch: int, length: int) -> None:
  """Checks a per-token boolean mask of shape [batch, length]."""
  if mask is None:
    return
  shape = tuple(np.shape(mask))
  if shape != (batch, length):
    raise ValueError(
        f"{name} must have shape [batch, length] = ({batch}, {length}), got {shape}.")
  dtype = np.dtype(mask.dtype if hasattr(mask, "dtype") else np.asarray(mask).dtype)
  if dtype != np.bool_:
    raise ValueError(f"{name} must be boolean (True = real token), got dtype {dtype}.")


def positive_int(name: str, value) -> int:
  """`value` as an int, or ValueError naming `name` when it is not a positive int."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}.")
  return int(value)


def tile_side(name: str, value, min_tile: int) -> int | None:
  """`value` as an int when it is a power of two >= `min_tile` (a kernel's tile side), None when
  None; else ValueError naming `name`."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < min_tile \
      or value & (value - 1):
    raise ValueError(f"{name} must be a power of two >= {min_tile} (a Triton tile side) or None, "
                     f"got {value!r}.")
  return int(value)


def num_warps(value) -> int | None:
  """A Triton launch's warps per program: a power of two from 1 to 32, or None."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= 32 \
      or value & (value - 1):
    raise ValueError(f"num_warps must be a power of two from 1 to 32 (warps per Triton program) "
                     f"or None, got {value!r}.")
  return int(value)


def num_stages(value) -> int | None:
  """A Triton launch's software-pipelining stages: an int from 1 to 8, or None."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= 8:
    raise ValueError(f"num_stages must be an int from 1 to 8 (Triton pipelining stages) or None, "
                     f"got {value!r}.")
  return int(value)


def pow2_at_least(x: int) -> int:
  """The smallest power of two >= x (1 for x <= 1)."""
  return 1 << max(0, int(x) - 1).bit_length()


def check_self_qkv(q: jax.Array, k: jax.Array, v: jax.Array,
                   key_mask: ArrayLike | None) -> tuple[int, int, int]:
  """Checks self-attention inputs (q, k and v of one length) and their key mask; returns
  (batch, length, heads)."""
  batch, length, _, heads, _ = check_qkv(q, k, v, same_length=True)
  check_token_mask("key_mask", key_mask, batch, length)
  return batch, length, heads


def token_masks(key_mask: jax.Array | None, query_mask: jax.Array | None, batch: int,
                q_length: int, k_length: int) -> jax.Array | None:
  """Checks `key_mask [B, Lk]` and `query_mask [B, Lq]`; returns the query mask to apply.

  `query_mask` defaults to `key_mask` for self-attention (q and k of the same length).
  """
  check_token_mask("key_mask", key_mask, batch, k_length)
  check_token_mask("query_mask", query_mask, batch, q_length)
  if query_mask is None and key_mask is not None and q_length == k_length:
    return key_mask
  return query_mask


def check_window(window: int) -> int:
  """Checks a one-sided window size: a non-negative Python int."""
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
    raise ValueError(f"window must be a non-negative int (one-sided), got {window!r}.")
  if window < 0:
    raise ValueError(
        f"window must be non-negative (it is one-sided: a query sees keys up to `window` "
        f"positions away on each side), got {window}.")
  return int(window)


def head_dilations(dilation: int | Sequence[int], num_heads: int) -> tuple[int, ...]:
  """Normalises `dilation` (an int, or one int per head) to a tuple of `num_heads` ints >= 1."""
  if isinstance(dilation, (int, np.integer)) and not isinstance(dilation, bool):
    values: Sequence = (int(dilation),) * num_heads
  else:
    try:
      values = tuple(int(d) for d in np.asarray(dilation).reshape(-1))
    except (TypeError, ValueError):
      raise ValueError(
          f"dilation must be an int or a sequence of ints (one per head), got {dilation!r}.")
    if len(values) != num_heads:
      raise ValueError(
          f"per-head dilation needs exactly one value per head: got {len(values)} values "
          f"{list(values)} for {num_heads} heads.")
  if any(d < 1 for d in values):
    raise ValueError(f"dilation values must be >= 1, got {list(values)}.")
  return tuple(values)


def global_slots(global_mask: jax.Array | None, max_global: int | None) -> int:
  """The static number of global-token slots per row for a band layer's `global_mask`:
  `max_global` when given (checked against a concrete mask), else the most global tokens in a
  row of a concrete mask; a traced mask needs `max_global`. 0 without a mask."""
  if global_mask is None:
    return 0
  traced = compat.is_tracer(global_mask)
  counts = None if traced else np.asarray(global_mask).sum(axis=1)
  if max_global is not None:
    if isinstance(max_global, bool) or not isinstance(max_global, (int, np.integer)) \
        or max_global < 0:
      raise ValueError(f"max_global must be a non-negative int or None, got {max_global!r}.")
    if counts is not None and counts.size and counts.max() > max_global:
      raise ValueError(
          f"global_mask has {int(counts.max())} global tokens in a row but max_global is "
          f"{int(max_global)}: raise max_global.")
    return int(max_global)
  if traced:
    raise ValueError(
        "global_mask is traced (band_attention is called inside jax.jit), so the number of "
        "global tokens is not known at trace time: pass max_global=<upper bound on global "
        "tokens per row>.")
  return int(counts.max()) if counts.size else 0


def drawn_random_blocks(random_blocks: str, backend: str) -> None:
  """A kernel of BigBird computes the drawn random blocks only (`random_blocks="drawn"`)."""
  if random_blocks != "drawn":
    raise ValueError(f"random_blocks = {random_blocks!r}: the {backend} BigBird computes drawn "
                     f"random blocks only; use implementation xla for 'first'.")
