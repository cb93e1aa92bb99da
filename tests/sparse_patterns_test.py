"""Tests for the Sparse Transformer, BigBird and block-local patterns (masks + fast fronts)."""

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention
from attention import block_sparse_plan, masks, sparse_patterns
from attention.dot_product import dot_product_attention
from attention.sparse_patterns import bigbird_attention, block_local_attention, sparse_attention

TOL = 1e-5


@pytest.fixture(params=[False, True], ids=["assembled", "streamed"])
def stream(request, monkeypatch):
  """Both ways of reading key blocks: assembled before the scan, or streamed inside it (what
  the patterns use at LRA sizes, forced here for every bucket but "all" ones)."""
  monkeypatch.setattr(block_sparse_plan, "STREAM_ROW_ELEMENTS", 0 if request.param else 1 << 40)
  return request.param


def _inputs(rng, b, length, h, d=8):
  return [jnp.asarray(rng.standard_normal((b, length, h, d)), jnp.float32) for _ in range(3)]


def _key_mask(b, length, pad):
  if not pad:
    return None
  km = np.ones((b, length), bool)
  km[0, length // 2:] = False
  km[-1] = False                                   # a row with no real token: outputs 0
  return jnp.asarray(km)


def _check(fast, mask, length, heads, causal, pad, seed):
  rng = np.random.default_rng(seed)
  q, k, v = _inputs(rng, 2, length, heads)
  key_mask = _key_mask(2, length, pad)
  # jitted: op by op, the block-sparse cores' gradients take minutes on two cores
  f = jax.jit(lambda q, k, v: fast(q, k, v, key_mask))
  g = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask, causal=causal,
                                                     key_mask=key_mask))
  out, vjp_f = jax.vjp(f, q, k, v)
  ref, vjp_g = jax.vjp(g, q, k, v)
  chex.assert_shape(out, q.shape)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  names = ("out", "dq", "dk", "dv")       # one tree: a failure names the leaf that differs
  chex.assert_trees_all_close(dict(zip(names, (out, *vjp_f(ct)))),
                              dict(zip(names, (ref, *vjp_g(ct)))), atol=TOL, rtol=0)
  if pad:
    np.testing.assert_array_equal(out[-1], 0.0)


@pytest.mark.parametrize("length,stride,block,causal,pad", [
    (50, 8, 4, False, False),     # length not a multiple of the stride
    (61, 8, 8, True, True),       # causal (language modelling) with padding
    (5, 8, 8, True, False),       # shorter than one stride
])
def test_strided_matches_dense(length, stride, block, causal, pad, stream):
  fast = lambda q, k, v, km: sparse_attention(q, k, v, pattern="strided", stride=stride,
                                              block_size=block, causal=causal, key_mask=km)
  _check(fast, masks.strided_mask(length, stride=stride, causal=causal), length, 2, causal, pad,
         seed=length)


@pytest.mark.parametrize("length,stride,causal,pad,multiple", [
    (50, 8, False, True, 4),      # classes of 7 padded to 8 tokens
    (61, 8, True, True, 16),      # causal, classes of 8 padded to a 16-token tile
    (37, 5, True, False, 1),      # odd stride, length not a multiple of it
])
def test_strided_parts_with_tile_padded_classes(length, stride, causal, pad, multiple):
  """`strided_parts` as a kernel with tiles would call it: each residue class padded to a
  multiple of the tile, the class part one block-diagonal call with blocks of the padded class
  length, the band part in token order; equal to the dense strided mask, values and gradients."""
  from attention.block_sparse import pad_tokens, sparse_core
  bh = 2 * 2
  nb = -(-length // stride)
  near_plan = block_sparse_plan.make_plan(
      sparse_patterns._near_layout(nb, stride, stride, causal), q_block=stride, k_block=stride,
      causal=causal, pair=sparse_patterns._Near(stride), batch_heads=bh)
  blocks = []

  def near(q, k, v, ok):
    return sparse_core(*(pad_tokens(x, nb * stride) for x in (q, k, v, ok)), near_plan)

  def diagonal(q, k, v, ok, block):
    blocks.append(block)
    assert q.shape[1] == block * stride and ok.shape == q.shape[:2]
    plan = block_sparse_plan.make_plan(np.eye(stride, dtype=bool), q_block=block, k_block=block,
                                       causal=causal, batch_heads=bh)
    return sparse_core(q, k, v, ok, plan)

  fast = lambda q, k, v, km: sparse_patterns.strided_parts(
      q, k, v, km, stride=stride, local=near, diagonal=diagonal, multiple=multiple)
  _check(fast, masks.strided_mask(length, stride=stride, causal=causal), length, 2, causal, pad,
         seed=length)
  assert blocks[0] == sparse_patterns.class_length(length, stride, multiple)
  assert blocks[0] % multiple == 0 and blocks[0] >= -(-length // stride)


@pytest.mark.parametrize("length,causal,pad,offsets", [
    (50, False, True, None),      # bidirectional encoder, per-head summary offsets
    (61, True, False, None),      # causal
    (37, False, False, 1),        # every head reads the same (last) summary columns
])
def test_fixed_matches_dense(length, causal, pad, offsets, stream):
  heads, stride, width = 3, 8, 2
  fast = lambda q, k, v, km: sparse_attention(
      q, k, v, pattern="fixed", stride=stride, summary_width=width, block_size=4, causal=causal,
      key_mask=km, num_summary_offsets=offsets)
  mask = masks.fixed_mask(length, stride=stride, summary_width=width, causal=causal,
                          num_heads=heads, num_summary_offsets=offsets)
  _check(fast, mask[None], length, heads, causal, pad, seed=length)


def test_block_local_matches_dense():
  fast = lambda q, k, v, km: block_local_attention(q, k, v, block_size=12, causal=True,
                                                   key_mask=km)
  _check(fast, masks.block_local_mask(37, block_size=12, causal=True), 37, 2, True, True, seed=0)


@pytest.mark.parametrize("length,block,pad", [(70, 8, True), (5, 8, False)])
def test_bigbird_matches_dense(length, block, pad, stream):
  heads = 3
  fast = lambda q, k, v, km: bigbird_attention(q, k, v, block_size=block, num_global_blocks=2,
                                               num_random_blocks=2, seed=7, key_mask=km)
  mask = masks.bigbird_mask(length, block_size=block, num_global_blocks=2, num_random_blocks=2,
                            seed=7, num_heads=heads)
  _check(fast, mask[None], length, heads, False, pad, seed=length)


def test_fixed_heads_read_different_summaries():
  mask = masks.fixed_mask(32, stride=8, summary_width=2, num_heads=4)
  assert len({m.tobytes() for m in mask}) == 4
  assert masks.fixed_summary_offsets(stride=8, summary_width=2, num_heads=5) == (6, 4, 2, 0, 6)


def test_layouts_cover_their_patterns():
  fixed = sparse_patterns.fixed_layout(45, stride=8, summary_width=2, block_size=4, causal=True,
                                       num_heads=3)
  dense = masks.fixed_mask(45, stride=8, summary_width=2, causal=True, num_heads=3)
  assert not (dense & ~masks.block_layout_mask(fixed, 4, 45)).any()
  bigbird = sparse_patterns.bigbird_layout(45, block_size=4, num_global_blocks=3,
                                           num_random_blocks=2, seed=1, num_heads=2)
  np.testing.assert_array_equal(
      masks.block_layout_mask(bigbird, 4, 45),
      masks.bigbird_mask(45, block_size=4, num_global_blocks=3, num_random_blocks=2, seed=1,
                         num_heads=2))


def test_bigbird_random_blocks_follow_the_definition():
  nb, r = 20, 3
  rand = masks.bigbird_random_blocks(nb, num_global_blocks=2, num_random_blocks=r, seed=5,
                                     num_heads=4)
  glob = masks.bigbird_global_blocks(nb, 2)
  assert glob == (0, nb - 1)
  for h in range(4):
    for n in range(nb):
      row = rand[h, n]
      if n in glob:
        assert (row == -1).all()
        continue
      assert len(set(row.tolist())) == r and (row >= 0).all()
      assert all(abs(m - n) > 1 and m not in glob for m in row)
  assert not (rand[0] == rand[1]).all()           # heads draw their own blocks
  again = masks.bigbird_random_blocks(nb, num_global_blocks=2, num_random_blocks=r, seed=5,
                                      num_heads=4)
  np.testing.assert_array_equal(rand, again)
  other = masks.bigbird_random_blocks(nb, num_global_blocks=2, num_random_blocks=r, seed=6,
                                      num_heads=4)
  assert not (rand == other).all()


def test_bigbird_layout_is_identical_in_a_separate_process():
  code = ("from attention import masks; import hashlib; "
          "p = masks.bigbird_block_pattern(40, num_global_blocks=2, num_random_blocks=3, seed=11, "
          "num_heads=4); print(hashlib.sha256(p.tobytes()).hexdigest())")
  here = masks.bigbird_block_pattern(40, num_global_blocks=2, num_random_blocks=3, seed=11,
                                     num_heads=4)
  import hashlib
  runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": str(salt), "PATH": ""},
                         cwd=attention.__path__[0] + "/..").stdout.strip() for salt in (1, 2)}
  assert runs == {hashlib.sha256(here.tobytes()).hexdigest()}


def test_impossible_settings_raise_clear_errors():
  q = k = v = jnp.zeros((1, 64, 2, 8))
  with pytest.raises(ValueError, match="stride 12 is not a multiple of block_size 8.*divides"):
    sparse_attention(q, k, v, pattern="strided", stride=12, block_size=8)
  with pytest.raises(ValueError, match="summary_width 16 is larger than the stride 8"):
    sparse_attention(q, k, v, pattern="fixed", stride=8, summary_width=16)
  with pytest.raises(ValueError, match="num_summary_offsets 5 does not fit"):
    sparse_attention(q, k, v, pattern="fixed", stride=8, summary_width=2, num_summary_offsets=5)
  with pytest.raises(ValueError, match="unknown sparse pattern 'dense'.*strided, fixed"):
    sparse_attention(q, k, v, pattern="dense", stride=8)
  with pytest.raises(ValueError, match="pattern='fixed' only"):
    sparse_attention(q, k, v, pattern="strided", stride=8, summary_width=2)
  with pytest.raises(ValueError, match="seed must be an int"):
    bigbird_attention(q, k, v, block_size=8, seed=None)


def test_registry_names():
  assert attention.get("bigbird") is bigbird_attention
  assert attention.get("sparse") is sparse_attention
  assert attention.get("block_local") is block_local_attention
  assert attention.get("block_sparse") is attention.block_sparse_attention


def _first_block_reference(q, k, v, key_mask, block, r):
  """Dense attention with Hugging Face's inference counts, transcribed from its table
  (BigBirdBlockSparseAttention.bigbird_block_sparse_attention): query block 0 and the last see
  every key; block 1 sees blocks 0, 1, 2 and the last; middle block q sees 0, q-1, q, q+1 and
  the last; block nb-2 sees 0, nb-3, nb-2, nb-1; and each of blocks 1 .. nb-2 sees its r
  "random" blocks, all block 0 at inference. Inputs of at most (5 + 2r) blocks: full attention."""
  length = q.shape[1]
  nb = -(-length // block)
  counts = np.zeros((nb, nb))
  if length <= (5 + 2 * r) * block:
    counts[:] = 1
  else:
    counts[0, :] = counts[nb - 1, :] = 1
    for qb in range(1, nb - 1):
      for kb in {0, qb - 1, qb, qb + 1, nb - 1}:
        counts[qb, kb] += 1
      counts[qb, 0] += r
  tok = np.repeat(np.repeat(counts, block, 0), block, 1)[:length, :length]
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  scores = scores + np.log(np.where(tok > 0, tok, 1.0)) + np.where(tok > 0, 0.0, -np.inf)
  scores = np.where(key_mask[:, None, None, :], scores, -np.inf)
  w = np.exp(scores - scores.max(-1, keepdims=True))
  w = w / w.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", w, v)
  return np.where(key_mask[:, :, None, None], out, 0.0)


@pytest.mark.parametrize("length, block, r", [(150, 16, 2), (203, 8, 3), (96, 8, 1),
                                              (64, 8, 0), (40, 8, 2)])
def test_bigbird_first_blocks_equal_hugging_faces_inference_counts(length, block, r):
  rng = np.random.default_rng(length + r)
  q, k, v = (rng.normal(size=(2, length, 3, 8)).astype(np.float32) for _ in range(3))
  key_mask = np.ones((2, length), bool)
  key_mask[1, length - 37:] = False
  out = sparse_patterns.bigbird_attention(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), block_size=block, num_random_blocks=r,
      seed=0, key_mask=jnp.asarray(key_mask), random_blocks="first")
  want = _first_block_reference(q.astype(np.float64), k.astype(np.float64),
                                v.astype(np.float64), key_mask, block, r)
  np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-5)


def test_bigbird_random_blocks_takes_drawn_or_first():
  x = jnp.zeros((1, 64, 2, 4))
  with pytest.raises(ValueError, match="random_blocks = 'hf'"):
    sparse_patterns.bigbird_attention(x, x, x, block_size=8, seed=0, random_blocks="hf")
  with pytest.raises(ValueError, match="num_global_blocks must be 2"):
    sparse_patterns.bigbird_attention(x, x, x, block_size=8, seed=0, num_global_blocks=4,
                                      random_blocks="first")
