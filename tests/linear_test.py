"""Tests for attention.linear: elu+1 linear attention and the chunked causal prefix sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention
from attention import linear
from attention.dot_product import NEG_INF


def _naive(phi_q, phi_k, v, *, causal, key_mask=None, log_scale=None, xp=np):
  """Quadratic masked kernel attention: sum_j (phi_q_i . phi_k_j) v_j / sum_j (...)."""
  if log_scale is not None:
    phi_k = phi_k * xp.exp(log_scale)[..., None]
  kern = xp.einsum("bqhm,bkhm->bhqk", phi_q, phi_k)                # [B, H, Lq, Lk]
  lq, lk = phi_q.shape[1], phi_k.shape[1]
  allowed = np.ones((lq, lk), bool)
  if causal:
    allowed = np.tril(allowed)
  allowed = allowed[None, None]
  if key_mask is not None:
    allowed = allowed & np.asarray(key_mask)[:, None, None, :]
  kern = xp.where(allowed, kern, 0.0)
  num = xp.einsum("bhqk,bkhd->bqhd", kern, v)
  den = xp.sum(kern, axis=-1).transpose(0, 2, 1)[..., None]        # [B, Lq, H, 1]
  out = xp.where(den > 0, num / xp.where(den > 0, den, 1.0), 0.0)
  if key_mask is not None and lq == lk:
    out = xp.where(np.asarray(key_mask)[:, :, None, None], out, 0.0)
  return out


def _elu1(x, xp=np):
  return xp.where(x > 0, x + 1.0, xp.exp(xp.minimum(x, 0.0)))


def _inputs(rng, b, length, h, d, dv=None):
  shape = (b, length, h, d)
  q, k = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(b, length, h, dv or d)), jnp.float32)
  return q, k, v


def _key_mask(b, length, rng):
  mask = rng.random((b, length)) < 0.8
  mask[0, :] = False                                 # an all-padding row
  if b > 1:
    mask[1, : length // 3] = True
  return jnp.asarray(mask)


@pytest.mark.parametrize("causal,length,chunk", [
    (False, 1, 16), (False, 100, 32), (True, 7, 16), (True, 64, 16), (True, 130, 64)])
def test_linear_attention_matches_naive(causal, length, chunk):
  rng = np.random.default_rng(length)
  q, k, v = _inputs(rng, 3, length, 2, 8, dv=5)
  key_mask = _key_mask(3, length, rng)
  out = linear.linear_attention(q, k, v, causal=causal, key_mask=key_mask, chunk_size=chunk,
                                precision="exact")
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  ref = _naive(_elu1(q64), _elu1(k64), v64, causal=causal, key_mask=key_mask)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)
  assert not np.any(np.asarray(out)[0])               # all-padding row outputs exactly 0

  ct = jnp.asarray(rng.normal(size=v.shape), jnp.float32)

  def loss_fast(q, k, v):
    return jnp.sum(ct * linear.linear_attention(q, k, v, causal=causal, key_mask=key_mask,
                                                chunk_size=chunk, precision="exact"))

  def loss_naive(q, k, v):
    return jnp.sum(ct * _naive(_elu1(q, jnp), _elu1(k, jnp), v, causal=causal,
                               key_mask=key_mask, xp=jnp))

  grads = jax.grad(loss_fast, argnums=(0, 1, 2))(q, k, v)
  refs = jax.jit(jax.grad(loss_naive, argnums=(0, 1, 2)))(q, k, v)
  for g, r in zip(grads, refs):
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-4)


def test_key_log_scale_matches_naive():
  """Keys whose true features are phi_k * exp(log_scale) with scales far beyond float32 range."""
  rng = np.random.default_rng(0)
  b, length, h, m, dv = 2, 150, 2, 6, 4
  phi_q = np.exp(rng.normal(size=(b, length, h, m)))
  phi_k = np.exp(-rng.random((b, length, h, m)) * 3)
  log_scale = rng.uniform(-60, 60, size=(b, length, h))
  v = rng.normal(size=(b, length, h, dv))
  real = rng.random((b, length)) < 0.85
  real[0, :5] = False                                 # leading padding: no key yet
  phi_k = np.where(real[:, :, None, None], phi_k, 0.0)
  ls = np.where(real[:, :, None], log_scale, NEG_INF)
  head_major = lambda x: jnp.swapaxes(jnp.asarray(x, jnp.float32), 1, 2)
  out = linear.causal_linear_attention(*(head_major(x) for x in (phi_q, phi_k, v)), 32,
                                       key_log_scale=head_major(ls))
  out = jnp.swapaxes(out, 1, 2)
  ref = _naive(phi_q, phi_k, v, causal=True,
               log_scale=np.where(real[:, :, None], log_scale, -np.inf))
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)
  assert not np.any(np.asarray(out)[0, :5])


def test_chunk_size_does_not_change_the_result():
  rng = np.random.default_rng(1)
  q, k, v = _inputs(rng, 2, 200, 2, 16)
  outs = [np.asarray(linear.linear_attention(q, k, v, causal=True, chunk_size=c))
          for c in (1, 8, 64, 256)]
  for o in outs[1:]:
    np.testing.assert_allclose(o, outs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("t", [40, 63, 64])
def test_causal_outputs_ignore_future_tokens_bitwise(t):
  rng = np.random.default_rng(t)
  q, k, v = _inputs(rng, 2, 150, 2, 16)
  out = linear.linear_attention(q, k, v, causal=True, chunk_size=64)
  future = jnp.arange(150)[None, :, None, None] > t
  q2, k2, v2 = (jnp.where(future, x * 5 + 3, x) for x in (q, k, v))
  out2 = linear.linear_attention(q2, k2, v2, causal=True, chunk_size=64)
  np.testing.assert_array_equal(np.asarray(out)[:, :t + 1], np.asarray(out2)[:, :t + 1])
  assert not np.array_equal(np.asarray(out)[:, t + 1:], np.asarray(out2)[:, t + 1:])


def _all_avals(jaxpr):
  """Yields every intermediate aval of a jaxpr and its sub-jaxprs, and every scan length."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      yield "scan", eqn.params["length"]
    for var in eqn.outvars:
      yield "aval", var.aval
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _all_avals(inner)


@pytest.mark.parametrize("log_scale", [False, True])
def test_causal_never_builds_an_l_m_d_tensor_nor_scans_tokens(log_scale):
  b, h, length, m, dv, chunk = 1, 1, 1024, 32, 16, 64
  phi = jnp.ones((b, h, length, m))                  # head-major
  v = jnp.ones((b, h, length, dv))
  ls = jnp.zeros((b, h, length)) if log_scale else None

  def loss(pq, pk, v):
    return jnp.sum(linear.causal_linear_attention(pq, pk, v, chunk, key_log_scale=ls))

  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(phi, phi, v).jaxpr
  items = list(_all_avals(jaxpr))
  biggest = max(int(np.prod(a.shape)) for kind, a in items if kind == "aval")
  assert biggest < length * m * dv // 4, biggest     # [L/C, m, dv] is 1/64 of [L, m, dv]
  assert all(n <= length // chunk for kind, n in items if kind == "scan")


def test_errors_say_what_to_do():
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(ValueError, match="chunk_size must be a positive int"):
    linear.linear_attention(q, q, q, causal=True, chunk_size=0)
  with pytest.raises(ValueError, match="same length"):
    linear.linear_attention(q, jnp.zeros((1, 6, 2, 4)), jnp.zeros((1, 6, 2, 4)), causal=True)
  with pytest.raises(ValueError, match=r"key_mask must have shape \[batch, length\]"):
    linear.linear_attention(q, q, q, key_mask=jnp.ones((1, 7), bool))
  with pytest.raises(ValueError, match="key_mask must be boolean"):
    linear.linear_attention(q, q, q, key_mask=jnp.ones((1, 8)))


def test_registered():
  assert attention.get("linear") is linear.linear_attention
  assert attention.linear_attention is linear.linear_attention


U = 2.0 ** -9                                        # bfloat16's unit roundoff


@pytest.mark.parametrize("causal,length,chunk", [(False, 37, 16), (True, 37, 8), (True, 5, 16)])
def test_fast_precision_within_the_bfloat16_bound(causal, length, chunk):
  """precision="fast" against "exact" and the float64 transcription (`_naive` of elu + 1),
  outputs and gradients, with padding. Bound: the features, values and states are rounded to
  bfloat16 as matmul operands, causal chunk scores once more: at most D = 5 u relative on any
  weight of the average, so |out_fast - out_exact| <= (exp(2 D) - 1) * 2 max |v|; gradients
  within 4 times that relative to their largest entry, and closer to exact than 0 by 10x."""
  rng = np.random.default_rng(length)
  q, k, v = _inputs(rng, 3, length, 2, 8, dv=5)
  key_mask = _key_mask(3, length, rng)
  attend = {p: (lambda q, k, v, p=p: linear.linear_attention(
      q, k, v, causal=causal, key_mask=key_mask, chunk_size=chunk, precision=p))
            for p in ("exact", "fast")}
  fast, exact = (np.asarray(attend[p](q, k, v)) for p in ("fast", "exact"))
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  ref = _naive(_elu1(q64), _elu1(k64), v64, causal=causal, key_mask=key_mask)
  bound = (np.exp(2 * 5 * U) - 1) * 2 * np.abs(v64).max()
  assert np.abs(fast - exact).max() <= bound and np.abs(fast - ref).max() <= bound
  assert np.abs(fast - exact).max() > 0              # it did round
  assert not np.any(fast[0])

  ct = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
  grads = {p: jax.grad(lambda q, k, v: jnp.sum(ct * attend[p](q, k, v)), argnums=(0, 1, 2))(
      q, k, v) for p in ("fast", "exact")}
  for name, gf, ge in zip("qkv", grads["fast"], grads["exact"]):
    gf, ge = np.asarray(gf), np.asarray(ge)
    err = np.abs(gf - ge).max()
    assert err <= 4 * bound * np.abs(ge).max() / np.abs(v64).max() + 1e-6, name
    assert err <= 0.1 * np.abs(ge).max(), name


def test_precision_auto_is_exact_on_cpu_and_bad_settings_are_refused():
  rng = np.random.default_rng(0)
  q, k, v = _inputs(rng, 1, 12, 1, 8)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(linear.linear_attention(q, k, v),
                                  linear.linear_attention(q, k, v, precision="exact"))
  with pytest.raises(ValueError, match="precision must be one of"):
    linear.linear_attention(q, k, v, precision="half")
