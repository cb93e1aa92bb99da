"""LED, the Longformer encoder-decoder: a band + global attention encoder and a dense decoder.

The encoder is `models.encoder.Encoder` (embeddings, positions, pre-LayerNorm blocks, final
LayerNorm) with any attention kind; in its band layers the first `num_global` tokens are global
(`GlobalBandAttention`: they attend to every token and every token attends to them, as the LED
encoder's first token does). The decoder is `decoder_layers` pre-LayerNorm blocks of causal
self-attention, dense cross-attention to the encoder output and an MLP, with a final LayerNorm.
Encoder and decoder share the token embedding, which (transposed, on features scaled by
1/sqrt(emb_dim) as in `models.language_model`) is also the output layer. Decoder positions are
fixed sinusoids.

Hugging Face's BART and LED (`models.pretrained_seq2seq`) differ in ways that are settings,
all off by default: `norm="post"` makes the decoder blocks post-LayerNorm (residual, then
LayerNorm; no final LayerNorm), as the encoder's; `decoder_pos_emb="learned"` gives the decoder
its own learned table (`decoder_positions`, target_length rows after `position_offset` rows:
BART's offset of 2, LED's 0); `embed_norm` and `embed_scale` apply to the decoder's embeddings
as to the encoder's (BART's layernorm_embedding and scale_embedding); `activation` and
`layer_norm_eps` are the decoder's too; `lm_head` makes the output layer the tied embedding
without the 1/sqrt(emb_dim) scale plus a bias per vocabulary entry (`logits_bias`, BART's
final_logits_bias). BART's `<s>` is id 0, which this codebase takes for padding: `encode`,
`decode` and `step` take explicit masks (`key_mask`, `token_mask`) that replace `tokens > 0`,
and `encode` takes Longformer's `global_mask` (LED's global tokens through the encoder's
`global_projections`, with `num_global` = 0).

Decoding one position at a time (`step`) uses a key-value cache (`init_cache`): per decoder
layer, the self-attention keys and values written so far and the cross-attention keys and values
of the encoder output, computed once. `models.decoding` has greedy and beam search on top.

`cfg` (a `ModelSettings` or its mapping) fields: those of `Encoder` (vocab_size, max_length,
emb_dim, num_heads, qkv_dim, mlp_dim, num_layers = encoder layers, dropout, pos_emb, attention,
layer_attention) plus decoder_layers, target_length (decoder positions) and num_global (global
tokens at the start of the input).
Token id 0 is padding in inputs and targets.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

import attention
from models import sequence, settings
from models.attention_layer import MultiHeadAttention, split_spec
from models.embeddings import PositionEmbedding, sinusoidal_table
from models.encoder import MLP, Encoder, compute_dtype, dense, dropout, layer_norm
from models.settings import ModelSettings
from models.sharding import param


def _fold(rng, i: int):
  return None if rng is None else jax.random.fold_in(rng, i)


class GlobalBandAttention(MultiHeadAttention):
  """The encoder's band self-attention with its first `num_global` real tokens global.

  The projections and arguments are those of `MultiHeadAttention` (biases and Longformer's
  global projections included, as an imported BART or LED has them); the call hands it a
  `global_mask` of the first `num_global` positions (where real), or-ed with the caller's.
  """

  def __init__(self, *args, num_global: int, **kwargs):
    super().__init__(*args, global_tokens=int(num_global) > 0, **kwargs)
    self.num_global = int(num_global)
    self.args = {**self.args, "max_global": max(self.args.get("max_global") or 0,
                                                self.num_global)}

  def __call__(self, x: jax.Array, key_mask: jax.Array | None, *, rng=None,
               global_mask: jax.Array | None = None) -> jax.Array:
    if sequence.devices() > 1:
      raise ValueError("global tokens in the LED encoder need the whole sequence on each "
                       "device: use config.mesh.sequence=1.")
    b, length, _ = x.shape
    if key_mask is None:
      key_mask = jnp.ones((b, length), bool)
    glob = (jnp.arange(length) < self.num_global)[None, :] & key_mask          # [B, L]
    if global_mask is not None:
      glob = glob | (global_mask & key_mask)
    return super().__call__(x, key_mask, rng=rng, global_mask=glob)           # [B, L, E]


def led_encoder(cfg: ModelSettings | Mapping[str, Any], *, rngs: nnx.Rngs) -> Encoder:
  """`Encoder(cfg)` whose band layers make the first `num_global` tokens global."""
  s = ModelSettings.from_mapping(cfg)
  # `lm_head` is the decoder's output layer (LED._logits), not a masked-LM head of the encoder.
  enc = Encoder(dataclasses.replace(s, lm_head=False), rngs=rngs)
  num_global = s.num_global
  if num_global <= 0:
    return enc
  specs = s.layer_specs(s.num_layers)
  for i, (block, spec) in enumerate(zip(enc.blocks, specs)):
    if split_spec(spec)[0] == "band":
      block.attention = GlobalBandAttention(
          s.emb_dim, s.num_heads, s.qkv_dim, spec, max_length=s.max_length, layer_index=i,
          num_global=num_global, bias=s.attention_bias,
          global_projections=s.global_projections, tiles=s.splash_tiles, rngs=rngs)
  return enc


class DenseAttention(nnx.Module):
  """Dense multi-head attention with separate key/value projection (`kv`), so that keys and
  values can be cached or precomputed; the attention is `attention.dot_product_attention`."""

  def __init__(self, emb_dim: int, num_heads: int, qkv_dim: int, *, rngs: nnx.Rngs, dtype=None):
    settings.check_heads(num_heads, qkv_dim)
    self.num_heads = num_heads
    self.query = dense(rngs, emb_dim, qkv_dim, ("embed", "heads"), dtype)
    self.key = dense(rngs, emb_dim, qkv_dim, ("embed", "heads"), dtype)
    self.value = dense(rngs, emb_dim, qkv_dim, ("embed", "heads"), dtype)
    self.out = dense(rngs, qkv_dim, emb_dim, ("heads", "embed"), dtype)

  def _heads(self, x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:2], self.num_heads, -1)                     # [B, L, H, Dh]

  def kv(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values `[B, L, H, Dh]` of `x: [B, L, E]`."""
    return self._heads(self.key(x)), self._heads(self.value(x))

  def __call__(self, x: jax.Array, k: jax.Array, v: jax.Array, *, key_mask: jax.Array,
               query_mask: jax.Array, causal: bool = False) -> jax.Array:
    """x `[B, Lq, E]` attends to k, v `[B, Lk, H, Dh]` -> `[B, Lq, E]`."""
    out = attention.dot_product_attention(self._heads(self.query(x)), k, v, key_mask=key_mask,
                                          query_mask=query_mask, causal=causal)
    return self.out(out.reshape(*out.shape[:2], -1))


class DecoderBlock(nnx.Module):
  """Decoder block: causal self-attention, cross-attention, MLP, each residual; pre-LayerNorm
  (x + f(LN(x))), or post-LayerNorm (LN(x + f(x)), BART's order) with `norm="post"`."""

  def __init__(self, s: ModelSettings, *, rngs: nnx.Rngs):
    e, h, qkv = s.emb_dim, s.num_heads, s.qkv_dim
    dtype, eps = compute_dtype(s), s.layer_norm_eps
    self.ln_self = layer_norm(rngs, e, dtype, eps)
    self.self_attention = DenseAttention(e, h, qkv, rngs=rngs, dtype=dtype)
    self.ln_cross = layer_norm(rngs, e, dtype, eps)
    self.cross_attention = DenseAttention(e, h, qkv, rngs=rngs, dtype=dtype)
    self.ln_mlp = layer_norm(rngs, e, dtype, eps)
    self.mlp = MLP(e, s.mlp_dim, s.dropout, rngs=rngs, dtype=dtype, activation=s.activation)
    self.dropout_rate = s.dropout
    self.post_norm = s.norm == "post"

  def _pre(self, ln, x):      # the sublayer's input: LN(x) before it, or x
    return x if self.post_norm else ln(x)

  def _post(self, ln, x):     # the residual sum: LN(x + f) after it, or x + f
    return ln(x) if self.post_norm else x

  def __call__(self, x, query_mask, cross, cross_mask, *, cache=None, t=None, self_mask=None,
               rng=None):
    """x `[B, T, E]` (T = 1 with a cache); cross: this layer's encoder (keys, values).

    Without `cache`, the T positions attend causally among themselves (teacher forcing). With
    `cache` ({"k", "v"}: `[B, T_max, H, Dh]`), x is position `t`: its keys and values are
    written at t and it attends to the cached positions where `self_mask` `[B, T_max]` is True.
    Returns (x, the updated cache or None).
    """
    pre, post = self._pre, self._post
    h = pre(self.ln_self, x)
    k, v = self.self_attention.kv(h)                                       # [B, T, H, Dh]
    if cache is None:
      out = self.self_attention(h, k, v, key_mask=query_mask, query_mask=query_mask,
                                causal=True)
    else:
      k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), t, 1)
      v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), t, 1)
      out = self.self_attention(h, k, v, key_mask=self_mask, query_mask=query_mask)
      cache = {"k": k, "v": v}
    x = post(self.ln_self, x + dropout(out, self.dropout_rate, _fold(rng, 0)))
    out = self.cross_attention(pre(self.ln_cross, x), *cross, key_mask=cross_mask,
                               query_mask=query_mask)
    x = post(self.ln_cross, x + dropout(out, self.dropout_rate, _fold(rng, 1)))
    out = self.mlp(pre(self.ln_mlp, x), rng=_fold(rng, 2))
    return post(self.ln_mlp, x + dropout(out, self.dropout_rate, _fold(rng, 3))), cache


class LED(nnx.Module):
  """The Longformer encoder-decoder (see the module docstring for `cfg`)."""

  def __init__(self, cfg: ModelSettings | Mapping[str, Any], *, rngs: nnx.Rngs):
    s = ModelSettings.from_mapping(cfg)
    s.require("decoder_layers", "target_length", model="the encoder-decoder")
    self.encoder = led_encoder(s, rngs=rngs)
    self.blocks = nnx.List([DecoderBlock(s, rngs=rngs) for _ in range(s.decoder_layers)])
    # Post-LayerNorm blocks end normalised: no final LayerNorm (BART).
    self.ln_final = (layer_norm(rngs, s.emb_dim, compute_dtype(s), s.layer_norm_eps)
                     if s.norm == "pre" else None)
    self.decoder_positions = (
        PositionEmbedding("learned", s.target_length, s.emb_dim, rngs=rngs,
                          offset=s.position_offset) if s.decoder_pos_emb == "learned" else None)
    self.ln_embed = (layer_norm(rngs, s.emb_dim, compute_dtype(s), s.layer_norm_eps)
                     if s.embed_norm else None)
    self.logits_bias = (param(rngs, nnx.initializers.zeros_init(), (s.vocab_size,), ("vocab",))
                        if s.lm_head else None)
    self.embed_scale = s.embed_scale
    self.target_length = s.target_length
    self.emb_dim = int(s.emb_dim)
    self.dtype = compute_dtype(s)
    self.dropout_rate = s.dropout

  def encode(self, inputs: jax.Array, *, rng=None, key_mask: jax.Array | None = None,
             global_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """inputs `[B, L]` -> (encoder output `[B, L, E]`, its key mask `[B, L]`).

    `key_mask` (`[B, L]` bool, True = real token) replaces `inputs > 0`; `global_mask` names
    global tokens (`models.encoder.Encoder`)."""
    return self.encoder(inputs, rng=rng, key_mask=key_mask, global_mask=global_mask)

  def cross_kv(self, memory: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Each decoder layer's cross-attention keys and values of the encoder output."""
    return [block.cross_attention.kv(memory) for block in self.blocks]

  def _embed(self, tokens: jax.Array, start, rng) -> jax.Array:
    """Decoder tokens `[B, T]` at positions start.. -> `[B, T, E]`."""
    length = tokens.shape[1]
    if isinstance(start, int) and start + length > self.target_length:
      raise ValueError(f"decoder input of length {start + length} is longer than "
                       f"target_length ({self.target_length}).")
    if self.decoder_positions is None:
      table = jnp.asarray(sinusoidal_table(self.target_length, self.emb_dim))  # [T_max, E]
    else:
      offset = self.decoder_positions.offset
      table = self.decoder_positions.table[...][offset:offset + self.target_length]
    pos = jax.lax.dynamic_slice_in_dim(table, start, length, 0)             # [T, E]
    x = self.encoder.embed(tokens)
    if self.embed_scale != 1.0:
      x = x * self.embed_scale
    x = x + pos[None].astype(x.dtype)
    if self.ln_embed is not None:
      x = self.ln_embed(x)
    return dropout(x, self.dropout_rate, rng).astype(self.dtype)

  def _final(self, x: jax.Array) -> jax.Array:
    """The last block's output -> the decoder's last hidden state (the final LayerNorm's)."""
    return x if self.ln_final is None else self.ln_final(x)

  def _logits(self, x: jax.Array) -> jax.Array:
    """The decoder's last hidden state `[B, T, E]` -> logits `[B, T, V]` float32."""
    if self.logits_bias is None:
      return self.encoder.embed.attend(x * (self.emb_dim ** -0.5)).astype(jnp.float32)
    logits = self.encoder.embed.attend(x) + self.logits_bias[...].astype(x.dtype)
    return logits.astype(jnp.float32)                                      # [B, T, V]

  def decoder_states(self, memory: jax.Array, memory_mask: jax.Array, tokens: jax.Array, *,
                     token_mask: jax.Array | None = None, rng=None) -> jax.Array:
    """Teacher forcing: decoder inputs `[B, T]` -> the decoder's last hidden state `[B, T, E]`
    (Hugging Face's `last_hidden_state`). `token_mask` (`[B, T]` bool, True = real token)
    replaces `tokens > 0`."""
    mask = tokens > 0 if token_mask is None else token_mask.astype(bool)   # [B, T]
    x = self._embed(tokens, 0, _fold(rng, 0))
    for i, (block, cross) in enumerate(zip(self.blocks, self.cross_kv(memory))):
      x, _ = block(x, mask, cross, memory_mask, rng=_fold(rng, i + 1))
    return self._final(x)

  def decode(self, memory: jax.Array, memory_mask: jax.Array, tokens: jax.Array, *,
             token_mask: jax.Array | None = None, rng=None) -> jax.Array:
    """Teacher forcing: decoder inputs `[B, T]` (BOS first) -> next-token logits `[B, T, V]`
    (`token_mask` as in `decoder_states`)."""
    return self._logits(self.decoder_states(memory, memory_mask, tokens, token_mask=token_mask,
                                            rng=rng))

  def __call__(self, inputs: jax.Array, tokens: jax.Array, *, rng=None) -> jax.Array:
    """inputs `[B, L]`, decoder inputs `[B, T]` -> logits `[B, T, V]` float32."""
    memory, memory_mask = self.encode(inputs, rng=_fold(rng, 0))
    return self.decode(memory, memory_mask, tokens, rng=_fold(rng, 1))

  def init_cache(self, memory: jax.Array, memory_mask: jax.Array) -> dict[str, Any]:
    """The decoding cache for a batch of encoder outputs: per layer empty self-attention keys
    and values `[B, target_length, H, Dh]`, the cross-attention keys and values, the encoder
    mask, and `mask` `[B, target_length]` (positions written with a real token)."""
    b = memory.shape[0]
    layers = []
    for block, (k, v) in zip(self.blocks, self.cross_kv(memory)):
      shape = (b, self.target_length, *k.shape[2:])
      layers.append({"k": jnp.zeros(shape, k.dtype), "v": jnp.zeros(shape, v.dtype)})
    return {"self": layers, "cross": self.cross_kv(memory), "memory_mask": memory_mask,
            "mask": jnp.zeros((b, self.target_length), bool)}

  def step(self, cache: dict[str, Any], tokens: jax.Array, t, *,
           token_mask: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Decodes position `t` (an int or a traced scalar) from its input tokens `[B]`: returns
    the next-token logits `[B, V]` and the cache with position t written. `token_mask` (`[B]`
    bool, True = real token) replaces `tokens > 0`."""
    tokens = tokens[:, None]                                               # [B, 1]
    query_mask = tokens > 0 if token_mask is None else token_mask.astype(bool)[:, None]
    self_mask = jax.lax.dynamic_update_slice_in_dim(cache["mask"], query_mask, t, 1)
    self_mask = self_mask & (jnp.arange(self.target_length) <= t)[None]
    x = self._embed(tokens, t, None)
    layers = []
    for block, layer, cross in zip(self.blocks, cache["self"], cache["cross"]):
      x, layer = block(x, query_mask, cross, cache["memory_mask"], cache=layer, t=t,
                       self_mask=self_mask)
      layers.append(layer)
    cache = {**cache, "self": layers, "mask": self_mask}
    return self._logits(self._final(x))[:, 0], cache
