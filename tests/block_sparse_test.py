"""Tests for attention.block_sparse and attention.block_sparse_plan against the dense reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import block_sparse, block_sparse_plan, masks
from attention.block_sparse import block_sparse_attention
from attention.static_take import static_take
from attention.dot_product import dot_product_attention

TOL = 1e-5


def _inputs(rng, b, length, h, d=8):
  return [jnp.asarray(rng.standard_normal((b, length, h, d)), jnp.float32) for _ in range(3)]


def _key_mask(b, length, kind):
  if kind is None:
    return None
  km = np.ones((b, length), bool)
  km[0, (2 * length) // 3:] = False              # trailing padding
  if kind == "empty_row" and b > 1:
    km[1] = False                                  # a row with no real token at all
  return jnp.asarray(km)


def _compare(fast, dense, q, k, v, rng):
  """Output and gradients of `fast` against `dense`, compared as one tree {out, dq, dk, dv}
  (a failure names the leaf that differs); returns fast's output."""
  out_fast, vjp_fast = jax.vjp(fast, q, k, v)
  out_dense, vjp_dense = jax.vjp(dense, q, k, v)
  chex.assert_shape(out_fast, q.shape[:3] + v.shape[3:])
  ct = jnp.asarray(rng.standard_normal(out_fast.shape), jnp.float32)
  names = ("out", "dq", "dk", "dv")
  chex.assert_trees_all_close(dict(zip(names, (out_fast, *vjp_fast(ct)))),
                              dict(zip(names, (out_dense, *vjp_dense(ct)))), atol=TOL, rtol=0)
  return out_fast


@pytest.mark.parametrize("stream", [False, True], ids=["assembled", "streamed"])
@pytest.mark.parametrize("length,block,heads,per_head,causal,pad", [
    (100, 16, 2, False, False, None),         # length not a multiple of the block
    (130, 32, 3, True, True, "empty_row"),    # per-head layouts, causal, an all-padding row
    (10, 16, 2, False, True, "pad"),          # length shorter than one block
    (257, 32, 2, True, False, "pad"),
])
def test_matches_dense_reference(length, block, heads, per_head, causal, pad, stream,
                                 monkeypatch):
  # Streamed: every bucket but "all" ones reads its key blocks inside the scan, one row per step
  # (at these sizes the default threshold streams nothing).
  monkeypatch.setattr(block_sparse_plan, "STREAM_ROW_ELEMENTS", 0 if stream else 1 << 40)
  rng = np.random.default_rng(length)
  nb = -(-length // block)
  layout = rng.random((heads, nb, nb) if per_head else (nb, nb)) < 0.35
  layout[..., 0, :] = False                       # a query block with no key block at all
  plan = block_sparse_plan.make_plan(layout, q_block=block, k_block=block, causal=causal,
                                     batch_heads=2 * heads)
  assert any(b.stream for b in plan.buckets) == (stream and bool(plan.buckets))
  if stream and per_head:                         # per-head slots are read head by head
    assert not all(u for b in plan.buckets if b.stream for u in b.uniform)
  q, k, v = _inputs(rng, 2, length, heads)
  key_mask = _key_mask(2, length, pad)
  dense_mask = masks.block_layout_mask(layout, block, length)
  dense_mask = dense_mask[None] if dense_mask.ndim == 3 else dense_mask
  fast = lambda q, k, v: block_sparse_attention(q, k, v, layout=layout, block_size=block,
                                                causal=causal, key_mask=key_mask)
  dense = lambda q, k, v: dot_product_attention(q, k, v, mask=dense_mask, causal=causal,
                                                key_mask=key_mask)
  out = _compare(fast, dense, q, k, v, rng)
  np.testing.assert_array_equal(out[:, :block], 0.0)   # empty layout row outputs exactly 0
  if pad == "empty_row":
    np.testing.assert_array_equal(out[1], 0.0)


def test_scan_over_several_chunks_with_row_padding(monkeypatch):
  # A tiny score budget forces several rows per scan step to be padded and several steps.
  monkeypatch.setattr(block_sparse_plan, "CHUNK_SCORE_ELEMENTS", 4 * 4 * 8 * 24)
  rng = np.random.default_rng(1)
  length, block = 75, 8
  nb = -(-length // block)
  layout = np.abs(np.arange(nb)[:, None] - np.arange(nb)[None, :]) <= 1
  layout[3, 7] = layout[5, 0] = True              # irregular blocks go through one-hot slots
  plan = block_sparse_plan.make_plan(layout, q_block=block, k_block=block, batch_heads=4)
  assert any(b.chunk < len(b.rows) and len(b.rows) % b.chunk for b in plan.buckets)
  q, k, v = _inputs(rng, 2, length, 2)
  key_mask = _key_mask(2, length, "pad")
  fast = lambda q, k, v: block_sparse_attention(q, k, v, layout=layout, block_size=block,
                                                key_mask=key_mask)
  dense = lambda q, k, v: dot_product_attention(
      q, k, v, mask=masks.block_layout_mask(layout, block, length), key_mask=key_mask)
  _compare(fast, dense, q, k, v, rng)


def test_static_take_matches_take_with_gradient():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((3, 11, 4)), jnp.float32)
  idx = [0, 1, 2, 2, 2, 7, 3, 4, 5, 10, 10, 0, 6]
  ct = jnp.asarray(rng.standard_normal((3, len(idx), 4)), jnp.float32)
  out, vjp = jax.vjp(lambda x: static_take(x, idx, 1), x)
  ref, vjp_ref = jax.vjp(lambda x: jnp.take(x, jnp.asarray(idx), axis=1), x)
  np.testing.assert_array_equal(out, ref)
  np.testing.assert_allclose(vjp(ct)[0], vjp_ref(ct)[0], atol=1e-6)


def test_plan_uses_slices_for_bands_and_one_hot_only_for_irregular_blocks():
  nb = 12
  band = np.abs(np.arange(nb)[:, None] - np.arange(nb)[None, :]) <= 1
  plan = block_sparse_plan.make_plan(band, q_block=4, k_block=4)
  assert all(b.onehot is None for b in plan.buckets)
  assert {s[0] for b in plan.buckets for s in b.slots} == {"shift"}
  bigbird = masks.bigbird_block_pattern(nb, num_global_blocks=2, num_random_blocks=2, seed=0,
                                        num_heads=2)
  plan = block_sparse_plan.make_plan(bigbird, q_block=4, k_block=4)
  kinds = {s[0] for b in plan.buckets for s in b.slots}
  assert kinds == {"shift", "const", "all"}
  assert any(b.onehot is not None for b in plan.buckets)
  # The global query blocks read every key block: one "all" slot, not one slot per block.
  full = [b for b in plan.buckets if b.slots == (("all",),)]
  assert len(full) == 1 and full[0].rows == (0, nb - 1) and full[0].num_slots == nb


def test_causal_layout_is_bucketed_by_row_length():
  nb = 32
  causal = np.tril(np.ones((nb, nb), bool))
  plan = block_sparse_plan.make_plan(causal, q_block=4, k_block=4)
  computed = sum(len(b.rows) * b.num_slots for b in plan.buckets)
  assert len(plan.buckets) > 1
  assert computed < 0.7 * nb * nb                 # one bucket would compute nb * nb blocks
  assert computed >= causal.sum()


def test_layout_shape_error_says_what_to_pass():
  q = k = v = jnp.zeros((1, 100, 2, 8))
  with pytest.raises(ValueError, match=r"ceil\(100/16\) = 7 blocks.*\(7, 7\)"):
    block_sparse_attention(q, k, v, layout=np.ones((6, 6), bool), block_size=16)
  with pytest.raises(ValueError, match="boolean"):
    block_sparse_attention(q, k, v, layout=np.ones((7, 7), int), block_size=16)
  with pytest.raises(ValueError, match="one per head"):
    block_sparse_attention(q, k, v, layout=np.ones((3, 7, 7), bool), block_size=16)
  with pytest.raises(ValueError, match="block_size must be a positive int"):
    block_sparse_attention(q, k, v, layout=np.ones((7, 7), bool), block_size=0)


def test_merge_parts_equals_attention_over_the_union():
  rng = np.random.default_rng(3)
  length, block = 40, 8
  q, k, v = _inputs(rng, 1, length, 2)
  nb = length // block
  left = np.tril(np.ones((nb, nb), bool), -1)
  rest = ~left
  key_ok = jnp.ones((1, length), bool)
  parts = [block_sparse.sparse_core(q, k, v, key_ok,
                                    block_sparse_plan.make_plan(lay, q_block=block, k_block=block))
           for lay in (left, rest)]
  out, _ = block_sparse.merge_parts(parts)
  chex.assert_trees_all_close(out, dot_product_attention(q, k, v), atol=TOL, rtol=1e-7)
