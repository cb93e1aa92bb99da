"""Transformer encoder pieces and the LRA encoder classifier.

`Block` is pre-LayerNorm: x + Dropout(Attention(LN(x))), then x + Dropout(MLP(LN(x))). `Encoder`
embeds tokens, adds positions, runs `num_layers` blocks (each with its own attention spec, see
`layer_specs`) and a final LayerNorm. `Classifier` pools the encoder output (a prepended CLS
token or a padding-aware mean) and applies Dense -> ReLU -> Dense, as in LRA.

Randomness is explicit: `rng` is a key in training (dropout, LSH hashing) and None in eval.
Token id 0 is padding everywhere.

The models take a `ModelSettings` (models/settings.py) or the mapping it is made from, once, at
their entry; the settings hold the valid names and the rules, so nothing here checks them again.

`sublayers` (a string of "s" = self-attention and "f" = feed-forward sublayers, or "") and
`sandwich` (k: s^k (sf)^(n-k) f^k) reorder the sublayers (Press et al. 2020,
`settings.sublayer_order`); the default interleaved order builds `Block`s as before.

`remat` trades compute for memory in the backward pass: "none" keeps every block's
activations; "block" keeps only each block's input and recomputes the block (`nnx.remat`);
"dots_saveable" and "dots_with_no_batch_dims_saveable" recompute the block but keep the matmul
outputs that `jax.checkpoint_policies` of that name saves. The values are the same in all cases.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention_extras, sequence, settings
from models.attention_layer import MultiHeadAttention, split_spec
from models.embeddings import PositionEmbedding, TokenEmbedding
from models.settings import ModelSettings, layer_specs, sublayer_order  # noqa: F401
from models.sharding import metadata, param


def _policy(remat: str):
  """The jax.checkpoint policy of a `settings.REMATS` name: None (no rematerialisation) for
  "none", nothing_saveable for "block", else the `jax.checkpoint_policies` of that name."""
  if remat == "none":
    return None
  return getattr(jax.checkpoint_policies, "nothing_saveable" if remat == "block" else remat)


# settings.REMATS name -> the jax.checkpoint policy of each block.
REMAT = {name: _policy(name) for name in settings.REMATS}


def _apply_block(block, x, key_mask, rng, global_mask=None):
  if global_mask is None:
    return block(x, key_mask, rng=rng)
  return block(x, key_mask, rng=rng, global_mask=global_mask)


def block_runner(remat: str):
  """`(block, x, key_mask, rng, global_mask=None) -> x`, rematerialised as `remat` says.

  The rematerialised block is a pure function of its state (`nnx.split`) under
  `jax.checkpoint`; blocks change no state when called, so nothing is written back.
  """
  settings.check_choice("remat", remat)
  policy = REMAT[remat]
  if policy is None:
    return _apply_block

  def run(block, x, key_mask, rng, global_mask=None):
    graphdef, state = nnx.split(block)

    def pure(state, x, key_mask, rng, global_mask):
      return _apply_block(nnx.merge(graphdef, state), x, key_mask, rng, global_mask)

    return jax.checkpoint(pure, policy=policy)(state, x, key_mask, rng, global_mask)

  return run


def dropout(x: jax.Array, rate: float, rng) -> jax.Array:
  """Inverted dropout; identity when `rng` is None (evaluation) or the rate is 0."""
  if rng is None or rate <= 0.0:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def _fold(rng, i: int):
  return None if rng is None else jax.random.fold_in(rng, i)


def dense(rngs: nnx.Rngs, fan_in: int, fan_out: int, names: tuple[str | None, str | None],
          dtype=None):
  """nnx.Linear with Xavier-uniform kernel, zero bias, and logical axis names; `dtype` is the
  computation's (float32 parameters either way)."""
  return nnx.Linear(
      fan_in, fan_out, rngs=rngs, kernel_init=nnx.initializers.xavier_uniform(),
      kernel_metadata=metadata(names), bias_metadata=metadata((names[1],)), dtype=dtype)


def layer_norm(rngs: nnx.Rngs, dim: int, dtype=None, eps: float = 1e-6) -> nnx.LayerNorm:
  """nnx.LayerNorm whose scale and bias carry the logical name "embed" (statistics in float32,
  output in `dtype`; `eps` is added to the variance)."""
  return nnx.LayerNorm(dim, epsilon=eps, rngs=rngs, scale_metadata=metadata(("embed",)),
                       bias_metadata=metadata(("embed",)), dtype=dtype)


# settings.ACTIVATIONS name -> the function.
ACTIVATION = {"gelu_tanh": jax.nn.gelu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
              "relu": jax.nn.relu}


def compute_dtype(cfg: ModelSettings | Mapping[str, Any]):
  """The activations' dtype (`config.dtype`): float32, or bfloat16 with float32 parameters."""
  name = cfg.dtype if isinstance(cfg, ModelSettings) else str(cfg.get("dtype", "float32"))
  settings.check_choice("dtype", name)
  return jnp.dtype(name)


class MLP(nnx.Module):
  """Dense(mlp_dim) -> GELU (or `activation`, a settings.ACTIVATIONS name) -> Dropout ->
  Dense(emb_dim)."""

  def __init__(self, emb_dim: int, mlp_dim: int, dropout_rate: float, *, rngs: nnx.Rngs,
               dtype=None, activation: str = "gelu_tanh"):
    settings.check_choice("activation", activation)
    self.fc1 = dense(rngs, emb_dim, mlp_dim, ("embed", "mlp"), dtype)
    self.fc2 = dense(rngs, mlp_dim, emb_dim, ("mlp", "embed"), dtype)
    self.dropout_rate = dropout_rate
    self.activation = activation

  def __call__(self, x: jax.Array, *, rng=None) -> jax.Array:
    h = ACTIVATION[self.activation](self.fc1(x))                           # [B, L, M]
    return self.fc2(dropout(h, self.dropout_rate, rng))                    # [B, L, E]


def _attention(s: ModelSettings, spec, *, max_length, causal, shared_extras, layer_index, rngs):
  return MultiHeadAttention(
      s.emb_dim, s.num_heads, s.qkv_dim, spec, max_length=max_length, causal=causal,
      shared_extras=shared_extras, layer_index=layer_index, positions=s.positions,
      bias=s.attention_bias, global_projections=s.global_projections, tiles=s.splash_tiles,
      rngs=rngs)


def _mlp(s: ModelSettings, rngs: nnx.Rngs) -> MLP:
  return MLP(s.emb_dim, s.mlp_dim, s.dropout, rngs=rngs, dtype=compute_dtype(s),
             activation=s.activation)


class AttentionSublayer(nnx.Module):
  """x + Dropout(Attention(LN(x))): an "s" of a reordered stack."""

  def __init__(self, s: ModelSettings, spec: Mapping[str, Any], *, rngs: nnx.Rngs, **kw):
    self.ln_attn = layer_norm(rngs, s.emb_dim, compute_dtype(s), s.layer_norm_eps)
    self.attention = _attention(s, spec, rngs=rngs, **kw)
    self.dropout_rate = s.dropout

  def __call__(self, x: jax.Array, key_mask, *, rng=None, global_mask=None) -> jax.Array:
    kw = {} if global_mask is None else {"global_mask": global_mask}
    h = self.attention(self.ln_attn(x), key_mask, rng=_fold(rng, 0), **kw)
    return x + dropout(h, self.dropout_rate, _fold(rng, 1))


class FeedForwardSublayer(nnx.Module):
  """x + Dropout(MLP(LN(x))): an "f" of a reordered stack."""

  def __init__(self, s: ModelSettings, *, rngs: nnx.Rngs):
    self.ln_mlp = layer_norm(rngs, s.emb_dim, compute_dtype(s), s.layer_norm_eps)
    self.mlp = _mlp(s, rngs)
    self.dropout_rate = s.dropout

  def __call__(self, x: jax.Array, key_mask, *, rng=None, global_mask=None) -> jax.Array:
    del global_mask  # the feed-forward sublayer mixes no positions
    h = self.mlp(self.ln_mlp(x), rng=_fold(rng, 2))
    return x + dropout(h, self.dropout_rate, _fold(rng, 3))


class Block(nnx.Module):
  """A transformer block: pre-LayerNorm (x + f(LN(x))), or post-LayerNorm (LN(x + f(x)), BERT's
  order) with `norm="post"`."""

  def __init__(self, s: ModelSettings, spec: Mapping[str, Any], *, max_length: int,
               causal: bool = False, shared_extras=None, layer_index: int = 0,
               rngs: nnx.Rngs):
    e = s.emb_dim
    dtype = compute_dtype(s)
    self.ln_attn = layer_norm(rngs, e, dtype, s.layer_norm_eps)
    self.attention = _attention(s, spec, max_length=max_length, causal=causal,
                                shared_extras=shared_extras, layer_index=layer_index, rngs=rngs)
    self.ln_mlp = layer_norm(rngs, e, dtype, s.layer_norm_eps)
    self.mlp = _mlp(s, rngs)
    self.dropout_rate = s.dropout
    self.post_norm = s.norm == "post"

  def __call__(self, x: jax.Array, key_mask, *, rng=None, global_mask=None) -> jax.Array:
    kw = {} if global_mask is None else {"global_mask": global_mask}
    if self.post_norm:
      h = self.attention(x, key_mask, rng=_fold(rng, 0), **kw)               # [B, L, E]
      x = self.ln_attn(x + dropout(h, self.dropout_rate, _fold(rng, 1)))
      h = self.mlp(x, rng=_fold(rng, 2))
      return self.ln_mlp(x + dropout(h, self.dropout_rate, _fold(rng, 3)))  # [B, L, E]
    h = self.attention(self.ln_attn(x), key_mask, rng=_fold(rng, 0), **kw)  # [B, L, E]
    x = x + dropout(h, self.dropout_rate, _fold(rng, 1))
    h = self.mlp(self.ln_mlp(x), rng=_fold(rng, 2))
    return x + dropout(h, self.dropout_rate, _fold(rng, 3))                # [B, L, E]


def run_blocks(blocks, x, key_mask, rng, remat: str, global_mask=None):
  """Applies `blocks` in order (block i gets `_fold(rng, i + 1)`), rematerialised as `remat` says.

  With rematerialisation, blocks of one structure (every block unless `layer_attention` makes
  them differ) run as one `jax.lax.scan` over their stacked states: XLA then recomputes one block
  at a time in the backward pass. Unrolled `jax.checkpoint` blocks are not enough on XLA:CPU,
  whose scheduler hoists every block's recomputation to the start of the backward pass (the
  compiled temporaries did not shrink at all). Blocks of different structures are unrolled.
  """
  if REMAT.get(remat, "") is None or len(blocks) == 1:
    run = block_runner(remat)
    for i, block in enumerate(blocks):
      x = run(block, x, key_mask, _fold(rng, i + 1), global_mask)
    return x
  split = [nnx.split(block) for block in blocks]
  graphdef = split[0][0]
  if any(g != graphdef for g, _ in split):
    run = block_runner(remat)
    for i, block in enumerate(blocks):
      x = run(block, x, key_mask, _fold(rng, i + 1), global_mask)
    return x
  settings.check_choice("remat", remat)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *(state for _, state in split))
  keys = None if rng is None else jnp.stack([_fold(rng, i + 1) for i in range(len(blocks))])

  def body(x, layer):
    state, key = layer
    return _apply_block(nnx.merge(graphdef, state), x, key_mask, key, global_mask), None

  body = jax.checkpoint(body, policy=REMAT[remat])
  x, _ = jax.lax.scan(body, x, (stacked, keys))
  return x


class Encoder(nnx.Module):
  """Embeddings + blocks + final LayerNorm; optionally prepends a learned CLS token.

  `cfg`: a `ModelSettings` or its mapping (vocab_size, max_length, emb_dim, num_heads, qkv_dim,
  mlp_dim, num_layers, dropout, pos_emb, attention (dict), layer_attention (sequence of dicts),
  and optionally rotary_base, sublayers, sandwich, remat, dtype).
  """

  def __init__(self, cfg: ModelSettings | Mapping[str, Any], *, cls_token: bool = False,
               causal: bool = False, rngs: nnx.Rngs):
    s = ModelSettings.from_mapping(cfg)
    self.cls_token = cls_token
    max_length = s.max_length + int(cls_token)
    self.embed = TokenEmbedding(s.vocab_size, s.emb_dim, rngs=rngs)
    self.positions = PositionEmbedding(s.pos_emb, max_length, s.emb_dim, rngs=rngs,
                                       offset=s.position_offset)
    self.types = (TokenEmbedding(s.type_vocab_size, s.emb_dim, rngs=rngs)
                  if s.type_vocab_size else None)
    self.ln_embed = (layer_norm(rngs, s.emb_dim, compute_dtype(s), s.layer_norm_eps)
                     if s.embed_norm else None)
    self.embed_scale = s.embed_scale
    if cls_token:
      self.cls = param(rngs, nnx.initializers.zeros_init(), (s.emb_dim,), ("embed",))
    order = s.order
    interleaved = order == "sf" * s.num_layers
    shared = {}
    blocks = []
    for i, spec in enumerate(s.layer_specs()):
      kind, args = split_spec(spec)
      extras = None
      cls = attention_extras.extras_class(kind)
      if cls is not None and cls.shared_across_layers(args):
        if kind not in shared:  # built once, before the first such layer's own parameters
          shared[kind] = attention_extras.make_extras(
              kind, args, num_heads=s.num_heads, head_dim=s.head_dim, max_length=max_length,
              rngs=rngs)
        extras = shared[kind]
      blocks.append(Block(s, spec, max_length=max_length, causal=causal,
                          shared_extras=extras, layer_index=i, rngs=rngs) if interleaved else
                    AttentionSublayer(s, spec, max_length=max_length, causal=causal,
                                      shared_extras=extras, layer_index=i, rngs=rngs))
    if not interleaved:  # the reordered stack: attention sublayers in order, MLPs between
      attn = iter(blocks)
      blocks = [next(attn) if c == "s" else FeedForwardSublayer(s, rngs=rngs) for c in order]
    self.blocks = nnx.List(blocks)
    # Post-LayerNorm blocks end normalised: no final LayerNorm (BERT).
    self.ln_final = (layer_norm(rngs, s.emb_dim, compute_dtype(s), s.layer_norm_eps)
                     if s.norm == "pre" else None)
    self.lm_head = MaskedLMHead(s, rngs=rngs) if s.lm_head else None
    self.dtype = compute_dtype(s)
    self.dropout_rate = s.dropout
    self.remat = s.remat
    self.settings = s

  def __call__(self, tokens: jax.Array, *, rng=None, key_mask=None, token_types=None,
               global_mask=None, shown_as_mask=None) -> tuple[jax.Array, jax.Array]:
    """tokens `[B, L]` int -> (features `[B, L', E]`, key_mask `[B, L']`), L' = L (+1 with CLS).

    `key_mask` (`[B, L]` bool, True = real token) defaults to `tokens > 0` (id 0 = padding);
    `token_types` (`[B, L]` int) needs `type_vocab_size` (type 0 when not given); `global_mask`
    (`[B, L]` bool) names global tokens to the attention layers (band attention's global tokens;
    with `global_projections`, Longformer's own projections for them); `shown_as_mask` (`[B, L]`
    bool) shows the [MASK] embedding, the padding id's row, at those positions (BERT's masked
    LM, `models.pretraining.masked_logits`)."""
    if key_mask is None:
      key_mask = tokens > 0                                                # [B, L]
    key_mask = key_mask.astype(bool)
    x = self.embed(tokens)                                                 # [B, L, E]
    if shown_as_mask is not None:
      x = jnp.where(shown_as_mask[..., None], self.embed.embedding[...][0], x)
    if self.embed_scale != 1.0:
      x = x * self.embed_scale
    if self.types is not None:
      x = x + self.types(jnp.zeros_like(tokens) if token_types is None else token_types)
    if self.cls_token:
      cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, x.shape[2])).astype(x.dtype)
      x = jnp.concatenate([cls, x], axis=1)                                # [B, L+1, E]
      key_mask = jnp.concatenate([jnp.ones_like(key_mask[:, :1]), key_mask], axis=1)
      if global_mask is not None:
        global_mask = jnp.concatenate([jnp.zeros_like(global_mask[:, :1]), global_mask], axis=1)
    x = self.positions(x)
    if self.ln_embed is not None:
      x = self.ln_embed(x)
    x = dropout(x, self.dropout_rate, _fold(rng, 0)).astype(self.dtype)
    split = sequence.devices()
    if split > 1:   # the length split over devices: padded to a multiple (exact), then split
      if global_mask is not None:
        raise ValueError("global tokens need the whole sequence on each device: use "
                         "config.mesh.sequence=1.")
      x, key_mask, length = sequence.pad_length(x, key_mask, split)
      x = sequence.split_length(x)
    glob = None if global_mask is None else global_mask.astype(bool) & key_mask
    x = run_blocks(self.blocks, x, key_mask, rng, self.remat, glob)
    if self.ln_final is not None:
      x = self.ln_final(x)
    x = jnp.where(key_mask[..., None], x, 0.0)
    if split > 1:
      x, key_mask = x[:, :length], key_mask[:, :length]
    return x, key_mask

  def encode(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
             global_attention_mask: jax.Array | None = None,
             token_type_ids: jax.Array | None = None) -> jax.Array:
    """Hugging Face's call: what it names `last_hidden_state`, `[B, L, E]`, in evaluation mode.

    `attention_mask` (`[B, L]`, 1 = real token, 0 = padding; all real when not given) replaces
    this codebase's padding id 0, so any vocabulary works; padded positions output zeros.
    Padding must be on the right: position i is the i-th token."""
    input_ids = jnp.asarray(input_ids)
    key_mask = (jnp.ones(input_ids.shape, bool) if attention_mask is None
                else jnp.asarray(attention_mask) > 0)
    glob = None if global_attention_mask is None else jnp.asarray(global_attention_mask) > 0
    x, _ = self(input_ids, key_mask=key_mask, token_types=token_type_ids, global_mask=glob)
    return x

  def mlm_logits(self, x: jax.Array) -> jax.Array:
    """Masked-LM logits `[B, L, V]` of features `[B, L, E]` through the `lm_head`."""
    if self.lm_head is None:
      raise ValueError("this encoder has no masked-LM head: build it with "
                       "config.model.lm_head=True.")
    return self.lm_head(x, self.embed)


class MaskedLMHead(nnx.Module):
  """BERT's masked-LM head: Dense(E) -> activation -> LayerNorm -> the tied token embedding,
  plus a bias per vocabulary entry (RoBERTa's `lm_head`, BERT's `cls.predictions`)."""

  def __init__(self, s: ModelSettings, *, rngs: nnx.Rngs):
    self.dense = dense(rngs, s.emb_dim, s.emb_dim, ("embed", "mlp"), compute_dtype(s))
    self.ln = layer_norm(rngs, s.emb_dim, compute_dtype(s), s.layer_norm_eps)
    self.bias = param(rngs, nnx.initializers.zeros_init(), (s.vocab_size,), ("vocab",))
    self.activation = s.activation

  def __call__(self, x: jax.Array, embed: TokenEmbedding) -> jax.Array:
    h = self.ln(ACTIVATION[self.activation](self.dense(x)))                # [B, L, E]
    return (embed.attend(h) + self.bias[...]).astype(jnp.float32)          # [B, L, V]


def pool(x: jax.Array, key_mask: jax.Array, kind: str) -> jax.Array:
  """`[B, L, E]` -> `[B, E]`: the CLS position, or the mean over real tokens."""
  settings.check_choice("pool", kind)
  if kind == "cls":
    return x[:, 0]
  count = jnp.maximum(key_mask.sum(axis=1, keepdims=True), 1).astype(x.dtype)
  return jnp.where(key_mask[..., None], x, 0.0).sum(axis=1) / count


class Classifier(nnx.Module):
  """The LRA encoder classifier: Encoder -> pool -> Dense(classifier_dim) -> ReLU -> Dense.

  Extra settings: num_classes, pool ("cls" or "mean"), classifier_dim.
  """

  def __init__(self, cfg: ModelSettings | Mapping[str, Any], *, rngs: nnx.Rngs):
    s = ModelSettings.from_mapping(cfg)
    s.require("pool", "classifier_dim", "num_classes", model="the classifier")
    self.pool_kind = s.pool
    self.encoder = Encoder(s, cls_token=s.pool == "cls", rngs=rngs)
    self.hidden = dense(rngs, s.emb_dim, s.classifier_dim, ("embed", "mlp"))
    self.head = dense(rngs, s.classifier_dim, s.num_classes, ("mlp", None))

  def __call__(self, inputs: jax.Array, *, rng=None) -> jax.Array:
    """inputs `[B, L]` int32 token ids (0 = padding) -> logits `[B, num_classes]` float32."""
    x, key_mask = self.encoder(inputs, rng=rng)                            # [B, L', E]
    h = jax.nn.relu(self.hidden(pool(x, key_mask, self.pool_kind)))        # [B, C']
    return self.head(h).astype(jnp.float32)                                # [B, num_classes]
