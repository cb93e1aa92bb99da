"""A causal character language model (enwik8/text8 style): decoder-only, tied embeddings.

The encoder stack runs with `causal=True`, so every attention kind gets `causal=True` (kinds that
cannot be causal, listed in `models.attention_extras.NOT_CAUSAL`, are refused with the reason).
Logits at position i predict token i + 1; the loss and bits per character live in the trainer.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models.encoder import Encoder


class LanguageModel(nnx.Module):
  """Decoder-only LM. `cfg` as for `Encoder`; the output layer is the transposed embedding."""

  def __init__(self, cfg: Mapping[str, Any], *, rngs: nnx.Rngs):
    self.encoder = Encoder(cfg, causal=True, rngs=rngs)

  def __call__(self, inputs: jax.Array, *, rng=None) -> jax.Array:
    """inputs `[B, L]` int32 (0 = padding) -> next-token logits `[B, L, vocab]` float32."""
    x, _ = self.encoder(inputs, rng=rng)                                   # [B, L, E]
    return self.encoder.embed.attend(x).astype(jnp.float32)                # [B, L, V]
