"""Dense boolean masks: the one definition of which (query, key) pairs each pattern allows.

Every fast attention path in this package is tested against `dot_product_attention` with the
mask built here, so these builders are the specification, written for clarity, not speed. They
are O(length^2) and meant for tests, small inputs and documentation.

Masks are boolean, True = the query may attend the key, and have shape `[..., Lq, Lk]` with
leading dimensions that broadcast against `[batch, heads, Lq, Lk]`.

Band (Longformer) convention, used everywhere in the codebase:
  * `window=w` is one-sided: query i may attend key j when |i - j| <= w * dilation and
    (i - j) is a multiple of `dilation`; with `causal=True` additionally 0 <= i - j.
    A query therefore sees up to 2w+1 keys (w+1 when causal).
  * `dilation` is an int or one int per head (Longformer's per-head dilation).
  * `global_mask: [batch, length]`: a global query attends to every real key, and every query
    attends to every global key. With `causal=True` the causal rule still applies to global
    pairs (j <= i), so the model stays autoregressive.
  * `key_mask: [batch, length]`, True = real token: padded keys are never attended and padded
    queries attend nothing (their output is 0).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attention import validation


def causal_mask(length: int, key_length: int | None = None) -> np.ndarray:
  """[Lq, Lk] bool: query i may attend key j when j <= i (positions aligned at the start)."""
  key_length = length if key_length is None else key_length
  return np.arange(length)[:, None] >= np.arange(key_length)[None, :]


def band_mask(length: int, *, window: int, dilation=1, causal: bool = False,
              num_heads: int | None = None) -> np.ndarray:
  """The sliding-window (band) pattern of Longformer, optionally dilated and causal.

  Args:
    length: sequence length L.
    window: one-sided window w >= 0.
    dilation: an int >= 1, or one int per head.
    causal: keep only keys at or before the query.
    num_heads: number of heads; required when `dilation` is per head.

  Returns:
    bool `[L, L]` when `dilation` is an int and `num_heads` is None, else `[H, L, L]`.
  """
  window = validation.check_window(window)
  per_head = not isinstance(dilation, (int, np.integer))
  if per_head and num_heads is None:
    num_heads = len(np.asarray(dilation).reshape(-1))
  heads = 1 if num_heads is None else num_heads
  dilations = validation.head_dilations(dilation, heads)
  rel = np.arange(length)[:, None] - np.arange(length)[None, :]  # [L, L], i - j
  masks = []
  for d in dilations:
    m = (np.abs(rel) <= window * d) & (rel % d == 0)
    if causal:
      m &= rel >= 0
    masks.append(m)
  out = np.stack(masks)  # [H, L, L]
  return out[0] if num_heads is None else out


def key_padding_mask(key_mask, query_mask=None):
  """[B, 1, Lq, Lk] bool from token masks: real keys only, and nothing for padded queries.

  `query_mask` defaults to `key_mask` (self-attention).
  """
  key_mask = jnp.asarray(key_mask, bool)
  query_mask = key_mask if query_mask is None else jnp.asarray(query_mask, bool)
  return query_mask[:, None, :, None] & key_mask[:, None, None, :]


def global_pairs_mask(global_mask):
  """[B, 1, L, L] bool: pairs that involve a global token (global query or global key)."""
  g = jnp.asarray(global_mask, bool)
  return g[:, None, :, None] | g[:, None, None, :]


def longformer_mask(length: int, *, window: int, dilation=1, causal: bool = False,
                    global_mask=None, key_mask=None, num_heads: int | None = None):
  """The full Longformer pattern: band | global pairs, then causal and padding rules.

  Returns a bool array broadcastable to `[batch, heads, L, L]` (leading dims are 1 where the
  pattern does not depend on them).
  """
  band = band_mask(length, window=window, dilation=dilation, causal=causal, num_heads=num_heads)
  mask = jnp.asarray(band.reshape((-1, length, length))[None])  # [1, H|1, L, L]
  if global_mask is not None:
    pairs = global_pairs_mask(global_mask)
    if causal:
      pairs = pairs & causal_mask(length)
    mask = mask | pairs
  if key_mask is not None:
    mask = mask & key_padding_mask(key_mask)
  return mask
