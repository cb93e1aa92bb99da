"""Linformer attention (Wang et al. 2020): keys and values projected along the length axis.

Keys and values of length L are compressed to K slots by `[N, K]` projections E (keys) and F
(values), N being the longest input the projections were built for:

    K' = E[:L]^T K,   V' = F[:L]^T V,   out = softmax(Q K'^T / sqrt(D)) V'

so time and memory are O(L K) instead of O(L^2).

Explicit choices (the reference implementations leave these undefined or get them wrong):
  * Length. The projections have N rows. An input of length L <= N uses the first L rows (the
    fairseq convention); an input longer than N is refused, since the positions past N have no
    projection row: build the projections with a larger projected input length.
  * Padding. Padded keys and values are set to zero *before* the projection, so a padded
    position adds nothing to any slot and the rows of E and F at padded positions are never
    used. (The public codes mix padded tokens into every slot; with a bias in the key/value
    projection the padded tokens are not even zero.) A slot that no real position feeds (all
    of its nonzero weights in E and F sit at padded positions or past L, which happens with
    sparse projections such as identity or pooling) is removed from the softmax instead of
    taking part as a zero key with logit 0 and zero value, which would absorb probability
    mass. The softmax normaliser therefore runs over the slots fed by real tokens only, and
    the same real tokens at the same positions give the same outputs whatever the amount of
    trailing padding. What it cannot remove: each slot is a weighted sum over the real tokens,
    so slot keys and values grow with the number of real tokens (inherent to Linformer).
    Padded queries output 0; a row with no real token outputs 0.
  * Causality. Every slot mixes all positions, so Linformer cannot be causal; `causal=True` is
    refused.
  * Sharing (paper, section 4): `proj_k` and `proj_v` are `[N, K]` (one matrix shared by all
    heads: "headwise" sharing) or `[H, N, K]` (one per head). Key-value sharing is passing the
    same array as `proj_k` and `proj_v`; layerwise sharing is the model passing the same array
    to every layer. The parameters are owned by the model layer, not by this function.
  * Order of projections. With bias-free key and value projections W, E^T (X W) = (E^T X) W:
    `linformer_from_inputs` projects the layer's input X along the length first and computes
    keys and values for the K slots only, saving the L x E x (H D) multiplies of each full
    key and value projection (at LRA Text base, 4K tokens, k = 256: 825 -> 728 GFLOP per
    training step, `benchmarks/lra_flops.py`). The model layer takes it whenever the length
    projections are shared by the heads and the keys are not rotated.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from attention import validation
from attention.dot_product import masked_softmax_stats


def _check_projection(name: str, proj: ArrayLike, length: int, heads: int) -> None:
  shape = tuple(np.shape(proj))
  if len(shape) not in (2, 3) or (len(shape) == 3 and shape[0] != heads):
    raise ValueError(
        f"{name} must have shape [max_length, projected_length] (shared by all heads) or "
        f"[heads, max_length, projected_length] = [{heads}, N, K] (one per head), got {shape}.")
  if shape[-2] < length:
    raise ValueError(
        f"input length {length} is longer than the projected input length {shape[-2]} of "
        f"{name} (shape {shape}): Linformer has no projection row for positions past "
        f"{shape[-2]}; rebuild the projections with a projected input length (max_length) of "
        f"at least {length}.")


def _project(x: jax.Array, proj: jax.Array) -> jax.Array:
  """Projects `[B, L, H, D]` along L with `[L, K]` or `[H, L, K]`; returns `[B, K, H, D]`, in
  float32 whatever the input dtype (XLA:CPU has no bfloat16 dot with a float32 result)."""
  x, proj = x.astype(jnp.float32), proj.astype(jnp.float32)
  if proj.ndim == 2:
    return jnp.einsum("blhd,lk->bkhd", x, proj, preferred_element_type=jnp.float32)
  return jnp.einsum("blhd,hlk->bkhd", x, proj, preferred_element_type=jnp.float32)


def _fed_slots(real: jax.Array, proj: jax.Array) -> jax.Array:
  """`[B, H|1, K]` bool: slots with a nonzero projection weight at some real position."""
  nonzero = (proj != 0).astype(jnp.float32)
  real = real.astype(jnp.float32)
  if proj.ndim == 2:
    return (jnp.einsum("bl,lk->bk", real, nonzero) > 0)[:, None, :]
  return jnp.einsum("bl,hlk->bhk", real, nonzero) > 0


def _attend_slots(q: jax.Array, kp: jax.Array, vp: jax.Array, slot_ok: jax.Array,
                  query_mask: jax.Array | None) -> jax.Array:
  """Softmax attention of q `[B, Lq, H, D]` over slot keys kp and values vp `[B, K, H, .]`
  (float32); slot_ok `[B, H|1, K]` removes the slots no real position feeds."""
  scale = 1.0 / math.sqrt(q.shape[-1])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kp) * scale  # [B, H, Lq, K]
  p, _, row_sum = masked_softmax_stats(logits, slot_ok[:, :, None, :])
  p = p / jnp.where(row_sum > 0, row_sum, 1.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, vp)                          # [B, Lq, H, Dv]
  if query_mask is not None:
    out = jnp.where(query_mask[:, :, None, None], out, 0.0)
  return out.astype(q.dtype)


def _real_rows(key_mask: jax.Array | None, b_: int, lk: int, proj_k: jax.Array,
               proj_v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(real `[B, L]`, proj_k and proj_v cut to their first L rows)."""
  proj_k = jax.lax.slice_in_dim(proj_k, 0, lk, axis=proj_k.ndim - 2)  # [(H,) L, K]
  proj_v = jax.lax.slice_in_dim(proj_v, 0, lk, axis=proj_v.ndim - 2)
  real = jnp.ones((b_, lk), bool) if key_mask is None else key_mask    # [B, L]
  return real, proj_k, proj_v


def _zero_pad(x: jax.Array, real: jax.Array) -> jax.Array:
  return jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


@jax.jit
def _linformer(q: jax.Array, k: jax.Array, v: jax.Array, proj_k: jax.Array, proj_v: jax.Array,
               key_mask: jax.Array | None, query_mask: jax.Array | None) -> jax.Array:
  real, proj_k, proj_v = _real_rows(key_mask, q.shape[0], k.shape[1], proj_k, proj_v)
  kp = _project(_zero_pad(k, real), proj_k.astype(k.dtype))           # [B, K, H, D] f32
  vp = _project(_zero_pad(v, real), proj_v.astype(v.dtype))           # [B, K, H, Dv] f32
  slot_ok = _fed_slots(real, proj_k) | _fed_slots(real, proj_v)      # [B, H|1, K]
  return _attend_slots(q, kp, vp, slot_ok, query_mask)


@functools.partial(jax.jit, static_argnames=("shared",))
def _linformer_inputs(q: jax.Array, x_k: jax.Array, x_v: jax.Array, w_k: jax.Array,
                      w_v: jax.Array, proj_k: jax.Array, proj_v: jax.Array,
                      key_mask: jax.Array | None, query_mask: jax.Array | None, *,
                      shared: bool) -> jax.Array:
  real, proj_k, proj_v = _real_rows(key_mask, q.shape[0], x_k.shape[1], proj_k, proj_v)
  f32 = lambda a: a.astype(jnp.float32)
  slots = lambda x, proj: jnp.einsum("ble,lk->bke", f32(_zero_pad(x, real)), f32(proj))
  xk = slots(x_k, proj_k)                                             # [B, K, E] f32
  xv = xk if shared else slots(x_v, proj_v)
  kp = jnp.einsum("bke,ehd->bkhd", xk, f32(w_k))                     # [B, K, H, D]
  vp = jnp.einsum("bke,ehd->bkhd", xv, f32(w_v))                     # [B, K, H, Dv]
  slot_ok = _fed_slots(real, proj_k) | _fed_slots(real, proj_v)      # [B, 1, K]
  return _attend_slots(q, kp, vp, slot_ok, query_mask)


def _refuse_causal(causal: bool, name: str) -> None:
  if causal:
    raise ValueError(
        f"{name} cannot be causal: each projected slot mixes keys from every "
        "position, including future ones. Use causal=False, or a causal attention "
        "(dot_product, band, lsh) for autoregressive models.")


def _check_projections(proj_k: ArrayLike, proj_v: ArrayLike, lk: int, h: int) -> None:
  _check_projection("proj_k", proj_k, lk, h)
  _check_projection("proj_v", proj_v, lk, h)
  if np.shape(proj_k)[-1] != np.shape(proj_v)[-1]:
    raise ValueError(
        f"proj_k and proj_v must project to the same number of slots, got shapes "
        f"{tuple(np.shape(proj_k))} and {tuple(np.shape(proj_v))}.")


def linformer_from_inputs(q: jax.Array, x_k: jax.Array, x_v: jax.Array, w_k: jax.Array,
                          w_v: jax.Array, *, proj_k: ArrayLike, proj_v: ArrayLike,
                          key_mask: jax.Array | None = None,
                          query_mask: jax.Array | None = None,
                          causal: bool = False) -> jax.Array:
  """Linformer attention that projects the layer's inputs along the length before their key and
  value projections: E^T (X W_k) = (E^T X) W_k, so keys and values are computed for the K slots
  only instead of for all L positions. The same function as `linformer_attention(q, X_k W_k,
  X_v W_v, ...)` (up to float rounding) with L x E x H D less multiply work per projection;
  for projections shared by the heads (`[N, K]`), since a per-head E would need the input
  projected once per head.

  Args:
    q: `[B, Lq, H, D]` queries.
    x_k, x_v: `[B, L, E]` inputs of the key and value projections (pass the same array twice
      when they are one input).
    w_k, w_v: `[E, H, D]` and `[E, H, Dv]` key and value projection kernels (no bias).
    proj_k, proj_v: `[N, K]` length projections E and F, N >= L (pass `proj_k` again for
      key-value sharing: with one input as well, the input is projected once).
    key_mask, query_mask, causal: as in `linformer_attention`.

  Returns:
    `[B, Lq, H, Dv]` in q's dtype.
  """
  _refuse_causal(causal, "linformer_from_inputs")
  if np.ndim(q) != 4:
    raise ValueError(f"q must be [B, Lq, H, D], got shape {tuple(np.shape(q))}.")
  b_, lq, h, d = np.shape(q)
  if np.ndim(x_k) != 3 or np.shape(x_v) != np.shape(x_k) or np.shape(x_k)[0] != b_:
    raise ValueError(f"x_k and x_v must both be [B, L, E] with B = {b_} (q's batch), got "
                     f"{tuple(np.shape(x_k))} and {tuple(np.shape(x_v))}.")
  lk, e = np.shape(x_k)[1:]
  for name, w, depth in (("w_k", w_k, d), ("w_v", w_v, None)):
    shape = tuple(np.shape(w))
    if len(shape) != 3 or shape[:2] != (e, h) or (depth is not None and shape[2] != depth):
      raise ValueError(f"{name} must be [E, H, D] = [{e}, {h}, {depth or 'Dv'}], got {shape}.")
  _check_projections(proj_k, proj_v, lk, h)
  if np.ndim(proj_k) != 2 or np.ndim(proj_v) != 2:
    raise ValueError(
        "linformer_from_inputs needs length projections shared by the heads ([N, K]); per-head "
        "projections ([H, N, K]) go through linformer_attention on computed keys and values.")
  query_mask = validation.token_masks(key_mask, query_mask, b_, lq, lk)
  shared = proj_v is proj_k and x_v is x_k
  return _linformer_inputs(q, x_k, x_v, w_k, w_v, jnp.asarray(proj_k), jnp.asarray(proj_v),
                           key_mask, query_mask, shared=shared)


def linformer_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, proj_k: ArrayLike,
                        proj_v: ArrayLike, key_mask: jax.Array | None = None,
                        query_mask: jax.Array | None = None,
                        causal: bool = False) -> jax.Array:
  """Linformer attention with length projections; linear in length.

  Args:
    q: `[B, Lq, H, D]` queries.
    k: `[B, L, H, D]` keys.
    v: `[B, L, H, Dv]` values.
    proj_k: `[N, K]` or `[H, N, K]` key projection E with N >= L (the first L rows are used).
    proj_v: value projection F, same conventions (pass `proj_k` again for key-value sharing).
    key_mask: optional bool `[B, L]`, True = real token. Padded keys and values are zeroed
      before the projection; slots fed by no real position are left out of the softmax.
    query_mask: optional bool `[B, Lq]`; padded queries output 0. Defaults to `key_mask` when
      Lq == L (self-attention).
    causal: must be False; Linformer mixes every position into every slot.

  Returns:
    `[B, Lq, H, Dv]` in q's dtype. With `proj_k = proj_v = identity [L, L]` and no padding it
    equals `dot_product_attention(q, k, v)`.
  """
  _refuse_causal(causal, "linformer_attention")
  b_, lq, lk, h, _ = validation.check_qkv(q, k, v)
  query_mask = validation.token_masks(key_mask, query_mask, b_, lq, lk)
  _check_projections(proj_k, proj_v, lk, h)
  return _linformer(q, k, v, jnp.asarray(proj_k), jnp.asarray(proj_v), key_mask, query_mask)
