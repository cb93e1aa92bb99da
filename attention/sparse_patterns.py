"""Sparse Transformer (strided, fixed), BigBird ITC and block-local attention on the block kernel.

The patterns are defined in `attention.masks` (dense, the specification); this module computes
them with `attention.block_sparse.sparse_core`, only over the blocks they use:

  * `block_local`: blocks of `block_size` tokens attend to themselves: a block-diagonal layout
    (computed in blocks of a divisor of `block_size`, so a causal diagonal wastes little).
  * `fixed` (Child et al. 2019) = same stride group (the block-local part, with block = stride)
    + the summary columns of the head. The summary keys of every head are cut out of each group
    with static slices into a short sequence of `ceil(L / stride) * summary_width` keys, and every
    query attends to those of the *other* groups (earlier ones when causal) through a block
    layout with key blocks of `summary_width`. Per-head summary offsets only change which
    columns are cut out, so all heads share one plan.
  * `strided` (Child et al. 2019) = local part 0 < |i - j| < stride (a band of blocks with a token
    predicate) + strided part stride | (i - j): a reshape-transpose puts each residue class mod
    stride in a contiguous run, where the strided part is block-diagonal attention with one
    dense block per class (`strided_parts`, which takes the two attention calls as arguments,
    so any kernel that returns its log-sum-exp runs the pattern the same way: `_strided` here,
    the Pallas kernel in `attention.pallas_block_sparse`). Computed in token order, the
    strided part would visit a tile for every tile pair whose distance range holds a multiple
    of the stride, each tile holding one diagonal of pairs: its work per tile would fall as
    1 / tile side, and its tiles grow as L^2.
  * `bigbird` (Zaheer et al. 2020, ITC): the block layout of `masks.bigbird_block_pattern`
    (3-block window, global blocks, seeded random blocks per head) on the block kernel.

Parts over disjoint key sets are merged by their log-sum-exp, so every pair is counted once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from attention import masks, validation
from attention.block_sparse import check_layout, finish, merge_parts, pad_tokens, sparse_core
from attention.block_sparse_plan import Static, make_plan
from attention.static_take import static_take

PATTERNS = ("strided", "fixed")


def default_block_size(stride: int) -> int:
  """The largest divisor of `stride` that is at most 128 (the compute block of the patterns)."""
  return max(d for d in range(1, min(stride, 128) + 1) if stride % d == 0)


def _check_block(stride: int, block_size: int | None) -> int:
  if block_size is None:
    return default_block_size(stride)
  block_size = validation.positive_int("block_size", block_size)
  if stride % block_size:
    divisors = [d for d in range(1, min(stride, 128) + 1) if stride % d == 0][-4:]
    raise ValueError(
        f"stride {stride} is not a multiple of block_size {block_size}: the blocks must tile "
        f"each stride group. Pass a block_size that divides the stride (for example "
        f"{', '.join(map(str, divisors))}) or a stride that is a multiple of {block_size}.")
  return block_size


# --- Block layouts (numpy, static). ---

def block_local_layout(num_blocks: int, *, group: int = 1, causal: bool = False) -> np.ndarray:
  """bool `[nb, nb]`: block n sees block m when both lie in the same group of `group` blocks."""
  n = np.arange(num_blocks)
  same = (n[:, None] // group) == (n[None, :] // group)
  return same & (n[:, None] >= n[None, :]) if causal else same


def fixed_layout(length: int, *, stride: int, summary_width: int, block_size: int,
                 causal: bool = False, num_heads: int = 1,
                 num_summary_offsets: int | None = None) -> np.ndarray:
  """bool `[H, nb, nb]`: the blocks that hold a pair of the `fixed` pattern (nb = ceil(L/b))."""
  offsets = masks.fixed_summary_offsets(stride=stride, summary_width=summary_width,
                                        num_heads=num_heads,
                                        num_summary_offsets=num_summary_offsets)
  nb = -(-length // block_size)
  blocks = np.arange(nb)
  group = block_local_layout(nb, group=stride // block_size)
  out = []
  for lo in offsets:
    cols = np.arange(length)
    summary = (cols % stride >= lo) & (cols % stride < lo + summary_width)
    has = np.zeros(nb, bool)
    has[cols[summary] // block_size] = True
    layout = group | has[None, :]
    out.append(layout & (blocks[:, None] >= blocks[None, :]) if causal else layout)
  return np.stack(out)


def bigbird_layout(length: int, *, block_size: int, num_global_blocks: int,
                   num_random_blocks: int, seed: int, num_heads: int = 1) -> np.ndarray:
  """bool `[H, nb, nb]`: the BigBird ITC layout (`masks.bigbird_block_pattern`)."""
  return masks.bigbird_block_pattern(-(-length // block_size),
                                     num_global_blocks=num_global_blocks,
                                     num_random_blocks=num_random_blocks, seed=seed,
                                     num_heads=num_heads)


@dataclasses.dataclass(frozen=True)
class _Near:
  """Token predicate of the strided pattern's local part: 0 < |i - j| < stride."""
  stride: int

  def __call__(self, qpos: jax.Array, kpos: jax.Array) -> jax.Array:
    dist = jnp.abs(qpos - kpos)
    return (dist > 0) & (dist < self.stride)


def _near_layout(num_blocks: int, block: int, stride: int, causal: bool) -> np.ndarray:
  """bool `[nb, nb]`: blocks holding a pair with 0 < |i - j| < stride (j < i when causal)."""
  n = np.arange(num_blocks)
  gap = np.abs(n[:, None] - n[None, :])
  near = np.where(gap == 0, block > 1 and stride > 1, (gap - 1) * block + 1 < stride)
  return near & (n[:, None] >= n[None, :]) if causal else near


# --- The parts, on padded token-major arrays. ---

def _group_part(q: jax.Array, k: jax.Array, v: jax.Array, key_ok: jax.Array, *,
                plan: Static) -> tuple[jax.Array, jax.Array]:
  """Same-group attention; q, k, v `[B, Lp, H, .]` with Lp = plan.nqb * plan.q_block."""
  return sparse_core(q, k, v, key_ok, plan)


def _summary_part(q: jax.Array, k: jax.Array, v: jax.Array, key_ok: jax.Array, *, plan: Static,
                  offsets: tuple[int, ...], stride: int,
                  width: int) -> tuple[jax.Array, jax.Array]:
  """Attention to the summary columns of the other stride groups (per-head offsets)."""
  b_, lp, h, _ = k.shape
  groups = lp // stride

  def cut(x):  # [B, Lp, H, E] -> [B, G * width, H, E], head h keeps columns offsets[h] + [0, w)
    x = x.reshape(b_, groups, stride, h, x.shape[-1]).transpose(0, 1, 3, 2, 4)
    x = x.reshape(b_, groups, h * stride, x.shape[-1])
    idx = [hh * stride + offsets[hh] + t for hh in range(h) for t in range(width)]
    x = static_take(x, idx, 2).reshape(b_, groups, h, width, x.shape[-1])
    return x.transpose(0, 1, 3, 2, 4).reshape(b_, groups * width, h, x.shape[-1])

  ok = jnp.broadcast_to(key_ok[:, :, None, None], (b_, lp, h, 1)).astype(jnp.float32)
  ok_summary = cut(ok)[..., 0] > 0.5                                       # [B, G*w, H]
  return sparse_core(q, cut(k), cut(v), ok_summary, plan)


def class_major(x: jax.Array, stride: int) -> jax.Array:
  """`[B, m * stride, ...]` token order -> residue-class order (class r holds r, r + stride...)."""
  b_, lp = x.shape[:2]
  x = x.reshape((b_, lp // stride, stride) + x.shape[2:])
  return jnp.swapaxes(x, 1, 2).reshape((b_, lp) + x.shape[3:])


def token_major(x: jax.Array, stride: int) -> jax.Array:
  """Inverse of `class_major`."""
  b_, lp = x.shape[:2]
  x = x.reshape((b_, stride, lp // stride) + x.shape[2:])
  return jnp.swapaxes(x, 1, 2).reshape((b_, lp) + x.shape[3:])


def class_length(length: int, stride: int, multiple: int = 1) -> int:
  """Tokens per residue class in `strided_parts`: ceil(length / stride), rounded up to a
  multiple of `multiple` (a kernel's tile, so that every class fills whole tiles)."""
  m = -(-length // stride)
  return -(-m // multiple) * multiple


def strided_parts(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None, *,
                  stride: int, local: Callable[..., tuple[jax.Array, jax.Array]],
                  diagonal: Callable[..., tuple[jax.Array, jax.Array]],
                  multiple: int = 1) -> jax.Array:
  """The strided pattern from two attention calls that each do full work per block.

  The pairs stride | (i - j) are, in residue-class order (`class_major`: token a * stride + r at
  r * m + a), the blocks of a block-diagonal layout with one block of m = `class_length(L,
  stride, multiple)` tokens per class; in order within a class, so causal inside a block is
  causal in tokens. The other pairs, 0 < |i - j| < stride, are a band in token order. The two
  key sets are disjoint; the parts are merged by their log-sum-exps.

  Args:
    q, k, v: `[B, L, H, .]` self-attention inputs.
    key_mask: optional bool `[B, L]`, True = real token.
    stride: the pattern's stride.
    local: `(q, k, v, key_ok) -> (out, lse)` in token order on the unpadded length: pairs with
      0 < |i - j| < stride (and j < i when causal); out `[B, L', H, Dv]` float32 normalised,
      lse `[B, L', H]` (NEG_INF for a query with none), L' >= L.
    diagonal: `(q, k, v, key_ok, block) -> (out, lse)` on class-major arrays of
      `stride * block` tokens: block-diagonal attention, blocks of `block` tokens (causal inside
      the block when the pattern is); padded tokens come with key_ok False.
    multiple: the class length is rounded up to a multiple of this (a kernel's tile).

  Returns:
    `[B, L, H, Dv]` in q's dtype; padded queries output 0.
  """
  b_, length = q.shape[:2]
  key_ok = jnp.ones((b_, length), bool) if key_mask is None else key_mask
  block = class_length(length, stride, multiple)
  padded = [class_major(pad_tokens(x, block * stride), stride) for x in (q, k, v, key_ok)]
  out_c, lse_c = diagonal(*padded, block)
  out_l, lse_l = local(q, k, v, key_ok)
  out, _ = merge_parts([(token_major(out_c, stride)[:, :length],
                         token_major(lse_c, stride)[:, :length]),
                        (out_l[:, :length], lse_l[:, :length])])
  return finish(out, key_mask, length, q.dtype)


@functools.partial(jax.jit, static_argnames=("local", "classes", "stride"))
def _strided(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None, *,
             local: Static, classes: Static, stride: int) -> jax.Array:
  """The xla path of the strided pattern: `strided_parts` on `sparse_core`."""

  def near(q, k, v, key_ok):
    lp = local.nqb * local.q_block
    return sparse_core(*(pad_tokens(x, lp) for x in (q, k, v, key_ok)), local)

  def diagonal(q, k, v, key_ok, block):
    assert block == classes.q_block, (block, classes.q_block)
    return sparse_core(q, k, v, key_ok, classes)

  return strided_parts(q, k, v, key_mask, stride=stride, local=near, diagonal=diagonal)


@functools.partial(jax.jit, static_argnames=("plans", "pattern", "stride", "width", "offsets",
                                             "log_weights"))
def _run(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None, *,
         plans: tuple[tuple[str, Static], ...], pattern: str, stride: int,
         width: int | None = None, offsets: tuple[int, ...] | None = None,
         log_weights: tuple[float, ...] | None = None) -> jax.Array:
  """The parts of `plans`, merged by their log-sum-exps; `log_weights` (one per part) counts a
  part's keys exp(w) times (BigBird's repeated block 0, `bigbird_attention`)."""
  b_, length = q.shape[:2]
  key_ok = jnp.ones((b_, length), bool) if key_mask is None else key_mask
  parts = []
  for i, (name, plan) in enumerate(plans):
    lp = plan.nqb * plan.q_block
    args = [pad_tokens(x, lp) for x in (q, k, v, key_ok)]
    if name == "summary":
      out, lse = _summary_part(*args, plan=plan, offsets=offsets, stride=stride, width=width)
    else:
      out, lse = _group_part(*args, plan=plan)
    lse = lse if not log_weights or not log_weights[i] else lse + log_weights[i]
    parts.append((out[:, :length], lse[:, :length]))
  out, _ = merge_parts(parts)
  return finish(out, key_mask, length, q.dtype)


# --- Public fronts. ---

def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, pattern: str, stride: int,
                     summary_width: int | None = None, causal: bool = False,
                     key_mask: jax.Array | None = None, block_size: int | None = None,
                     num_summary_offsets: int | None = None) -> jax.Array:
  """Sparse Transformer attention (Child et al. 2019), computing only the pairs it uses.

  Args:
    q, k, v: `[B, L, H, D]` (v may have its own last dimension); self-attention.
    pattern: "strided" (|i - j| < stride, or stride | (i - j)) or "fixed" (same stride group,
      or a summary column of the head); see `attention.masks` for the exact definitions.
    stride: the stride l (group length for "fixed").
    summary_width: c, the summary columns per group for "fixed" (default stride // 8, at
      least 1). Must be <= stride.
    causal: keep only keys j <= i (language modelling); False gives the bidirectional pattern.
    key_mask: optional bool `[B, L]`, True = real token. Padded queries output 0.
    block_size: compute block; must divide the stride (default: its largest divisor <= 128).
    num_summary_offsets: "fixed" only: how many distinct summary positions the heads cycle
      through (default stride // summary_width; 1 = every head reads the last c columns).

  Returns:
    `[B, L, H, Dv]` in q's dtype, equal to `dot_product_attention` with
    `masks.strided_mask(...)` / `masks.fixed_mask(..., num_heads=H)` (and causal, key_mask).
  """
  b_, length, _, h, _ = validation.check_qkv(q, k, v, same_length=True)
  validation.check_token_mask("key_mask", key_mask, b_, length)
  if pattern not in PATTERNS:
    raise ValueError(f"unknown sparse pattern {pattern!r}; valid patterns: {', '.join(PATTERNS)}.")
  stride = validation.positive_int("stride", stride)
  block = _check_block(stride, block_size)
  if pattern == "strided":
    if summary_width is not None or num_summary_offsets is not None:
      raise ValueError("summary_width and num_summary_offsets apply to pattern='fixed' only.")
    nb = -(-length // block)
    local = make_plan(_near_layout(nb, block, stride, causal), q_block=block, k_block=block,
                      causal=causal, pair=_Near(stride), batch_heads=b_ * h)
    m = class_length(length, stride)
    pos = np.arange(m * stride).reshape(m, stride).T.reshape(-1)           # class-major positions
    classes = make_plan(np.eye(stride, dtype=bool), q_block=m, k_block=m, causal=causal,
                        q_pos=pos, k_pos=pos, batch_heads=b_ * h)
    return _strided(q, k, v, key_mask, local=local, classes=classes, stride=stride)
  width = max(1, stride // 8) if summary_width is None else validation.positive_int(
      "summary_width", summary_width)
  offsets = masks.fixed_summary_offsets(stride=stride, summary_width=width, num_heads=h,
                                        num_summary_offsets=num_summary_offsets)
  groups = -(-length // stride)
  nb = groups * (stride // block)
  plans = [("group", make_plan(block_local_layout(nb, group=stride // block, causal=causal),
                               q_block=block, k_block=block, causal=causal,
                               batch_heads=b_ * h))]
  g = np.arange(nb) * block // stride                                    # group of each q block
  summary = (g[:, None] > np.arange(groups)) if causal else (g[:, None] != np.arange(groups))
  if summary.any():
    plans.append(("summary", make_plan(summary, q_block=block, k_block=width,
                                       batch_heads=b_ * h)))
  return _run(q, k, v, key_mask, plans=tuple(plans), pattern=pattern, stride=stride,
              width=width, offsets=offsets)


def block_local_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_size: int,
                          causal: bool = False, key_mask: jax.Array | None = None) -> jax.Array:
  """Contiguous-block local attention: query i sees key j when i // block_size == j //
  block_size (and j <= i when causal). Equal to `dot_product_attention` with
  `masks.block_local_mask(...)`."""
  b_, length, _, h, _ = validation.check_qkv(q, k, v, same_length=True)
  validation.check_token_mask("key_mask", key_mask, b_, length)
  size = validation.positive_int("block_size", block_size)
  block = default_block_size(size)
  nb = -(-length // size) * (size // block)
  plan = make_plan(block_local_layout(nb, group=size // block, causal=causal), q_block=block,
                   k_block=block, causal=causal, batch_heads=b_ * h)
  return _run(q, k, v, key_mask, plans=(("group", plan),), pattern="block_local", stride=size)


RANDOM_BLOCKS = ("drawn", "first")


def bigbird_first_block_counts(length: int, block_size: int, num_random_blocks: int
                               ) -> np.ndarray:
  """int `[nb, nb]`: how often each key block enters each query block's softmax in Hugging
  Face's BigBird at inference (`random_blocks="first"`): the sliding blocks q-1..q+1, the first
  and last blocks (global rows see every block once), and r "random" blocks that are all block
  0 (`_bigbird_block_rand_mask`, "During inference (eval) no randomness"), so block 0 is counted
  1 + r times in rows 1 .. nb-2."""
  nb = -(-length // block_size)
  n = np.arange(nb)
  counts = (np.abs(n[:, None] - n[None, :]) <= 1).astype(np.int64)
  counts[:, [0, nb - 1]] = 1
  counts[[0, nb - 1], :] = 1
  counts[1:nb - 1, 0] += num_random_blocks
  return counts


def bigbird_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_size: int,
                      num_global_blocks: int = 2, num_random_blocks: int = 3, seed: int,
                      key_mask: jax.Array | None = None,
                      random_blocks: str = "drawn") -> jax.Array:
  """BigBird ITC attention (Zaheer et al. 2020): window + global + random blocks.

  Args:
    q, k, v: `[B, L, H, D]`; self-attention, bidirectional. L need not be a multiple of
      block_size (the last block is partial).
    block_size: tokens per block.
    num_global_blocks: g; the first ceil(g/2) and last floor(g/2) blocks are global.
    num_random_blocks: r random key blocks per (head, query block).
    seed: int fixing the random blocks (`masks.bigbird_random_blocks`): the same pattern in
      every process, and at training and evaluation. Use one seed per layer.
    key_mask: optional bool `[B, L]`, True = real token. Padded queries output 0.
    random_blocks: "drawn" (the paper's random blocks, fixed by `seed`), or "first": Hugging
      Face's BigBird at inference, which puts every random block on block 0 and counts block
      0's keys 1 + r times in the softmax of query blocks 1 .. nb-2
      (`bigbird_first_block_counts`); with 2 global blocks only, and like Hugging Face, full
      attention for inputs of at most (5 + 2r) blocks.

  Returns:
    `[B, L, H, Dv]` in q's dtype, equal to `dot_product_attention` with
    `masks.bigbird_mask(..., num_heads=H)` (and key_mask); with "first", to dense attention
    whose scores add log(count) of `bigbird_first_block_counts` (-inf where 0).
  """
  b_, length, _, h, _ = validation.check_qkv(q, k, v, same_length=True)
  validation.check_token_mask("key_mask", key_mask, b_, length)
  block = validation.positive_int("block_size", block_size)
  if random_blocks not in RANDOM_BLOCKS:
    raise ValueError(f"random_blocks = {random_blocks!r}: must be one of "
                     f"{', '.join(RANDOM_BLOCKS)}.")
  if random_blocks == "first":
    return _bigbird_first(q, k, v, key_mask, block, num_global_blocks, num_random_blocks)
  layout = bigbird_layout(length, block_size=block, num_global_blocks=num_global_blocks,
                          num_random_blocks=num_random_blocks, seed=seed, num_heads=h)
  layout = check_layout(layout, num_blocks=-(-length // block), num_heads=h, length=length,
                        block_size=block)
  plan = make_plan(layout, q_block=block, k_block=block, batch_heads=b_ * h)
  return _run(q, k, v, key_mask, plans=(("group", plan),), pattern="bigbird", stride=block)


def _bigbird_first(q, k, v, key_mask, block: int, num_global_blocks: int,
                   num_random_blocks: int) -> jax.Array:
  """`bigbird_attention(random_blocks="first")`: the layout without random blocks, plus block 0
  for query blocks 1 .. nb-2 again, its log-sum-exp raised by log(r) (merged as r more copies)."""
  length = q.shape[1]
  if num_global_blocks != 2:
    raise ValueError(f"random_blocks='first' is Hugging Face's BigBird, whose first and last "
                     f"blocks are global: num_global_blocks must be 2, got {num_global_blocks}.")
  r = int(num_random_blocks)
  if r < 0:
    raise ValueError(f"num_random_blocks must be >= 0, got {num_random_blocks!r}.")
  nb = -(-length // block)
  b_, h = q.shape[0], q.shape[2]
  if length <= (5 + 2 * r) * block:      # Hugging Face attends fully to such short inputs
    layout = np.ones((h, nb, nb), bool)
    plan = make_plan(layout, q_block=block, k_block=block, batch_heads=b_ * h)
    return _run(q, k, v, key_mask, plans=(("group", plan),), pattern="bigbird", stride=block)
  base = bigbird_layout(length, block_size=block, num_global_blocks=2, num_random_blocks=0,
                        seed=0, num_heads=h)
  again = np.zeros_like(base)
  again[:, 1:nb - 1, 0] = True
  plans = (("group", make_plan(base, q_block=block, k_block=block, batch_heads=b_ * h)),
           ("group", make_plan(again, q_block=block, k_block=block, batch_heads=b_ * h)))
  if r == 0:
    plans = plans[:1]
  return _run(q, k, v, key_mask, plans=plans, pattern="bigbird", stride=block,
              log_weights=(0.0, float(np.log(r))) if r else None)