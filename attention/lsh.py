"""Reformer LSH attention (Kitaev et al. 2020): shared query-key, angular hashing, sorted chunks.

One hash round:
  1. Keys are the shared query-key vectors RMS-normalised (`shared_qk_keys`: norm sqrt(D)), so
     with the usual 1/sqrt(D) scale the logit of (i, j) is q_i . k_j / |k_j|. (LRA's Reformer
     multiplies by sqrt(D) instead of dividing; trax and the paper divide, as here.)
  2. Angular LSH by a random rotation R `[D, num_buckets / 2]` drawn from the explicit `key`:
     bucket = argmax([x R, -x R]), so num_buckets must be even (or 1: no hashing). Padded
     tokens get an extra bucket `num_buckets`, which sorts after every real token.
  3. Tokens are sorted by (bucket, position) (a two-key sort, no overflow-prone combined key),
     so within a bucket tokens keep their order. The sorted sequence is cut into chunks of `chunk_size`; each chunk attends to
     itself and to the previous chunk of the same round. The first chunk has no look-back
     (no wrap-around to the last chunk, unlike trax's `look_adjacent`).
  4. A token attends to itself only when nothing else is available (shared QK makes q_i . k_i
     the largest logit, so self-attention would dominate). This is an exact rule, not trax's
     soft -1e5 penalty.

Causal mode. Masking by original positions (key position <= query position) is necessary but
not sufficient: the chunk boundaries of the sorted order depend on how many tokens, future ones
included, fall into lower buckets, so with plain chunks a future token can change which past
keys a query sees. In causal mode a query therefore attends only to keys of its own bucket at
most `chunk_size` places before it in the sorted order, i.e. to the `chunk_size` most recent
earlier tokens of its bucket (and to itself only when there is none). That set depends on past
tokens only, and it always lies inside the chunk and look-back window, so the blocked
computation is exact. Row sums come from the same matmul as the outputs (a column of ones
appended to the values), so an earlier query's arithmetic does not depend on where its keys sit
in the window, and changing a future token leaves earlier outputs bit-identical.

Several rounds (`num_hashes`) use independent rotations; each round gives an output and the
log-sum-exp of its logits, and the rounds are combined with weights softmax(lse) over rounds.
This equals one softmax over the union of the rounds' keys where a (query, key) pair found by n
rounds counts n times (duplicates are not removed, as in the paper's released code). The dense
definition of the pattern, with these multiplicities, is `masks.lsh_pair_counts`.

Gathers (the sort permutation and its inverse) are intrinsic to LSH and used here; there is no
`[L, L]` tensor: the cost is O(num_hashes * L * chunk_size) per head.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from attention import validation
from attention.dot_product import NEG_INF, masked_softmax_stats


def _check_positive_int(name: str, value: int, hint: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}; {hint}.")
  return int(value)


def check_lsh_args(num_hashes: int, num_buckets: int,
                   chunk_size: int) -> tuple[int, int, int]:
  """Validates the static LSH settings; returns them as ints."""
  num_hashes = _check_positive_int("num_hashes", num_hashes,
                                   "use 1 to 8 hash rounds (more rounds, fewer missed keys)")
  num_buckets = _check_positive_int(
      "num_buckets", num_buckets, "a usual choice is 2 * length / chunk_size, rounded to even")
  chunk_size = _check_positive_int("chunk_size", chunk_size, "typical values are 64 to 256")
  if num_buckets > 1 and num_buckets % 2:
    raise ValueError(
        f"num_buckets must be even (angular LSH takes the argmax over [x R, -x R], so buckets "
        f"come in pairs) or 1 (no hashing), got {num_buckets}: use {num_buckets - 1} or "
        f"{num_buckets + 1}.")
  return num_hashes, num_buckets, chunk_size


def shared_qk_keys(qk: jax.Array) -> jax.Array:
  """Keys of shared-QK attention: `qk` RMS-normalised over the last axis (norm sqrt(D))."""
  qk = qk.astype(jnp.float32)
  return qk * jax.lax.rsqrt(jnp.mean(qk * qk, axis=-1, keepdims=True) + 1e-6)


def lsh_buckets(qk: jax.Array, *, key: jax.Array, num_hashes: int, num_buckets: int,
                key_mask: jax.Array | None = None) -> jax.Array:
  """Angular LSH buckets of every token in every round.

  Args:
    qk: `[B, L, H, D]` shared query-key vectors.
    key: `jax.random` key for the rotations, one `[D, num_buckets / 2]` per head and round.
    num_hashes: number of rounds R.
    num_buckets: even number of buckets, or 1 (every token in bucket 0).
    key_mask: optional bool `[B, L]`; padded tokens get bucket `num_buckets`.

  Returns:
    int32 `[B, H, R, L]`.
  """
  num_hashes, num_buckets, _ = check_lsh_args(num_hashes, num_buckets, 1)
  b_, length, h, d = qk.shape
  if num_buckets == 1:
    buckets = jnp.zeros((b_, h, num_hashes, length), jnp.int32)
  else:
    rot = jax.random.normal(key, (h, d, num_hashes, num_buckets // 2), jnp.float32)
    x = jnp.einsum("blhd,hdrn->bhrln", qk.astype(jnp.float32), rot)   # [B, H, R, L, nb/2]
    buckets = jnp.argmax(jnp.concatenate([x, -x], axis=-1), axis=-1).astype(jnp.int32)
  if key_mask is not None:
    buckets = jnp.where(key_mask[:, None, None, :], buckets, num_buckets)
  return jax.lax.stop_gradient(buckets)


def _look_back(x: jax.Array, fill: float | int | bool) -> jax.Array:
  """`[..., nc, c, ...]` chunks -> `[..., nc, 2c, ...]`: previous chunk then own chunk.

  The chunk axis is at position 3 and the in-chunk axis at 4. Chunk 0 gets `fill` as its
  previous chunk (no wrap-around).
  """
  pad = [(0, 0)] * x.ndim
  pad[3] = (1, 0)
  prev = jnp.pad(x, pad, constant_values=fill)[:, :, :, :-1]
  return jnp.concatenate([prev, x], axis=4)


def _searchsorted(sorted_rows: jax.Array, values: jax.Array, side: str) -> jax.Array:
  """Row-wise `jnp.searchsorted`: `sorted_rows [..., n]`, `values [m]` -> int32 `[..., m]`."""
  flat = sorted_rows.reshape(-1, sorted_rows.shape[-1])
  out = jax.vmap(lambda row: jnp.searchsorted(row, values, side=side))(flat)
  return out.reshape(sorted_rows.shape[:-1] + values.shape).astype(jnp.int32)


def _bucket_aligned_layout(sorted_buckets: jax.Array, perm: jax.Array, *, num_buckets: int,
                           chunk: int, num_slots: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sorted order with every bucket starting on a chunk boundary (causal mode).

  A token's place in this layout is (chunks taken by lower buckets) * chunk + (its rank in its
  own bucket), so its place inside its chunk, and the places of the earlier tokens of its
  bucket, do not depend on later tokens.

  Returns (token `[..., S]`, valid `[..., S]`, slot_of_rank `[..., Lp]`): the token index at
  every slot, whether the slot holds a real-bucket token, and the slot of every sorted rank.
  """
  edges = jnp.arange(num_buckets + 1, dtype=sorted_buckets.dtype)
  start = _searchsorted(sorted_buckets, edges, "left")                # [..., nb+1]
  size = start[..., 1:] - start[..., :-1]                             # [..., nb]
  aligned_size = -(-size // chunk) * chunk
  aligned_end = jnp.cumsum(aligned_size, axis=-1)
  aligned_start = aligned_end - aligned_size                          # [..., nb]
  slots = jnp.arange(num_slots, dtype=jnp.int32)
  owner = jnp.clip(_searchsorted(aligned_start, slots, "right") - 1, 0, num_buckets - 1)
  take = lambda x: jnp.take_along_axis(x, owner, axis=-1)             # [..., S]
  in_bucket = slots - take(aligned_start)
  valid = in_bucket < take(size)
  rank = jnp.clip(take(start[..., :-1]) + in_bucket, 0, perm.shape[-1] - 1)
  token = jnp.take_along_axis(perm, rank, axis=-1)
  # Slot of each sorted rank; ranks in the padding bucket get slot 0 (their output is unused).
  ranks = jnp.arange(perm.shape[-1], dtype=jnp.int32)
  rb = jnp.clip(sorted_buckets, 0, num_buckets - 1)
  slot_of_rank = (jnp.take_along_axis(aligned_start, rb, axis=-1)
                  + ranks - jnp.take_along_axis(start[..., :-1], rb, axis=-1))
  slot_of_rank = jnp.where(sorted_buckets < num_buckets, slot_of_rank, 0)
  return token, valid, slot_of_rank


@functools.partial(jax.jit, static_argnames=("num_hashes", "num_buckets", "chunk", "causal"))
def _lsh(qk: jax.Array, v: jax.Array, key: jax.Array, key_mask: jax.Array | None, *,
         num_hashes: int, num_buckets: int, chunk: int, causal: bool) -> jax.Array:
  b_, length, h, d = qk.shape
  dv = v.shape[-1]
  lp = -(-length // chunk) * chunk
  real = jnp.ones((b_, length), bool) if key_mask is None else key_mask
  real = jnp.pad(real, ((0, 0), (0, lp - length)))                     # [B, Lp]
  pad_len = lambda x: jnp.pad(x, ((0, 0), (0, lp - length), (0, 0), (0, 0)))
  qk_t = pad_len(qk).transpose(0, 2, 1, 3)                             # [B, H, Lp, D]
  v_t = pad_len(v).transpose(0, 2, 1, 3)                               # [B, H, Lp, Dv]

  buckets = lsh_buckets(pad_len(qk), key=key, num_hashes=num_hashes, num_buckets=num_buckets,
                        key_mask=real)                                 # [B, H, R, Lp]
  positions = jnp.arange(lp, dtype=jnp.int32)
  sorted_buckets, perm = jax.lax.sort(                                 # by (bucket, position)
      (buckets, jnp.broadcast_to(positions, buckets.shape)), dimension=3, num_keys=2)
  inv = jnp.argsort(perm, axis=-1)                                     # rank of each token
  if causal:
    # Chunks: at most ceil(L / c) plus one partial chunk per non-empty bucket.
    nc = min(lp // chunk + num_buckets, (length + min(num_buckets, length) * (chunk - 1))
             // chunk)
    token, slot_ok, slot_of_rank = _bucket_aligned_layout(
        sorted_buckets, perm, num_buckets=num_buckets, chunk=chunk, num_slots=nc * chunk)
    slot = jnp.take_along_axis(slot_of_rank, inv, axis=-1)             # [B, H, R, Lp]
  else:
    nc = lp // chunk
    token, slot_ok, slot = perm, jnp.ones_like(perm, bool), inv

  def arrange(x):  # [B, H, Lp, ...] -> [B, H, R, nc, c, ...] in layout order
    idx = token.reshape(token.shape + (1,) * (x.ndim - 3))
    x = jnp.take_along_axis(x[:, :, None], idx, axis=3)
    return x.reshape(x.shape[:3] + (nc, chunk) + x.shape[4:])

  sq = arrange(qk_t)                                                   # [B, H, R, nc, c, D]
  sk = _look_back(shared_qk_keys(sq), 0.0)                             # [B, H, R, nc, 2c, D]
  ones = jnp.ones(v_t.shape[:3] + (1,), jnp.float32)
  sv = _look_back(arrange(jnp.concatenate([v_t.astype(jnp.float32), ones], -1)), 0.0)
  chunked = lambda x: x.reshape(x.shape[:3] + (nc, chunk))
  qpos = chunked(token)                                                # [B, H, R, nc, c]
  kpos = _look_back(qpos, -1)                                          # [B, H, R, nc, 2c]
  qreal = chunked(slot_ok & jnp.take_along_axis(real[:, None, None, :], token, axis=3))
  kreal = _look_back(qreal, False)

  allowed = qreal[..., :, None] & kreal[..., None, :]                  # [B, H, R, nc, c, 2c]
  if causal:
    qb = chunked(jnp.take_along_axis(buckets, token, axis=3))
    kb = _look_back(qb, -1)
    rank_gap = chunk + np.arange(chunk)[:, None] - np.arange(2 * chunk)[None, :]  # [c, 2c]
    allowed = (allowed & (qpos[..., :, None] >= kpos[..., None, :])
               & (qb[..., :, None] == kb[..., None, :]) & (rank_gap <= chunk))
  is_self = qpos[..., :, None] == kpos[..., None, :]
  other = allowed & ~is_self
  allowed = jnp.where(jnp.any(other, axis=-1, keepdims=True), other, allowed & is_self)

  logits = jnp.einsum("bhrnqd,bhrnkd->bhrnqk", sq.astype(jnp.float32), sk) / math.sqrt(d)
  p, row_max, _ = masked_softmax_stats(logits, allowed)
  ov = jnp.einsum("bhrnqk,bhrnkd->bhrnqd", p, sv)                      # [B, H, R, nc, c, Dv+1]
  den = ov[..., dv:]
  has = den > 0
  o = ov[..., :dv] / jnp.where(has, den, 1.0)
  lse = jnp.where(has, row_max + jnp.log(jnp.where(has, den, 1.0)), NEG_INF)[..., 0]

  # Back to original order, then combine the rounds by their log-sum-exp.
  o = jnp.take_along_axis(o.reshape(b_, h, num_hashes, nc * chunk, dv), slot[..., None], axis=3)
  lse = jnp.take_along_axis(lse.reshape(b_, h, num_hashes, nc * chunk), slot, axis=3)
  found = lse > NEG_INF / 2                                            # [B, H, R, Lp]
  top = jax.lax.stop_gradient(jnp.max(lse, axis=2, keepdims=True))
  w = jnp.where(found, jnp.exp(lse - top), 0.0)                        # [B, H, R, Lp]
  total = jnp.sum(w, axis=2)                                           # [B, H, Lp]
  out = jnp.sum(w[..., None] * o, axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
  out = out.transpose(0, 2, 1, 3)[:, :length]                          # [B, L, H, Dv]
  out = jnp.where(real[:, :length, None, None], out, 0.0)
  return out.astype(qk.dtype)


def lsh_attention(qk: jax.Array, v: jax.Array, *, key: jax.Array, num_hashes: int,
                  num_buckets: int, chunk_size: int, causal: bool = False,
                  key_mask: jax.Array | None = None) -> jax.Array:
  """Reformer LSH self-attention with shared query-key vectors.

  Args:
    qk: `[B, L, H, D]` shared query-key vectors (the model layer passes its query projection);
      keys are `shared_qk_keys(qk)`.
    v: `[B, L, H, Dv]` values.
    key: `jax.random` key for the hash rotations; the output is a deterministic function of
      (qk, v, key). Pass a different key per layer (e.g. `jax.random.fold_in`).
    num_hashes: hash rounds, combined by their log-sum-exp.
    num_buckets: even number of buckets per round, or 1 (no hashing: sorted order is position
      order). A usual choice is about 2 * L / chunk_size.
    chunk_size: queries per chunk; each chunk attends to itself and the previous chunk of the
      sorted order. Lengths need not be a multiple of it.
    causal: query i attends only keys at original positions <= i, of its own bucket and at most
      `chunk_size` places before it in sorted order (see the module docstring).
    key_mask: optional bool `[B, L]`, True = real token. Padded keys are never attended, padded
      queries output 0, and trailing padding does not change the real tokens' outputs.

  Returns:
    `[B, L, H, Dv]` in qk's dtype. A query attends to itself only when no other key is
    allowed; it outputs 0 only when it is padding.
  """
  b_, length, _, _, _ = validation.check_qkv(qk, qk, v)
  validation.check_token_mask("key_mask", key_mask, b_, length)
  num_hashes, num_buckets, chunk_size = check_lsh_args(num_hashes, num_buckets, chunk_size)
  if key is None:
    raise ValueError(
        "lsh_attention needs an explicit random key for its hash rotations: pass "
        "key=jax.random.key(seed) (fold in the layer index so layers hash differently).")
  return _lsh(qk, v, key, key_mask, num_hashes=num_hashes, num_buckets=num_buckets,
              chunk=min(chunk_size, length), causal=bool(causal))
