"""Attention with the sequence split over devices: band (halo exchange, never an all-gather of
the sequence), FAVOR+ and linear attention (feature states summed or prefixed over devices).

Called inside `jax.shard_map` with the length axis of q, k, v and the masks split over the mesh
axis `axis_name` (device i holds positions [i C, (i+1) C), C = L / devices). Each device
computes its own queries. A query sees keys up to `window * dilation` positions away, so a
device needs only that many keys and values (the halo) from each neighbour, one side when
causal; they arrive by `jax.lax.ppermute`, and the device runs the one-device band kernel
(`attention.band._band_core`) on [left halo, own chunk, right halo], keeping its own rows. The
first and last devices receive no halo (positions outside the sequence are not keys).

Global tokens: a device keeps at most `max_global` of them (static); their keys, values,
queries and positions are all-gathered (devices x max_global rows: the global rows, not the
sequence), so every query attends to every global key (merged with its band by log-sum-exp, as
on one device); each global query attends to the keys of every device, combined across devices
from per-device partial results (a `pmax` of the log-sum-exps, then a `psum` of the rescaled
sums), and each device keeps the rows of its own global tokens.

The result equals `attention.band_attention` on the whole sequence (tests/sequence_parallel_
test.py, outputs and gradients) with the same masking rules. The band kernel's scans start from
unsharded zeros, so the enclosing `jax.shard_map` needs `check_vma=False`.

FAVOR+ and linear attention: see `sequence_parallel_favor_attention`; what crosses devices is
the m x Dv feature state per device and head, never keys or values. `precision` is the one-device
functions' (`linear.check_precision`): with "fast" the feature projection and every contraction
(key states, readout, causal chunk matmuls) take bfloat16 operands with float32 accumulation,
forward and backward (`linear.contract`), as on one device; maxima, exps, normalisers and the
states summed or prefixed over devices stay float32. "exact" is float32 throughout.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention import band, favor, linear, validation
from attention.dot_product import NEG_INF


def _neighbour(x: jax.Array, axis_name: str, devices: int, *, from_left: bool) -> jax.Array:
  """`x` of the left (or right) neighbour; zeros on the first (or last) device."""
  if devices == 1:
    return jnp.zeros_like(x)
  pairs = [(i, i + 1) for i in range(devices - 1)] if from_left else \
      [(i + 1, i) for i in range(devices - 1)]
  return jax.lax.ppermute(x, axis_name, pairs)


def _with_halo(x: jax.Array, halo: int, axis_name: str, devices: int,
               causal: bool) -> jax.Array:
  """[left neighbour's last `halo` rows, x, right neighbour's first `halo` rows] (right side
  zeros when causal) along axis 1."""
  if halo == 0:
    return x
  left = _neighbour(x[:, x.shape[1] - halo:], axis_name, devices, from_left=True)
  right = jnp.zeros_like(x[:, :halo]) if causal else \
      _neighbour(x[:, :halo], axis_name, devices, from_left=False)
  return jnp.concatenate([left, x, right], axis=1)


def _partial_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                       allowed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Unnormalised dense pieces: (sum_j p_ij v_j f32, row max, row sum) with p = exp(s - max)."""
  scale = 1.0 / math.sqrt(q.shape[-1])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  logits = jnp.where(allowed, logits, NEG_INF)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))          # [B, H, Q]
  p = jnp.where(allowed, jnp.exp(logits - row_max[..., None]), 0.0)
  return (jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)), row_max,
          jnp.sum(p, axis=-1))


def sequence_parallel_band_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int,
                                     dilation: int | Sequence[int] = 1, causal: bool = False,
                                     key_mask: jax.Array | None = None,
                                     global_mask: jax.Array | None = None, max_global: int = 0,
                                     block_size: int | None = None,
                                     axis_name: str = "sequence") -> jax.Array:
  """`band_attention` over a sequence split along `axis_name` (call inside `jax.shard_map`).

  Args:
    q, k, v: this device's chunk `[B, C, H, D]` of the sequence (C the same on every device).
    window, dilation, causal, block_size: as `band_attention`.
    key_mask: optional bool `[B, C]`, this chunk's real tokens.
    global_mask: optional bool `[B, C]`, this chunk's global tokens (at most `max_global` per
      row and device; a row with more outputs NaN, as `band_attention` under jit).
    max_global: static bound on the global tokens per row of one device's chunk.
    axis_name: the mesh axis the length is split over.

  Returns:
    `[B, C, H, Dv]` in q's dtype: this chunk's rows of the whole sequence's band attention.
  """
  b_, chunk, _, h, _ = validation.check_qkv(q, k, v, same_length=True)
  window = validation.check_window(window)
  dilations = validation.head_dilations(dilation, h)
  devices = jax.lax.axis_size(axis_name)
  halo = window * max(dilations)
  if halo > chunk:
    raise ValueError(
        f"each device holds {chunk} positions but the band reaches {halo} (window {window} x "
        f"dilation {max(dilations)}): a query's keys must lie on its own device and its "
        f"neighbours; use fewer devices on the sequence axis or a smaller window.")
  if global_mask is not None and int(max_global) < 1:
    raise ValueError("global_mask needs max_global >= 1: the static number of global tokens "
                     "one device's chunk may hold per row.")
  block = band.default_block_size(window) if block_size is None else int(block_size)
  real = jnp.ones((b_, chunk), bool) if key_mask is None else key_mask
  glob = None if global_mask is None else global_mask & real
  band_keys = real if glob is None else real & ~glob

  # The band: own chunk plus halos, one pass per run of heads sharing a dilation value.
  ext = lambda x: _with_halo(x, halo, axis_name, devices, causal)
  qe, ke, ve, oke = ext(q), ext(k), ext(v), ext(band_keys)
  outs, lses, start = [], [], 0
  for run_dilation, run_len in band._runs(dilations):   # noqa: SLF001 - the same kernel
    sl = slice(start, start + run_len)
    o, lse = band._band_core(qe[:, :, sl], ke[:, :, sl], ve[:, :, sl], oke,  # noqa: SLF001
                             window=window, dilation=run_dilation, causal=causal, block=block)
    outs.append(o[:, halo:halo + chunk])
    lses.append(lse[:, halo:halo + chunk])
    start += run_len
  out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]   # [B, C, H, Dv] f32
  lse = jnp.concatenate(lses, axis=2) if len(lses) > 1 else lses[0]   # [B, C, H]

  if glob is not None:
    out = _with_globals(q, k, v, out, lse, real, glob, int(max_global), causal, axis_name)
  out = jnp.where(real[:, :, None, None], out, 0.0)
  return out.astype(q.dtype)


def _with_globals(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
                  real: jax.Array, glob: jax.Array, num_global: int, causal: bool,
                  axis_name: str) -> jax.Array:
  """Adds the global pairs to the band output `out` (normalised, with log-sum-exp `lse`)."""
  b_, chunk = real.shape
  offset = jax.lax.axis_index(axis_name) * chunk
  positions = offset + jnp.arange(chunk)                              # global positions
  sel = band._global_slots(glob, num_global)                          # [B, G, C]  # noqa: SLF001
  gather = lambda x: jnp.einsum("bgl,blhd->bghd", sel, x.astype(jnp.float32))
  slot_ok = jnp.sum(sel, axis=2) > 0                                  # [B, G]
  slot_pos = jnp.einsum("bgl,l->bg", sel, positions.astype(jnp.float32))
  every = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
  kg, vg, qg = every(gather(k)), every(gather(v)), every(gather(q))   # [B, n G, H, D]
  all_ok, all_pos = every(slot_ok), every(slot_pos)                   # [B, n G]

  # Every query attends to every global key; merged with the band by log-sum-exp.
  allowed = all_ok[:, None, None, :]
  if causal:
    allowed = allowed & (all_pos[:, None, None, :] <= positions[None, None, :, None])
  og, lseg = band._attend_dense(q.astype(jnp.float32), kg, vg, allowed)  # noqa: SLF001
  total = jnp.logaddexp(lse, lseg)
  out = out * jnp.exp(lse - total)[..., None] + og * jnp.exp(lseg - total)[..., None]

  # Every global query attends to every real key: partial sums here, combined over devices.
  allowed = real[:, None, None, :]
  if causal:
    allowed = allowed & (positions[None, None, None, :] <= all_pos[:, None, :, None])
  num, row_max, row_sum = _partial_attention(qg, k, v, allowed)      # [B, nG, H, D], [B, H, nG]
  top = jax.lax.pmax(row_max, axis_name)
  scale = jnp.exp(row_max - top)
  num = jax.lax.psum(num * scale.transpose(0, 2, 1)[..., None], axis_name)
  den = jax.lax.psum(row_sum * scale, axis_name).transpose(0, 2, 1)[..., None]
  oq = num / jnp.where(den > 0, den, 1.0)                             # [B, n G, H, Dv]
  mine = jax.lax.dynamic_slice_in_dim(oq, jax.lax.axis_index(axis_name) * num_global,
                                      num_global, axis=1)             # this device's slots
  out = jnp.where(glob[:, :, None, None], jnp.einsum("bgl,bghd->blhd", sel, mine), out)
  # A row with more global tokens on one device than slots: poison the whole row, everywhere.
  overflow = jax.lax.psum((jnp.sum(glob, axis=1) > num_global).astype(jnp.int32), axis_name) > 0
  return jnp.where(overflow[:, None, None, None], jnp.nan, out)


def _gathered_prefix(state: tuple[jax.Array, ...], axis_name: str) -> tuple[jax.Array, ...]:
  """Sum of the states of the devices before this one: all-gather the (small) per-device states,
  keep those of lower index. `state` is a tuple of arrays; returns the same structure."""
  me = jax.lax.axis_index(axis_name)
  out = []
  for x in state:
    every = jax.lax.all_gather(x, axis_name)                          # [n, ...]
    before = (jnp.arange(every.shape[0]) < me).reshape((-1,) + (1,) * x.ndim)
    out.append(jnp.sum(jnp.where(before, every, 0.0), axis=0))
  return tuple(out)


def _softmax_prefix(phi: jax.Array, t: jax.Array, v: jax.Array, axis_name: str,
                    fast: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The exclusive prefix over devices of per-feature-stabilised states: each device's S, z are
  relative to its own per-feature key max t; the sum over earlier devices is taken relative to
  their largest t (NEG_INF when there is none: device 0, or only padding before). `fast`: S of
  bfloat16 operands with float32 accumulation (as `favor`'s per-chunk states); z, t float32."""
  me = jax.lax.axis_index(axis_name)
  s = linear.contract("bhlm,bhld->bhmd", phi, v, fast)                 # [B, H, m, Dv]
  z = jnp.sum(phi, axis=2)                                             # [B, H, m]
  ss, zs, ts = (jax.lax.all_gather(x, axis_name) for x in (s, z, t))   # [n, ...]
  before = (jnp.arange(ts.shape[0]) < me)[:, None, None, None]
  ts = jnp.where(before, ts, NEG_INF)
  top = jnp.max(ts, axis=0)                                            # [B, H, m]
  w = jnp.where(before, jnp.exp(ts - top), 0.0)                        # <= 1
  return (jnp.sum(ss * w[..., None], axis=0), jnp.sum(zs * w, axis=0), top)


def sequence_parallel_favor_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                                      features: ArrayLike, causal: bool = False,
                                      key_mask: jax.Array | None = None,
                                      chunk_size: int | None = None, kernel: str = "softmax",
                                      precision: str = "auto",
                                      axis_name: str = "sequence") -> jax.Array:
  """`favor_attention` over a sequence split along `axis_name` (call inside `jax.shard_map`,
  `check_vma=False`); q, k, v, key_mask are this device's chunk `[B, C, ...]`.

  Bidirectional: the per-feature key maxima (`pmax`), then the m x Dv state and the normaliser
  summed over devices (`psum`). Causal: each device's whole-chunk state relative to its own
  per-feature key max; a device adds the states of the devices before it (all-gathered states,
  not keys) relative to their largest max, then runs the one-device chunked prefix; so no
  position depends on a later one on any device. `precision` as `favor_attention`: "fast"
  rounds the same operands to bfloat16 as the one-device function (the projection, features,
  values and states of every contraction, the per-device states too), "exact" none.
  """
  b_, chunk_len, _, h, d = validation.check_qkv(q, k, v, same_length=True)
  favor.check_features(features, d)
  validation.check_token_mask("key_mask", key_mask, b_, chunk_len)
  if kernel not in favor.KERNELS:
    raise ValueError(f"unknown FAVOR+ kernel {kernel!r}; valid kernels: "
                     f"{', '.join(favor.KERNELS)}.")
  chunk = linear.check_chunk_size(chunk_size)
  fast = linear.check_precision(precision) == "fast"
  head_major = lambda x: jnp.swapaxes(x, 1, 2)
  w = jnp.asarray(features).astype(jnp.float32)
  qh, kh, vh = head_major(q), head_major(k), head_major(v).astype(jnp.float32)
  real = jnp.ones((b_, 1, chunk_len, 1), bool) if key_mask is None else \
      key_mask[:, None, :, None]
  vh = jnp.where(real, vh, 0.0)
  if kernel == "relu":
    scale = d ** -0.25
    if fast:
      proj = lambda x: linear.contract("bhld,md->bhlm", x, w * scale, True)
    else:
      proj = lambda x: jnp.einsum("bhld,md->bhlm", x.astype(jnp.float32) * scale, w)
    feats = lambda x: jax.nn.relu(proj(x)) + favor.RELU_EPSILON
    out = _linear_parts(feats(qh), jnp.where(real, feats(kh), 0.0), vh, causal, chunk,
                        axis_name, fast)
  else:
    log_features = functools.partial(favor._log_features, fast=fast)  # noqa: SLF001
    a = log_features(qh, w, with_norm=False)
    bk = jnp.where(real, log_features(kh, w, with_norm=True), NEG_INF)
    if causal:
      t = jax.lax.stop_gradient(jnp.max(bk, axis=2))                  # [B, H, m] this device
      phi = jnp.where(real, jnp.exp(bk - t[:, :, None]), 0.0)
      prefix = _softmax_prefix(phi, t, vh, axis_name, fast)
      num, den, _ = favor.causal_softmax_parts(
          a, bk, vh, real[..., 0], favor._power_of_two_chunk(chunk, chunk_len),  # noqa: SLF001
          prefix=prefix, fast=fast)
      out = linear._normalise(num, den)   # noqa: SLF001
    else:
      y = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(bk, axis=2, keepdims=True)), axis_name)
      phi_k = jnp.where(real, jnp.exp(bk - y), 0.0)
      x = jax.lax.stop_gradient(jnp.max(a + y, axis=-1, keepdims=True))
      out = _bidirectional(jnp.exp(a + y - x), phi_k, vh, axis_name, fast)
  out = jnp.where(real, out, 0.0)
  return head_major(out).astype(q.dtype)


def _bidirectional(phi_q: jax.Array, phi_k: jax.Array, v: jax.Array, axis_name: str,
                   fast: bool = False) -> jax.Array:
  """`linear.bidirectional_linear_attention` with the key state summed over devices. `fast`:
  as there, z rides along as a column of ones appended to v, and both contractions take
  bfloat16 operands with float32 accumulation (the summed state is float32)."""
  if fast:
    ones = jnp.ones(v.shape[:-1] + (1,), jnp.float32)
    s = jax.lax.psum(linear.contract("bhlm,bhld->bhmd", phi_k, jnp.concatenate([v, ones], -1),
                                     True), axis_name)                # [B, H, m, Dv + 1]
    num_den = linear.contract("bhlm,bhmd->bhld", phi_q, s, True)
    return linear._normalise(num_den[..., :-1], num_den[..., -1])   # noqa: SLF001
  s = jax.lax.psum(jnp.einsum("bhlm,bhld->bhmd", phi_k, v), axis_name)
  z = jax.lax.psum(jnp.sum(phi_k, axis=2), axis_name)
  num = jnp.einsum("bhlm,bhmd->bhld", phi_q, s)
  den = jnp.einsum("bhlm,bhm->bhl", phi_q, z)
  return linear._normalise(num, den)   # noqa: SLF001


def _linear_parts(phi_q: jax.Array, phi_k: jax.Array, v: jax.Array, causal: bool, chunk: int,
                  axis_name: str, fast: bool = False) -> jax.Array:
  """Kernelized attention from non-negative features over the split sequence. `fast`: every
  contraction of bfloat16 operands with float32 accumulation (the per-device state S too, as
  `linear.causal_parts`' per-chunk states); sums and normalisers float32."""
  if not causal:
    return _bidirectional(phi_q, phi_k, v, axis_name, fast)
  prefix = _gathered_prefix((linear.contract("bhlm,bhld->bhmd", phi_k, v, fast),
                             jnp.sum(phi_k, axis=2)), axis_name)
  num, den = linear.causal_parts(phi_q, phi_k, v, chunk=chunk, prefix=prefix, fast=fast)
  return linear._normalise(num, den)   # noqa: SLF001


def sequence_parallel_linear_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                                       causal: bool = False, key_mask: jax.Array | None = None,
                                       chunk_size: int | None = None, precision: str = "auto",
                                       axis_name: str = "sequence") -> jax.Array:
  """`linear_attention` (elu + 1 features) over a sequence split along `axis_name`: the states
  summed over devices, or (causal) the states of earlier devices added to each device's prefix.
  `precision` as `linear_attention` ("fast": bfloat16 operands in every contraction)."""
  b_, chunk_len, _, _, _ = validation.check_qkv(q, k, v, same_length=True)
  validation.check_token_mask("key_mask", key_mask, b_, chunk_len)
  chunk = linear.check_chunk_size(chunk_size)
  fast = linear.check_precision(precision) == "fast"
  head_major = lambda x: jnp.swapaxes(x, 1, 2)
  real = jnp.ones((b_, 1, chunk_len, 1), bool) if key_mask is None else \
      key_mask[:, None, :, None]
  phi_q, phi_k = linear.elu_features(head_major(q)), linear.elu_features(head_major(k))
  vh = jnp.where(real, head_major(v).astype(jnp.float32), 0.0)
  out = _linear_parts(phi_q, jnp.where(real, phi_k, 0.0), vh, causal, chunk, axis_name, fast)
  return head_major(jnp.where(real, out, 0.0)).astype(q.dtype)
