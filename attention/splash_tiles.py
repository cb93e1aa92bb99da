"""The TPU splash kernel's tiles (`Tiles`, `splash_tiles`): the config fields
`config.model.splash` and their checks, without jax, so that `lra.schema` checks a config
instantly; `attention.splash` runs the kernel with them.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

LANES = 128
# The kernel's tile sizes (splash's `BlockSizes`), as config fields. Defaults follow MaxText's
# production setting for splash (`sa_block_*: 512`, `sa_use_fused_bwd_kernel: False`); the
# kernel's own `BlockSizes.get_default()` is 128 everywhere, marked as a placeholder there. A
# tile longer than the (lane-padded) sequence is cut to it, so short inputs run one tile.
TILE_FIELDS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
               "block_kv_dkv_compute")
DEFAULT_TILES = dict(block_q=512, block_kv=512, block_kv_compute=512, block_q_dkv=512,
                     block_kv_dkv=512, block_kv_dkv_compute=512, use_fused_bwd_kernel=False)


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The splash kernel's tiles: forward query / key tiles (`block_q`, `block_kv`) and the key
  sub-tile of each matmul (`block_kv_compute`, dividing `block_kv`); the dK/dV pass's
  (`block_q_dkv`, `block_kv_dkv`, `block_kv_dkv_compute`); `use_fused_bwd_kernel`: dQ computed
  in the dK/dV kernel (one backward kernel, no dQ tiles) instead of its own pass at the forward
  tiles. Sides are multiples of 128 (the lane width)."""
  block_q: int = DEFAULT_TILES["block_q"]
  block_kv: int = DEFAULT_TILES["block_kv"]
  block_kv_compute: int = DEFAULT_TILES["block_kv_compute"]
  block_q_dkv: int = DEFAULT_TILES["block_q_dkv"]
  block_kv_dkv: int = DEFAULT_TILES["block_kv_dkv"]
  block_kv_dkv_compute: int = DEFAULT_TILES["block_kv_dkv_compute"]
  use_fused_bwd_kernel: bool = DEFAULT_TILES["use_fused_bwd_kernel"]

  def __post_init__(self):
    for name in TILE_FIELDS:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive multiple of {LANES}, got {value!r}; "
                         f"the default is {DEFAULT_TILES[name]}.")
      if value % LANES:
        raise ValueError(f"{name} must be a multiple of {LANES} (the kernel's lane width), got "
                         f"{value}; pass {LANES * max(1, round(value / LANES))}.")
      object.__setattr__(self, name, int(value))
    for outer, inner in (("block_kv", "block_kv_compute"), ("block_kv_dkv",
                                                            "block_kv_dkv_compute")):
      if getattr(self, outer) % getattr(self, inner):
        raise ValueError(f"{inner} = {getattr(self, inner)} must divide {outer} = "
                         f"{getattr(self, outer)} (it is the sub-tile of each matmul); pass "
                         f"{inner} = {getattr(self, outer)} or a divisor of it.")
    if not isinstance(self.use_fused_bwd_kernel, (bool, np.bool_)):
      raise ValueError(f"use_fused_bwd_kernel must be True or False, got "
                       f"{self.use_fused_bwd_kernel!r}.")
    object.__setattr__(self, "use_fused_bwd_kernel", bool(self.use_fused_bwd_kernel))

  def fit(self, q_len: int, kv_len: int) -> Tiles:
    """These tiles cut to sequences of `q_len` queries and `kv_len` keys (each side at most the
    length rounded up to 128; a compute sub-tile that no longer divides its tile becomes it)."""
    cap_q, cap_kv = _round_up(max(q_len, 1), LANES), _round_up(max(kv_len, 1), LANES)
    out = {n: min(getattr(self, n), cap_q if "_q" in n else cap_kv) for n in TILE_FIELDS}
    for outer, inner in (("block_kv", "block_kv_compute"), ("block_kv_dkv",
                                                            "block_kv_dkv_compute")):
      if out[outer] % out[inner]:
        out[inner] = out[outer]
    return Tiles(**out, use_fused_bwd_kernel=self.use_fused_bwd_kernel)

  def block_sizes(self):
    """Splash's `BlockSizes`: the dQ pass (unfused) at the forward tiles, whose `MaskInfo` it
    shares."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as _splash)
    dq = {} if self.use_fused_bwd_kernel else dict(block_q_dq=self.block_q,
                                                   block_kv_dq=self.block_kv)
    return _splash.BlockSizes(
        block_q=self.block_q, block_kv=self.block_kv, block_kv_compute=self.block_kv_compute,
        block_q_dkv=self.block_q_dkv, block_kv_dkv=self.block_kv_dkv,
        block_kv_dkv_compute=self.block_kv_dkv_compute,
        use_fused_bwd_kernel=self.use_fused_bwd_kernel, **dq)


def splash_tiles(config: Tiles | Mapping | None = None, *, block_q: int | None = None,
                 block_kv: int | None = None) -> Tiles:
  """The `Tiles` of a config mapping (`config.model.splash`: any of `DEFAULT_TILES`' names; a
  `Tiles` is returned as it is) with `block_q` / `block_kv` overriding it. An unknown name or a
  bad value raises ValueError in one line."""
  if isinstance(config, Tiles):
    values = dataclasses.asdict(config)
  else:
    values = dict(config or {})
    unknown = sorted(set(values) - set(DEFAULT_TILES))
    if unknown:
      raise ValueError(f"{unknown[0]} is not a splash tile field; valid: "
                       f"{', '.join(DEFAULT_TILES)}.")
  values.update({k: v for k, v in (("block_q", block_q), ("block_kv", block_kv))
                 if v is not None})
  return Tiles(**{k: v for k, v in values.items() if v is not None})


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m
