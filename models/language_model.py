"""A causal character language model (enwik8/text8 style): decoder-only, tied embeddings.

The encoder stack runs with `causal=True`, so every attention kind gets `causal=True` (kinds whose
record in `attention.kinds` says they cannot be causal are refused with the reason).
Logits at position i predict token i + 1; the loss is `lra.objectives.language_modelling` and
bits per character are reported by the trainer.

The output layer is the token embedding transposed, applied to the final features scaled by
1/sqrt(emb_dim) (as T5 does with tied embeddings): the embedding is initialised N(0, 1) (the LRA
convention), so without the scale the initial logits have a standard deviation of about
sqrt(emb_dim) and the first loss is far above ln(vocab) (about 16 nats instead of 5.5 at width
128 in the character-LM demo).
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
    x = x * (x.shape[-1] ** -0.5)
    return self.encoder.embed.attend(x).astype(jnp.float32)                # [B, L, V]
