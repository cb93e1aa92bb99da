"""Tests for attention.linformer: identity projections equal dense attention, padding handling,
length handling, per-head projections, gradients and error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import dot_product_attention
from attention.linformer import linformer_attention, linformer_from_inputs


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _qkv(seed, b=2, length=12, h=3, d=8, dv=None):
  return (_normal(seed, (b, length, h, d)), _normal(seed + 1000, (b, length, h, d)),
          _normal(seed + 2000, (b, length, h, dv or d)))


def _grads(fn, q, k, v):
  ct = _normal(99, q.shape[:3] + v.shape[3:])
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), argnums=(0, 1, 2)))(q, k, v)


def _assert_close(a, b, tol=2e-5):
  # Absolute tolerance relative to the array's scale: float32 sums of terms of size ~50 leave
  # rounding of ~1e-5 on small entries.
  b = np.asarray(b)
  scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
  np.testing.assert_allclose(np.asarray(a), b, atol=tol * scale, rtol=tol)


def _mask(lengths, total):
  return jnp.arange(total)[None, :] < jnp.asarray(lengths)[:, None]


@pytest.mark.parametrize("per_head", [False, True])
def test_identity_projection_equals_dense(per_head):
  q, k, v = _qkv(0, length=13, dv=5)
  eye = jnp.eye(13)
  proj = jnp.broadcast_to(eye, (3, 13, 13)) if per_head else eye
  lin = lambda q, k, v: linformer_attention(q, k, v, proj_k=proj, proj_v=proj)
  _assert_close(lin(q, k, v), jax.jit(dot_product_attention)(q, k, v))
  for g, r in zip(_grads(lin, q, k, v), _grads(dot_product_attention, q, k, v)):
    _assert_close(g, r)


def test_identity_projection_with_padding_equals_dense_masked():
  # Slots fed only by padded positions leave the softmax, so identity Linformer is exactly
  # dense attention with the key mask, including a row that is all padding (output 0).
  q, k, v = _qkv(1, b=3, length=11)
  key_mask = _mask([11, 6, 0], 11)
  eye = jnp.eye(16)  # longer than the input: the first 11 rows are used
  lin = lambda q, k, v: linformer_attention(q, k, v, proj_k=eye, proj_v=eye, key_mask=key_mask)
  ref = lambda q, k, v: dot_product_attention(q, k, v, key_mask=key_mask)
  out = lin(q, k, v)
  _assert_close(out, jax.jit(ref)(q, k, v))
  assert np.all(np.asarray(out)[2] == 0.0)
  for g, r in zip(_grads(lin, q, k, v), _grads(ref, q, k, v)):
    assert np.all(np.isfinite(np.asarray(g)))
    _assert_close(g, r)


def _numpy_linformer(q, k, v, e, f, key_mask):
  """Straight numpy transcription of the documented semantics (shared [N, K] projections)."""
  q, k, v, e, f = (np.asarray(x, np.float64) for x in (q, k, v, e, f))
  key_mask = np.asarray(key_mask)
  b_, length, h, d = q.shape
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  for b in range(b_):
    m = key_mask[b].astype(np.float64)
    fed = (m @ (e[:length] != 0) + m @ (f[:length] != 0)) > 0              # [K]
    for hh in range(h):
      kp = e[:length].T @ (k[b, :, hh] * m[:, None])                      # [K, D]
      vp = f[:length].T @ (v[b, :, hh] * m[:, None])
      logits = q[b, :, hh] @ kp.T / np.sqrt(d)                            # [L, K]
      logits = np.where(fed, logits, -np.inf)
      if fed.any():
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[b, :, hh] = np.where(key_mask[b][:, None], p @ vp, 0.0)
  return out


def test_random_projection_matches_numpy_reference():
  q, k, v = _qkv(2, b=3, length=10, dv=6)
  e = _normal(3, (24, 7)) / 4
  f = _normal(4, (24, 7)).at[:, 2].set(0.0) / 4  # slot 2 is fed by keys only
  key_mask = _mask([10, 3, 0], 10)
  out = linformer_attention(q, k, v, proj_k=e, proj_v=f, key_mask=key_mask)
  _assert_close(out, _numpy_linformer(q, k, v, e, f, key_mask))


def test_padding_does_not_change_real_outputs():
  # The same 9 real tokens, alone and padded to 21 with garbage in the padded positions.
  real = 9
  q, k, v = _qkv(5, b=1, length=30)
  e = _normal(6, (32, 8))
  f = _normal(7, (32, 8))
  outs, grads = [], []
  for total in (9, 21):
    key_mask = _mask([real], total)
    fn = lambda q, k, v: linformer_attention(q, k, v, proj_k=e, proj_v=f, key_mask=key_mask)
    qs, ks, vs = q[:, :total], k[:, :total], v[:, :total]
    out = fn(qs, ks, vs)
    assert np.all(np.asarray(out)[:, real:] == 0.0)
    outs.append(out[:, :real])
    # Gradient of the real outputs w.r.t. the real inputs.
    g = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)[:, :real] ** 2), argnums=(0, 1, 2))(
        qs, ks, vs)
    grads.append([x[:, :real] for x in g])
    for x in g:  # padded inputs do not influence anything
      assert np.all(np.asarray(x)[:, real:] == 0.0)
  for out, g in zip(outs[1:], grads[1:]):
    _assert_close(out, outs[0], 1e-5)
    for a, r in zip(g, grads[0]):
      _assert_close(a, r, 1e-5)


def test_per_head_and_shared_kv_projections():
  q, k, v = _qkv(8, length=9)
  e = _normal(9, (3, 9, 4))
  out = linformer_attention(q, k, v, proj_k=e, proj_v=e)
  for hh in range(3):
    head = linformer_attention(q[:, :, hh:hh + 1], k[:, :, hh:hh + 1], v[:, :, hh:hh + 1],
                               proj_k=e[hh], proj_v=e[hh])
    _assert_close(out[:, :, hh:hh + 1], head)


def test_shorter_input_uses_first_rows():
  q, k, v = _qkv(10, length=7)
  e = _normal(11, (20, 5))
  f = _normal(12, (20, 5))
  _assert_close(linformer_attention(q, k, v, proj_k=e, proj_v=f),
                linformer_attention(q, k, v, proj_k=e[:7], proj_v=f[:7]))


def test_under_jit_with_traced_mask():
  q, k, v = _qkv(13, length=8)
  e = _normal(14, (8, 4))
  key_mask = _mask([8, 5], 8)
  fn = jax.jit(lambda q, k, v, m: linformer_attention(q, k, v, proj_k=e, proj_v=e, key_mask=m))
  _assert_close(fn(q, k, v, key_mask),
                linformer_attention(q, k, v, proj_k=e, proj_v=e, key_mask=key_mask))


def test_errors_say_what_to_do():
  q, k, v = _qkv(15, length=10)
  e = jnp.ones((10, 4))
  with pytest.raises(ValueError, match="cannot be causal.*causal=False"):
    linformer_attention(q, k, v, proj_k=e, proj_v=e, causal=True)
  with pytest.raises(ValueError, match="longer than the projected input length 8.*at least 10"):
    linformer_attention(q, k, v, proj_k=jnp.ones((8, 4)), proj_v=jnp.ones((8, 4)))
  with pytest.raises(ValueError, match=r"\[heads, max_length, projected_length\]"):
    linformer_attention(q, k, v, proj_k=jnp.ones((2, 10, 4)), proj_v=e)
  with pytest.raises(ValueError, match="same number of slots"):
    linformer_attention(q, k, v, proj_k=e, proj_v=jnp.ones((10, 5)))


def _inputs(seed, b=3, length=11, e=12, h=3, d=4):
  x = _normal(seed, (b, length, e))
  return (x, _normal(seed + 1, (b, length, e)), _normal(seed + 2, (e, h, d)),
          _normal(seed + 3, (e, h, d + 1)), _normal(seed + 4, (b, length, h, d)))


@pytest.mark.parametrize("shared", ["none", "kv", "kv_one_input"])
def test_from_inputs_equals_projecting_computed_keys(shared):
  """(E^T X) W_k equals E^T (X W_k): outputs and every gradient, with padding (a half-padded
  row, an all-padding row) and projections longer than the input."""
  x_k, x_v, w_k, w_v, q = _inputs(20)
  x_v = x_k if shared == "kv_one_input" else x_v
  e = _normal(25, (16, 5))
  f = e if shared != "none" else _normal(26, (16, 5))
  key_mask = _mask([11, 6, 0], 11)

  def fast(q, x_k, x_v, w_k, w_v, e, f):
    x_v = x_k if shared == "kv_one_input" else x_v
    return linformer_from_inputs(q, x_k, x_v, w_k, w_v, proj_k=e,
                                 proj_v=e if shared != "none" else f, key_mask=key_mask)

  def reference(q, x_k, x_v, w_k, w_v, e, f):
    x_v = x_k if shared == "kv_one_input" else x_v
    k = jnp.einsum("ble,ehd->blhd", x_k, w_k)
    v = jnp.einsum("ble,ehd->blhd", x_v, w_v)
    return linformer_attention(q, k, v, proj_k=e, proj_v=e if shared != "none" else f,
                               key_mask=key_mask)

  args = (q, x_k, x_v, w_k, w_v, e, f)
  out = fast(*args)
  assert out.shape == (3, 11, 3, 5)
  assert np.all(np.asarray(out)[1, 6:] == 0.0) and np.all(np.asarray(out)[2] == 0.0)
  _assert_close(out, reference(*args), 1e-5)
  ct = _normal(27, out.shape)
  grad = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=tuple(range(7)))(*args)
  for a, r in zip(grad(fast), grad(reference)):
    _assert_close(a, r, 1e-5)


def test_from_inputs_refuses_what_it_cannot_do():
  x_k, x_v, w_k, w_v, q = _inputs(30)
  e = jnp.ones((11, 4))
  call = lambda **kw: linformer_from_inputs(**{**dict(
      q=q, x_k=x_k, x_v=x_v, w_k=w_k, w_v=w_v, proj_k=e, proj_v=e), **kw})
  with pytest.raises(ValueError, match="cannot be causal.*causal=False"):
    call(causal=True)
  with pytest.raises(ValueError, match=r"shared by the heads.*linformer_attention"):
    call(proj_k=jnp.ones((3, 11, 4)), proj_v=jnp.ones((3, 11, 4)))
  with pytest.raises(ValueError, match="longer than the projected input length 8"):
    call(proj_k=jnp.ones((8, 4)), proj_v=jnp.ones((8, 4)))
  with pytest.raises(ValueError, match=r"w_k must be \[E, H, D\] = \[12, 3, 4\]"):
    call(w_k=w_v)
  with pytest.raises(ValueError, match="x_k and x_v must both be"):
    call(x_v=x_v[:, :5])
