"""Greedy and beam-search decoding for `models.seq2seq.LED`, with or without its key-value cache.

Every function starts from the encoder output (`model.encode(inputs)`), feeds `bos_id` at
position 0 and writes `length` positions. Padding (id 0) and BOS are never produced. After a
hypothesis produces `eos_id` it is finished: its later positions are 0. A hypothesis's score is
the sum of its tokens' log-probabilities (EOS included; no length normalisation).

- `greedy(..., cache=True)`: one `model.step` per position (the cache holds the decoder
  self-attention keys/values and the precomputed cross-attention keys/values).
- `greedy(..., cache=False)`: reruns the whole decoder (`model.decode`) on the prefix at every
  position; the reference the cached path must equal.
- `beam_search`: `beam` hypotheses per example over the cached steps; finished hypotheses keep
  their score and compete with the live ones; returns the highest-scoring hypothesis.
- `sequence_scores`: the score of given token sequences (for checks by enumeration).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def shift_right(targets: jax.Array, bos_id: int) -> jax.Array:
  """Decoder inputs of `targets` `[B, T]`: BOS, then targets[:, :-1]."""
  bos = jnp.full_like(targets[:, :1], bos_id)
  return jnp.concatenate([bos, targets[:, :-1]], axis=1)


def log_probs(logits: jax.Array, bos_id: int) -> jax.Array:
  """Log-probabilities `[..., V]` over the tokens a decoder may write (not padding or BOS)."""
  banned = (jnp.arange(logits.shape[-1]) == 0) | (jnp.arange(logits.shape[-1]) == bos_id)
  return jax.nn.log_softmax(jnp.where(banned, -jnp.inf, logits), axis=-1)


def greedy(model, memory: jax.Array, memory_mask: jax.Array, *, length: int, bos_id: int,
           eos_id: int, cache: bool = True) -> jax.Array:
  """The greedy tokens `[B, length]` (0 after EOS) for encoder outputs `memory` `[B, L, E]`."""
  b = memory.shape[0]
  out = jnp.zeros((b, length), jnp.int32)
  done = jnp.zeros((b,), bool)
  prev = jnp.full((b,), bos_id, jnp.int32)

  def choose(t, logits, out, done):
    token = jnp.argmax(log_probs(logits, bos_id), axis=-1).astype(jnp.int32)
    token = jnp.where(done, 0, token)
    return token, out.at[:, t].set(token), done | (token == eos_id)

  if cache:
    def body(t, carry):
      state, prev, out, done = carry
      logits, state = model.step(state, prev, t)
      token, out, done = choose(t, logits, out, done)
      return state, token, out, done

    state = model.init_cache(memory, memory_mask)
    return jax.lax.fori_loop(0, length, body, (state, prev, out, done))[2]

  def body_full(t, carry):
    out, done = carry
    tokens = shift_right(out, bos_id)                                      # [B, length]
    logits = model.decode(memory, memory_mask, tokens)                     # [B, length, V]
    logits = jax.lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False)
    _, out, done = choose(t, logits, out, done)
    return out, done

  return jax.lax.fori_loop(0, length, body_full, (out, done))[0]


def beam_search(model, memory: jax.Array, memory_mask: jax.Array, *, length: int, beam: int,
                bos_id: int, eos_id: int) -> tuple[jax.Array, jax.Array]:
  """The highest-scoring of `beam` hypotheses per example: (tokens `[B, length]`, scores `[B]`).
  """
  b, k = memory.shape[0], int(beam)
  if k < 1:
    raise ValueError(f"beam={beam}: must be a positive integer.")
  state = model.init_cache(jnp.repeat(memory, k, axis=0), jnp.repeat(memory_mask, k, axis=0))
  scores = jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf)[None].repeat(b, 0)  # [B, K]
  seqs = jnp.zeros((b, k, length), jnp.int32)
  done = jnp.zeros((b, k), bool)
  prev = jnp.full((b * k,), bos_id, jnp.int32)

  def reorder(x, parent):                       # x [B*K, ...]: take each new beam's parent
    x = x.reshape(b, k, *x.shape[1:])
    idx = parent.reshape(b, k, *([1] * (x.ndim - 2)))
    return jnp.take_along_axis(x, idx, axis=1).reshape(b * k, *x.shape[2:])

  def body(t, carry):
    state, prev, seqs, scores, done = carry
    logits, state = model.step(state, prev, t)                             # [B*K, V]
    lp = log_probs(logits, bos_id).reshape(b, k, -1)                       # [B, K, V]
    v = lp.shape[-1]
    stay = jnp.where(jnp.arange(v) == 0, 0.0, -jnp.inf)                    # finished: pad, +0
    lp = jnp.where(done[..., None], stay, lp)
    scores, flat = jax.lax.top_k((scores[..., None] + lp).reshape(b, k * v), k)  # [B, K]
    parent, token = flat // v, (flat % v).astype(jnp.int32)
    seqs = jnp.take_along_axis(seqs, parent[..., None], axis=1).at[:, :, t].set(token)
    done = jnp.take_along_axis(done, parent, axis=1) | (token == eos_id)
    state = {**state, "self": jax.tree.map(lambda x: reorder(x, parent), state["self"]),
             "mask": reorder(state["mask"], parent)}
    return state, token.reshape(b * k), seqs, scores, done

  _, _, seqs, scores, _ = jax.lax.fori_loop(0, length, body, (state, prev, seqs, scores, done))
  best = jnp.argmax(scores, axis=1)                                        # [B]
  return seqs[jnp.arange(b), best], scores[jnp.arange(b), best]


def sequence_scores(model, memory: jax.Array, memory_mask: jax.Array, tokens: jax.Array, *,
                    bos_id: int) -> jax.Array:
  """The score `[B]` of `tokens` `[B, T]` (0 after EOS): the sum of their log-probabilities."""
  logits = model.decode(memory, memory_mask, shift_right(tokens, bos_id))  # [B, T, V]
  lp = jnp.take_along_axis(log_probs(logits, bos_id), tokens[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(tokens > 0, lp, 0.0), axis=1)
