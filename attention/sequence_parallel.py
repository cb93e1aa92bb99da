"""Band attention with the sequence split over devices: halo exchange, never an all-gather.

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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attention import band, validation
from attention.dot_product import NEG_INF


def _neighbour(x, axis_name: str, devices: int, *, from_left: bool):
  """`x` of the left (or right) neighbour; zeros on the first (or last) device."""
  if devices == 1:
    return jnp.zeros_like(x)
  pairs = [(i, i + 1) for i in range(devices - 1)] if from_left else \
      [(i + 1, i) for i in range(devices - 1)]
  return jax.lax.ppermute(x, axis_name, pairs)


def _with_halo(x, halo: int, axis_name: str, devices: int, causal: bool):
  """[left neighbour's last `halo` rows, x, right neighbour's first `halo` rows] (right side
  zeros when causal) along axis 1."""
  if halo == 0:
    return x
  left = _neighbour(x[:, x.shape[1] - halo:], axis_name, devices, from_left=True)
  right = jnp.zeros_like(x[:, :halo]) if causal else \
      _neighbour(x[:, :halo], axis_name, devices, from_left=False)
  return jnp.concatenate([left, x, right], axis=1)


def _partial_attention(q, k, v, allowed):
  """Unnormalised dense pieces: (sum_j p_ij v_j f32, row max, row sum) with p = exp(s - max)."""
  scale = 1.0 / math.sqrt(q.shape[-1])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  logits = jnp.where(allowed, logits, NEG_INF)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))          # [B, H, Q]
  p = jnp.where(allowed, jnp.exp(logits - row_max[..., None]), 0.0)
  return (jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)), row_max,
          jnp.sum(p, axis=-1))


def sequence_parallel_band_attention(q, k, v, *, window: int, dilation=1, causal: bool = False,
                                     key_mask=None, global_mask=None, max_global: int = 0,
                                     block_size: int | None = None,
                                     axis_name: str = "sequence"):
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


def _with_globals(q, k, v, out, lse, real, glob, num_global, causal, axis_name):
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
