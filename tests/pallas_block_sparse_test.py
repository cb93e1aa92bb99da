"""The Pallas block-sparse kernel (interpreted here) against dot_product_attention with each kind's
mask from masks.py: BigBird (per-head random blocks), strided and fixed sparse, block-local and
block-sparse layouts; outputs and gradients, on lengths that do not fit the tiles, with padding
and causality. Also the tile lists decoded back to pairs, and a planted slip that must fail."""

import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention
from attention import masks, pallas_block_sparse, splash_masks
from attention import pallas_block_sparse_kernel as kernel

KINDS = ("bigbird", "sparse", "block_local", "block_sparse")


def _inputs(rng, b, length, h, d, dtype=jnp.float32):
  return [jnp.asarray(rng.normal(size=(b, length, h, d)), dtype) for _ in range(4)]


def _key_mask(rng, b, length, all_padding_row=True):
  lengths = rng.integers(1, length + 1, size=b)
  if all_padding_row and b > 1:
    lengths[-1] = 0
  return jnp.asarray(np.arange(length)[None] < lengths[:, None])


def _out_and_grads(fn, q, k, v, ct):
  """{out, dq, dk, dv} of `fn` at (q, k, v) for the output cotangent `ct`, jitted."""
  def both(q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(ct))))
  return jax.jit(both)(q, k, v, ct)


def _kind_mask(name, length, h, causal, args):
  """bool `[H|1, L, L]`: the kind's pairs from masks.py (the reference's own description)."""
  if name == "bigbird":
    return masks.bigbird_mask(length, num_heads=h, **args)
  if name == "sparse":
    if args["pattern"] == "strided":
      return masks.strided_mask(length, stride=args["stride"], causal=causal)[None]
    return masks.fixed_mask(length, stride=args["stride"], summary_width=args["summary_width"],
                            causal=causal, num_heads=h)
  if name == "block_local":
    return masks.block_local_mask(length, block_size=args["block_size"], causal=causal)[None]
  mask = masks.block_layout_mask(args["layout"], args["block_size"], length)
  mask = mask if mask.ndim == 3 else mask[None]
  return mask & masks.causal_mask(length) if causal else mask


def _fast(name, causal, key_mask, args, tiles):
  fn = getattr(pallas_block_sparse, {"bigbird": "bigbird_attention",
                                     "sparse": "sparse_attention",
                                     "block_local": "block_local_attention",
                                     "block_sparse": "block_sparse_attention"}[name])
  kw = dict(args, key_mask=key_mask, **tiles)
  if name != "bigbird":
    kw["causal"] = causal
  return lambda q, k, v: fn(q, k, v, **kw)


def _check(name, q, k, v, ct, *, causal=False, key_mask=None, args, tiles=None, atol=1e-5):
  length, h = q.shape[1], q.shape[2]
  mask = _kind_mask(name, length, h, causal, args)
  with jax.default_matmul_precision("highest"):
    got = _out_and_grads(_fast(name, causal, key_mask, args, tiles or {}), q, k, v, ct)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
    want = _out_and_grads(lambda q, k, v: attention.dot_product_attention(
        q, k, v, mask=mask, key_mask=key_mask), *f32)
  chex.assert_shape(got["out"], q.shape[:3] + v.shape[3:])
  chex.assert_type(list(got.values()), q.dtype)
  got = jax.tree.map(lambda x: x.astype(jnp.float32), got)
  chex.assert_trees_all_close(got, want, atol=atol, rtol=atol)
  out = np.asarray(got["out"])
  if key_mask is not None:                              # padded queries output exactly 0
    assert np.all(out[~np.asarray(key_mask)] == 0)
  return out


def _layout(seed, h, nb, empty_row=True):
  layout = np.random.default_rng(seed).random((h, nb, nb)) < 0.35
  if empty_row:
    layout[:, 1] = False                                # a query block that sees nothing
  return layout


def _rng(*case):
  return np.random.default_rng(zlib.crc32(repr(case).encode()))


# (name, length, heads, head_dim, causal, padding, args, tiles)
CASES = [
    # per-head random blocks, a block (20) that does not divide the tiles, the last one partial
    ("bigbird", 70, 3, 8, False, True, dict(block_size=20, num_global_blocks=2,
                                             num_random_blocks=1, seed=4), dict(block_k=32)),
    # per-head summary offsets, causal, bq != bk
    ("sparse", 61, 2, 16, True, True, dict(pattern="fixed", stride=12, summary_width=3),
     dict(block_q=32, block_k=16)),
    ("sparse", 37, 2, 8, False, False, dict(pattern="strided", stride=5), {}),
    # strided in two parts merged by log-sum-exp: causal, padding (37 real tokens in the first
    # example), classes of 11 in 16-tiles
    ("sparse", 43, 2, 8, True, True, dict(pattern="strided", stride=4), {}),
    ("block_local", 5, 1, 8, True, True, dict(block_size=4), {}),        # shorter than a tile
    # per-head layouts with an empty query block, causal, padding
    ("block_sparse", 70, 2, 8, True, True, dict(layout=_layout(0, 2, 5), block_size=16),
     dict(block_q=16, block_k=16)),
]

SLOW_CASES = [
    ("bigbird", 130, 2, 40, False, False, dict(block_size=37, num_global_blocks=3,
                                               num_random_blocks=2, seed=0), {}),
    ("bigbird", 96, 4, 16, False, True, dict(block_size=16, num_global_blocks=2,
                                             num_random_blocks=2, seed=7), dict(block_q=32)),
    ("sparse", 130, 3, 8, False, True, dict(pattern="fixed", stride=24, summary_width=4),
     dict(block_q=16, block_k=32)),
    ("sparse", 100, 2, 8, True, True, dict(pattern="strided", stride=11), dict(block_q=16,
                                                                               block_k=16)),
    ("block_local", 130, 3, 8, False, True, dict(block_size=37), {}),
    ("block_local", 90, 2, 32, True, False, dict(block_size=16), dict(block_q=16, block_k=16)),
    ("block_sparse", 130, 2, 8, False, True, dict(layout=_layout(1, 2, 5)[0], block_size=30),
     dict(block_k=16)),
    ("block_sparse", 100, 3, 16, True, False, dict(layout=_layout(2, 3, 4, empty_row=False),
                                                    block_size=25), dict(block_q=32)),
]


def _run_case(case, dtype=jnp.float32, atol=1e-5):
  name, length, h, d, causal, padding, args, tiles = case
  rng = _rng(name, length, h, d, causal, padding, sorted(tiles.items()))
  q, k, v, ct = _inputs(rng, 2, length, h, d, dtype)
  key_mask = _key_mask(rng, 2, length) if padding else None
  return _check(name, q, k, v, ct, causal=causal, key_mask=key_mask, args=args, tiles=tiles,
                atol=atol)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_matches_dense_reference(case):
  _run_case(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_matches_dense_reference_more(case):
  _run_case(case)


def test_bfloat16_within_bfloat16_tolerance():
  _run_case(("bigbird", 70, 3, 16, False, True, dict(block_size=16, num_global_blocks=2,
                                                       num_random_blocks=2, seed=1), {}),
            jnp.bfloat16, atol=3e-2)


@pytest.mark.slow
def test_bfloat16_causal_fixed_within_bfloat16_tolerance():
  _run_case(("sparse", 130, 2, 32, True, True, dict(pattern="fixed", stride=32,
                                                      summary_width=4), {}),
            jnp.bfloat16, atol=3e-2)


def test_a_query_block_with_no_allowed_key_outputs_zero():
  rng = np.random.default_rng(3)
  layout = np.zeros((3, 3), bool)
  layout[0, 2] = layout[2, 0] = True                    # query block 1 sees nothing
  q, k, v, ct = _inputs(rng, 1, 48, 1, 8)
  out = _check("block_sparse", q, k, v, ct, args=dict(layout=layout, block_size=16))
  assert np.all(out[0, 16:32] == 0) and np.all(out[0, :16] != 0)


def _row_kinds(lists, length, bq, bk):
  """The (has full tiles, has partial tiles) pairs of the forward rows and of the transposed
  rows, over every head."""
  padded = pallas_block_sparse.padded_length(length, bq, bk)
  kinds = []
  for ptr, n in ((lists.fwd_ptr, padded // bq), (lists.bwd_ptr, padded // bk)):
    segments = np.diff(ptr[:, :2 * n + 1], axis=-1).reshape(-1, 2) > 0
    kinds.append({tuple(bool(x) for x in row) for row in segments})
  return kinds


@pytest.mark.parametrize("causal,tiles", [(True, (16, 16)), (False, (16, 32))])
def test_full_and_partial_loops(causal, tiles):
  # Per-head layouts (blocks of 16, length 70) whose query tiles, and key tiles, include ones
  # with only full tiles (the loop without the table), only partial ones, both, and none.
  # Key 36 to 43 of the first example are masked inside tiles that are full (a real query
  # sees them there); the second example's keys 60.. are padding, 70.. the sequence end.
  bq, bk = tiles
  layout = np.zeros((2, 5, 5), bool)
  for head, rows in enumerate([[[0], [], [0], [0, 2, 3], [1, 4]],
                               [[0], [0, 1], [], [1], [0, 2, 3]]]):
    for i, cols in enumerate(rows):
      layout[head, i, cols] = True
  lists = pallas_block_sparse.tile_lists(splash_masks.layout_patterns(layout, 16, causal), 70,
                                         bq, bk)
  every = {(True, False), (False, True), (True, True), (False, False)}
  assert _row_kinds(lists, 70, bq, bk) == [every, every]
  q, k, v, ct = _inputs(_rng("loops", causal, tiles), 2, 70, 2, 8)
  key_mask = np.ones((2, 70), bool)
  key_mask[0, 36:44] = key_mask[1, 60:] = False
  _check("block_sparse", q, k, v, ct, causal=causal, key_mask=jnp.asarray(key_mask),
         args=dict(layout=layout, block_size=16), tiles=dict(block_q=bq, block_k=bk))


# --- The tile lists. ---

def _rows(ptr, idx, tid, head):
  """[(tile, [(listed tile, table entry), ...]), ...] of one head's lists; checks that each
  row lists its full tiles (entry 0) first, then its partial ones, each in increasing order."""
  h = min(head, ptr.shape[0] - 1)
  rows = []
  for i in range((ptr.shape[1] - 1) // 2):
    lo, mid, hi = ptr[h, 2 * i:2 * i + 3]
    assert lo <= mid <= hi and np.all(tid[h, lo:mid] == 0) and np.all(tid[h, mid:hi] > 0)
    assert np.all(np.diff(idx[h, lo:mid]) > 0) and np.all(np.diff(idx[h, mid:hi]) > 0)
    rows.append((i, list(zip(idx[h, lo:hi], tid[h, lo:hi]))))
  return rows


def _decode(lists, h, length, bq, bk):
  """bool `[H, Lp, Lp]` from the forward lists and, separately, from the transposed lists."""
  fwd = np.zeros((h, length, length), bool)
  bwd = np.zeros((h, length, length), bool)
  for head in range(h):
    for qi, row in _rows(*lists[:3], head):
      for ki, t in row:
        fwd[head, qi * bq:(qi + 1) * bq, ki * bk:(ki + 1) * bk] |= lists.tiles[t] != 0
    for ki, col in _rows(*lists[3:6], head):
      for qi, t in col:
        bwd[head, qi * bq:(qi + 1) * bq, ki * bk:(ki + 1) * bk] |= lists.tiles[t] != 0
  return fwd, bwd


@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (16, 64)])
def test_tile_lists_decode_to_the_kind_mask(tiles):
  bq, bk = tiles
  length, h = 128, 3
  layout = masks.bigbird_block_pattern(7, num_global_blocks=2, num_random_blocks=2, seed=2,
                                       num_heads=h)
  cases = [(splash_masks.layout_patterns(layout, 21, False),
            masks.bigbird_mask(length, block_size=21, num_global_blocks=2, num_random_blocks=2,
                               seed=2, num_heads=h)),
           (tuple(splash_masks.FixedPattern(20, 4, lo, True) for lo in (16, 12, 8)),
            masks.fixed_mask(length, stride=20, summary_width=4, causal=True, num_heads=h)),
           ((splash_masks.StridedPattern(9, False),) * h, masks.strided_mask(length, stride=9))]
  for patterns, want in cases:
    lists = pallas_block_sparse.tile_lists(patterns, length, bq, bk)
    assert lists.fwd_ptr.shape[0] == (1 if len(set(patterns)) == 1 else h)
    for x in lists[:6]:
      assert x.shape[-1] & (x.shape[-1] - 1) == 0       # Triton block sides: powers of two
    assert np.all(lists.tiles[0] == 1) and len(lists.tiles) & (len(lists.tiles) - 1) == 0
    fwd, bwd = _decode(lists, h, length, bq, bk)
    np.testing.assert_array_equal(fwd, np.broadcast_to(want, fwd.shape))
    np.testing.assert_array_equal(bwd, fwd)


def test_lists_hold_the_visited_tiles_only():
  layout = np.ones((5, 5), bool)
  layout[1] = False                                     # query block 1 (16..31) sees nothing
  layout[2:, 2:] = False
  layout[2:, 2] = True                                  # blocks 2.. see blocks 0, 1, 2
  patterns = splash_masks.layout_patterns(layout[None], 16, False)
  lists = pallas_block_sparse.tile_lists(patterns, 70, 16, 16)    # padded to 80: 5 tiles
  # (full, partial) per query tile; key tile 4 is full (keys 70.. are the key validity's).
  np.testing.assert_array_equal(np.diff(lists.fwd_ptr[0, :11]), [5, 0, 0, 0, 3, 0, 3, 0, 3, 0])
  assert lists.fwd_ptr[0, -1] == 14 and lists.fwd_idx.shape == (1, 16)
  np.testing.assert_array_equal(lists.fwd_idx[0, :5], [0, 1, 2, 3, 4])
  # A global query tile lists every key tile; the others do not grow to its length.
  lists = pallas_block_sparse.tile_lists((splash_masks.StridedPattern(3),), 70, 64, 16)
  np.testing.assert_array_equal(np.diff(lists.bwd_ptr[0, :17]).reshape(8, 2),
                                [[0, 2]] * 5 + [[0, 0]] * 3)


def test_a_skipped_tile_is_caught():
  # The planted slip: one visited key tile dropped from one query tile's list. The comparison
  # of _check must see it (the fast cases would then fail).
  rng = np.random.default_rng(5)
  length, h = 64, 2
  q, k, v, ct = _inputs(rng, 1, length, h, 16)
  patterns = (splash_masks.BlockLocalPattern(32, False),) * h
  lists = pallas_block_sparse.tile_lists(patterns, length, 16, 16)
  ptr, idx, tid = (x.copy() for x in lists[:3])
  entry = ptr[0, 4] + 1                                 # query tile 2's second key tile (3)
  assert idx[0, entry] == 3 and ptr[0, 5] == entry + 1  # a full one
  idx[0, entry:-1], tid[0, entry:-1] = idx[0, entry + 1:], tid[0, entry + 1:]
  ptr[0, 5:] -= 1
  cfg = kernel.Tiles(block_q=16, block_k=16, heads=h, list_heads=1, scale=0.25, interpret=True)
  ok = jnp.ones((1, length), jnp.int32)

  def attend(fwd):
    args = [jnp.asarray(x) for x in (*fwd, *lists[3:])]
    return lambda q, k, v: kernel.attend(cfg, q, k, v, ok, *args)

  mask = masks.block_local_mask(length, block_size=32)
  want = _out_and_grads(lambda q, k, v: attention.dot_product_attention(q, k, v, mask=mask),
                        q, k, v, ct)
  chex.assert_trees_all_close(_out_and_grads(attend(lists[:3]), q, k, v, ct), want,
                              atol=1e-5, rtol=1e-5)
  slipped = _out_and_grads(attend((ptr, idx, tid)), q, k, v, ct)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(slipped, want, atol=1e-5, rtol=1e-5)
  wrong = np.abs(np.asarray(slipped["out"] - want["out"])).max(axis=-1)[0]   # [L, H]
  assert wrong[32:48].min() > 1e-3 and wrong[:32].max() < 1e-5 and wrong[48:].max() < 1e-5


# --- The strided pattern's two parts (log-sum-exp entry, tiles that stay full). ---

def test_attend_with_lse_gives_the_dense_log_sum_exp_and_its_gradient():
  # Out and lse of the near part (0 < i - j < 3, so query 0 sees nothing: 0 and NEG_INF), and
  # the gradients of a loss on both: the lse's cotangent must reach q and k.
  rng = np.random.default_rng(8)
  length, h, d = 40, 2, 16
  q, k, v, ct = _inputs(rng, 1, length, h, d)
  ct_lse = jnp.asarray(rng.normal(size=(1, length, h)), jnp.float32)
  pattern = pallas_block_sparse.NearPattern(3, causal=True)
  rel = np.arange(length)[:, None] - np.arange(length)[None, :]
  allowed = np.asarray(pattern.allowed(rel, 0)) & np.ones((length, length), bool)
  cfg = dict(block_q=16, block_k=16, num_warps=4, num_stages=2, interpret=True)
  ok = jnp.ones((1, length), bool)

  def fast(q, k, v):
    out, lse = pallas_block_sparse._with_lse(q, k, v, ok, (pattern,) * h, **cfg)
    return jnp.sum(out * ct) + jnp.sum(jnp.where(lse > -1e29, lse, 0.0) * ct_lse), (out, lse)

  def dense(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    s = jnp.where(allowed, s, -1e30)
    lse = jax.nn.logsumexp(s, axis=-1).transpose(0, 2, 1)
    p = jnp.where(allowed, jnp.exp(s - lse.transpose(0, 2, 1)[..., None]), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    lse = jnp.where(allowed.any(-1)[None, :, None], lse, -1e30)
    return jnp.sum(out * ct) + jnp.sum(jnp.where(lse > -1e29, lse, 0.0) * ct_lse), (out, lse)

  with jax.default_matmul_precision("highest"):
    got = jax.jit(jax.grad(fast, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want = jax.jit(jax.grad(dense, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got[1][1])[0, 0] == -1e30) and np.all(np.asarray(got[1][0])[0, 0] == 0)


def _full_share(calls):
  """Per recorded `tile_lists` call: allowed pairs / pairs of the tiles the kernel visits."""
  shares = []
  for patterns, length, bq, bk in calls:
    lists = pallas_block_sparse.tile_lists(patterns, length, bq, bk)
    tid = lists.fwd_tid[0, :lists.fwd_ptr[0, -1]]
    shares.append(lists.tiles[tid].astype(bool).sum() / (tid.size * bq * bk))
  return shares


def _strided_tile_lists(monkeypatch, shape, dtype, **kwargs) -> list[tuple]:
  """The arguments of every `tile_lists` call of the Pallas strided sparse pattern on `shape`
  (traced only, nothing runs)."""
  calls = []
  real = pallas_block_sparse.tile_lists
  monkeypatch.setattr(pallas_block_sparse, "tile_lists",
                      lambda *a: calls.append(a) or real(*a))
  q = jax.ShapeDtypeStruct(shape, dtype)
  jax.eval_shape(lambda q: pallas_block_sparse.sparse_attention(
      q, q, q, pattern="strided", interpret=True, **kwargs), q)
  return calls


@pytest.mark.parametrize("causal", [False, True])
def test_strided_classes_fill_whole_tiles(monkeypatch, causal):
  # Length 203, stride 4: classes of 51 and 50 tokens, each padded to 64 (whole 16-tiles), so
  # the class part visits full tiles only, and one partial tile a row when causal (its
  # diagonal). Classes of 51 in token order would leave partial tiles at their edges.
  calls = _strided_tile_lists(monkeypatch, (1, 203, 1, 8), jnp.float32, stride=4,
                              causal=causal, block_q=16, block_k=16)
  classes = [c for c in calls if isinstance(c[0][0], splash_masks.BlockLocalPattern)]
  assert len(calls) == 2 and [c[1:] for c in classes] == [(256, 16, 16)]
  lists = pallas_block_sparse.tile_lists(*classes[0])
  segments = np.diff(lists.fwd_ptr[0, :33]).reshape(16, 2)   # (full, partial) per row
  np.testing.assert_array_equal(segments[:, 0], np.arange(16) % 4 if causal else 4)
  np.testing.assert_array_equal(segments[:, 1], int(causal))


# Exhaustive: building and reading the token-order tile table at 16K takes over 20 minutes on
# two CPU cores (past the suite's per-test limit).
@pytest.mark.exhaustive
@pytest.mark.parametrize("causal", [False, True])
def test_strided_tiles_stay_full_at_long_lengths(monkeypatch, causal):
  # In token order a tile far from the diagonal holds one diagonal of stride | (i - j): at 16K
  # with stride 128 and 64-tiles, 1/64 of its pairs. The parts keep every visited tile at
  # least half full (the causal diagonal tiles, the band's edges).
  calls = _strided_tile_lists(monkeypatch, (1, 16384, 1, 64), jnp.bfloat16, stride=128,
                              causal=causal)
  assert [c[2:] for c in calls] == [(64, 64), (64, 64)]
  assert min(_full_share(calls)) >= 0.5
  token_order = (splash_masks.StridedPattern(128, causal),), 16384, 64, 64
  assert _full_share([token_order])[0] < 0.1


# --- Arguments and the GPU lowering. ---

def test_bad_arguments_raise_one_line_errors():
  q = jnp.zeros((1, 8, 1, 16))
  cases = [
      (pallas_block_sparse.block_local_attention, dict(block_size=4, block_q=24), "power of two"),
      (pallas_block_sparse.block_local_attention, dict(block_size=4, block_k=8), "power of two"),
      (pallas_block_sparse.block_local_attention, dict(block_size=4, num_warps=6),
       "num_warps must be a power of two from 1 to 32"),
      (pallas_block_sparse.sparse_attention, dict(pattern="strided", stride=2, num_stages=0),
       "num_stages must be an int from 1 to 8"),
      (pallas_block_sparse.block_local_attention, dict(block_size=0), "block_size"),
      (pallas_block_sparse.sparse_attention, dict(pattern="axial", stride=2), "strided, fixed"),
      (pallas_block_sparse.sparse_attention, dict(pattern="strided", stride=2, summary_width=1),
       "fixed' only"),
      (pallas_block_sparse.bigbird_attention, dict(block_size=4, seed=None), "seed"),
      (pallas_block_sparse.block_sparse_attention,
       dict(layout=np.ones((3, 3), bool), block_size=4), "ceil"),
      (pallas_block_sparse.block_local_attention,
       dict(block_size=4, key_mask=jnp.ones((1, 8))), "boolean"),
  ]
  for fn, kw, pattern in cases:
    with pytest.raises(ValueError, match=pattern):
      fn(q, q, q, **kw)


@pytest.mark.parametrize("dtype,head_dim,name,args", [
    (jnp.bfloat16, 64, "bigbird", dict(block_size=48, num_random_blocks=2, seed=1)),
    (jnp.float32, 40, "sparse", dict(pattern="fixed", stride=40, summary_width=6, causal=True)),
    (jnp.bfloat16, 64, "sparse", dict(pattern="strided", stride=24, causal=True))])
def test_kernels_lower_to_triton_for_a_gpu(dtype, head_dim, name, args):
  # No GPU here, but the Triton lowering runs on any machine: every op of the three kernels must
  # have a Triton lowering rule and every block shape must be one Triton takes.
  rng = np.random.default_rng(6)
  q, k, v, ct = _inputs(rng, 2, 300, 3, head_dim, dtype)

  def loss(q, k, v, key_mask):
    out = getattr(pallas_block_sparse, f"{name}_attention")(q, k, v, key_mask=key_mask,
                                                             interpret=False, **args)
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  text = grad.trace(q, k, v, _key_mask(rng, 2, 300)).lower(
      lowering_platforms=("cuda",)).as_text()
  for name in ("forward", "dq", "dkv"):
    assert f'"pallas_block_sparse_{name}"' in text
  assert text.count("gpu.triton") >= 3


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24))
def test_random_configurations_match_dense_reference(seed):
  rng = np.random.default_rng(seed)
  name = KINDS[seed % 4]
  length, h = int(rng.integers(1, 140)), int(rng.integers(1, 4))
  d = int(rng.choice([8, 16, 40]))
  causal = name != "bigbird" and bool(rng.random() < 0.5)
  if name == "bigbird":
    block = int(rng.integers(4, 40))
    args = dict(block_size=block, num_global_blocks=int(rng.integers(0, 3)),
                num_random_blocks=int(rng.integers(0, 3)), seed=int(rng.integers(0, 100)))
  elif name == "sparse":
    stride = int(rng.integers(1, 40))
    args = dict(pattern="strided", stride=stride) if rng.random() < 0.5 else dict(
        pattern="fixed", stride=stride, summary_width=int(rng.integers(1, stride + 1)))
  elif name == "block_local":
    args = dict(block_size=int(rng.integers(1, 50)))
  else:
    block = int(rng.integers(4, 40))
    nb = -(-length // block)
    args = dict(layout=rng.random((h, nb, nb) if rng.random() < 0.5 else (nb, nb)) < 0.4,
                block_size=block)
  blocks = [None, 16, 32, 64]
  tiles = dict(block_q=blocks[int(rng.integers(0, 4))], block_k=blocks[int(rng.integers(0, 4))])
  q, k, v, ct = _inputs(rng, int(rng.integers(1, 3)), length, h, d)
  key_mask = _key_mask(rng, q.shape[0], length, bool(rng.random() < 0.3)) \
      if rng.random() < 0.6 else None
  _check(name, q, k, v, ct, causal=causal, key_mask=key_mask, args=args, tiles=tiles)
