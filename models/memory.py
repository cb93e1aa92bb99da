"""Transformer-XL memory and the Compressive Transformer's compressed memory.

Each layer attends over [compressed memory; memory; current segment]. The memory of a layer holds
the layer's *inputs* (the residual stream entering the layer, not keys and values) for the last
`n_m` positions of the previous segments, under `stop_gradient`; its keys and values are computed
with the layer's current projections. Positions are Transformer-XL's relative ones: query i of a
segment sits at position C + M + i of the key sequence (C compressed slots, M memory slots), the
logit is (q+u)_i . k_j + (q+v)_i . R[i' - j], causal. A band layer keeps the pattern of its own
band attention over the key sequence, per head: query position p sees key position j when
p - j <= window * d_h and (p - j) % d_h == 0 (d_h the head's dilation), so the causal window
reaches into the memory with its dilation. "Layer" means attention sublayer: in a reordered stack
(`sublayers`, `sandwich`) every attention sublayer carries a memory of the stream entering it and
the feed-forward sublayers carry none. Transformer-XL's `same_length` evaluation (every query sees
its last P keys, P = C + M, itself included) is a further distance limit, P - 1.

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
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention import kinds, relative, validation
from attention.adaptive_span import span_mask
from models.attention_extras import AdaptiveSpan
from models.settings import ModelSettings

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
                     dilation: int | Sequence[int] = 1, max_distance: int | None = None,
                     clamp_len: int = 0, span=None, ramp: float = 32.0):
  """Dense relative attention of `q [B, L, H, D]` over `k, v [B, P + L, H, D]` (P earlier keys).

  Query i is at key position P + i; key j is allowed when key_valid[:, j], j <= P + i, (with
  `window`) the band layer's pattern holds per head h: the distance t = P + i - j satisfies
  t <= window * d_h and t % d_h == 0 (d_h = `dilation`, an int or one int per head), and (with
  `max_distance`, Transformer-XL's `same_length`) t <= max_distance. Rows with no allowed key
  give zeros. With `clamp_len` > 0 the position term uses the distance min(t, clamp_len)
  (Transformer-XL's clamp_len). With `span` (`[H]`, adaptive span's z per head) the weights
  are softmax(logits + log m) with m = clamp((ramp + z_h - t) / ramp, 0, 1), keys with m = 0
  not allowed (`attention.adaptive_span`).
  """
  b, lq, h, d = q.shape
  lk = k.shape[1]
  prefix = lk - lq
  qpos = prefix + jnp.arange(lq)[:, None]
  kpos = jnp.arange(lk)[None, :]
  distance = qpos - kpos                                                   # [L, P+L]
  allowed = (distance >= 0)[None]                                          # [1, L, P+L]
  if window is not None:
    dil = np.asarray(validation.head_dilations(dilation, h))[:, None, None]  # [H, 1, 1]
    allowed = allowed & (distance[None] <= int(window) * dil) & (distance[None] % dil == 0)
  if max_distance is not None:
    allowed = allowed & (distance <= int(max_distance))[None]
  span_bias = 0.0
  if span is not None:
    m = span_mask(distance[None].astype(jnp.float32),
                  jnp.asarray(span, jnp.float32)[:, None, None], ramp)   # [H, L, P+L]
    allowed = allowed & (m > 0)
    span_bias = jnp.log(jnp.where(m > 0, m, 1.0))
  allowed = allowed[None] & key_valid[:, None, None, :] & query_valid[:, None, :, None]
  qf = q.astype(jnp.float32)
  content = jnp.einsum("bqhd,bkhd->bhqk", qf + u, k.astype(jnp.float32))
  r = relative.projected_table(w_r, lk)                                    # [2lk-1, H, D]
  pos = jnp.einsum("bqhd,mhd->bhqm", qf + v_bias, r)                       # rows: lk-1 .. -(lk-1)
  if clamp_len:
    distance = jnp.minimum(distance, clamp_len)
  index = jnp.broadcast_to((lk - 1) - distance, pos.shape[:2] + (lq, lk))
  pos = jnp.take_along_axis(pos, index, axis=-1)
  logits = jnp.where(allowed, (content + pos) / math.sqrt(d) + span_bias, -1e30)
  p = jax.nn.softmax(logits, axis=-1) * allowed
  return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)


def _project(mha, x, name):
  return jnp.einsum("ble,ehd->blhd", x, getattr(mha, name)[...].astype(x.dtype))


def attend(mha, x, prefix, query_valid, key_valid, clamp_len, same_length):
  """The layer `mha` (relative positions) over [prefix; x]: x `[B, L, E]`, prefix `[B, P, E]`.

  A band layer keeps its own pattern (window, dilation, per head) measured over the key
  sequence [prefix; x]; `same_length` lets every query see its last P + 1 keys (itself
  included) and no more (distances up to P - 1), as Transformer-XL's evaluation does.
  """
  if mha.pos_kind != "relative" or not mha.record.memory:
    memory_kinds = " or ".join(kinds.names_where(lambda k: k.memory))
    raise ValueError(f"memory needs pos_emb='relative' with attention {memory_kinds}, not "
                     f"{mha.kind!r} with pos_emb={mha.pos_kind!r}.")
  full = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
  q = _project(mha, x, "query")
  k, v = _project(mha, full, "key"), _project(mha, full, "value")
  window = mha.args.get("window")   # a band layer: its window, as far as the memory reaches
  dilation = mha.args.get("dilation", 1)   # a None or 0 is refused by the config check
  limit = prefix.shape[1] - 1 if same_length else None
  spans = {}
  if isinstance(mha.extras, AdaptiveSpan):   # its soft span over the memory too
    got = mha.extras(length=x.shape[1], rng=None)
    spans = {"span": jnp.clip(got["span"], 0.0, float(got["max_span"])), "ramp": got["ramp"]}
  out = memory_attention(q, k, v, u=mha.u[...], v_bias=mha.v_bias[...], w_r=mha.w_r[...],
                         key_valid=key_valid, query_valid=query_valid, window=window,
                         dilation=dilation, max_distance=limit, clamp_len=clamp_len, **spans)
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


def memory_layers(cfg: ModelSettings | Mapping[str, Any]) -> int:
  """How many layers carry a memory: the attention sublayers (the "s" of the sublayer order)."""
  return ModelSettings.from_mapping(cfg).order.count("s")


def forward(encoder, compress, tokens, state: Mapping[str, jax.Array], *, rng=None,
            clamp_len: int, same_length: bool):
  """The encoder over one segment with memory: (features `[B, L, E]`, new state, recon loss).

  `encoder` is a `models.encoder.Encoder` of pre-LN sublayers in any order: interleaved
  `Block`s, or the `AttentionSublayer`s and `FeedForwardSublayer`s of a reordered stack
  (`sublayers`, `sandwich`). Every attention sublayer carries a memory (memory index a = its
  rank among the attention sublayers); `compress` is a list of `Compression` per attention
  sublayer, or None. Dropout follows the encoder (the same rng folding). The memory length is the
  state's: no parameter depends on it, so a model trained with one memory length runs with
  another. `clamp_len` > 0 clamps the relative distances (`memory_attention`); `same_length`
  gives every query the same number of keys (`attend`).
  """
  from models.encoder import _fold, dropout   # pylint: disable=import-outside-toplevel
  key_mask = tokens > 0
  x = encoder.embed(tokens)
  x = dropout(encoder.positions(x), encoder.dropout_rate, _fold(rng, 0)).astype(encoder.dtype)
  mem, valid = state["memory"], state["valid"]
  m_len, seg = mem.shape[2], tokens.shape[1]
  layers = sum(hasattr(block, "attention") for block in encoder.blocks)
  if mem.shape[0] != layers:
    raise ValueError(f"the memory has {mem.shape[0]} layers but the model has {layers} attention "
                     f"sublayers: make it with the model's init_memory.")
  prefix_valid = valid
  if compress is not None:
    prefix_valid = jnp.concatenate([state["cvalid"], valid], axis=1)
  key_valid = jnp.concatenate([prefix_valid, key_mask], axis=1)
  new_mem, new_comp, recon = [], [], jnp.zeros((), jnp.float32)
  all_valid = jnp.concatenate([valid, key_mask], axis=1)
  a = 0                                            # the memory of the next attention sublayer
  for i, block in enumerate(encoder.blocks):
    r = _fold(rng, i + 1)
    if hasattr(block, "attention"):
      stream = jnp.concatenate([mem[a].astype(x.dtype), jax.lax.stop_gradient(x)], axis=1)
      new_mem.append(stream[:, stream.shape[1] - m_len:])
      prefix = mem[a]
      if compress is not None:
        prefix = jnp.concatenate([state["compressed"][a], mem[a]], axis=1)
      ln_x, ln_prefix = block.ln_attn(x), block.ln_attn(prefix.astype(x.dtype))
      h = attend(block.attention, ln_x, ln_prefix, key_mask, key_valid, clamp_len, same_length)
      if compress is not None:
        old = stream[:, :seg]                                              # leaving the memory
        comp = compress[a](old)                                            # [B, L / c, E]
        recon = recon + reconstruction_loss(block.attention, _sg_norm(block.ln_attn, x),
                                            _sg_norm(block.ln_attn, old),
                                            _sg_norm(block.ln_attn, comp))
        new_comp.append(comp)
      x = x + dropout(h, block.dropout_rate, _fold(r, 1))
      a += 1
    if hasattr(block, "mlp"):
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
  return x, new, recon / max(layers, 1)


def check(cfg: Mapping[str, Any], seg_length: int) -> None:
  """Raises ValueError for memory settings the model cannot run."""
  rate = int(cfg.get("compression_rate", 1) or 1)
  if int(cfg.get("compressed_length", 0) or 0) and seg_length % rate:
    raise ValueError(f"compression_rate {rate} must divide the segment length {seg_length}.")
