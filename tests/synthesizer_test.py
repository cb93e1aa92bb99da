"""Tests for attention.synthesizer: every variant against a numpy transcription of its formula,
masking (padding, causal, all-padding rows), mixtures with dot-product attention (outputs and
gradients), per-head parameters and error messages."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import dot_product_attention
from attention.synthesizer import synthesizer_attention

B, L, H, D, N = 2, 9, 2, 4, 12


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _assert_close(a, b, tol=2e-5):
  """Arrays or trees of arrays `a` equal to the reference `b` within `tol`."""
  chex.assert_trees_all_close(a, b, atol=tol, rtol=tol)


def _params():
  return dict(
      dense=dict(w1=_normal(1, (H, D, 5)), b1=_normal(2, (H, 5)), w2=_normal(3, (5, N)),
                 b2=_normal(4, (N,))),
      random=_normal(5, (H, N, N)),
      factorized_dense=dict(wa=_normal(6, (D, 3)), ba=_normal(7, (3,)), wb=_normal(8, (D, 4)),
                            bb=_normal(9, (4,))),
      factorized_random=dict(r1=_normal(10, (N, 3)), r2=_normal(11, (H, N, 3))))


def _numpy_logits(name, q, k, prm):
  """Per-head `[B, H, L, L]` logits of each component, straight from the formulas."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  out = np.zeros((B, H, L, L))
  for hh in range(H):
    pick = lambda x, nd: np.asarray(x, np.float64)[hh] if np.ndim(x) > nd else np.asarray(x)
    for b in range(B):
      x = q[b, :, hh]                                                   # [L, D]
      if name == "dense":
        p = prm["dense"]
        hid = np.maximum(x @ pick(p["w1"], 2) + pick(p["b1"], 1), 0)
        out[b, hh] = (hid @ pick(p["w2"], 2) + pick(p["b2"], 1))[:, :L]
      elif name == "random":
        out[b, hh] = pick(prm["random"], 2)[:L, :L]
      elif name == "factorized_dense":
        p = prm["factorized_dense"]
        fa = x @ pick(p["wa"], 2) + pick(p["ba"], 1)                    # [L, 3]
        fb = x @ pick(p["wb"], 2) + pick(p["bb"], 1)                    # [L, 4]
        for j in range(L):
          out[b, hh, :, j] = fa[:, j % 3] * fb[:, j // 3]
      elif name == "factorized_random":
        p = prm["factorized_random"]
        out[b, hh] = pick(p["r1"], 2)[:L] @ pick(p["r2"], 2)[:L].T
      else:
        out[b, hh] = x @ k[b, :, hh].T / np.sqrt(D)
  return out


def _numpy_attention(logits, v, allowed):
  logits = np.where(allowed, logits, -np.inf)
  out = np.zeros((B, L, H, v.shape[-1]))
  for b in range(B):
    for hh in range(H):
      for i in range(L):
        row = logits[b, hh, i]
        if np.isfinite(row).any():
          p = np.exp(row - row.max())
          out[b, i, hh] = (p / p.sum()) @ np.asarray(v, np.float64)[b, :, hh]
  return out


@pytest.mark.parametrize("causal", [False, True])
def test_each_variant_and_a_mixture_match_numpy(causal):
  q, k, v = _normal(20, (B, L, H, D)), _normal(21, (B, L, H, D)), _normal(22, (B, L, H, 3))
  key_mask = jnp.arange(L)[None, :] < jnp.asarray([L, 5])[:, None]
  prm = _params()
  km = np.asarray(key_mask)
  allowed = km[:, None, :, None] & km[:, None, None, :]
  if causal:
    allowed = allowed & np.tril(np.ones((L, L), bool))
  fn = jax.jit(synthesizer_attention, static_argnames=("dot_product", "causal"))
  for name in ("dense", "random", "factorized_dense", "factorized_random"):
    out = fn(q, k, v, **{name: prm[name]}, causal=causal, key_mask=key_mask)
    _assert_close(out, _numpy_attention(_numpy_logits(name, q, k, prm), v, allowed))
  # Random + dense + vanilla with per-head weights.
  mix = np.asarray([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
  out = fn(q, k, v, dense=prm["dense"], random=prm["random"], dot_product=True, mix=mix,
           causal=causal, key_mask=key_mask)
  logits = sum(mix[None, :, c, None, None] * _numpy_logits(n, q, k, prm)
               for c, n in enumerate(("dense", "random", "dot")))
  _assert_close(out, _numpy_attention(logits, v, allowed))
  assert np.all(np.asarray(out)[1, 5:] == 0.0)


def test_dot_product_weight_only_equals_dense_attention_with_gradients():
  # All mixture weight on the dot-product component: exactly dense attention, for outputs and
  # for gradients w.r.t. q, k and v; a row that is all padding outputs 0 with finite grads.
  q, k, v = _normal(30, (3, L, H, D)), _normal(31, (3, L, H, D)), _normal(32, (3, L, H, D))
  key_mask = jnp.arange(L)[None, :] < jnp.asarray([L, 4, 0])[:, None]
  prm = _params()
  syn = lambda q, k, v: synthesizer_attention(q, k, v, random=prm["random"], dot_product=True,
                                              mix=[0.0, 1.0], causal=True, key_mask=key_mask)
  ref = lambda q, k, v: dot_product_attention(q, k, v, causal=True, key_mask=key_mask)
  out = jax.jit(syn)(q, k, v)
  _assert_close(out, jax.jit(ref)(q, k, v))
  assert np.all(np.asarray(out)[2] == 0.0)
  ct = _normal(33, out.shape)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
  grads = grad(syn)
  chex.assert_tree_all_finite(grads)
  _assert_close(dict(zip(("dq", "dk", "dv"), grads)), dict(zip(("dq", "dk", "dv"), grad(ref))))


def test_random_gradient_flows_to_parameters_only_through_allowed_pairs():
  v = _normal(40, (1, L, H, D))
  q = k = jnp.zeros((1, L, H, D))
  r = _normal(41, (H, N, N))
  key_mask = jnp.arange(L)[None, :] < 6
  f = lambda r: jnp.sum(synthesizer_attention(q, k, v, random=r, causal=True,
                                              key_mask=key_mask) ** 2)
  g = np.asarray(jax.jit(jax.grad(f))(r))
  allowed = np.tril(np.ones((L, L), bool)) & (np.arange(L) < 6)[None, :] & \
      (np.arange(L) < 6)[:, None]
  assert np.all(g[:, :L, :L][:, ~allowed] == 0.0) and np.all(g[:, L:] == 0.0)
  assert np.all(g[:, :, L:] == 0.0)
  assert np.count_nonzero(g[:, :L, :L][:, allowed]) > allowed.sum()  # both heads get gradient


def test_errors_say_what_to_do():
  q = k = v = _normal(50, (1, L, H, D))
  with pytest.raises(ValueError, match="at least one component"):
    synthesizer_attention(q, k, v)
  with pytest.raises(ValueError, match="max_length >= 9"):
    synthesizer_attention(q, k, v, random=jnp.zeros((8, 8)))
  with pytest.raises(ValueError, match=r"mix must give their weights: shape \[2\]"):
    synthesizer_attention(q, k, v, random=jnp.zeros((N, N)), dot_product=True)
  with pytest.raises(ValueError, match=r"mix must have shape \[2\] or \[2, 2\]"):
    synthesizer_attention(q, k, v, random=jnp.zeros((N, N)), dot_product=True, mix=[1, 2, 3])
  with pytest.raises(ValueError, match="leading head axis of size 2"):
    synthesizer_attention(q, k, v, random=jnp.zeros((3, N, N)))
  with pytest.raises(ValueError, match=r"keys \['w1', 'b1', 'w2', 'b2'\]"):
    synthesizer_attention(q, k, v, dense=dict(w1=jnp.zeros((D, 3))))
  with pytest.raises(ValueError, match=r"a \* b = 2 \* 4.*max_length >= 9"):
    synthesizer_attention(q, k, v, factorized_dense=dict(
        wa=jnp.zeros((D, 2)), ba=jnp.zeros(2), wb=jnp.zeros((D, 4)), bb=jnp.zeros(4)))
