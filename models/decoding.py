"""Greedy and beam-search decoding for `models.seq2seq.LED`, with or without its key-value cache.

Every function starts from the encoder output (`model.encode(inputs)`), feeds `bos_id` at
position 0 and writes `length` positions. Padding (id 0) and BOS are never produced. After a
hypothesis produces `eos_id` it is finished: its later positions are 0. A hypothesis's score is
the sum of its tokens' log-probabilities (EOS included; no length normalisation).

- `greedy(..., cache=True)`: one `model.step` per position (the cache holds the decoder
  self-attention keys/values and the precomputed cross-attention keys/values).
- `greedy(..., cache=False)`: reruns the whole decoder (`model.decode`) on the prefix at every
  position; the reference the cached path must equal.
- `beam_search`: `beam` hypotheses per example; finished hypotheses keep their score and
  compete with the live ones; returns the highest-scoring hypothesis. `cache=False` reruns the
  whole decoder on every beam's prefix at each position, as greedy's does.
- `sequence_scores`: the score of given token sequences (for checks by enumeration).

`hf=HFGeneration(...)` (greedy and beam_search; `models.pretrained_seq2seq.generation` makes it
from a checkpoint's generation config) gives Hugging Face's `generate` semantics instead, for
imported BART and LED models: no token is banned (BART's `<s>` is id 0 and its decoder start is
EOS), every decoder input is a real token (`token_mask` all True), forced BOS at the first
position and forced EOS at the last (their log-probability 0, every other token's -inf), and
`pad_id` after EOS. Beam search then follows transformers' `_beam_search` (the vectorised one of
transformers 4.5x / 5.x): 2 * beam candidates per step from the running hypotheses; the running
beams are the best candidates that did not just finish (EOS or the last position); a candidate
among the first `beam` that finished joins the finished hypotheses with its score divided by
its length (tokens written, EOS included) ** length_penalty, unless the example's finished set
is full and `early_stopping` is True, or the early-stopping heuristic says no running beam can
beat the worst finished one (`_check_early_stop_heuristic`); the result is the best finished
hypothesis and its normalised score (HF's sequences_scores). Scores are float32 with HF's
-1e9 penalties added as HF adds them, so ties and roundings fall the same way. Hugging Face
stops its loop once nothing can change; ours runs all `length` positions, with the same result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def shift_right(targets: jax.Array, bos_id: int) -> jax.Array:
  """Decoder inputs of `targets` `[B, T]`: BOS, then targets[:, :-1]."""
  bos = jnp.full_like(targets[:, :1], bos_id)
  return jnp.concatenate([bos, targets[:, :-1]], axis=1)


@dataclasses.dataclass(frozen=True)
class HFGeneration:
  """Hugging Face's generation settings that decide the tokens (module docstring). The decoder
  start and EOS ids stay `bos_id` and `eos_id` of the decoding functions.

  pad_id: written after EOS (HF's pad_token_id; beam search writes eos_id when it is 0, as
    HF's `pad_token_id or eos_token_id` does).
  forced_bos_id, forced_eos_id: the token forced at the first / last position, or None.
  length_penalty: finished beam scores are divided by length ** length_penalty.
  early_stopping: True, False or "never" (transformers' GenerationConfig.early_stopping).
  """

  pad_id: int = 0
  forced_bos_id: int | None = None
  forced_eos_id: int | None = None
  length_penalty: float = 1.0
  early_stopping: bool | str = False

  def __post_init__(self):
    if self.early_stopping not in (True, False, "never"):
      raise ValueError(f"early_stopping = {self.early_stopping!r}: must be True, False or "
                       f"'never' (as transformers' GenerationConfig).")

  def force(self, scores: jax.Array, t, length: int) -> jax.Array:
    """`scores` `[..., V]` at position t: only the forced token (score 0) where one is forced
    (HF's ForcedBOSTokenLogitsProcessor, then ForcedEOSTokenLogitsProcessor)."""
    v = jnp.arange(scores.shape[-1])
    for position, token in ((0, self.forced_bos_id), (length - 1, self.forced_eos_id)):
      if token is not None:
        only = jnp.where(v == token, 0.0, -jnp.inf).astype(scores.dtype)
        scores = jnp.where(t == position, only, scores)
    return scores


def log_probs(logits: jax.Array, bos_id: int) -> jax.Array:
  """Log-probabilities `[..., V]` over the tokens a decoder may write (not padding or BOS)."""
  banned = (jnp.arange(logits.shape[-1]) == 0) | (jnp.arange(logits.shape[-1]) == bos_id)
  return jax.nn.log_softmax(jnp.where(banned, -jnp.inf, logits), axis=-1)


def greedy(model, memory: jax.Array, memory_mask: jax.Array, *, length: int, bos_id: int,
           eos_id: int, cache: bool = True, hf: HFGeneration | None = None) -> jax.Array:
  """The greedy tokens `[B, length]` (0 after EOS) for encoder outputs `memory` `[B, L, E]`;
  with `hf`, Hugging Face's (module docstring; `hf.pad_id` after EOS)."""
  b = memory.shape[0]
  pad = 0 if hf is None else hf.pad_id
  out = jnp.full((b, length), pad, jnp.int32)
  done = jnp.zeros((b,), bool)
  prev = jnp.full((b,), bos_id, jnp.int32)
  real = None if hf is None else jnp.ones((b,), bool)      # every decoder input is a token

  def choose(t, logits, out, done):
    scores = log_probs(logits, bos_id) if hf is None else hf.force(logits, t, length)
    token = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    token = jnp.where(done, pad, token)
    return token, out.at[:, t].set(token), done | (token == eos_id)

  if cache:
    def body(t, carry):
      state, prev, out, done = carry
      logits, state = model.step(state, prev, t, token_mask=real)
      token, out, done = choose(t, logits, out, done)
      return state, token, out, done

    state = model.init_cache(memory, memory_mask)
    return jax.lax.fori_loop(0, length, body, (state, prev, out, done))[2]

  def body_full(t, carry):
    out, done = carry
    tokens = shift_right(out, bos_id)                                      # [B, length]
    mask = None if hf is None else jnp.ones(tokens.shape, bool)
    logits = model.decode(memory, memory_mask, tokens, token_mask=mask)    # [B, length, V]
    logits = jax.lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False)
    _, out, done = choose(t, logits, out, done)
    return out, done

  return jax.lax.fori_loop(0, length, body_full, (out, done))[0]


class _Beams:
  """The decoder over `beam` copies of each example `[B*K]`: `next(state, prev, t, seqs)` is
  (logits `[B*K, V]` at position t, state) from one cached `model.step` (`cache=True`) or from
  the whole decoder rerun on the beams' tokens `seqs` `[B, K, length]` (positions < t written;
  later ones are not seen by the causal decoder); `reorder(state, parent)` makes each new
  beam's cache its parent's."""

  def __init__(self, model, memory, memory_mask, k: int, cache: bool, real: bool, bos_id: int):
    self.model, self.cache, self.bos_id = model, cache, bos_id
    self.memory = jnp.repeat(memory, k, axis=0)
    self.memory_mask = jnp.repeat(memory_mask, k, axis=0)
    self.real = jnp.ones((self.memory.shape[0],), bool) if real else None

  def init(self):
    return self.model.init_cache(self.memory, self.memory_mask) if self.cache else ()

  def next(self, state, prev, t, seqs):
    if self.cache:
      return self.model.step(state, prev, t, token_mask=self.real)
    tokens = shift_right(seqs.reshape(-1, seqs.shape[-1]), self.bos_id)     # [B*K, length]
    mask = None if self.real is None else jnp.ones(tokens.shape, bool)
    logits = self.model.decode(self.memory, self.memory_mask, tokens, token_mask=mask)
    return jax.lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False), state

  def reorder(self, state, parent):
    return _reorder_cache(state, parent) if self.cache else state


def beam_search(model, memory: jax.Array, memory_mask: jax.Array, *, length: int, beam: int,
                bos_id: int, eos_id: int, cache: bool = True, hf: HFGeneration | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """The highest-scoring of `beam` hypotheses per example: (tokens `[B, length]`, scores `[B]`);
  with `hf`, Hugging Face's beam search (module docstring; scores length-normalised). With
  `cache=False` the decoder is rerun on every prefix (the same tokens, slower).
  """
  b, k = memory.shape[0], int(beam)
  if k < 1:
    raise ValueError(f"beam={beam}: must be a positive integer.")
  beams = _Beams(model, memory, memory_mask, k, cache, hf is not None, bos_id)
  if hf is not None:
    return _hf_beam_search(beams, b, length=length, beam=k, eos_id=eos_id, hf=hf)
  state = beams.init()
  scores = jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf)[None].repeat(b, 0)  # [B, K]
  seqs = jnp.zeros((b, k, length), jnp.int32)
  done = jnp.zeros((b, k), bool)
  prev = jnp.full((b * k,), bos_id, jnp.int32)

  def body(t, carry):
    state, prev, seqs, scores, done = carry
    logits, state = beams.next(state, prev, t, seqs)                       # [B*K, V]
    lp = log_probs(logits, bos_id).reshape(b, k, -1)                       # [B, K, V]
    v = lp.shape[-1]
    stay = jnp.where(jnp.arange(v) == 0, 0.0, -jnp.inf)                    # finished: pad, +0
    lp = jnp.where(done[..., None], stay, lp)
    scores, flat = jax.lax.top_k((scores[..., None] + lp).reshape(b, k * v), k)  # [B, K]
    parent, token = flat // v, (flat % v).astype(jnp.int32)
    seqs = jnp.take_along_axis(seqs, parent[..., None], axis=1).at[:, :, t].set(token)
    done = jnp.take_along_axis(done, parent, axis=1) | (token == eos_id)
    state = beams.reorder(state, parent)
    return state, token.reshape(b * k), seqs, scores, done

  _, _, seqs, scores, _ = jax.lax.fori_loop(0, length, body, (state, prev, seqs, scores, done))
  best = jnp.argmax(scores, axis=1)                                        # [B]
  return seqs[jnp.arange(b), best], scores[jnp.arange(b), best]


def _reorder(x: jax.Array, parent: jax.Array) -> jax.Array:
  """x `[B*K, ...]`: each new beam's row is its parent's (`parent` `[B, K]`)."""
  b, k = parent.shape
  x = x.reshape(b, k, *x.shape[1:])
  idx = parent.reshape(b, k, *([1] * (x.ndim - 2)))
  return jnp.take_along_axis(x, idx, axis=1).reshape(b * k, *x.shape[2:])


def _reorder_cache(state: dict, parent: jax.Array) -> dict:
  """The decoding cache of beams `[B*K]` with each new beam's self-attention rows its parent's
  (the cross-attention keys and values are the same for every beam of an example)."""
  return {**state, "self": jax.tree.map(lambda x: _reorder(x, parent), state["self"]),
          "mask": _reorder(state["mask"], parent)}


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x `[B, N, ...]` at `idx` `[B, M]` along axis 1 (HF's `_gather_beams`)."""
  return jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 2))), axis=1)


def _hf_beam_search(beams: _Beams, b: int, *, length, beam, eos_id, hf):
  """transformers' `_beam_search` (module docstring): (best finished tokens `[B, length]`,
  their normalised scores `[B]`). Position t is HF's cur_len = t + 1 (the decoder start is
  HF's prompt of length 1); a hypothesis finished at t has length t + 1."""
  k = beam
  k2 = 2 * k                                       # HF: max(2, 1 + number of EOS ids) * beam
  neg = jnp.float32(-1.0e9)
  lp_power = jnp.float32(hf.length_penalty)
  fill = hf.pad_id or eos_id                       # HF's `pad_token_id or eos_token_id`
  state = beams.init()
  seqs = jnp.full((b, k, length), fill, jnp.int32)                         # running
  scores = jnp.where(jnp.arange(k) == 0, 0.0, neg)[None].repeat(b, 0).astype(jnp.float32)
  fseqs, fscores = seqs, jnp.full((b, k), neg, jnp.float32)                # finished
  fdone = jnp.zeros((b, k), bool)
  unsatisfied = jnp.ones((b, 1), bool)             # the early-stopping heuristic's state
  prev = jnp.full((b * k,), beams.bos_id, jnp.int32)
  top = jnp.arange(k2) < k                         # HF's top_num_beam_mask

  def body(t, carry):
    state, prev, seqs, scores, fseqs, fscores, fdone, unsatisfied = carry
    logits, state = beams.next(state, prev, t, seqs)                       # [B*K, V]
    lp = hf.force(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), t, length)
    v = lp.shape[-1]
    acc = (lp.reshape(b, k, v) + scores[..., None]).reshape(b, k * v)
    cand_scores, flat = jax.lax.top_k(acc, k2)                             # [B, 2K]
    parent, token = flat // v, (flat % v).astype(jnp.int32)
    cand = _gather(seqs, parent).at[:, :, t].set(token)                    # [B, 2K, length]
    hits = (token == eos_id) | (t >= length - 1)                           # EOS or max length
    # The running beams: the best candidates that did not finish.
    running = cand_scores + hits.astype(jnp.float32) * neg
    _, keep = jax.lax.top_k(running, k)                                    # [B, K]
    seqs, scores = _gather(cand, keep), _gather(running, keep)
    parents = _gather(parent, keep)
    # The finished hypotheses: merged with those of the first K candidates that finished.
    just = hits & top[None]
    norm = cand_scores / ((t + 1).astype(jnp.float32) ** lp_power)
    full = jnp.all(fdone, axis=1, keepdims=True) & (hf.early_stopping is True)
    norm = norm + full.astype(jnp.float32) * neg
    norm = norm + (~unsatisfied).astype(jnp.float32) * neg
    norm = norm + (~just).astype(jnp.float32) * neg
    merged = jnp.concatenate([fscores, norm], axis=1)                      # [B, 3K]
    _, best = jax.lax.top_k(merged, k)
    fseqs = _gather(jnp.concatenate([fseqs, cand], axis=1), best)
    fscores = _gather(merged, best)
    fdone = _gather(jnp.concatenate([fdone, just], axis=1), best)
    # Can a running beam still beat the worst finished one? (cur_len is now t + 2.)
    if hf.early_stopping == "never" and hf.length_penalty > 0.0:
      hypothetical = jnp.float32(length)
    else:
      hypothetical = (t + 1).astype(jnp.float32)
    best_running = scores[:, :1] / hypothetical ** lp_power
    worst = jnp.where(fdone, jnp.min(fscores, axis=1, keepdims=True), neg)
    unsatisfied = unsatisfied & jnp.any(best_running > worst, axis=-1, keepdims=True)
    state = beams.reorder(state, parents)
    prev = _gather(token, keep).reshape(b * k)
    return state, prev, seqs, scores, fseqs, fscores, fdone, unsatisfied

  carry = (state, prev, seqs, scores, fseqs, fscores, fdone, unsatisfied)
  carry = jax.lax.fori_loop(0, length, body, carry)
  fseqs, fscores = carry[4], carry[5]
  return fseqs[:, 0], fscores[:, 0]


def sequence_scores(model, memory: jax.Array, memory_mask: jax.Array, tokens: jax.Array, *,
                    bos_id: int) -> jax.Array:
  """The score `[B]` of `tokens` `[B, T]` (0 after EOS): the sum of their log-probabilities."""
  logits = model.decode(memory, memory_mask, shift_right(tokens, bos_id))  # [B, T, V]
  lp = jnp.take_along_axis(log_probs(logits, bos_id), tokens[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(tokens > 0, lp, 0.0), axis=1)
