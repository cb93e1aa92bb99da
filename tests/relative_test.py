"""Transformer-XL relative positions: the shift against a direct (q + v).R[i - j] for every (i, j),
the XL shift's causal-only validity and the `[:-1]` slip, and band + relative equal to dense +
relative with the band mask (outputs and gradients, odd lengths, short lengths, padding)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import masks, relative
from attention.band import band_attention

H, D, E = 2, 4, 6


def _direct(q_v, w_r, lk):
  """(q + v)_i . R[i - j] by a Python loop over (i, j), R from the sinusoid of each distance."""
  q_v, w_r = np.asarray(q_v, np.float64), np.asarray(w_r, np.float64)
  b, lq, h, _ = q_v.shape
  out = np.zeros((b, h, lq, lk))
  for i in range(lq):
    for j in range(lk):
      r = np.einsum("e,ehd->hd", relative.sinusoid([i - j], w_r.shape[0])[0], w_r)
      out[:, :, i, j] = np.einsum("bhd,hd->bh", q_v[:, i], r)
  return out


def _arrays(length, seed=0, b=2):
  ks = jax.random.split(jax.random.key(seed), 6)
  q, k, v = (jax.random.normal(ks[i], (b, length, H, D)) for i in range(3))
  u, vb = (0.3 * jax.random.normal(ks[3 + i], (H, D)) for i in range(2))
  w_r = jax.random.normal(ks[5], (E, H, D)) / np.sqrt(E)
  return q, k, v, dict(u=u, v_bias=vb, w_r=w_r)


@pytest.mark.parametrize("length", [1, 7])
def test_shift_equals_direct_bidirectional_and_causal(length):
  q, _, _, p = _arrays(length)
  direct = _direct(q + p["v_bias"], p["w_r"], length)
  got = relative.position_scores(q + p["v_bias"], p["w_r"], length)
  chex.assert_shape(got, (2, H, length, length))
  chex.assert_trees_all_close(got, direct, atol=1e-5, rtol=1e-7)   # every (i, j): bidirectional
  causal = np.tril(np.ones((length, length), bool))
  chex.assert_trees_all_close(np.where(causal, got, 0), np.where(causal, direct, 0), atol=1e-5,
                              rtol=1e-7)


def test_xl_shift_is_right_only_below_the_diagonal_and_the_slip_is_caught():
  length = 6
  q, _, _, p = _arrays(length)
  q_v = q + p["v_bias"]
  direct = _direct(q_v, p["w_r"], length)
  # Transformer-XL's rows: distances L-1 .. 0 (the last L rows of the distance table).
  r = relative.projected_table(p["w_r"], length)[:length]
  scores = jnp.einsum("bqhd,mhd->bhqm", q_v, r)
  causal = np.tril(np.ones((length, length), bool))
  xl = relative.rel_shift_xl(scores)
  chex.assert_trees_all_close(np.where(causal, xl, 0), np.where(causal, direct, 0), atol=1e-5,
                              rtol=1e-7)
  assert not np.allclose(xl, direct, atol=1e-3)              # wrong above the diagonal
  slipped = relative.rel_shift_xl(scores, slip=True)
  assert np.abs(np.where(causal, slipped - direct, 0)).max() > 1e-2


def _dense_band(q, k, v, p, window, causal, key_mask):
  mask = masks.longformer_mask(q.shape[1], window=window, num_heads=H)
  return relative.relative_attention(q, k, v, **p, key_mask=key_mask, causal=causal, mask=mask)


def _band(q, k, v, p, window, causal, key_mask, block=8):
  qa, ka = relative.factorised_qk(q, k, **p)
  return band_attention(qa, ka, v, window=window, causal=causal, key_mask=key_mask,
                        block_size=block)


@pytest.mark.parametrize("length,window,causal,pad", [
    (13, 3, False, 3),     # not a multiple of the block (8), padding
    (5, 2, True, 0),       # shorter than a block
    (19, 9, True, 4)])     # window over a block, causal, padding
def test_band_relative_equals_dense_relative_with_band_mask(length, window, causal, pad):
  q, k, v, p = _arrays(length, seed=length)
  key_mask = jnp.broadcast_to(jnp.arange(length) < length - pad, (2, length))

  def value_and_grad(fn):
    def f(q, k, v, p):
      out = fn(q, k, v, p, window, causal, key_mask)
      return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, p)

  (_, band), band_grads = value_and_grad(_band)
  (_, dense), dense_grads = value_and_grad(_dense_band)
  chex.assert_shape(band, q.shape)
  # Gradients w.r.t. q, k, v and the position parameters u, v_bias, w_r, as one tree.
  chex.assert_trees_all_close((band, band_grads), (dense, dense_grads), atol=1e-5, rtol=1e-7)


def test_dense_relative_without_positions_is_dot_product():
  from attention.dot_product import dot_product_attention
  q, k, v, p = _arrays(9)
  zero = dict(u=jnp.zeros((H, D)), v_bias=jnp.zeros((H, D)), w_r=jnp.zeros((E, H, D)))
  key_mask = jnp.arange(9)[None].repeat(2, 0) < 7
  chex.assert_trees_all_close(
      relative.relative_attention(q, k, v, **zero, key_mask=key_mask, causal=True),
      dot_product_attention(q, k, v, key_mask=key_mask, causal=True), atol=1e-6, rtol=1e-7)


def test_band_relative_with_dilation_and_global_tokens(causal=True):
  length = 23
  q, k, v, p = _arrays(length, seed=3)
  key_mask = jnp.broadcast_to(jnp.arange(length) < 20, (2, length))
  glob = jnp.zeros((2, length), bool).at[:, 0].set(True)
  mask = masks.longformer_mask(length, window=3, dilation=[1, 2], global_mask=glob, num_heads=H,
                               causal=causal)
  dense = relative.relative_attention(q, k, v, **p, key_mask=key_mask, causal=causal, mask=mask)
  qa, ka = relative.factorised_qk(q, k, **p)
  band = band_attention(qa, ka, v, window=3, dilation=[1, 2], causal=causal, key_mask=key_mask,
                        global_mask=glob, block_size=8)
  chex.assert_trees_all_close(band, dense, atol=1e-5, rtol=1e-7)
