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


def _apply_block(block, x, key_mask, rng):
  return block(x, key_mask, rng=rng)


def block_runner(remat: str):
  """`(block, x, key_mask, rng) -> x`, rematerialised as `remat` (a REMAT name) says.

  The rematerialised block is a pure function of its state (`nnx.split`) under
  `jax.checkpoint`; blocks change no state when called, so nothing is written back.
  """
  settings.check_choice("remat", remat)
  policy = REMAT[remat]
  if policy is None:
    return _apply_block

  def run(block, x, key_mask, rng):
    graphdef, state = nnx.split(block)

    def pure(state, x, key_mask, rng):
      return _apply_block(nnx.merge(graphdef, state), x, key_mask, rng)

    return jax.checkpoint(pure, policy=policy)(state, x, key_mask, rng)

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


def layer_norm(rngs: nnx.Rngs, dim: int, dtype=None) -> nnx.LayerNorm:
  """nnx.LayerNorm whose scale and bias carry the logical name "embed" (statistics in float32,
  output in `dtype`)."""
  return nnx.LayerNorm(dim, rngs=rngs, scale_metadata=metadata(("embed",)),
                       bias_metadata=metadata(("embed",)), dtype=dtype)


def compute_dtype(cfg: ModelSettings | Mapping[str, Any]):
  """The activations' dtype (`config.dtype`): float32, or bfloat16 with float32 parameters."""
  name = cfg.dtype if isinstance(cfg, ModelSettings) else str(cfg.get("dtype", "float32"))
  settings.check_choice("dtype", name)
  return jnp.dtype(name)


class MLP(nnx.Module):
  """Dense(mlp_dim) -> GELU -> Dropout -> Dense(emb_dim)."""

  def __init__(self, emb_dim: int, mlp_dim: int, dropout_rate: float, *, rngs: nnx.Rngs,
               dtype=None):
    self.fc1 = dense(rngs, emb_dim, mlp_dim, ("embed", "mlp"), dtype)
    self.fc2 = dense(rngs, mlp_dim, emb_dim, ("mlp", "embed"), dtype)
    self.dropout_rate = dropout_rate

  def __call__(self, x: jax.Array, *, rng=None) -> jax.Array:
    h = jax.nn.gelu(self.fc1(x))                                           # [B, L, M]
    return self.fc2(dropout(h, self.dropout_rate, rng))                    # [B, L, E]


def _attention(s: ModelSettings, spec, *, max_length, causal, shared_extras, layer_index, rngs):
  return MultiHeadAttention(
      s.emb_dim, s.num_heads, s.qkv_dim, spec, max_length=max_length, causal=causal,
      shared_extras=shared_extras, layer_index=layer_index, positions=s.positions, rngs=rngs)


class AttentionSublayer(nnx.Module):
  """x + Dropout(Attention(LN(x))): an "s" of a reordered stack."""

  def __init__(self, s: ModelSettings, spec: Mapping[str, Any], *, rngs: nnx.Rngs, **kw):
    self.ln_attn = layer_norm(rngs, s.emb_dim, compute_dtype(s))
    self.attention = _attention(s, spec, rngs=rngs, **kw)
    self.dropout_rate = s.dropout

  def __call__(self, x: jax.Array, key_mask, *, rng=None) -> jax.Array:
    h = self.attention(self.ln_attn(x), key_mask, rng=_fold(rng, 0))
    return x + dropout(h, self.dropout_rate, _fold(rng, 1))


class FeedForwardSublayer(nnx.Module):
  """x + Dropout(MLP(LN(x))): an "f" of a reordered stack."""

  def __init__(self, s: ModelSettings, *, rngs: nnx.Rngs):
    self.ln_mlp = layer_norm(rngs, s.emb_dim, compute_dtype(s))
    self.mlp = MLP(s.emb_dim, s.mlp_dim, s.dropout, rngs=rngs, dtype=compute_dtype(s))
    self.dropout_rate = s.dropout

  def __call__(self, x: jax.Array, key_mask, *, rng=None) -> jax.Array:
    h = self.mlp(self.ln_mlp(x), rng=_fold(rng, 2))
    return x + dropout(h, self.dropout_rate, _fold(rng, 3))


class Block(nnx.Module):
  """Pre-LayerNorm transformer block."""

  def __init__(self, s: ModelSettings, spec: Mapping[str, Any], *, max_length: int,
               causal: bool = False, shared_extras=None, layer_index: int = 0,
               rngs: nnx.Rngs):
    e = s.emb_dim
    dtype = compute_dtype(s)
    self.ln_attn = layer_norm(rngs, e, dtype)
    self.attention = _attention(s, spec, max_length=max_length, causal=causal,
                                shared_extras=shared_extras, layer_index=layer_index, rngs=rngs)
    self.ln_mlp = layer_norm(rngs, e, dtype)
    self.mlp = MLP(e, s.mlp_dim, s.dropout, rngs=rngs, dtype=dtype)
    self.dropout_rate = s.dropout

  def __call__(self, x: jax.Array, key_mask, *, rng=None) -> jax.Array:
    h = self.attention(self.ln_attn(x), key_mask, rng=_fold(rng, 0))        # [B, L, E]
    x = x + dropout(h, self.dropout_rate, _fold(rng, 1))
    h = self.mlp(self.ln_mlp(x), rng=_fold(rng, 2))
    return x + dropout(h, self.dropout_rate, _fold(rng, 3))                # [B, L, E]


def run_blocks(blocks, x, key_mask, rng, remat: str):
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
      x = run(block, x, key_mask, _fold(rng, i + 1))
    return x
  split = [nnx.split(block) for block in blocks]
  graphdef = split[0][0]
  if any(g != graphdef for g, _ in split):
    run = block_runner(remat)
    for i, block in enumerate(blocks):
      x = run(block, x, key_mask, _fold(rng, i + 1))
    return x
  settings.check_choice("remat", remat)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *(state for _, state in split))
  keys = None if rng is None else jnp.stack([_fold(rng, i + 1) for i in range(len(blocks))])

  def body(x, layer):
    state, key = layer
    return _apply_block(nnx.merge(graphdef, state), x, key_mask, key), None

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
    self.positions = PositionEmbedding(s.pos_emb, max_length, s.emb_dim, rngs=rngs)
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
    self.ln_final = layer_norm(rngs, s.emb_dim, compute_dtype(s))
    self.dtype = compute_dtype(s)
    self.dropout_rate = s.dropout
    self.remat = s.remat

  def __call__(self, tokens: jax.Array, *, rng=None) -> tuple[jax.Array, jax.Array]:
    """tokens `[B, L]` int -> (features `[B, L', E]`, key_mask `[B, L']`), L' = L (+1 with CLS)."""
    key_mask = tokens > 0                                                  # [B, L]
    x = self.embed(tokens)                                                 # [B, L, E]
    if self.cls_token:
      cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, x.shape[2])).astype(x.dtype)
      x = jnp.concatenate([cls, x], axis=1)                                # [B, L+1, E]
      key_mask = jnp.concatenate([jnp.ones_like(key_mask[:, :1]), key_mask], axis=1)
    x = dropout(self.positions(x), self.dropout_rate, _fold(rng, 0)).astype(self.dtype)
    split = sequence.devices()
    if split > 1:   # the length split over devices: padded to a multiple (exact), then split
      x, key_mask, length = sequence.pad_length(x, key_mask, split)
      x = sequence.split_length(x)
    x = run_blocks(self.blocks, x, key_mask, rng, self.remat)
    x = self.ln_final(x)
    x = jnp.where(key_mask[..., None], x, 0.0)
    if split > 1:
      x, key_mask = x[:, :length], key_mask[:, :length]
    return x, key_mask


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
