"""Tests for attention/flash.py: exact dense attention by online softmax over key blocks.

`flash_attention` must equal `dot_product_attention` with the equivalent dense mask in outputs
and in gradients w.r.t. q, k and v (float32, awkward shapes, causal and bidirectional, padding,
block masks of every rank), follow its masking rules (queries with no key output 0 and get zero
gradients), skip block pairs with nothing allowed, and never hold an `[Lq, Lk]` array: the
gradient's jaxpr has no variable of L x L elements and its compiled temporaries stay far below
B * H * L * L * 4 bytes.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention
from attention import block_sparse, flash, kinds
from attention.dot_product import dot_product_attention
from models.attention_layer import MultiHeadAttention

TOL = dict(rtol=1e-5, atol=1e-5)


def normal(seed: int, shape, dtype=jnp.float32):
  """Standard normal inputs from numpy (no per-shape compilation of a jax sampler)."""
  return jnp.asarray(np.random.RandomState(seed).standard_normal(shape), dtype)


def dense_mask(block_mask, block_size: int, lq: int, lk: int):
  """bool `[..., Lq, Lk]`: the token meaning of a block mask."""
  qb, kb = np.arange(lq) // block_size, np.arange(lk) // block_size
  return np.asarray(block_mask)[..., qb[:, None], kb[None, :]]


def both(q, k, v, *, block_size, block_mask=None, **masks):
  """(flash, dot_product) as functions of (q, k, v) with the same masks."""
  mask = None
  if block_mask is not None:
    mask = dense_mask(block_mask, block_size, q.shape[1], k.shape[1])
  fl = lambda q, k, v: flash.flash_attention(q, k, v, block_size=block_size,
                                             block_mask=block_mask, **masks)
  dp = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, **masks)
  return fl, dp


def outputs_and_grads(fn, q, k, v, weights):
  """fn(q, k, v) and the gradients of sum(fn(q, k, v) * weights), in one jitted call."""

  def run(q, k, v, weights):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(weights.astype(out.dtype))

  return jax.jit(run)(q, k, v, weights)


def named(out, grads):
  """{out, dq, dk, dv}: compared as one tree, a failure names the leaf that differs."""
  return dict(zip(("out", "dq", "dk", "dv"), (out, *grads)))


# (batch, Lq, Lk, heads, D, Dv, block_size, causal, key padding, query mask, block-mask rank)
CASES = [
    (2, 13, 13, 3, 8, 5, 4, False, True, False, 2),     # partial last block, layout [nq, nk]
    (2, 13, 13, 3, 8, 8, 4, True, True, False, 3),      # causal, one layout per head
    (2, 7, 19, 2, 4, 4, 5, True, True, True, 4),        # Lq < Lk, per batch and head
    (2, 21, 9, 2, 4, 3, 32, False, False, True, 0),     # both shorter than one block
    (1, 16, 16, 2, 8, 8, 16, False, False, False, 0),   # exactly one block
    (2, 33, 33, 2, 8, 8, 8, True, False, False, 0),     # causal, one token past the blocks
    (3, 24, 24, 2, 8, 8, 8, False, True, False, 3),     # a row of the batch is all padding
]


@pytest.mark.parametrize("b, lq, lk, h, d, dv, bs, causal, pad, use_qm, rank", CASES)
def test_equals_dot_product_in_outputs_and_gradients(b, lq, lk, h, d, dv, bs, causal, pad,
                                                     use_qm, rank):
  q, k, v = normal(0, (b, lq, h, d)), normal(1, (b, lk, h, d)), normal(2, (b, lk, h, dv))
  rng = np.random.RandomState(lq * 100 + lk)
  masks = {"causal": causal}
  if pad:
    key_mask = rng.rand(b, lk) > 0.25
    if b == 3:
      key_mask[1] = False                                  # every key of row 1 is padding
    masks["key_mask"] = jnp.asarray(key_mask)
  if use_qm:
    masks["query_mask"] = jnp.asarray(rng.rand(b, lq) > 0.25)
  block_mask = None
  if rank:
    nq, nk = -(-lq // bs), -(-lk // bs)
    block_mask = rng.rand(*((b, h, nq, nk)[4 - rank:])) > 0.35
  fl, dp = both(q, k, v, block_size=bs, block_mask=block_mask, **masks)
  weights = normal(3, (b, lq, h, dv))
  out, grads = outputs_and_grads(fl, q, k, v, weights)
  ref, ref_grads = outputs_and_grads(dp, q, k, v, weights)
  chex.assert_shape(out, (b, lq, h, dv))
  chex.assert_type(out, jnp.float32)
  chex.assert_trees_all_close(named(out, grads), named(ref, ref_grads), **TOL)
  assert np.abs(np.asarray(ref)).max() > 0.1             # the case attends something


def test_queries_with_no_key_output_zero_and_get_zero_gradients():
  b, length, h, d, bs = 2, 20, 2, 8, 4
  q, k, v = normal(0, (b, length, h, d)), normal(1, (b, length, h, d)), normal(2, (b, length, h, d))
  key_mask = jnp.arange(length)[None] < jnp.array([[15], [0]])           # row 1: all padding
  block_mask = np.ones((5, 5), bool)
  block_mask[2] = False                                  # queries 8..11 see no block
  fn = lambda q, k, v: flash.flash_attention(q, k, v, key_mask=key_mask, causal=True,
                                             block_mask=block_mask, block_size=bs)
  out, (dq, dk, dv) = outputs_and_grads(fn, q, k, v, normal(3, (b, length, h, d)))
  out, dq, dk, dv = map(np.asarray, (out, dq, dk, dv))
  chex.assert_tree_all_finite((out, dq, dk, dv))
  empty = np.zeros((b, length), bool)
  empty[1] = True                                        # no key at all
  empty[0, 15:] = True                                   # padded queries
  empty[0, 8:12] = True                                  # masked query block
  assert (out[empty] == 0).all() and (dq[empty] == 0).all()
  assert np.abs(out[~empty]).min(axis=-1).max() > 0
  assert (dk[1] == 0).all() and (dv[1] == 0).all() and (dk[0, 15:] == 0).all()


def test_bfloat16_inputs_keep_float32_statistics():
  b, length, h, d, bs = 2, 37, 2, 16, 8
  q, k, v = (normal(i, (b, length, h, d)) * 3 for i in range(3))
  key_mask = jnp.arange(length)[None] < jnp.array([[37], [30]])
  half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  fl, dp = both(*half, block_size=bs, key_mask=key_mask, causal=True)
  weights = normal(3, (b, length, h, d))
  out, grads = outputs_and_grads(fl, *half, weights)
  ref, ref_grads = outputs_and_grads(dp, *half, weights)
  chex.assert_type([out, *grads], jnp.bfloat16)
  as32 = lambda x: np.asarray(x.astype(jnp.float32))
  chex.assert_trees_all_close(as32(out), as32(ref), rtol=2e-2, atol=2e-2)
  chex.assert_trees_all_close(jax.tree.map(as32, grads), jax.tree.map(as32, ref_grads),
                              rtol=5e-2, atol=5e-2)
  # the same bf16 inputs in float32: only the output rounding differs
  exact = flash.flash_attention(*[x.astype(jnp.float32) for x in half], key_mask=key_mask,
                                causal=True, block_size=bs)
  chex.assert_trees_all_close(as32(out), np.asarray(exact), rtol=1e-2, atol=1e-2)


def test_traced_block_mask_under_jit():
  b, length, h, d, bs = 1, 12, 2, 4, 4
  q, k, v = normal(0, (b, length, h, d)), normal(1, (b, length, h, d)), normal(2, (b, length, h, d))
  run = jax.jit(lambda bm: flash.flash_attention(q, k, v, block_mask=bm, block_size=bs))
  for seed in range(2):
    bm = np.random.RandomState(seed).rand(h, 3, 3) > 0.5
    ref = dot_product_attention(q, k, v, mask=dense_mask(bm, bs, length, length))
    chex.assert_trees_all_close(run(jnp.asarray(bm)), ref, **TOL)


def test_pairs_with_nothing_allowed_are_skipped():
  """NaN values in keys no query may see poison every computed block (p @ v with p = 0 is
  still NaN), so a finite output shows those block pairs were never computed."""
  b, length, h, d, bs = 1, 16, 1, 4, 4
  q, k, v = normal(0, (b, length, h, d)), normal(1, (b, length, h, d)), normal(2, (b, length, h, d))
  v = v.at[:, 12:].set(jnp.nan)                          # key block 3
  key_mask = jnp.arange(length)[None] < 12               # ... is all padding
  out = flash.flash_attention(q, k, v, key_mask=key_mask, query_mask=jnp.ones_like(key_mask),
                              block_size=bs)
  assert np.isfinite(np.asarray(out)).all()
  v = v.at[:, 12:].set(0.0).at[:, 4:8].set(jnp.nan)     # key block 1, masked out for every query
  block_mask = np.ones((4, 4), bool)
  block_mask[:, 1] = False
  out = flash.flash_attention(q, k, v, block_mask=block_mask, block_size=bs)
  assert np.isfinite(np.asarray(out)).all()
  v = v.at[:, 4:8].set(0.0).at[:, 8:].set(jnp.nan)     # the causal upper triangle
  out = flash.flash_attention(q, k, v, causal=True, block_size=bs)
  assert np.isfinite(np.asarray(out[:, :8])).all()


def test_block_mask_is_the_exact_dense_path_of_a_block_sparse_layout():
  b, length, h, d, bs = 2, 22, 2, 8, 4
  q, k, v = normal(0, (b, length, h, d)), normal(1, (b, length, h, d)), normal(2, (b, length, h, d))
  layout = np.random.RandomState(0).rand(h, 6, 6) > 0.5
  key_mask = jnp.arange(length)[None] < jnp.array([[22], [17]])
  for causal in (False, True):
    ref = block_sparse.block_sparse_attention(q, k, v, layout=layout, block_size=bs,
                                              causal=causal, key_mask=key_mask)
    out = flash.flash_attention(q, k, v, block_mask=layout, block_size=bs, causal=causal,
                                key_mask=key_mask)
    chex.assert_trees_all_close(out, ref, **TOL)


def test_bad_arguments_say_what_to_pass():
  q = jnp.zeros((1, 10, 2, 4))
  with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
    flash.flash_attention(q, q, q, block_size=0)
  with pytest.raises(ValueError, match=r"\[num_q_blocks, num_k_blocks\] = \[3, 3\]"):
    flash.flash_attention(q, q, q, block_size=4, block_mask=np.ones((2, 3), bool))
  with pytest.raises(ValueError, match="does not broadcast"):
    flash.flash_attention(q, q, q, block_size=4, block_mask=np.ones((3, 3, 3), bool))
  with pytest.raises(ValueError, match="key_mask must have shape"):
    flash.flash_attention(q, q, q, key_mask=jnp.ones((1, 9), bool))


def _avals(jaxpr):
  """Every variable's abstract value in a jaxpr and its sub-jaxprs (scan, cond, custom_vjp)."""
  for eqn in jaxpr.eqns:
    for var in (*eqn.invars, *eqn.outvars):
      if hasattr(var, "aval"):
        yield var.aval
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _avals(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _avals(sub)


def test_gradient_never_holds_an_l_by_l_array():
  b, length, h, d = 1, 2048, 2, 16
  spec = jax.ShapeDtypeStruct((b, length, h, d), jnp.float32)
  l_by_l = b * h * length * length * 4                    # bytes of one [B, H, L, L] float32

  def grad_of(fn):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2))

  for causal in (False, True):
    fn = grad_of(lambda q, k, v: flash.flash_attention(q, k, v, causal=causal))
    largest = max(int(np.prod(a.shape)) for a in _avals(jax.make_jaxpr(fn)(spec, spec, spec).jaxpr)
                  if hasattr(a, "shape"))
    assert largest < length * length // 16, largest
    temp = jax.jit(fn).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
    assert temp < l_by_l / 8, (temp, l_by_l)
  # the measure sees the L x L array of the dense reference
  dense = grad_of(lambda q, k, v: dot_product_attention(q, k, v))
  temp = jax.jit(dense).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
  assert temp >= l_by_l


def test_kind_record_and_layer():
  kind = kinds.get("flash")
  assert attention.get("flash") is flash.flash_attention is attention.flash_attention
  assert kind.arguments == ("block_size",) and kind.supports_causal and not kind.masks
  x = normal(0, (2, 11, 16))
  key_mask = jnp.arange(11)[None] < jnp.array([[11], [6]])
  for causal in (False, True):
    layers = [MultiHeadAttention(16, 2, 16, spec, max_length=11, causal=causal,
                                 rngs=nnx.Rngs(0))
              for spec in ({"kind": "flash", "block_size": 4}, {"kind": "dot_product"})]
    out, ref = (jax.jit(lambda x, m, layer=layer: layer(x, m))(x, key_mask) for layer in layers)
    chex.assert_trees_all_close(out, ref, **TOL)


def test_no_keys_or_no_queries():
  q = normal(0, (2, 5, 2, 4))
  empty = q[:, :0]
  out = flash.flash_attention(q, empty, empty[..., :3])
  chex.assert_shape(out, (2, 5, 2, 3))
  assert not np.asarray(out).any()
  chex.assert_shape(flash.flash_attention(empty, q, q), (2, 0, 2, 4))
