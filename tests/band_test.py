"""band_attention against dot_product_attention with the masks.py Longformer mask."""

import re
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention
from attention import band, masks


def _inputs(rng, b, length, h, d, dtype=jnp.float32):
  return [jnp.asarray(rng.normal(size=(b, length, h, d)), dtype) for _ in range(4)]


def _key_mask(rng, b, length, all_padding_row=True):
  lengths = rng.integers(1, length + 1, size=b)
  if all_padding_row and b > 1:
    lengths[-1] = 0
  return jnp.asarray(np.arange(length)[None] < lengths[:, None])


def _out_and_grads(fn, q, k, v, ct):
  """{out, dq, dk, dv} of `fn` at (q, k, v) for the output cotangent `ct`: one tree, so a
  failed comparison names the leaf that differs."""
  out, vjp = jax.vjp(fn, q, k, v)
  return dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(ct))))


def _check(q, k, v, ct, *, window, dilation=1, causal=False, global_mask=None, key_mask=None,
           block_size=None, atol=1e-5):
  h = q.shape[2]
  mask = masks.longformer_mask(q.shape[1], window=window, dilation=dilation, causal=causal,
                               global_mask=global_mask, key_mask=key_mask, num_heads=h)

  def fast(q, k, v):
    return attention.band_attention(q, k, v, window=window, dilation=dilation, causal=causal,
                                    global_mask=global_mask, key_mask=key_mask,
                                    block_size=block_size)

  def ref(q, k, v):
    return attention.dot_product_attention(q, k, v, mask=mask, key_mask=key_mask)

  got = _out_and_grads(fast, q, k, v, ct)
  chex.assert_shape(got["out"], q.shape[:3] + v.shape[3:])
  chex.assert_trees_all_close(got, _out_and_grads(ref, q, k, v, ct), atol=atol, rtol=atol)
  out = got["out"]
  if key_mask is not None:  # padded queries output exactly 0
    assert np.all(np.asarray(out)[~np.asarray(key_mask)] == 0)
  return out


# (length, heads, window, dilation, causal, global, padding, block_size)
EDGE_CASES = [
    (37, 2, 5, 1, False, False, False, 8),       # length not a multiple of the block
    (5, 2, 3, 1, False, False, True, 16),        # shorter than one block
    (40, 2, 0, 1, False, False, True, 8),        # window 0: each token sees itself
    (40, 2, 0, 1, True, True, True, 8),          # window 0, causal, global
    (30, 2, 64, 1, False, False, True, 8),       # window longer than the sequence
    (30, 2, 64, 2, True, True, False, None),     # window longer than the sequence, dilated
    (50, 4, 4, [1, 2, 3, 4], False, True, True, 8),  # per-head dilation, all values 1..4
    (50, 4, 3, [2, 2, 1, 3], True, False, True, 4),  # per-head dilation, causal
    (64, 2, 7, 4, False, True, True, 16),        # dilation 4
    (33, 3, 6, 3, True, False, True, None),      # dilation 3, causal
]


@pytest.mark.parametrize("case", EDGE_CASES, ids=[str(c) for c in EDGE_CASES])
def test_edge_cases_match_dense_reference(case):
  length, h, window, dilation, causal, use_global, padding, block = case
  rng = np.random.default_rng(zlib.crc32(str(case).encode()))
  q, k, v, ct = _inputs(rng, 3, length, h, 8)
  key_mask = _key_mask(rng, 3, length) if padding else None
  global_mask = jnp.asarray(rng.random((3, length)) < 0.15) if use_global else None
  _check(q, k, v, ct, window=window, dilation=dilation, causal=causal, global_mask=global_mask,
         key_mask=key_mask, block_size=block)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_configurations_match_dense_reference(seed):
  rng = np.random.default_rng(seed)
  b, h, d = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.choice([4, 8, 16]))
  length = int(rng.integers(1, 120))
  window = int(rng.integers(0, 40))
  if rng.random() < 0.4:
    dilation = [int(x) for x in rng.integers(1, 5, size=h)]
  else:
    dilation = int(rng.integers(1, 5))
  causal = bool(rng.random() < 0.5)
  block = [None, 4, 8, 16, 32][int(rng.integers(0, 5))]
  q, k, v, ct = _inputs(rng, b, length, h, d)
  key_mask = _key_mask(rng, b, length, all_padding_row=bool(rng.random() < 0.3)) \
      if rng.random() < 0.7 else None
  global_mask = jnp.asarray(rng.random((b, length)) < 0.1) if rng.random() < 0.5 else None
  _check(q, k, v, ct, window=window, dilation=dilation, causal=causal, global_mask=global_mask,
         key_mask=key_mask, block_size=block)


def test_global_key_inside_window_counted_once():
  # One global token inside every window: if it were counted in the band and again as a
  # global key, its weight would double and the output would differ from the reference.
  rng = np.random.default_rng(0)
  q, k, v, ct = _inputs(rng, 1, 16, 1, 4)
  global_mask = jnp.zeros((1, 16), bool).at[0, 8].set(True)
  _check(q, k, v, ct, window=16, global_mask=global_mask, block_size=4)


def test_all_padding_and_no_key_rows_are_zero_not_nan():
  rng = np.random.default_rng(1)
  q, k, v, ct = _inputs(rng, 2, 20, 2, 8)
  key_mask = jnp.zeros((2, 20), bool)
  out = _check(q, k, v, ct, window=3, key_mask=key_mask)
  assert np.all(np.asarray(out) == 0)


def test_bfloat16_close_to_float32():
  rng = np.random.default_rng(2)
  q, k, v, _ = _inputs(rng, 2, 300, 4, 32)
  key_mask = _key_mask(rng, 2, 300)
  global_mask = jnp.asarray(rng.random((2, 300)) < 0.02)
  kw = dict(window=24, dilation=[1, 1, 2, 3], global_mask=global_mask, key_mask=key_mask)
  want = attention.band_attention(q, k, v, **kw)
  got = attention.band_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), **kw)
  chex.assert_type(got, jnp.bfloat16)
  err = np.abs(np.asarray(got, np.float32) - np.asarray(want))
  assert np.isfinite(err).all()
  assert err.max() < 0.05 and err.mean() < 5e-3, (err.max(), err.mean())


def test_repeated_calls_of_one_shape_do_not_retrace():
  rng = np.random.default_rng(3)
  kw = dict(window=5, dilation=[1, 2], causal=True, block_size=8)
  band._band_attention.clear_cache()
  for _ in range(3):
    q, k, v, _ = _inputs(rng, 2, 40, 2, 8)
    key_mask = _key_mask(rng, 2, 40)
    attention.band_attention(q, k, v, key_mask=key_mask, **kw).block_until_ready()
  assert band._band_attention._cache_size() == 1


def test_jit_with_traced_global_mask_needs_max_global():
  rng = np.random.default_rng(4)
  q, k, v, ct = _inputs(rng, 2, 24, 2, 8)
  global_mask = jnp.asarray(rng.random((2, 24)) < 0.2)
  fn = jax.jit(lambda q, k, v, g: attention.band_attention(q, k, v, window=2, global_mask=g))
  with pytest.raises(ValueError, match="max_global"):
    fn(q, k, v, global_mask)
  fn = jax.jit(lambda q, k, v, g: attention.band_attention(q, k, v, window=2, global_mask=g,
                                                           max_global=24))
  want = attention.dot_product_attention(
      q, k, v, mask=masks.longformer_mask(24, window=2, global_mask=global_mask))
  chex.assert_trees_all_close(fn(q, k, v, global_mask), want, atol=1e-5, rtol=1e-7)


def _max_array_elements(hlo_text):
  sizes = [int(np.prod([int(x) for x in dims.split(",") if x]))
           for dims in re.findall(r"(?:f32|pred|s32|bf16)\[([0-9,]*)\]", hlo_text)]
  return max(sizes)


def test_no_gather_and_no_quadratic_array_in_forward_and_backward():
  length, window = 2048, 16
  rng = np.random.default_rng(5)
  q, k, v, ct = _inputs(rng, 1, length, 2, 16)
  key_mask = _key_mask(rng, 1, length, all_padding_row=False)

  def loss(q, k, v):
    out = attention.band_attention(q, k, v, window=window, dilation=[1, 3], key_mask=key_mask)
    return jnp.sum(out * ct)

  hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile().as_text()
  assert "gather(" not in hlo
  # Inputs hold 2 * 2048 * 16 = 65536 elements; an [L, L] array would hold 4M.
  assert _max_array_elements(hlo) < length * length // 16


@pytest.mark.parametrize("kwargs, message", [
    (dict(window=-1), "non-negative"),
    (dict(window=2.5), "int"),
    (dict(window=2, dilation=[1, 2, 3]), "one value per head"),
    (dict(window=2, dilation=0), ">= 1"),
    (dict(window=2, key_mask=jnp.ones((2, 7), bool)), "key_mask must have shape"),
    (dict(window=2, global_mask=jnp.ones((1, 8), bool)), "global_mask must have shape"),
    (dict(window=2, key_mask=jnp.ones((2, 8), jnp.int32)), "boolean"),
    (dict(window=2, block_size=0), "block_size"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, message):
  x = jnp.zeros((2, 8, 2, 4))
  with pytest.raises(ValueError, match=message):
    attention.band_attention(x, x, x, **kwargs)


def test_mismatched_qkv_shapes_are_rejected():
  x = jnp.zeros((2, 8, 2, 4))
  with pytest.raises(ValueError, match="same length"):
    attention.band_attention(x, jnp.zeros((2, 9, 2, 4)), jnp.zeros((2, 9, 2, 4)), window=1)
  with pytest.raises(ValueError, match="heads and head_dim"):
    attention.band_attention(x, jnp.zeros((2, 8, 2, 5)), x, window=1)
  with pytest.raises(ValueError, match="batch, length and heads"):
    attention.band_attention(x, x, jnp.zeros((2, 8, 3, 4)), window=1)
  with pytest.raises(ValueError, match="shape \\[batch, length, heads, head_dim\\]"):
    attention.band_attention(jnp.zeros((8, 2, 4)), x, x, window=1)


def test_registry_lookup():
  assert attention.get("band") is attention.band_attention
  assert attention.get("dot_product") is attention.dot_product_attention
  with pytest.raises(ValueError, match="valid names: .*band.*dot_product"):
    attention.get("longformer_typo")
