"""Transformer-XL memory and the Compressive Transformer's compressed memory.

Each layer attends over [compressed memory; memory; current segment]. The memory of a layer holds
the layer's *inputs* (the residual stream entering the layer, not keys and values) for the last
`n_m` positions of the previous segments, under `stop_gradient`; its keys and values are computed
with the layer's current projections. Positions are Transformer-XL's relative ones: query i of a
segment sits at position C + M + i of the key sequence (C compressed slots, M memory slots), the
logit is (q+u)_i . k_j + (q+v)_i . R[i' - j], causal, and a band window (`window` of a "band"
layer) counts its distance from the query into the memory, so the causal window reaches into it.

A state is a dict of arrays (a pytree, carried by the caller):
  memory `[N, B, M, E]`, valid `[B, M]` bool (False until a slot has been filled),
  and with compression compressed `[N, B, Ncm, E]`, cvalid `[B, Ncm]`.
When a segment of L states enters, the oldest L states of [memory; segment] leave the memory;
with compression they are pooled by the rate c (mean, max or a stride-c 1D convolution) into L / c
slots appended to the compressed memory, which keeps its newest n_cm slots (Rae et al. 2020).

The attention-reconstruction loss compares, per layer, content attention of the current queries
over the leaving states with attention over their compressed form, both through stop-gradient
projections and inputs: its gradient reaches only the compression function's parameters.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from attention import kinds, relative

COMPRESSIONS = ("mean", "max", "conv")


def init_state(num_layers: int, batch: int, emb_dim: int, memory_length: int,
               compressed_length: int = 0) -> dict[str, jax.Array]:
  """An empty memory (every slot invalid)."""
  state = {"memory": jnp.zeros((num_layers, batch, memory_length, emb_dim), jnp.float32),
           "valid": jnp.zeros((batch, memory_length), bool)}
  if compressed_length:
    state["compressed"] = jnp.zeros((num_layers, batch, compressed_length, emb_dim), jnp.float32)
    state["cvalid"] = jnp.zeros((batch, compressed_length), bool)
  return state


def memory_attention(q, k, v, *, u, v_bias, w_r, key_valid, query_valid, window=None,
                     clamp_len=0):
  """Dense relative attention of `q [B, L, H, D]` over `k, v [B, P + L, H, D]` (P earlier keys).

  Query i is at key position P + i; key j is allowed when key_valid[:, j], j <= P + i and (with
  `window`) P + i - j <= window. Rows with no allowed key give zeros. With `clamp_len` > 0 the
  position term uses the distance min(P + i - j, clamp_len) (Transformer-XL's clamp_len).
  """
  b, lq, h, d = q.shape
  lk = k.shape[1]
  prefix = lk - lq
  qpos = prefix + jnp.arange(lq)[:, None]
  kpos = jnp.arange(lk)[None, :]
  allowed = kpos <= qpos                                                   # [L, P+L]
  if window is not None:
    allowed = allowed & (qpos - kpos <= window)
  allowed = allowed[None, None] & key_valid[:, None, None, :] & query_valid[:, None, :, None]
  qf = q.astype(jnp.float32)
  content = jnp.einsum("bqhd,bkhd->bhqk", qf + u, k.astype(jnp.float32))
  r = relative.projected_table(w_r, lk)                                    # [2lk-1, H, D]
  pos = jnp.einsum("bqhd,mhd->bhqm", qf + v_bias, r)                       # rows: lk-1 .. -(lk-1)
  distance = qpos - kpos
  if clamp_len:
    distance = jnp.minimum(distance, clamp_len)
  index = jnp.broadcast_to((lk - 1) - distance, pos.shape[:2] + (lq, lk))
  pos = jnp.take_along_axis(pos, index, axis=-1)
  logits = jnp.where(allowed, (content + pos) / math.sqrt(d), -1e30)
  p = jax.nn.softmax(logits, axis=-1) * allowed
  return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)


def _project(mha, x, name):
  return jnp.einsum("ble,ehd->blhd", x, getattr(mha, name)[...].astype(x.dtype))


def attend(mha, x, prefix, query_valid, key_valid, clamp_len=0):
  """The layer `mha` (relative positions) over [prefix; x]: x `[B, L, E]`, prefix `[B, P, E]`."""
  if mha.pos_kind != "relative" or not mha.record.memory:
    memory_kinds = " or ".join(kinds.names_where(lambda k: k.memory))
    raise ValueError(f"memory needs pos_emb='relative' with attention {memory_kinds}, not "
                     f"{mha.kind!r} with pos_emb={mha.pos_kind!r}.")
  full = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
  q = _project(mha, x, "query")
  k, v = _project(mha, full, "key"), _project(mha, full, "value")
  window = None
  if "window" in mha.args:     # a band layer: its window, as far as the memory reaches
    window = int(mha.args["window"]) * int(mha.args.get("dilation", 1) or 1)
  out = memory_attention(q, k, v, u=mha.u[...], v_bias=mha.v_bias[...], w_r=mha.w_r[...],
                         key_valid=key_valid, query_valid=query_valid, window=window,
                         clamp_len=clamp_len)
  return jnp.einsum("blhd,hde->ble", out, mha.out[...].astype(out.dtype))


class Compression(nnx.Module):
  """f_c: `[B, L, E]` -> `[B, L / rate, E]` by mean or max pooling or a stride-`rate` conv."""

  def __init__(self, kind: str, rate: int, emb_dim: int, *, rngs: nnx.Rngs):
    if kind not in COMPRESSIONS:
      raise ValueError(f"compression {kind!r} is not one of {', '.join(COMPRESSIONS)}.")
    self.kind, self.rate = kind, rate
    if kind == "conv":
      limit = (3.0 / (rate * emb_dim)) ** 0.5
      eye = jnp.tile(jnp.eye(emb_dim)[None] / rate, (rate, 1, 1))   # starts as mean pooling
      noise = jax.random.uniform(rngs.params(), (rate, emb_dim, emb_dim), jnp.float32,
                                 -limit, limit)
      self.kernel = nnx.Param(eye + 0.1 * noise)
      self.bias = nnx.Param(jnp.zeros((emb_dim,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    b, l, e = x.shape
    groups = x.reshape(b, l // self.rate, self.rate, e)
    if self.kind == "mean":
      return groups.mean(axis=2)
    if self.kind == "max":
      return groups.max(axis=2)
    return jnp.einsum("bgce,cef->bgf", groups, self.kernel[...]) + self.bias[...]


def _content_attention(q, k, v):
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def _sg_norm(ln, x):
  """`ln(x)` with its scale and bias under stop_gradient (the gradient still flows through x)."""
  sg = jax.lax.stop_gradient
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  var = jnp.square(xf - mean).mean(-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + ln.epsilon)
  return y * sg(ln.scale[...]) + sg(ln.bias[...])


def reconstruction_loss(mha, h, old, compressed):
  """Mean squared difference of attention over `old` and over `compressed` (Rae et al. eq. 2).

  h, old: stop-gradient inputs; the projections are stop-gradient too, so only `compressed`
  (a function of the compression parameters) carries a gradient.
  """
  sg = jax.lax.stop_gradient
  proj = lambda x, name: jnp.einsum("ble,ehd->blhd", x, sg(getattr(mha, name)[...]))
  q = proj(sg(h), "query")
  full = _content_attention(q, proj(sg(old), "key"), proj(sg(old), "value"))
  comp = _content_attention(q, proj(compressed, "key"), proj(compressed, "value"))
  return jnp.mean(jnp.square(full - comp))


def forward(encoder, compress, tokens, state: Mapping[str, jax.Array], *, rng=None,
            clamp_len: int = 0):
  """The encoder over one segment with memory: (features `[B, L, E]`, new state, recon loss).

  `encoder` is a `models.encoder.Encoder` of interleaved pre-LN blocks; `compress` a list of
  `Compression` per layer or None. Dropout follows `Block` (the same rng folding). The memory
  length is the state's: no parameter depends on it, so a model trained with one memory length
  runs with another. `clamp_len` > 0 clamps the relative distances (`memory_attention`).
  """
  from models.encoder import _fold, dropout   # pylint: disable=import-outside-toplevel
  key_mask = tokens > 0
  x = encoder.embed(tokens)
  x = dropout(encoder.positions(x), encoder.dropout_rate, _fold(rng, 0)).astype(encoder.dtype)
  mem, valid = state["memory"], state["valid"]
  m_len, seg = mem.shape[2], tokens.shape[1]
  prefix_valid = valid
  if compress is not None:
    prefix_valid = jnp.concatenate([state["cvalid"], valid], axis=1)
  key_valid = jnp.concatenate([prefix_valid, key_mask], axis=1)
  new_mem, new_comp, recon = [], [], jnp.zeros((), jnp.float32)
  all_valid = jnp.concatenate([valid, key_mask], axis=1)
  for i, block in enumerate(encoder.blocks):
    r = _fold(rng, i + 1)
    stream = jnp.concatenate([mem[i].astype(x.dtype), jax.lax.stop_gradient(x)], axis=1)
    new_mem.append(stream[:, stream.shape[1] - m_len:])
    prefix = mem[i]
    if compress is not None:
      prefix = jnp.concatenate([state["compressed"][i], mem[i]], axis=1)
    ln_x, ln_prefix = block.ln_attn(x), block.ln_attn(prefix.astype(x.dtype))
    h = attend(block.attention, ln_x, ln_prefix, key_mask, key_valid, clamp_len)
    if compress is not None:
      old = stream[:, :seg]                                                # leaving the memory
      comp = compress[i](old)                                              # [B, L / c, E]
      recon = recon + reconstruction_loss(block.attention, _sg_norm(block.ln_attn, x),
                                          _sg_norm(block.ln_attn, old),
                                          _sg_norm(block.ln_attn, comp))
      new_comp.append(comp)
    x = x + dropout(h, block.dropout_rate, _fold(r, 1))
    h = block.mlp(block.ln_mlp(x), rng=_fold(r, 2))
    x = x + dropout(h, block.dropout_rate, _fold(r, 3))
  x = jnp.where(key_mask[..., None], encoder.ln_final(x), 0.0)
  sg = jax.lax.stop_gradient
  new = {"memory": sg(jnp.stack(new_mem).astype(jnp.float32)),
         "valid": all_valid[:, all_valid.shape[1] - m_len:]}
  if compress is not None:
    rate = compress[0].rate
    old_valid = all_valid[:, :seg].reshape(tokens.shape[0], seg // rate, rate).all(-1)
    n_cm = state["compressed"].shape[2]
    comp = jnp.concatenate([state["compressed"], jnp.stack(new_comp).astype(jnp.float32)], 2)
    cvalid = jnp.concatenate([state["cvalid"], old_valid], axis=1)
    new["compressed"] = sg(comp[:, :, comp.shape[2] - n_cm:])
    new["cvalid"] = cvalid[:, cvalid.shape[1] - n_cm:]
  return x, new, recon / max(len(encoder.blocks), 1)


def check(cfg: Mapping[str, Any], seg_length: int) -> None:
  """Raises ValueError for memory settings the model cannot run."""
  rate = int(cfg.get("compression_rate", 1) or 1)
  if int(cfg.get("compressed_length", 0) or 0) and seg_length % rate:
    raise ValueError(f"compression_rate {rate} must divide the segment length {seg_length}.")
