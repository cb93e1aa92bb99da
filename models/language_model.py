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

from models import memory as memory_lib
from models.encoder import Encoder
from models.settings import ModelSettings


class LanguageModel(nnx.Module):
  """Decoder-only LM. `cfg` as for `Encoder`, plus the memory settings (models/memory.py); the
  output layer is the transposed embedding."""

  def __init__(self, cfg: ModelSettings | Mapping[str, Any], *, rngs: nnx.Rngs):
    s = ModelSettings.from_mapping(cfg)
    self.encoder = Encoder(s, causal=True, rngs=rngs)
    self.memory_length = s.memory_length
    self.compressed_length = s.compressed_length
    # Evaluation reads a window in segments of this length (0: memory_length) through the memory.
    self.segment_length = s.segment_length or self.memory_length
    # Evaluation memory length (0: memory_length); no parameter depends on either.
    self.eval_memory_length = s.eval_memory_length or self.memory_length
    # Evaluation's relative distances clamped to this (0: not clamped; Transformer-XL's enwik8
    # recipe trains unclamped and evaluates with clamp_len 820).
    self.clamp_len = s.clamp_len
    # Evaluation as Transformer-XL's `same_length`: every query sees the same number of keys.
    self.same_length = s.same_length
    # One compression function per attention sublayer (models/memory.py), when there is a
    # compressed memory.
    self.compress = nnx.List([
        memory_lib.Compression(s.compression, s.compression_rate, s.emb_dim, rngs=rngs)
        for _ in range(memory_lib.memory_layers(s))]) if self.compressed_length else None

  def init_memory(self, batch: int, length: int | None = None) -> dict[str, jax.Array]:
    """An empty Transformer-XL (and compressed) memory for `batch` streams, of `length` states
    per layer (None: `memory_length`; `eval_memory_length` for evaluation)."""
    length = self.memory_length if length is None else int(length)
    layers = sum(hasattr(block, "attention") for block in self.encoder.blocks)
    return memory_lib.init_state(layers, batch, self.encoder.embed.embedding.shape[-1], length,
                                 self.compressed_length)

  def __call__(self, inputs: jax.Array, *, rng=None, memory=None, clamp_len: int = 0,
               same_length: bool = False):
    """inputs `[B, L]` int32 (0 = padding) -> next-token logits `[B, L, vocab]` float32.

    With `memory` (a state from `init_memory` or a previous call) returns (logits, new memory,
    attention-reconstruction loss), relative distances clamped to `clamp_len` (0: not) and, with
    `same_length`, every query seeing as many keys as the memory holds (the evaluation passes
    `self.clamp_len` and `self.same_length`); see models/memory.py.
    """
    if memory is not None:
      x, memory, recon = memory_lib.forward(self.encoder, self.compress, inputs, memory, rng=rng,
                                            clamp_len=clamp_len, same_length=same_length)
      x = x * (x.shape[-1] ** -0.5)
      return self.encoder.embed.attend(x).astype(jnp.float32), memory, recon
    x, _ = self.encoder(inputs, rng=rng)                                   # [B, L, E]
    x = x * (x.shape[-1] ** -0.5)
    return self.encoder.embed.attend(x).astype(jnp.float32)                # [B, L, V]
