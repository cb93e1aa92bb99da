"""Dense boolean masks: the one definition of which (query, key) pairs each pattern allows.

Every fast attention path in this package is tested against `dot_product_attention` with the
mask built here, so these builders are the specification, written for clarity, not speed. They
are O(length^2) and meant for tests, small inputs and documentation.

Masks are boolean, True = the query may attend the key, and have shape `[..., Lq, Lk]` with
leading dimensions that broadcast against `[batch, heads, Lq, Lk]`.

Band (Longformer) convention, used everywhere in the codebase:
  * `window=w` is one-sided: query i may attend key j when |i - j| <= w * dilation and
    (i - j) is a multiple of `dilation`; with `causal=True` additionally 0 <= i - j.
    A query therefore sees up to 2w+1 keys (w+1 when causal).
  * `dilation` is an int or one int per head (Longformer's per-head dilation).
  * `global_mask: [batch, length]`: a global query attends to every real key, and every query
    attends to every global key. With `causal=True` the causal rule still applies to global
    pairs (j <= i), so the model stays autoregressive.
  * `key_mask: [batch, length]`, True = real token: padded keys are never attended and padded
    queries attend nothing (their output is 0).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from attention import validation


def causal_mask(length: int, key_length: int | None = None) -> np.ndarray:
  """[Lq, Lk] bool: query i may attend key j when j <= i (positions aligned at the start)."""
  key_length = length if key_length is None else key_length
  return np.arange(length)[:, None] >= np.arange(key_length)[None, :]


def band_mask(length: int, *, window: int, dilation=1, causal: bool = False,
              num_heads: int | None = None) -> np.ndarray:
  """The sliding-window (band) pattern of Longformer, optionally dilated and causal.

  Args:
    length: sequence length L.
    window: one-sided window w >= 0.
    dilation: an int >= 1, or one int per head.
    causal: keep only keys at or before the query.
    num_heads: number of heads; required when `dilation` is per head.

  Returns:
    bool `[L, L]` when `dilation` is an int and `num_heads` is None, else `[H, L, L]`.
  """
  window = validation.check_window(window)
  per_head = not isinstance(dilation, (int, np.integer))
  if per_head and num_heads is None:
    num_heads = len(np.asarray(dilation).reshape(-1))
  heads = 1 if num_heads is None else num_heads
  dilations = validation.head_dilations(dilation, heads)
  rel = np.arange(length)[:, None] - np.arange(length)[None, :]  # [L, L], i - j
  masks = []
  for d in dilations:
    m = (np.abs(rel) <= window * d) & (rel % d == 0)
    if causal:
      m &= rel >= 0
    masks.append(m)
  out = np.stack(masks)  # [H, L, L]
  return out[0] if num_heads is None else out


def key_padding_mask(key_mask, query_mask=None):
  """[B, 1, Lq, Lk] bool from token masks: real keys only, and nothing for padded queries.

  `query_mask` defaults to `key_mask` (self-attention).
  """
  key_mask = jnp.asarray(key_mask, bool)
  query_mask = key_mask if query_mask is None else jnp.asarray(query_mask, bool)
  return query_mask[:, None, :, None] & key_mask[:, None, None, :]


def global_pairs_mask(global_mask):
  """[B, 1, L, L] bool: pairs that involve a global token (global query or global key)."""
  g = jnp.asarray(global_mask, bool)
  return g[:, None, :, None] | g[:, None, None, :]


def longformer_mask(length: int, *, window: int, dilation=1, causal: bool = False,
                    global_mask=None, key_mask=None, num_heads: int | None = None):
  """The full Longformer pattern: band | global pairs, then causal and padding rules.

  Returns a bool array broadcastable to `[batch, heads, L, L]` (leading dims are 1 where the
  pattern does not depend on them).
  """
  band = band_mask(length, window=window, dilation=dilation, causal=causal, num_heads=num_heads)
  mask = jnp.asarray(band.reshape((-1, length, length))[None])  # [1, H|1, L, L]
  if global_mask is not None:
    pairs = global_pairs_mask(global_mask)
    if causal:
      pairs = pairs & causal_mask(length)
    mask = mask | pairs
  if key_mask is not None:
    mask = mask & key_padding_mask(key_mask)
  return mask


# ----------------------------------------------------------------------------------------------
# Block-sparse patterns: Sparse Transformer (strided, fixed), BigBird ITC, contiguous-block local.
#
# Conventions of this section (fast paths: `attention.block_sparse`, `attention.sparse_patterns`):
#   * `strided` (Child et al. 2019, local + strided, merged into every head): query i attends key j
#     when |i - j| < stride or (i - j) is a multiple of stride.
#   * `fixed` (Child et al. 2019): query i attends key j when both are in the same stride group
#     (i // stride == j // stride) or j is a summary column of the head: j mod stride lies in
#     [stride - (v + 1) c, stride - v c) for summary width c and head variant v = h mod V, with V
#     `num_summary_offsets` (default stride // c), so different heads read different summaries.
#   * `causal=True` keeps only j <= i on top of the pattern (language modelling); causal=False is
#     the bidirectional (encoder) version of the same pattern.
#   * block local: i // block_size == j // block_size.
#   * BigBird ITC on blocks of `block_size` tokens (num_blocks = ceil(L / block_size)): global
#     blocks are the first ceil(g/2) and the last floor(g/2) blocks; a global query block attends
#     every block and every query block attends the global blocks; other query blocks attend the
#     3-block window (n-1, n, n+1) and r random blocks, drawn per head from
#     `np.random.default_rng(seed)` (`bigbird_random_blocks`): the same in every process.
# ----------------------------------------------------------------------------------------------


def _non_negative_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"{name} must be a non-negative int, got {value!r}.")
  return int(value)


def block_layout_mask(layout, block_size: int, length: int) -> np.ndarray:
  """Dense meaning of a block layout: `[..., nqb, nkb]` bool -> `[..., L, L]` bool.

  Query i may attend key j when `layout[..., i // block_size, j // block_size]`.
  """
  layout = np.asarray(layout, bool)
  block_size = validation.positive_int("block_size", block_size)
  blocks = np.arange(length) // block_size
  return layout[..., blocks[:, None], blocks[None, :]]


def block_local_mask(length: int, *, block_size: int, causal: bool = False) -> np.ndarray:
  """[L, L] bool: contiguous-block local attention, i // block_size == j // block_size."""
  block_size = validation.positive_int("block_size", block_size)
  blocks = np.arange(length) // block_size
  mask = blocks[:, None] == blocks[None, :]
  return mask & causal_mask(length) if causal else mask


def strided_mask(length: int, *, stride: int, causal: bool = False) -> np.ndarray:
  """[L, L] bool: the Sparse Transformer strided pattern, |i - j| < stride or stride | (i - j)."""
  stride = validation.positive_int("stride", stride)
  rel = np.arange(length)[:, None] - np.arange(length)[None, :]  # [L, L], i - j
  mask = (np.abs(rel) < stride) | (rel % stride == 0)
  return mask & (rel >= 0) if causal else mask


def fixed_summary_offsets(*, stride: int, summary_width: int, num_heads: int,
                          num_summary_offsets: int | None = None) -> tuple[int, ...]:
  """First summary residue (mod stride) of each head of the `fixed` pattern.

  Head h reads the summary columns j with `lo_h <= j mod stride < lo_h + summary_width`,
  lo_h = stride - (v + 1) * summary_width, v = h mod num_summary_offsets.
  """
  stride = validation.positive_int("stride", stride)
  width = validation.positive_int("summary_width", summary_width)
  num_heads = validation.positive_int("num_heads", num_heads)
  if width > stride:
    raise ValueError(
        f"summary_width {width} is larger than the stride {stride}: the summary columns are a "
        f"sub-block of each stride group, so pass summary_width <= stride.")
  most = stride // width
  variants = most if num_summary_offsets is None else validation.positive_int(
      "num_summary_offsets", num_summary_offsets)
  if variants > most:
    raise ValueError(
        f"num_summary_offsets {variants} does not fit: a stride of {stride} holds at most "
        f"{most} disjoint summary blocks of width {width}; pass num_summary_offsets <= {most}.")
  return tuple(stride - ((h % variants) + 1) * width for h in range(num_heads))


def fixed_mask(length: int, *, stride: int, summary_width: int, causal: bool = False,
               num_heads: int | None = None,
               num_summary_offsets: int | None = None) -> np.ndarray:
  """The Sparse Transformer fixed pattern: same stride group, or a summary column of the head.

  Returns bool `[L, L]` when `num_heads` is None (every head reads the last `summary_width`
  columns of each group) else `[H, L, L]` with per-head summary offsets
  (`fixed_summary_offsets`).
  """
  offsets = fixed_summary_offsets(stride=stride, summary_width=summary_width,
                                  num_heads=1 if num_heads is None else num_heads,
                                  num_summary_offsets=num_summary_offsets)
  pos = np.arange(length)
  same = (pos[:, None] // stride) == (pos[None, :] // stride)  # [L, L]
  out = []
  for lo in offsets:
    summary = (pos % stride >= lo) & (pos % stride < lo + summary_width)  # [L] over keys
    m = same | summary[None, :]
    out.append(m & causal_mask(length) if causal else m)
  out = np.stack(out)  # [H, L, L]
  return out[0] if num_heads is None else out


# ---- Patterns over positions (`Kind.pattern`): `fn(length, num_heads, args)` -> bool
# `[H|1, L, L]` from a kind's config arguments; MPNet's permutation masks are composed with
# them (models/pretraining.py). ----


def all_pairs_pattern(length: int, num_heads: int, args: Mapping[str, Any]) -> np.ndarray:
  """[1, L, L] all True: dense attention allows every pair."""
  del num_heads, args
  return np.ones((1, length, length), bool)


def band_pattern(length: int, num_heads: int, args: Mapping[str, Any]) -> np.ndarray:
  """[H|1, L, L]: the band of `args["window"]` and `args.get("dilation", 1)` (one per head
  when a sequence)."""
  dilation = args.get("dilation", 1)
  per_head = isinstance(dilation, (list, tuple))
  out = band_mask(length, window=int(args["window"]),
                  dilation=tuple(dilation) if per_head else dilation,
                  num_heads=num_heads if per_head else None)
  return out if per_head else out[None]


def block_local_pattern(length: int, num_heads: int, args: Mapping[str, Any]) -> np.ndarray:
  """[1, L, L]: contiguous blocks of `args["block_size"]`."""
  del num_heads
  return block_local_mask(length, block_size=int(args["block_size"]))[None]


def sparse_pattern(length: int, num_heads: int, args: Mapping[str, Any]) -> np.ndarray:
  """[H|1, L, L]: the Sparse Transformer `strided` or `fixed` pattern of `args`."""
  stride = int(args["stride"])
  if args.get("pattern", "fixed") == "strided":
    return strided_mask(length, stride=stride)[None]
  width = args.get("summary_width") or max(1, stride // 8)
  return fixed_mask(length, stride=stride, summary_width=int(width), num_heads=num_heads,
                    num_summary_offsets=args.get("num_summary_offsets"))


def bigbird_global_blocks(num_blocks: int, num_global_blocks: int) -> tuple[int, ...]:
  """The global blocks of BigBird ITC: the first ceil(g/2) and the last floor(g/2) blocks."""
  g = min(_non_negative_int("num_global_blocks", num_global_blocks), num_blocks)
  return tuple(sorted(set(range((g + 1) // 2)) | set(range(num_blocks - g // 2, num_blocks))))


def bigbird_random_blocks(num_blocks: int, *, num_global_blocks: int, num_random_blocks: int,
                          seed: int, num_heads: int = 1) -> np.ndarray:
  """int `[H, num_blocks, r]`: the random key blocks of every (head, query block); -1 = none.

  Drawn with `np.random.default_rng(seed)`, head by head and row by row: for a non-global query
  block n, `r` distinct blocks among those outside its window (|m - n| > 1) that are not global,
  sorted; fewer when not enough remain. Global query blocks draw nothing. The result depends
  only on the arguments, so it is identical in every process and at training and evaluation.
  """
  r = _non_negative_int("num_random_blocks", num_random_blocks)
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed must be an int (it fixes the random blocks), got {seed!r}.")
  num_heads = validation.positive_int("num_heads", num_heads)
  glob = set(bigbird_global_blocks(num_blocks, num_global_blocks))
  rng = np.random.default_rng(int(seed))
  out = np.full((num_heads, num_blocks, r), -1, np.int64)
  for h in range(num_heads):
    for n in range(num_blocks):
      if n in glob or r == 0:
        continue
      candidates = [m for m in range(num_blocks) if abs(m - n) > 1 and m not in glob]
      chosen = np.sort(rng.choice(candidates, size=min(r, len(candidates)), replace=False))
      out[h, n, :len(chosen)] = chosen
  return out


def bigbird_block_pattern(num_blocks: int, *, num_global_blocks: int, num_random_blocks: int,
                          seed: int, num_heads: int = 1) -> np.ndarray:
  """bool `[H, nb, nb]`: the BigBird ITC block layout (window + global + random)."""
  glob = list(bigbird_global_blocks(num_blocks, num_global_blocks))
  rand = bigbird_random_blocks(num_blocks, num_global_blocks=num_global_blocks,
                               num_random_blocks=num_random_blocks, seed=seed,
                               num_heads=num_heads)
  n = np.arange(num_blocks)
  window = np.abs(n[:, None] - n[None, :]) <= 1                   # [nb, nb]
  layout = np.broadcast_to(window, (num_heads, num_blocks, num_blocks)).copy()
  layout[:, glob, :] = True
  layout[:, :, glob] = True
  for h in range(num_heads):
    rows, slots = np.nonzero(rand[h] >= 0)
    layout[h, rows, rand[h][rows, slots]] = True
  return layout


def bigbird_mask(length: int, *, block_size: int, num_global_blocks: int,
                 num_random_blocks: int, seed: int, num_heads: int = 1) -> np.ndarray:
  """bool `[H, L, L]`: the BigBird ITC pattern on tokens (the last block may be partial)."""
  block_size = validation.positive_int("block_size", block_size)
  num_blocks = -(-length // block_size)
  layout = bigbird_block_pattern(num_blocks, num_global_blocks=num_global_blocks,
                                 num_random_blocks=num_random_blocks, seed=seed,
                                 num_heads=num_heads)
  return block_layout_mask(layout, block_size, length)


# --- Reformer LSH (attention.lsh) -----------------------------------------------------------


def lsh_pair_counts(buckets, *, chunk_size: int, causal: bool = False,
                    key_mask=None) -> np.ndarray:
  """int `[B, H, L, L]`: in how many hash rounds query i attends key j in `lsh_attention`.

  `buckets` is int `[B, H, R, L]` from `attention.lsh.lsh_buckets` (padded tokens in bucket
  `num_buckets`, above every real bucket). Per round, tokens are ordered by (bucket, position)
  and `rank` is the place in that order. Query i may use key j when both are real and
    * non-causal: rank(j) // chunk_size is rank(i) // chunk_size or one less (own chunk and
      the previous one, no wrap-around);
    * causal: j is in i's bucket, position(j) <= position(i), and rank(i) - rank(j) <=
      chunk_size (the chunk_size most recent earlier tokens of the bucket);
  and then j = i is allowed only when no other key is. `lsh_attention` equals a softmax over
  logits + log(count) restricted to count > 0.
  """
  buckets = np.asarray(buckets)
  b_, h, rounds, length = buckets.shape
  real = np.ones((b_, length), bool) if key_mask is None else np.asarray(key_mask, bool)
  pos = np.arange(length)
  eye = np.eye(length, dtype=bool)
  counts = np.zeros((b_, h, length, length), np.int32)
  for b in range(b_):
    for hh in range(h):
      for r in range(rounds):
        bucket = buckets[b, hh, r]
        rank = np.empty(length, int)
        rank[np.lexsort((pos, bucket))] = pos
        if causal:
          gap = rank[:, None] - rank[None, :]
          ok = ((bucket[:, None] == bucket[None, :]) & (gap <= chunk_size)
                & (pos[:, None] >= pos[None, :]))
        else:
          chunk = rank // chunk_size
          ok = (chunk[None, :] == chunk[:, None]) | (chunk[None, :] == chunk[:, None] - 1)
        ok &= real[b][:, None] & real[b][None, :]
        other = ok & ~eye
        ok = np.where(other.any(axis=1, keepdims=True), other, ok & eye)
        counts[b, hh] += ok
  return counts


# --- MPNet's two-stream masks (masked and permuted language modelling) ---------------------
#
# Song et al. 2020 ("MPNet", section 2.2 and Figure 2). A permutation z of the n real tokens puts
# the b predicted tokens at its end (ranks n-b .. n-1). The content stream holds the tokens
# x_{z<=c} that are not predicted, one mask token M (the [MASK] embedding plus the position of a
# predicted token) per predicted position, and the predicted tokens x_{z>c}; the query stream
# holds one query per predicted token (also the [MASK] embedding plus its position). With k the
# index of a predicted token in the permutation's predicted part:
#   * non-predicted tokens and mask tokens attend the non-predicted tokens and every mask token;
#   * the content of predicted token k attends the non-predicted tokens, the predicted tokens
#     k' <= k and the mask tokens k' > k;
#   * the query of predicted token k attends the non-predicted tokens, the predicted tokens
#     k' < k and the mask tokens k' >= k.
# Every predicted token therefore sees n positions, the whole sequence (real tokens where they
# are known, mask tokens elsewhere), and no stream ever reaches a predicted token's content
# from that token's own query, directly or through another token.

NON_PREDICTED, MASK_TOKEN, PREDICTED, QUERY, INACTIVE = 0, 1, 2, 3, -1


def mpnet_allowed(row_kind, row_rank, key_kind, key_rank):
  """bool `[..., R, K]`: which key each row may attend, from each entry's kind (NON_PREDICTED,
  MASK_TOKEN, PREDICTED, QUERY or INACTIVE) and its rank in the permutation (`[..., R]`,
  `[..., K]`). INACTIVE rows attend nothing and INACTIVE keys are never attended."""
  rk, rr = jnp.asarray(row_kind)[..., :, None], jnp.asarray(row_rank)[..., :, None]
  kk, kr = jnp.asarray(key_kind)[..., None, :], jnp.asarray(key_rank)[..., None, :]
  plain = (rk == NON_PREDICTED) | (rk == MASK_TOKEN)
  pred_key, mask_key = kk == PREDICTED, kk == MASK_TOKEN
  allowed = ((kk == NON_PREDICTED) & (rk != INACTIVE)) | (plain & mask_key)
  allowed |= (rk == PREDICTED) & ((pred_key & (kr <= rr)) | (mask_key & (kr > rr)))
  allowed |= (rk == QUERY) & ((pred_key & (kr < rr)) | (mask_key & (kr >= rr)))
  return allowed


def mpnet_masks(num_tokens: int, num_predicted: int) -> tuple[np.ndarray, np.ndarray]:
  """MPNet's masks in the permuted order of the paper (Figure 2b), True = may attend.

  The content stream is (x_{z<=c}, M_{z>c}, x_{z>c}): n - b tokens, b mask tokens, b predicted
  tokens, n + b entries. Returns (content `[n+b, n+b]`, query `[b, n+b]`).
  """
  n = validation.positive_int("num_tokens", num_tokens)
  b = _non_negative_int("num_predicted", num_predicted)
  if b > n:
    raise ValueError(f"num_predicted {b} exceeds num_tokens {n}.")
  kinds = np.array([NON_PREDICTED] * (n - b) + [MASK_TOKEN] * b + [PREDICTED] * b)
  ranks = np.concatenate([np.arange(n), np.arange(n - b, n)])
  content = mpnet_allowed(kinds, ranks, kinds, ranks)
  query = mpnet_allowed(np.full(b, QUERY), np.arange(n - b, n), kinds, ranks)
  return np.asarray(content), np.asarray(query)


def mpnet_position_masks(ranks, predicted, real):
  """The same masks laid out by position, for batches of sequences of one length L.

  `ranks` int `[B, L]`: each real token's place in its permutation (the predicted part last);
  `predicted`, `real` bool `[B, L]`. The content stream is the L tokens followed by L mask
  slots (slot j is the mask token of position j, used when j is predicted); the query stream
  has one slot per position (used when it is predicted). Returns (content `[B, 2L, 2L]`,
  query `[B, L, 2L]`); unused slots attend nothing and are never attended.
  """
  ranks = jnp.asarray(ranks)
  predicted, real = jnp.asarray(predicted, bool), jnp.asarray(real, bool)
  token_kind = jnp.where(real, jnp.where(predicted, PREDICTED, NON_PREDICTED), INACTIVE)
  slot_kind = jnp.where(predicted, MASK_TOKEN, INACTIVE)
  kinds = jnp.concatenate([token_kind, slot_kind], axis=-1)              # [B, 2L]
  both = jnp.concatenate([ranks, ranks], axis=-1)                        # [B, 2L]
  content = mpnet_allowed(kinds, both, kinds, both)
  query = mpnet_allowed(jnp.where(predicted, QUERY, INACTIVE), ranks, kinds, both)
  return content, query
