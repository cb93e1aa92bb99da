"""The splash backend (attention.splash, attention.splash_masks) against the dense reference.

Two levels: the tile masks (`splash_masks.mask_infos`) are compared with splash's own
`process_mask` on dense `NumpyMask`s and, decoded back to pairs, with `attention.masks`; the
kernels (Pallas interpret mode on the CPU) are compared with `dot_product_attention` under the
kind's mask, outputs and gradients.
"""

import dataclasses
import time
import tracemalloc
import zlib

import chex
import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as smask
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as sinfo

import attention
from attention import masks, splash, splash_masks
from attention.splash_masks import (BandPattern, BlockLocalPattern, DensePattern, FixedPattern,
                                    StridedPattern)


# --- Tile masks. ---

def _pairs(pattern, q_len, kv_len):
  return np.asarray(pattern.allowed(np.arange(q_len)[:, None], np.arange(kv_len)[None, :]))


def _dkv_pairs(info, num_heads, q_len, kv_len, bq, bkv):
  """Decodes a dK/dV MaskInfo (grid (kv, head, q), pointers to query tiles) to `[H, Lq, Lk]`."""
  out = np.zeros((num_heads, q_len, kv_len), bool)
  for h in range(num_heads):
    hh = 0 if info.block_mask.shape[0] == 1 else h
    for step in range(info.block_mask.shape[1]):
      for ki in range(info.block_mask.shape[2]):
        kind = int(info.block_mask[hh, step, ki])
        if kind:
          qi = int(info.data_next[hh, step, ki])
          tile = True if kind == 2 else info.partial_mask_blocks[
              int(info.mask_next[hh, step, ki])].T
          out[h, qi * bq:(qi + 1) * bq, ki * bkv:(ki + 1) * bkv] = tile
  return out


PROCESS_MASK_CASES = [  # (patterns, length, bq, bkv, shrink)
    ((BandPattern(100, 1, True),) * 2, 512, 128, 128, True),
    (tuple(BandPattern(60, d) for d in (1, 2, 3)), 512, 128, 128, False),
    ((FixedPattern(64, 8, 56), FixedPattern(64, 8, 48)), 384, 128, 128, False),
    ((StridedPattern(100, True),), 512, 128, 128, True),
    ((BlockLocalPattern(37),), 512, 256, 128, True),
    (splash_masks.layout_patterns(masks.bigbird_block_pattern(
        12, num_global_blocks=2, num_random_blocks=2, seed=3, num_heads=2), 40, False),
     512, 128, 128, False),
]


@pytest.mark.parametrize("case", PROCESS_MASK_CASES, ids=lambda c: type(c[0][0]).__name__)
def test_mask_info_equals_process_mask(case):
  patterns, length, bq, bkv, shrink = case
  fwd, dkv = splash_masks.mask_infos(patterns, length, length, length, bq, bkv, shrink)
  dense = smask.MultiHeadMask([smask.NumpyMask(_pairs(p, length, length)) for p in patterns])
  want_fwd, _ = sinfo.process_mask(dense, (bq, bkv))
  want_dkv, _ = sinfo.process_mask_dkv(dense, (bq, bkv))
  for got, want in ((fwd, want_fwd), (dkv, want_dkv)):
    for field in splash_masks.MaskInfo._fields:
      a, b = getattr(got, field), getattr(want, field)
      assert (a is None) == (b is None), field
      if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape, field
        np.testing.assert_array_equal(a, b, err_msg=field)


def _kind_cases():
  """(name, patterns, reference mask `[H|1, L, L]`, length): every pattern class, awkward
  lengths and per-head variants."""
  cases = []
  # Windows 254 / 255 put a band edge exactly one past a tile's last diagonal.
  for length, window, dil, causal in [(37, 5, (1, 2), False), (300, 20, (1, 1, 3, 4, 8), True),
                                      (130, 0, (2,), False), (600, 254, (1, 2), False),
                                      (600, 255, (1,), True)]:
    pats = tuple(BandPattern(window, d, causal) for d in dil)
    cases.append(("band", pats, masks.band_mask(length, window=window, dilation=dil,
                                               causal=causal, num_heads=len(dil)), length))
  for causal in (False, True):
    cases.append(("dense", (DensePattern(causal),),
                  masks.causal_mask(200)[None] if causal else np.ones((1, 200, 200), bool), 200))
    cases.append(("block_local", (BlockLocalPattern(37, causal),),
                  masks.block_local_mask(300, block_size=37, causal=causal)[None], 300))
    cases.append(("strided", (StridedPattern(19, causal),),
                  masks.strided_mask(300, stride=19, causal=causal)[None], 300))
    offsets = masks.fixed_summary_offsets(stride=48, summary_width=8, num_heads=3)
    cases.append(("fixed", tuple(FixedPattern(48, 8, lo, causal) for lo in offsets),
                  masks.fixed_mask(300, stride=48, summary_width=8, causal=causal,
                                   num_heads=3), 300))
    layout = np.random.default_rng(5).random((3, 10, 10)) < 0.3
    ref = masks.block_layout_mask(layout, 30, 290)
    cases.append(("block_sparse", splash_masks.layout_patterns(layout, 30, causal),
                  ref & masks.causal_mask(290) if causal else ref, 290))
  full = np.ones((2, 8, 8), bool)                       # aligned blocks, causal: the offset
  full[1, 3] = False                                    # of a tile across the diagonal counts
  cases.append(("block_sparse", splash_masks.layout_patterns(full, 64, True),
                masks.block_layout_mask(full, 64, 512) & masks.causal_mask(512), 512))
  cases.append(("bigbird", splash_masks.layout_patterns(masks.bigbird_block_pattern(
      9, num_global_blocks=2, num_random_blocks=2, seed=1, num_heads=3), 33, False),
      masks.bigbird_mask(290, block_size=33, num_global_blocks=2, num_random_blocks=2,
                         seed=1, num_heads=3), 290))
  return cases


@pytest.mark.parametrize("case", _kind_cases(), ids=lambda c: c[0])
@pytest.mark.parametrize("tiles", [(128, 128), (256, 128)])
def test_tile_masks_decode_to_the_kind_mask(case, tiles):
  _, patterns, ref, length = case
  bq, bkv = tiles
  padded = -(-length // 256) * 256
  fwd, dkv = splash_masks.mask_infos(patterns, padded, padded, padded, bq, bkv)
  h = len(patterns)
  got = splash_masks.dense_mask(fwd, h, padded, padded, bq, bkv)
  np.testing.assert_array_equal(got[:, :length, :length],
                                np.broadcast_to(ref, (h, length, length)))
  # The dK/dV pass visits the same pairs (only forced all-masked tiles may differ: none here
  # hold a pair).
  np.testing.assert_array_equal(_dkv_pairs(dkv, h, padded, padded, bq, bkv), got)


def _random_pattern(rng):
  causal = bool(rng.random() < 0.5)
  kind = int(rng.integers(0, 6))
  if kind == 0:
    return BandPattern(int(rng.integers(0, 300)), int(rng.integers(1, 9)), causal)
  if kind == 1:
    return DensePattern(causal)
  if kind == 2:
    return BlockLocalPattern(int(rng.integers(1, 300)), causal)
  if kind == 3:
    return StridedPattern(int(rng.integers(1, 300)), causal)
  if kind == 4:
    stride = int(rng.integers(1, 300))
    width = int(rng.integers(1, stride + 1))
    return FixedPattern(stride, width, int(rng.integers(0, stride - width + 1)), causal)
  block = int(rng.choice([16, 30, 64, 128, 200]))
  nb = int(rng.integers(1, 12))
  layout = rng.random((1, nb, nb)) < rng.random()
  return splash_masks.layout_patterns(layout, block, causal)[0]


@pytest.mark.parametrize("seed", range(40))
def test_random_patterns_decode_exactly(seed):
  # Tile keys must never merge tiles with different contents: decode and compare pair by pair.
  rng = np.random.default_rng(seed)
  patterns = tuple(_random_pattern(rng) for _ in range(int(rng.integers(1, 4))))
  bq, bkv = (int(x) for x in rng.choice([128, 256], size=2))
  length = int(rng.integers(1, 5)) * max(bq, bkv)
  fwd, dkv = splash_masks.mask_infos(patterns, length, length, length, bq, bkv)
  want = np.stack([_pairs(p, length, length) for p in patterns])
  got = splash_masks.dense_mask(fwd, len(patterns), length, length, bq, bkv)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(_dkv_pairs(dkv, len(patterns), length, length, bq, bkv), got)


def test_appended_columns_are_full_for_every_query():
  fwd, dkv = splash_masks.mask_infos((BandPattern(3),), 256, 512, 256, 128, 128)
  got = splash_masks.dense_mask(fwd, 1, 256, 512, 128, 128)[0]
  assert got[:, 256:].all()
  np.testing.assert_array_equal(got[:, :256], masks.band_mask(256, window=3))
  np.testing.assert_array_equal(_dkv_pairs(dkv, 1, 256, 512, 128, 128)[0], got)


def test_rows_with_nothing_allowed_still_run_one_masked_tile():
  layout = np.zeros((4, 4), bool)
  layout[0, 1] = True                                   # query blocks 1..3 see nothing
  fwd, _ = splash_masks.mask_infos(splash_masks.layout_patterns(layout[None], 64, False),
                                   256, 256, 256, 128, 128)
  assert (fwd.block_mask > 0).any(axis=2).all()         # every row of tiles runs a tile
  np.testing.assert_array_equal(splash_masks.dense_mask(fwd, 1, 256, 256, 128, 128)[0],
                                masks.block_layout_mask(layout, 64, 256))


def test_band_mask_at_65k_tokens_is_built_fast_and_small():
  # 8 heads, per-head dilation, window 256, 128 global slots: an L x L NumpyMask would be 4 GB
  # per head and splash's process_mask would slice 8 * 512 * 513 tiles in Python.
  length = 65536
  patterns = tuple(BandPattern(256, d) for d in (1, 1, 2, 2, 4, 4, 8, 8))
  build = splash_masks.mask_infos.__wrapped__                 # bypass the cache
  tracemalloc.start()
  start = time.perf_counter()
  fwd, dkv = build(patterns, length, length + 128, length, 128, 128)
  seconds = time.perf_counter() - start
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert seconds < 10, seconds
  assert peak < 200e6, peak
  assert fwd.block_mask.shape == (8, 512, 34)           # 33 band tiles + the global column
  assert fwd.partial_mask_blocks.shape[0] < 64


def test_band_front_traces_at_65k_tokens_without_dense_masks():
  # The whole forward and backward, traced (not run): shapes come back and the traced heap
  # stays far below one L x L mask.
  length = 65536
  q = jax.ShapeDtypeStruct((1, length, 8, 64), jnp.bfloat16)
  glob = jax.ShapeDtypeStruct((1, length), jnp.bool_)

  def loss(q, glob):
    out = splash.band_attention(q, q, q, window=256, dilation=(1, 1, 2, 2, 4, 4, 8, 8),
                                global_mask=glob, max_global=64, interpret=True)
    return out.astype(jnp.float32).sum()

  splash_masks.mask_infos.cache_clear()
  tracemalloc.start()
  grad = jax.eval_shape(jax.grad(loss), q, glob)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert grad.shape == q.shape
  assert peak < 200e6, peak


def test_masks_are_cached_per_configuration():
  patterns = (BandPattern(7, 2),) * 2
  a = splash_masks.mask_infos(patterns, 256, 256, 256, 128, 128)
  assert splash_masks.mask_infos((BandPattern(7, 2),) * 2, 256, 256, 256, 128, 128) is a


# --- Kernels (interpret mode) against the dense reference. ---

def _inputs(rng, b, length, h, d, dtype=jnp.float32):
  return [jnp.asarray(rng.normal(size=(b, length, h, d)), dtype) for _ in range(4)]


def _key_mask(rng, b, length):
  lengths = rng.integers(1, length + 1, size=b)
  lengths[-1] = 0                                       # an all-padding row
  return jnp.asarray(np.arange(length)[None] < lengths[:, None])


def _out_and_grads(fn, q, k, v, ct):
  out, vjp = jax.vjp(fn, q, k, v)
  return dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(ct))))


def _reference(q, k, v, ct, *, mask=None, causal=False, key_mask=None):
  """The dense reference's output and gradients: one jitted program, not op-by-op dispatch."""
  dense = lambda q, k, v: attention.dot_product_attention(q, k, v, mask=mask, causal=causal,
                                                          key_mask=key_mask)
  return jax.jit(lambda q, k, v, ct: _out_and_grads(dense, q, k, v, ct))(q, k, v, ct)


def _check(fast, mask, q, k, v, ct, key_mask, *, causal=False, atol=1e-5):
  got = jax.jit(lambda q, k, v, ct: _out_and_grads(fast, q, k, v, ct))(q, k, v, ct)
  ref = _reference(q, k, v, ct, mask=mask, causal=causal, key_mask=key_mask)
  chex.assert_shape(got["out"], q.shape[:3] + v.shape[3:])
  assert got["out"].dtype == q.dtype
  chex.assert_trees_all_close(got, ref, atol=atol, rtol=atol)
  if key_mask is not None:                              # padded queries output exactly 0
    assert np.all(np.asarray(got["out"])[~np.asarray(key_mask)] == 0)


def _rng(*case):
  return np.random.default_rng(zlib.crc32(repr(case).encode()))


BAND_CASES = [  # (length, heads, window, dilation, causal, globals, padding)
    (130, 3, 5, (1, 2, 3), False, True, True),          # per-head dilation, globals, padding
    (37, 2, 4, 2, True, False, True),                   # causal, dilated, < one tile
]
# The band's kernel paths beyond BAND_CASES: no key mask (with the public causal LocalMask, a
# window across tiles). The exhaustive ones repeat paths of these and BAND_CASES (globals,
# padding, per-head dilation, causal, under a tile); their tile masks are checked pair by pair
# above at every shape.
SLOW_BAND_CASES = [
    (257, 2, 200, 1, True, False, False),
    pytest.param((5, 1, 3, 1, False, True, True), marks=pytest.mark.exhaustive),
    pytest.param((300, 4, 20, (1, 2, 4, 8), False, True, False), marks=pytest.mark.exhaustive),
    pytest.param((300, 5, 9, (3, 1, 1, 2, 5), True, False, True), marks=pytest.mark.exhaustive),
    pytest.param((130, 2, 0, 1, False, True, True), marks=pytest.mark.exhaustive),
]


def _band_case(case, dtype=jnp.float32, atol=1e-5):
  length, h, window, dilation, causal, use_global, padding = case
  rng = _rng(*case)
  q, k, v, ct = _inputs(rng, 2, length, h, 8, dtype)
  key_mask = _key_mask(rng, 2, length) if padding else None
  glob = jnp.asarray(rng.random((2, length)) < 0.1) if use_global else None
  mask = masks.longformer_mask(length, window=window, dilation=dilation, causal=causal,
                               global_mask=glob, key_mask=key_mask, num_heads=h)
  fast = lambda q, k, v: splash.band_attention(q, k, v, window=window, dilation=dilation,
                                               causal=causal, global_mask=glob,
                                               key_mask=key_mask)
  _check(fast, mask, q, k, v, ct, key_mask, atol=atol)


@pytest.mark.parametrize("case", BAND_CASES, ids=str)
def test_band(case):
  _band_case(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_BAND_CASES, ids=str)
def test_band_more(case):
  _band_case(case)


def test_band_bfloat16():
  _band_case((130, 3, 5, (1, 2, 3), False, True, True), jnp.bfloat16, atol=3e-2)


def _block_case(name, length, h, causal, padding, **args):
  rng = _rng(name, length, h, causal, padding, sorted(args.items()))
  q, k, v, ct = _inputs(rng, 2, length, h, 8)
  key_mask = _key_mask(rng, 2, length) if padding else None
  if name == "bigbird":
    mask = masks.bigbird_mask(length, num_heads=h, **args)
    fast = lambda q, k, v: splash.bigbird_attention(q, k, v, key_mask=key_mask, **args)
  elif name == "sparse":
    if args["pattern"] == "strided":
      mask = masks.strided_mask(length, stride=args["stride"], causal=causal)
    else:
      mask = masks.fixed_mask(length, stride=args["stride"], summary_width=args["summary_width"],
                              causal=causal, num_heads=h)
    fast = lambda q, k, v: splash.sparse_attention(q, k, v, causal=causal, key_mask=key_mask,
                                                   **args)
  elif name == "block_local":
    mask = masks.block_local_mask(length, causal=causal, **args)
    fast = lambda q, k, v: splash.block_local_attention(q, k, v, causal=causal,
                                                        key_mask=key_mask, **args)
  elif name == "block_sparse":
    mask = masks.block_layout_mask(args["layout"], args["block_size"], length)
    mask = mask & masks.causal_mask(length) if causal else mask
    fast = lambda q, k, v: splash.block_sparse_attention(q, k, v, causal=causal,
                                                         key_mask=key_mask, **args)
  else:
    mask = None
    fast = lambda q, k, v: splash.dot_product_attention(q, k, v, causal=causal,
                                                        key_mask=key_mask)
  _check(fast, mask, q, k, v, ct, key_mask, causal=causal and name == "dot_product")


def _layout(seed, h, nb):
  layout = np.random.default_rng(seed).random((h, nb, nb)) < 0.35
  layout[:, 1] = False                                  # a query block that sees nothing
  return layout


BLOCK_CASES = [  # (name, length, heads, causal, padding, args)
    ("bigbird", 130, 3, False, True, dict(block_size=16, num_global_blocks=2,
                                          num_random_blocks=2, seed=4)),
    ("sparse", 130, 3, True, True, dict(pattern="fixed", stride=16, summary_width=4)),
    ("sparse", 37, 2, False, False, dict(pattern="strided", stride=5)),
    ("block_local", 5, 1, True, True, dict(block_size=4)),
    ("block_sparse", 130, 3, True, True, dict(layout=_layout(0, 3, 5), block_size=32)),
    ("dot_product", 37, 2, True, True, {}),
]
# Beyond BLOCK_CASES: block_sparse with one layout for every head, not causal (the other branch
# of the queries it keeps). The exhaustive ones take paths of these, BLOCK_CASES and the
# cross-attention cases (non-causal dense: splash's FullMask) again at other shapes.
_EXHAUSTIVE_BLOCK_CASES = [
    ("bigbird", 300, 2, False, False, dict(block_size=37, num_global_blocks=3,
                                           num_random_blocks=3, seed=0)),
    ("sparse", 300, 3, False, True, dict(pattern="fixed", stride=48, summary_width=8)),
    ("sparse", 300, 2, True, True, dict(pattern="strided", stride=19)),
    ("block_local", 130, 3, False, True, dict(block_size=37)),
    ("block_sparse", 300, 2, False, True, dict(layout=_layout(1, 2, 10), block_size=30)),
    ("dot_product", 130, 3, False, True, {}),
]
SLOW_BLOCK_CASES = [
    ("block_sparse", 130, 2, False, False, dict(layout=_layout(2, 2, 5)[0], block_size=32)),
    *(pytest.param(c, marks=pytest.mark.exhaustive, id=f"{c[0]}-{c[1]}")
      for c in _EXHAUSTIVE_BLOCK_CASES),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_block_patterns(case):
  name, length, h, causal, padding, args = case
  _block_case(name, length, h, causal, padding, **args)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_BLOCK_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_block_patterns_more(case):
  name, length, h, causal, padding, args = case
  _block_case(name, length, h, causal, padding, **args)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_dot_product_cross_attention(causal):
  rng = _rng("cross", causal)
  q, _, _, ct = _inputs(rng, 2, 37, 2, 8)
  k, v = _inputs(rng, 2, 140, 2, 8)[:2]
  key_mask = _key_mask(rng, 2, 140)
  fast = lambda q, k, v: splash.dot_product_attention(q, k, v, causal=causal,
                                                      key_mask=key_mask)
  got = jax.jit(lambda q, k, v, ct: _out_and_grads(fast, q, k, v, ct))(q, k, v, ct)
  ref = _reference(q, k, v, ct, causal=causal, key_mask=key_mask)
  chex.assert_trees_all_close(got, ref, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got["out"])[1] == 0)         # no real key in the second row


# --- Refusals. ---

def test_causal_band_with_global_tokens_is_refused():
  q = jnp.zeros((1, 16, 1, 4))
  with pytest.raises(ValueError, match="implementation='xla'"):
    splash.band_attention(q, q, q, window=2, causal=True, global_mask=jnp.ones((1, 16), bool))


def test_traced_global_mask_needs_max_global():
  q = jnp.zeros((1, 16, 1, 4))
  with pytest.raises(ValueError, match="max_global"):
    jax.jit(lambda g: splash.band_attention(q, q, q, window=2, global_mask=g))(
        jnp.ones((1, 16), bool))


@pytest.mark.parametrize("tiles", [dict(block_q=100), dict(block_kv=64), dict(block_q=0)])
def test_tiles_must_be_lane_multiples(tiles):
  q = jnp.zeros((1, 16, 1, 4))
  with pytest.raises(ValueError, match="block_"):
    splash.block_local_attention(q, q, q, block_size=4, **tiles)


def test_block_sparse_layout_shape_is_checked():
  q = jnp.zeros((1, 16, 1, 4))
  with pytest.raises(ValueError, match="ceil"):
    splash.block_sparse_attention(q, q, q, layout=np.ones((3, 3), bool), block_size=4)


# --- Tiles (splash's BlockSizes) as parameters. ---

# Tiles smaller than the sequence, forward and dK/dV tiles different, compute sub-tiles below
# their tiles: several grid steps per row, the dK/dV MaskInfo built at its own tiles.
SPLIT_TILES = dict(block_q=128, block_kv=256, block_kv_compute=128, block_q_dkv=256,
                   block_kv_dkv=128, block_kv_dkv_compute=128)


@pytest.mark.parametrize("fused", [False, True])
def test_band_with_split_tiles(fused):
  length, h, window, dilation = 260, 2, 70, (1, 2)       # not a multiple of any tile
  rng = _rng("tiles", fused)
  q, k, v, ct = _inputs(rng, 2, length, h, 8)
  key_mask = _key_mask(rng, 2, length)
  glob = jnp.asarray(rng.random((2, length)) < 0.05)
  mask = masks.longformer_mask(length, window=window, dilation=dilation, global_mask=glob,
                               key_mask=key_mask, num_heads=h)
  tiles = dict(SPLIT_TILES, use_fused_bwd_kernel=fused)
  fast = lambda q, k, v: splash.band_attention(q, k, v, window=window, dilation=dilation,
                                               global_mask=glob, key_mask=key_mask, tiles=tiles)
  _check(fast, mask, q, k, v, ct, key_mask)


def test_causal_dense_with_split_tiles():
  rng = _rng("tiles-dense")
  q, k, v, ct = _inputs(rng, 1, 260, 1, 8)
  fast = lambda q, k, v: splash.dot_product_attention(
      q, k, v, causal=True, tiles=dict(SPLIT_TILES, use_fused_bwd_kernel=True))
  _check(fast, None, q, k, v, ct, None, causal=True)


def test_tiles_reach_the_kernel():
  t = splash.splash_tiles(dict(SPLIT_TILES, use_fused_bwd_kernel=False))
  sizes = t.block_sizes()
  for name, value in SPLIT_TILES.items():
    assert getattr(sizes, name) == value, name
  assert (sizes.block_q_dq, sizes.block_kv_dq, sizes.use_fused_bwd_kernel) == (128, 256, False)
  fused = splash.splash_tiles(dict(SPLIT_TILES, use_fused_bwd_kernel=True))
  assert fused.block_sizes().use_fused_bwd_kernel and fused.block_sizes().block_q_dq is None
  patterns = (BandPattern(70, 1),)
  kernel = splash._kernel(patterns, 512, 512, 512, fused, True)
  assert kernel.dq_mask_info is None
  want = splash_masks.mask_infos(patterns, 512, 512, 512, 256, 128, False)[1]   # not shrunk
  np.testing.assert_array_equal(kernel.dkv_mask_info.block_mask, want.block_mask)
  kernel = splash._kernel(patterns, 512, 512, 512, t, True)
  np.testing.assert_array_equal(kernel.dq_mask_info.block_mask, kernel.fwd_mask_info.block_mask)


def test_tile_defaults_and_fit():
  t = splash.splash_tiles()
  assert dataclasses.asdict(t) == splash.DEFAULT_TILES
  assert splash.splash_tiles(block_q=256).block_q == 256
  small = t.fit(37, 300)                                 # cut to the lane-padded lengths
  assert (small.block_q, small.block_kv, small.block_kv_compute) == (128, 384, 384)
  assert (small.block_q_dkv, small.block_kv_dkv) == (128, 384)
  odd = splash.Tiles(block_kv=512, block_kv_compute=256).fit(128, 300)
  assert (odd.block_kv, odd.block_kv_compute) == (384, 384)   # 256 does not divide 384
  assert splash.Tiles(block_kv=512, block_kv_compute=256).fit(128, 600).block_kv_compute == 256


@pytest.mark.parametrize("config,match", [
    (dict(block_q=100), "block_q must be a multiple of 128.*pass 128"),
    (dict(block_kv_dkv=0), "block_kv_dkv must be a positive multiple"),
    (dict(block_kv_compute=True), "block_kv_compute must be a positive multiple"),
    (dict(block_kv=256, block_kv_compute=384), "block_kv_compute = 384 must divide block_kv"),
    (dict(block_kv_dkv=384, block_kv_dkv_compute=256), "block_kv_dkv_compute = 256 must div"),
    (dict(use_fused_bwd_kernel="yes"), "use_fused_bwd_kernel must be True or False"),
    (dict(block_q_dq=128), "block_q_dq is not a splash tile field; valid: block_q"),
])
def test_bad_tiles_are_refused_in_one_line(config, match):
  with pytest.raises(ValueError, match=match) as info:
    splash.splash_tiles(config)
  assert "\n" not in str(info.value)


def test_config_tiles_are_the_defaults_and_checked():
  from configs import common
  from lra import schema
  config = ml_collections.ConfigDict(dict(model=common.model_defaults()))
  assert dict(config.model.splash) == splash.DEFAULT_TILES
  schema.check(config)
  assert splash.splash_tiles(config.model.splash) == splash.Tiles()
  config.model.splash.block_kv_compute = 384
  with pytest.raises(ValueError, match=r"^config\.model\.splash\.block_kv_compute = 384 must "
                                       r"divide block_kv = 512"):
    schema.check(config)


# --- Splash's public mask classes where they express the pattern. ---

@pytest.mark.parametrize("patterns, classes", [
    ((DensePattern(False),) * 2, {"FullMask"}),
    ((DensePattern(True),), {"CausalMask"}),
    ((BandPattern(37, 1), BandPattern(128, 1, True)), {"LocalMask"}),
])
def test_public_masks_equal_the_kind_masks(patterns, classes):
  length = 384
  mask = splash_masks.public_mask(patterns, length, length, length)
  assert {type(m).__name__ for m in mask.masks} == classes
  for p, m in zip(patterns, mask.masks):
    np.testing.assert_array_equal(m[:, :], _pairs(p, length, length))
  # the band's edges: w away is in, w + 1 out
  band = splash_masks.public_mask((BandPattern(37, 1),), length, length, length).masks[0]
  row = band[100:101, :][0]
  assert row[137] and row[63] and not row[138] and not row[62]


def test_patterns_without_a_public_class_keep_their_own_mask_info():
  assert splash_masks.public_mask((BandPattern(5, 2),), 256, 256, 256) is None
  assert splash_masks.public_mask((BandPattern(5, 1), BandPattern(5, 2)), 256, 256, 256) is None
  assert splash_masks.public_mask((BandPattern(5, 1),), 256, 384, 256) is None   # global columns
  assert splash_masks.public_mask((StridedPattern(19),), 256, 256, 256) is None
  kernel = splash._kernel((BandPattern(5, 1),) * 2, 256, 256, 256, splash.Tiles().fit(256, 256),
                          True)
  assert kernel.fwd_mask_info.partial_mask_blocks is None        # the mask computed in-kernel


def test_undilated_band_on_the_public_mask():
  _band_case((140, 1, 30, 1, False, False, True))               # padded, not a tile multiple
