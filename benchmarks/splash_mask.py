"""Build time and peak memory of the splash backend's tile masks (`attention.splash_masks`).

The splash kernel needs, per head, which (query tile, key tile) pairs to visit and the boolean
contents of partly allowed tiles (`MaskInfo`). `attention.splash_masks.mask_infos` builds them
from each kind's pattern at tile granularity; this benchmark times that build, uncached, for the
patterns the `splash` backend uses (`attention.splash`) at long lengths, and measures its peak
Python heap (numpy included) with `tracemalloc`. As the peer, it times splash's own
`process_mask` on the dense `NumpyMask`s it would otherwise be given, at a length where those
still fit (their `L x L` booleans per distinct head mask are counted in that row's memory).

Run it as

  .venv/bin/python benchmarks/splash_mask.py [--lengths 16384 65536] [--peer-length 4096]

Columns: the configuration, seconds to build (forward and dK/dV `MaskInfo`), peak MB, the
non-empty tiles per head per query-tile row (the grid width after shrinking), and the number of
distinct stored partial tiles. Tiles are 128 x 128. Runs in well under a minute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# As a script, sys.path[0] is benchmarks/, where attention.py shadows the `attention` package.
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
  sys.path[0] = ROOT
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from attention import masks, splash_masks  # noqa: E402
from attention.splash_masks import (BandPattern, BlockLocalPattern, FixedPattern,  # noqa: E402
                                    StridedPattern)

TILE = 128
DILATIONS = (1, 1, 2, 2, 4, 4, 8, 8)


def measure(build: Callable[[], tuple]) -> tuple[float, float, tuple]:
  """(seconds, peak MB of the traced heap, result) of one call of `build`."""
  tracemalloc.start()
  start = time.perf_counter()
  result = build()
  seconds = time.perf_counter() - start
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  return seconds, peak / 1e6, result


def configurations(length: int) -> list[tuple[str, tuple, int]]:
  """(name, one pattern per head, appended key columns) at `length`."""
  nb = length // 64
  bigbird = masks.bigbird_block_pattern(nb, num_global_blocks=2, num_random_blocks=3, seed=0,
                                        num_heads=8)
  offsets = masks.fixed_summary_offsets(stride=256, summary_width=32, num_heads=8)
  return [
      ("band w256 dil (1,1,2,2,4,4,8,8) + 128 globals",
       tuple(BandPattern(256, d) for d in DILATIONS), TILE),
      ("band w256 causal", (BandPattern(256, 1, True),) * 8, 0),
      ("bigbird block 64, 8 heads", splash_masks.layout_patterns(bigbird, 64, False), 0),
      ("fixed stride 256 width 32, 8 heads",
       tuple(FixedPattern(256, 32, lo, True) for lo in offsets), 0),
      ("strided stride 256", (StridedPattern(256, True),) * 8, 0),
      ("block_local 512", (BlockLocalPattern(512),) * 8, 0),
  ]


def ours(patterns: tuple, length: int, extra: int) -> Callable[[], tuple]:
  build = splash_masks.mask_infos.__wrapped__          # uncached
  return lambda: build(patterns, length, length + extra, length, TILE, TILE)


def peer(patterns: tuple, length: int) -> Callable[[], tuple]:
  """splash's own path: dense NumpyMasks (built inside the measurement) and process_mask."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as smask
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_mask_info as sinfo)

  def build():
    pos = np.arange(length)
    dense = {p: smask.NumpyMask(np.asarray(p.allowed(pos[:, None], pos[None, :])))
             for p in dict.fromkeys(patterns)}
    mask = smask.MultiHeadMask([dense[p] for p in patterns])
    process = sinfo._process_mask.__wrapped__          # uncached, as the first call would be
    return (process(mask, (TILE, TILE), False)[0], process(mask, (TILE, TILE), True)[0])
  return build


def row(name: str, length: int, seconds: float, peak: float, fwd) -> str:
  stored = 0 if fwd.partial_mask_blocks is None else fwd.partial_mask_blocks.shape[0]
  return (f"| {name} | {length} | {seconds:.2f} | {peak:.0f} | {fwd.block_mask.shape[-1]} "
          f"| {stored} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
  parser.add_argument("--peer-length", type=int, default=4096,
                      help="length of the process_mask rows (0: none)")
  args = parser.parse_args()
  print("| mask | length | build s | peak MB | grid width | stored tiles |")
  print("|---|---|---|---|---|---|")
  for length in args.lengths:
    for name, patterns, extra in configurations(length):
      seconds, peak, (fwd, _) = measure(ours(patterns, length, extra))
      print(row(name, length, seconds, peak, fwd), flush=True)
  if args.peer_length:
    length = args.peer_length
    name, patterns, _ = configurations(length)[0]
    patterns = tuple(BandPattern(p.window, p.dilation) for p in patterns)   # no globals
    for label, build in (("splash_masks", ours(patterns, length, 0)),
                         ("process_mask on NumpyMask", peer(patterns, length))):
      seconds, peak, (fwd, _) = measure(build)
      print(row(f"{label}: band w256 dil (1,1,2,2,4,4,8,8)", length, seconds, peak, fwd),
            flush=True)


if __name__ == "__main__":
  main()
