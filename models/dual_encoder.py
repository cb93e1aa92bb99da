"""The retrieval dual encoder: one shared encoder on two documents, combined as [u, v, u*v, u-v].

This is the paper's two-tower setup (Tay et al. 2020, appendix A.1.3): no cross-attention, each
document pooled on its own (a real CLS token per tower, or the padding-aware mean), then
MLP([u, v, u * v, u - v]) with two ReLU layers and a 2-way (or `num_classes`-way) output.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models.encoder import Encoder, dense, pool
from models.settings import ModelSettings


class DualEncoder(nnx.Module):
  """Shared-weight two-tower classifier. `cfg` as for `Classifier`."""

  def __init__(self, cfg: ModelSettings | Mapping[str, Any], *, rngs: nnx.Rngs):
    s = ModelSettings.from_mapping(cfg)
    s.require("pool", "classifier_dim", "num_classes", model="the dual encoder")
    self.pool_kind = s.pool
    self.encoder = Encoder(s, cls_token=s.pool == "cls", rngs=rngs)
    hidden = s.classifier_dim
    self.hidden1 = dense(rngs, 4 * s.emb_dim, hidden, ("embed", "mlp"))
    self.hidden2 = dense(rngs, hidden, hidden // 2, ("mlp", None))
    self.head = dense(rngs, hidden // 2, s.num_classes, (None, None))

  def encode(self, tokens: jax.Array, *, rng=None) -> jax.Array:
    """tokens `[B, L]` -> pooled `[B, E]`."""
    x, key_mask = self.encoder(tokens, rng=rng)
    return pool(x, key_mask, self.pool_kind)

  def __call__(self, inputs1: jax.Array, inputs2: jax.Array, *, rng=None) -> jax.Array:
    """Two `[B, L]` token arrays -> logits `[B, num_classes]` float32."""
    u = self.encode(inputs1, rng=None if rng is None else jax.random.fold_in(rng, 1))
    v = self.encode(inputs2, rng=None if rng is None else jax.random.fold_in(rng, 2))
    h = jnp.concatenate([u, v, u * v, u - v], axis=-1)                     # [B, 4E]
    h = jax.nn.relu(self.hidden2(jax.nn.relu(self.hidden1(h))))
    return self.head(h).astype(jnp.float32)                                # [B, num_classes]
