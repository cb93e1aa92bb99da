"""Token and position embeddings for the LRA models.

Token ids are `[B, L]` int32 with 0 = padding; embeddings are `[B, L, E]`. Position embeddings
are either fixed sinusoids (Vaswani et al.; the LRA default) or a learned table of
`max_length` rows. `models.settings.POSITIONS` lists the valid names for `config.model.pos_emb`;
the `IN_LAYER` ones add nothing here: each attention layer applies them to its queries and keys
(`models.attention_layer`; docs/positions.md). `extend_table` tiles a learned table trained at a
shorter length (Longformer's recipe for longer inputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import settings
from models.settings import IN_LAYER
from models.sharding import param


def sinusoidal_table(length: int, dim: int, max_scale: float = 10000.0) -> np.ndarray:
  """Fixed `[length, dim]` sinusoids: sin on the first half of the features, cos on the rest."""
  half = dim // 2
  position = np.arange(length, dtype=np.float64)[:, None]                 # [L, 1]
  inv = np.exp(-np.log(max_scale) * np.arange(half) / max(half - 1, 1))   # [half]
  angles = position * inv[None, :]                                        # [L, half]
  table = np.zeros((length, dim), np.float32)
  table[:, :half] = np.sin(angles)
  table[:, half:2 * half] = np.cos(angles)
  return table


class TokenEmbedding(nnx.Module):
  """A `[vocab, embed]` lookup table, initialised N(0, 1) as in the LRA reference."""

  def __init__(self, vocab_size: int, emb_dim: int, *, rngs: nnx.Rngs):
    self.embedding = param(rngs, nnx.initializers.normal(1.0), (vocab_size, emb_dim),
                           ("vocab", "embed"))
    self.vocab_size = vocab_size

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens, axis=0)                   # [B, L, E]

  def attend(self, x: jax.Array) -> jax.Array:
    """Logits over the vocabulary with the transposed table (tied output embedding)."""
    return jnp.einsum("ble,ve->blv", x, self.embedding[...])               # [B, L, V]


class PositionEmbedding(nnx.Module):
  """Adds position information to `[B, L, E]` embeddings; `kind` is one of settings.POSITIONS."""

  def __init__(self, kind: str, max_length: int, emb_dim: int, *, rngs: nnx.Rngs,
               offset: int = 0):
    settings.check_choice("pos_emb", kind)
    self.kind = kind
    self.max_length = max_length
    # A learned table may keep `offset` rows before the first position (RoBERTa's table starts
    # at padding_idx + 1 = 2): position i reads row offset + i.
    self.offset = int(offset)
    if kind == "learned":
      self.table = param(rngs, nnx.initializers.normal(0.02), (max_length + self.offset, emb_dim),
                         ("length", "embed"))
    self.emb_dim = emb_dim

  def __call__(self, x: jax.Array) -> jax.Array:
    length = x.shape[1]
    if length > self.max_length:
      raise ValueError(
          f"sequence of length {length} is longer than the position table ({self.max_length} "
          f"positions): raise config.model.max_length.")
    if self.kind == "none" or self.kind in IN_LAYER:
      return x
    if self.kind == "sinusoidal":
      table = jnp.asarray(sinusoidal_table(length, self.emb_dim))          # [L, E] constant
    else:
      table = self.table[...][self.offset:self.offset + length]            # [L, E]
    return x + table[None].astype(x.dtype)                                 # [B, L, E]


def extend_table(table, length: int):
  """A learned `[L0, E]` table tiled (copied whole, then cut) to `[length, E]` rows."""
  table = jnp.asarray(table)
  reps = -(-length // table.shape[0])
  return jnp.tile(table, (reps, 1))[:length]


def _is_table(path) -> bool:
  keys = [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path]
  return any(a == "positions" and b == "table" for a, b in zip(keys, keys[1:]))


def map_position_tables(tree, fn):
  """`tree` (parameters, arrays or abstract) with `fn` applied to every learned position table."""
  return jax.tree_util.tree_map_with_path(lambda p, x: fn(x) if _is_table(p) else x, tree)


def shorter_tables(abstract_params, fewer: int):
  """The restore target for a checkpoint whose position tables have `fewer` rows less."""
  def shrink(x):
    if x.shape[0] - fewer < 1:
      raise ValueError(f"init_length: the source table would have {x.shape[0] - fewer} rows.")
    return jax.ShapeDtypeStruct((x.shape[0] - fewer,) + x.shape[1:], x.dtype,
                                sharding=getattr(x, "sharding", None))
  return map_position_tables(abstract_params, shrink)


def extend_tables(params, like):
  """`params` with each position table tiled to the rows of the same table in `like` (placed
  with its sharding): Longformer's copy of a short model's positions (RoBERTa 512 -> 4,096)."""
  targets = {}
  map_position_tables(like, lambda x: targets.setdefault(len(targets), x))
  done = []

  def grow(x):
    target = targets[len(done)]
    done.append(1)
    out = extend_table(x, target.shape[0]).astype(target.dtype)
    sharding = getattr(target, "sharding", None)
    return out if sharding is None else jax.device_put(out, sharding)
  return map_position_tables(params, grow)
