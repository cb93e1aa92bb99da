"""The ListOps generator's limits, checked with the config (`lra.schema`) before anything
compiles: the longest tree a depth and an argument count allow, the int32 token count the
generator keeps while it draws a tree, and the fraction of its draws that land in the length
window at `max_depth` (too few, and the generator gives up after its idle rounds).

Standard library only at import; the kept fraction imports numpy when it is computed.
"""

from __future__ import annotations

import functools

# The ListOps generator (lra/data/listops_generator.py; tests/dry_run_test.py checks this
# against it) counts each tree's tokens in int32 while it draws the tree.
GENERATOR_COUNT_MAX = 2**31 - 1
# The longest gen_max_length whose kept fraction (`listops_kept`) is computed by the check; a
# longer window skips it (its cost grows with gen_max_length).
KEPT_CHECK_TOKENS = 8192


def listops_longest(max_depth: int, max_args: int) -> int:
  """The most tokens a ListOps tree of `max_depth` levels and `max_args` arguments can have
  (every node above the last level an operator, its token, max_args children and `]`), capped
  at GENERATOR_COUNT_MAX + 1."""
  tokens = 1
  for _ in range(max_depth - 1):
    tokens = 2 + max_args * tokens
    if tokens > GENERATOR_COUNT_MAX:
      return GENERATOR_COUNT_MAX + 1
  return tokens


@functools.lru_cache(maxsize=64)
def listops_kept(low: int, high: int, depth: int, args: int) -> tuple[float, ...]:
  """For max_depth = 1, 2, ..., depth: the probability that one tree the ListOps generator draws
  has low < tokens < high (is kept). Exact up to floating point: the distribution of a
  subtree's token count below `high`, level by level from the last one (a digit there; above it
  a digit with probability 3/4, else an operator, its token, 2..args uniform children and `]`).
  Once the distribution stops changing (its change shrinks geometrically with the depth) the
  last value stands for every deeper one."""
  import numpy as np   # only for a config with the ListOps generator's fields
  size = 1 << (2 * high - 1).bit_length()   # no wrap-around below `high` in one product
  rfft, irfft = np.fft.rfft, np.fft.irfft
  q = np.zeros(high)   # [high] P(a subtree has n tokens)
  q[1] = 1.0
  kept, change = [float(q[low + 1:].sum())], 1.0
  for _ in range(depth - 1):
    if change < 1e-9:   # the distribution has settled (the rest of its change is smaller)
      kept.append(kept[-1])
      continue
    before = q
    f = rfft(q, size)
    more = np.zeros(high)   # 1 + q + ... + q^(args - 2), by Horner
    more[0] = 1.0
    for _ in range(args - 2):
      more = irfft(f * rfft(more, size), size)[:high]
      more[0] += 1.0
    pair = irfft(f * f, size)[:high]
    children = irfft(rfft(pair, size) * rfft(more, size), size)[:high - 2] / (args - 1)
    q = np.zeros(high)
    q[1] = 0.75
    q[2:] = 0.25 * np.clip(children, 0.0, None)
    kept.append(float(q[low + 1:].sum()))
    change = float(np.abs(q - before).sum())
  return tuple(kept)


def check(low: int, high: int, depth: int, args: int) -> None:
  """Raises ValueError (one line) when the ListOps generator cannot make trees of
  low < tokens < high with `depth` levels and `args` arguments (see the messages)."""
  longest = listops_longest(depth, args)
  sizes = f"config.data.max_depth = {depth} and config.data.max_args = {args}"
  most = GENERATOR_COUNT_MAX // (args + 1) + 1
  if longest > GENERATOR_COUNT_MAX and high > most:
    raise ValueError(f"config.data.gen_max_length = {high}: must be at most {most:,} with "
                     f"{sizes} (the ListOps generator counts a tree's tokens in int32, and a "
                     f"tree still shorter than gen_max_length can grow {args + 1}-fold in one "
                     f"level).")
  if low >= longest:
    raise ValueError(f"config.data.gen_min_length = {low}: must be below {longest:,}, the most "
                     f"tokens a ListOps tree of {sizes} can have (the generator would search "
                     f"for longer trees in vain); lower it or raise config.data.max_depth.")
  if high > KEPT_CHECK_TOKENS:   # a longer window costs too much to compute here
    return
  from lra.data.listops_generator import IDLE_ROUNDS, ROOTS_PER_ROUND   # numpy only
  window = IDLE_ROUNDS * ROOTS_PER_ROUND
  kept = listops_kept(low, high, min(depth, (high + 1) // 3 + 1), args)
  if kept[-1] * window < 1:   # deeper than (high + 1) // 3 + 1 draws only longer trees
    best = max(range(len(kept)), key=kept.__getitem__)
    fix = (f"max_depth = {best + 1} keeps the most ({kept[best]:.2g} of the draws)"
           if kept[best] * window >= 1 else "widen gen_min_length..gen_max_length")
    why = " (deeper trees mostly grow past gen_max_length)" if best + 1 < depth else ""
    raise ValueError(
        f"config.data.max_depth = {depth}: the ListOps generator would find almost no tree: "
        f"one it draws has config.data.gen_min_length = {low} < tokens < "
        f"config.data.gen_max_length = {high} with probability {kept[-1]:.2g}{why}, and it "
        f"gives up after {IDLE_ROUNDS} rounds of {ROOTS_PER_ROUND} draws that keep nothing; "
        f"{fix}.")
