"""Tests for attention.entmax: alpha-entmax attention against NumPy transcriptions of its limits
and its definition, its closed-form backward pass against central finite differences in
float64, masks, awkward shapes, bfloat16, and the model's learned alpha per head.

References written here, independently of the module: softmax; sparsemax by the sort-based
algorithm of Martins & Astudillo (2016, Algorithm 1); alpha-entmax by bisection on tau in the
paper's own form p_i = [(alpha - 1) z_i - tau]_+^(1 / (alpha - 1)), in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention import dot_product_attention, kinds
from attention.entmax import entmax, entmax_attention
from models import attention_extras
from models.attention_layer import MultiHeadAttention

B, LQ, LK, H, D = 2, 7, 9, 3, 4
# Compiled once per shape (op-by-op dispatch of the bisection is slow on a shared CPU).
attend = jax.jit(entmax_attention, static_argnames=("causal",))


def _normal(seed, shape, scale=1.0):
  return np.random.default_rng(seed).standard_normal(shape) * scale


def np_sparsemax(z):
  """Martins & Astudillo (2016), Algorithm 1, on one row (1-D)."""
  zs = np.sort(z)[::-1]
  cums = np.cumsum(zs)
  ks = np.arange(1, len(z) + 1)
  k = ks[1 + ks * zs > cums].max()
  tau = (cums[k - 1] - 1) / k
  return np.maximum(z - tau, 0.0)


def np_softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def np_entmax_tau(z, alpha):
  """(p, tau) of alpha-entmax on one row by bisection on tau (alpha > 1), in float64."""
  x = (alpha - 1) * z
  lo, hi = x.max() - 1, x.max() - (1 / len(z)) ** (alpha - 1)
  weights = lambda tau: np.maximum(x - tau, 0) ** (1 / (alpha - 1))
  for _ in range(200):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if weights(mid).sum() >= 1 else (lo, mid)
  p = weights((lo + hi) / 2)
  return p / p.sum(), (lo + hi) / 2


def np_entmax(z, alpha):
  if alpha == 1:
    return np_softmax(z)
  if alpha == 2:
    return np_sparsemax(z)
  return np_entmax_tau(z, alpha)[0]


def np_weights(q, k, alphas, allowed, row_fn=np_entmax):
  """Reference weights `[B, H, Lq, Lk]`: each row's map over its allowed keys, 0 elsewhere."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  z = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  allowed = np.broadcast_to(allowed, z.shape)
  p = np.zeros_like(z)
  for b, h, i in np.ndindex(*z.shape[:3]):
    on = allowed[b, h, i]
    if on.any():
      p[b, h, i, on] = row_fn(z[b, h, i, on], alphas[h])
  return p


def np_attention(q, k, v, alphas, allowed, row_fn=np_entmax):
  p = np_weights(q, k, alphas, allowed, row_fn)
  return np.einsum("bhqk,bkhd->bqhd", p, np.asarray(v, np.float64))


def qkv(seed=0, lq=LQ, lk=LK, dtype=jnp.float32, scale=2.0):
  q = jnp.asarray(_normal(seed, (B, lq, H, D), scale), dtype)
  k = jnp.asarray(_normal(seed + 1, (B, lk, H, D), scale), dtype)
  v = jnp.asarray(_normal(seed + 2, (B, lk, H, D)), dtype)
  return q, k, v


def key_mask(lk=LK):
  m = np.ones((B, lk), bool)
  m[1, lk - 3:] = False                                  # a padded second example
  return m


def allowed(lq, lk, km=None, causal=False, query_mask=None):
  a = np.ones((B, 1, lq, lk), bool)
  if causal:
    a &= np.tril(np.ones((lq, lk), bool))
  if km is not None:
    a &= km[:, None, None, :]
  if query_mask is not None:
    a &= query_mask[:, None, :, None]
  return a


def read_weights(q, k, alpha, **kw):
  """The weights entmax_attention uses, read through one-hot values `[B, Lk, H, Lk]`."""
  lk = k.shape[1]
  v = jnp.broadcast_to(jnp.eye(lk, dtype=q.dtype)[None, :, None, :], (B, lk, H, lk))
  return jnp.transpose(attend(q, k, v, alpha, **kw), (0, 2, 1, 3))  # [B, H, Lq, Lk]


@pytest.mark.parametrize("causal", [False, True])
def test_alpha_one_is_softmax_attention(causal):
  q, k, v = qkv()
  km = key_mask()
  got = attend(q, k, v, 1.0, key_mask=km, causal=causal)
  want = dot_product_attention(q, k, v, key_mask=km, causal=causal)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  ref = np_attention(q, k, v, [1.0] * H, allowed(LQ, LK, km, causal), row_fn=lambda z, a:
                     np_softmax(z))
  np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_alpha_two_is_sparsemax_attention(causal):
  q, k, v = qkv(seed=3)
  km = key_mask()
  got = attend(q, k, v, 2.0, key_mask=km, causal=causal)
  ref = np_attention(q, k, v, [2.0] * H, allowed(LQ, LK, km, causal),
                     row_fn=lambda z, a: np_sparsemax(z))
  np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
  p = read_weights(q, k, 2.0, key_mask=km, causal=causal)
  assert (np.asarray(p) == 0).mean() > 0.3             # sparsemax: many exact zeros


def test_per_head_alpha_matches_the_papers_definition():
  q, k, v = qkv(seed=5)
  alphas = np.array([1.25, 1.5, 1.8])
  km = key_mask()
  got = attend(q, k, v, jnp.asarray(alphas, jnp.float32), key_mask=km)
  ref = np_attention(q, k, v, alphas, allowed(LQ, LK, km, query_mask=km[:, :LQ]
                                              if LQ == LK else None))
  np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("alpha", [1.0, 1.0001, 1.3, 1.5, 2.0])
def test_weights_sum_to_one_over_real_keys_with_exact_zeros_where_the_threshold_says(alpha):
  q, k, _ = qkv(seed=7)
  km = key_mask()
  p = np.asarray(read_weights(q, k, alpha, key_mask=km))                   # [B, H, Lq, Lk]
  np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)
  assert (p[1, :, :, LK - 3:] == 0).all()                                  # padded keys
  z = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64)) / 2
  zeros = 0
  for b, h, i in np.ndindex(B, H, LQ):
    on = km[b]
    if alpha in (1.0, 1.0001):
      assert (p[b, h, i, on] > 0).all()                   # softmax-like: no zeros
      continue
    _, tau = np_entmax_tau(z[b, h, i, on], alpha)
    margin = (alpha - 1) * z[b, h, i, on] - tau
    clear = np.abs(margin) > 1e-5                         # away from the threshold
    assert (p[b, h, i, on][clear & (margin < 0)] == 0).all()
    assert (p[b, h, i, on][clear & (margin > 0)] > 0).all()
    zeros += (margin < 0).sum()
  assert alpha < 1.1 or zeros > 0


def test_masks_and_empty_rows_against_the_dense_reference():
  q, k, v = qkv(seed=9, lq=LK)
  km = key_mask()
  km[0, :] = False                                      # an example with no real key at all
  alphas = np.array([1.0, 1.6, 2.0])
  for causal in (False, True):
    got = attend(q, k, v, jnp.asarray(alphas), key_mask=km, causal=causal)
    ref = np_attention(q, k, v, alphas, allowed(LK, LK, km, causal, query_mask=km))
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)
    assert (np.asarray(got)[0] == 0).all()              # rows with no allowed key give 0
    assert (np.asarray(got)[1, LK - 3:] == 0).all()     # padded queries give 0


@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 1), (3, 11), (13, 5)])
def test_awkward_shapes(lq, lk):
  q, k, v = qkv(seed=11, lq=lq, lk=lk)
  alphas = np.array([1.2, 1.5, 2.0])
  got = attend(q, k, v, jnp.asarray(alphas, jnp.float32))
  ref = np_attention(q, k, v, alphas, allowed(lq, lk))
  np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)
  if lk == 1:                                           # one key: its value, weight 1
    np.testing.assert_allclose(got, np.broadcast_to(v, got.shape), atol=1e-6)


def test_bfloat16_inputs_within_bfloat16_tolerance():
  q, k, v = qkv(seed=13, dtype=jnp.bfloat16)
  km = key_mask()
  alphas = jnp.asarray([1.0, 1.5, 2.0])
  got = attend(q, k, v, alphas, key_mask=km, causal=True)
  assert got.dtype == jnp.bfloat16
  ref = np_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                     np.asarray(alphas), allowed(LQ, LK, km, True))
  np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=2e-2, rtol=2e-2)
  p = np.asarray(read_weights(q.astype(jnp.float32), k.astype(jnp.float32), alphas,
                              key_mask=km), np.float32)
  np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)


def _central_differences(f, args, direction, h):
  plus = f(*[a + h * d for a, d in zip(args, direction)])
  minus = f(*[a - h * d for a, d in zip(args, direction)])
  return (plus - minus) / (2 * h)


@pytest.mark.parametrize("alphas,causal", [((1.0, 1.0, 1.0), False),
                                           ((1.05, 1.5, 1.95), True),
                                           ((1.3, 1.7, 2.0), False)])
def test_gradients_match_central_differences_in_float64(alphas, causal):
  with jax.enable_x64(True):
    q, k, v = qkv(seed=17, lq=LK, dtype=jnp.float64)
    km = key_mask()
    alpha = jnp.asarray(alphas, jnp.float64)
    w = jnp.asarray(_normal(23, (B, LK, H, D)), jnp.float64)
    # alpha = 2 and alpha = 1 are the ends of the interval: differentiate alpha inside it.
    alpha_dir = jnp.asarray([a not in (1.0, 2.0) for a in alphas], jnp.float64)

    def loss(q, k, v, alpha):
      return jnp.sum(w * attend(q, k, v, alpha, key_mask=km, causal=causal))

    loss = jax.jit(loss)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, alpha)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    for seed in range(3):
      direction = [jnp.asarray(_normal(100 + seed + i, x.shape), jnp.float64)
                   for i, x in enumerate((q, k, v))] + [alpha_dir * (seed + 1)]
      fd = _central_differences(loss, (q, k, v, alpha), direction, 1e-6)
      analytic = sum(jnp.sum(g * d) for g, d in zip(grads, direction))
      np.testing.assert_allclose(analytic, fd, rtol=1e-6, atol=1e-7)
    for i in range(H):                                  # alpha alone, head by head
      if alphas[i] in (1.0, 2.0):
        continue
      e = jnp.zeros(H, jnp.float64).at[i].set(1.0)
      fd = _central_differences(lambda a: loss(q, k, v, a), (alpha,), (e,), 1e-6)
      np.testing.assert_allclose(grads[3][i], fd, rtol=1e-6, atol=1e-8)


def test_alpha_gradient_at_one_is_the_limit_of_its_neighbours():
  with jax.enable_x64(True):
    q, k, v = qkv(seed=29, dtype=jnp.float64)
    w = jnp.asarray(_normal(31, (B, LQ, H, D)), jnp.float64)
    grad = jax.jit(jax.grad(lambda a: jnp.sum(w * attend(q, k, v, a))))
    at_one = grad(jnp.ones(H, jnp.float64))
    assert np.abs(np.asarray(at_one)).max() > 1e-3
    for eps in (1e-3, 1e-4, 1e-6):
      np.testing.assert_allclose(grad(jnp.full(H, 1 + eps)), at_one, rtol=20 * eps, atol=1e-9)


def test_float32_alpha_gradient_near_one_is_accurate():
  # f(w) by its series keeps the alpha derivative accurate as alpha -> 1 in float32.
  q, k, v = qkv(seed=37)
  w = jnp.asarray(_normal(41, (B, LQ, H, D)), jnp.float32)
  alpha = jnp.asarray([1.001, 1.01, 1.3], jnp.float32)
  g32 = jax.jit(jax.grad(lambda a: jnp.sum(w * attend(q, k, v, a))))(alpha)
  with jax.enable_x64(True):
    g64 = jax.grad(lambda a: jnp.sum(jnp.asarray(w, jnp.float64) * attend(
        *(jnp.asarray(x, jnp.float64) for x in (q, k, v)), a)))(jnp.asarray(alpha, jnp.float64))
  np.testing.assert_allclose(g32, g64, rtol=1e-3, atol=1e-5)


def test_entmax_on_scores_takes_a_scalar_alpha_and_a_mask():
  z = jnp.asarray(_normal(43, (1, 2, 3, 6), 3.0), jnp.float32)
  mask = jnp.asarray([True, True, False, True, False, True])
  p = entmax(z, 1.5, mask)
  assert (np.asarray(p)[..., ~np.asarray(mask)] == 0).all()
  ref = np_entmax(np.asarray(z, np.float64)[0, 1, 2, np.asarray(mask)], 1.5)
  np.testing.assert_allclose(np.asarray(p)[0, 1, 2, np.asarray(mask)], ref, atol=1e-6)


def test_bad_alphas_are_refused():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="scalar or one value per head"):
    entmax_attention(q, k, v, jnp.ones(H + 1) * 1.5)
  with pytest.raises(ValueError, match=">= 1"):
    entmax_attention(q, k, v, 0.5)


def test_the_model_learns_one_alpha_per_head_from_one_point_five():
  assert kinds.get("entmax").extras == "EntmaxAlpha"
  assert kinds.resolve("adaptively_sparse") == "entmax"
  layer = MultiHeadAttention(16, 2, 16, {"kind": "entmax", "alpha": "learned"}, max_length=8,
                             rngs=nnx.Rngs(0))
  alpha = layer.extras(length=8, rng=None)["alpha"]
  np.testing.assert_allclose(alpha, [1.5, 1.5])
  x = jnp.asarray(_normal(47, (2, 8, 16)), jnp.float32)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(p):
    return jnp.sum(nnx.merge(graphdef, p, rest)(x, None) ** 2)

  grad = jax.jit(jax.grad(loss))(params)
  g = np.asarray(grad["extras"]["logit"][...])
  assert g.shape == (2,) and np.abs(g).min() > 0
  fixed = attention_extras.make_extras("entmax", {"alpha": 2.0}, num_heads=2, head_dim=8,
                                       max_length=8, rngs=nnx.Rngs(0))
  assert fixed(length=8, rng=None) == {"alpha": 2.0}
  assert not jax.tree.leaves(nnx.state(fixed, nnx.Param))
  with pytest.raises(ValueError, match="'learned' or a number in"):
    attention_extras.make_extras("entmax", {"alpha": 3}, num_heads=2, head_dim=8,
                                 max_length=8, rngs=nnx.Rngs(0))


def test_the_trained_model_report_counts_exact_zeros_over_real_pairs():
  from benchmarks import entmax_trained
  q, k, _ = qkv(seed=53, lq=LK)
  km = key_mask()
  rec = {"q": np.asarray(q), "k": np.asarray(k), "alpha": np.asarray([1.0, 1.5, 2.0], np.float32),
         "causal": True, "key_mask": km}
  row = entmax_trained.layer_sparsity(rec)
  pairs = allowed(LK, LK, km, True, query_mask=km)
  p = np_weights(q, k, [1.0, 1.5, 2.0], pairs)
  pairs = np.broadcast_to(pairs, p.shape)
  want = [((p[:, h] == 0) & pairs[:, h]).sum() / pairs[:, h].sum() for h in range(H)]
  np.testing.assert_allclose(row["zero_fraction_per_head"], want, atol=1e-4)
  assert row["zero_fraction_per_head"][0] == 0 and row["pairs"] == pairs.sum()
  assert row["alpha"] == [1.0, 1.5, 2.0]
