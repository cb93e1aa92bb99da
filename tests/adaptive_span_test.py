"""Adaptive span attention against an independent NumPy dense reference.

The reference builds the full `[L, L]` distance matrix, the soft mask from the paper's formula,
and softmax(s + log m) with log 0 = -inf, padding and the causal rule applied explicitly; the
layer under test only ever sees the band.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from attention.adaptive_span import adaptive_span_attention, span_mask, span_window


def np_mask(x, z, ramp):
  out = np.empty(np.broadcast(x, z).shape)
  for idx in np.ndindex(out.shape):
    xi = np.broadcast_to(x, out.shape)[idx]
    zi = np.broadcast_to(z, out.shape)[idx]
    out[idx] = min(1.0, max(0.0, (ramp + zi - xi) / ramp))
  return out


def np_reference(q, k, v, span, ramp, causal, key_mask, extra=None):
  """softmax((q.k + extra) / sqrt(D) + log m) over the allowed keys; `extra` `[B, H, L, L]`
  (Transformer-XL's position term) or None."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b_, length, h, d = q.shape
  t = np.arange(length)[:, None]
  r = np.arange(length)[None, :]
  dist = (t - r) if causal else np.abs(t - r)
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  for b in range(b_):
    for head in range(h):
      m = np_mask(dist, span[head], ramp)
      ok = (m > 0) & key_mask[b][None, :]
      if causal:
        ok &= r <= t
      s = q[b, :, head] @ k[b, :, head].T
      if extra is not None:
        s = s + np.asarray(extra, np.float64)[b, head]
      s = s / np.sqrt(d)
      s = np.where(ok, s + np.log(np.where(ok, m, 1.0)), -np.inf)
      for i in range(length):
        if not key_mask[b, i] or not ok[i].any():
          continue
        w = np.exp(s[i] - s[i].max())
        out[b, i, head] = (w / w.sum()) @ v[b, :, head]
  return out


def inputs(length, heads=3, batch=2, d=8, seed=0, pad=True):
  ks = jax.random.split(jax.random.key(seed), 3)
  q, k, v = (jax.random.normal(x, (batch, length, heads, d)) for x in ks)
  key_mask = np.ones((batch, length), bool)
  if pad:
    key_mask[1, length - length // 3:] = False
  return q, k, v, key_mask


def test_span_mask_is_the_formula_at_every_distance():
  ramp = 7.0
  z = np.array([0.0, 3.5, 12.0, 40.0])
  x = np.arange(0, 60)[:, None].astype(float)
  got = np.asarray(span_mask(jnp.asarray(x), jnp.asarray(z), ramp))
  np.testing.assert_allclose(got, np_mask(x, z, ramp), atol=1e-6)
  assert got[0, 0] == 1.0 and got[7, 0] == 0.0 and got[3, 0] == pytest.approx(4 / 7)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [37, 70])
def test_full_spans_equal_dense_band_reference(causal, length):
  max_span, ramp = 20, 6
  q, k, v, key_mask = inputs(length)
  span = np.full(3, float(max_span))
  got = adaptive_span_attention(q, k, v, span=jnp.asarray(span), max_span=max_span, ramp=ramp,
                                causal=causal, key_mask=jnp.asarray(key_mask), block_size=16)
  want = np_reference(q, k, v, span, ramp, causal, key_mask)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_random_spans_per_head_equal_dense_reference(causal):
  max_span, ramp = 40, 5
  q, k, v, key_mask = inputs(53, heads=4, seed=1)
  span = np.array([0.0, 2.7, 11.3, 33.9])
  got = adaptive_span_attention(q, k, v, span=jnp.asarray(span), max_span=max_span, ramp=ramp,
                                causal=causal, key_mask=jnp.asarray(key_mask), block_size=8)
  want = np_reference(q, k, v, span, ramp, causal, key_mask)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_relative_positions_combine_with_the_span_mask(causal):
  # Transformer-XL's logits ((q + u).k_j + (q + v).R[i - j]) / sqrt(D) through the factorised
  # features the layer appends to q and k, then the soft mask: against the reference with the
  # position term from `relative.position_scores` (the shift form, tested on its own).
  from attention import relative
  length, heads, d, e = 37, 3, 8, 6
  q, k, v, key_mask = inputs(length, heads=heads, d=d, seed=4)
  ks = jax.random.split(jax.random.key(9), 3)
  u, vb = (0.3 * jax.random.normal(x, (heads, d)) for x in ks[:2])
  w_r = jax.random.normal(ks[2], (e, heads, d)) / np.sqrt(e)
  span = np.array([0.0, 5.5, 40.0])
  qa, ka = relative.factorised_qk(q, k, u=u, v_bias=vb, w_r=w_r)
  got = adaptive_span_attention(qa, ka, v, span=jnp.asarray(span), max_span=40, ramp=8,
                                causal=causal, key_mask=jnp.asarray(key_mask), block_size=8)
  extra = relative.position_scores(q + vb, w_r, length)
  want = np_reference(q + u, k, v, span, 8, causal, key_mask, extra=extra)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_memory_attention_with_spans_by_definition():
  """The memory's attention with a span per head (models/memory.py), against a NumPy
  transcription of Transformer-XL's logit plus log m over the keys [memory; segment], with a
  padded memory key; and with an empty memory it equals the band computation of the primitive
  on the factorised features."""
  from attention import relative
  from models import memory as memory_lib
  b, lq, prefix, h, d, e, ramp = 1, 5, 9, 3, 4, 6, 3
  keys = jax.random.split(jax.random.key(3), 6)
  q = jax.random.normal(keys[0], (b, lq, h, d))
  k, v = (jax.random.normal(keys[i], (b, prefix + lq, h, d)) for i in (1, 2))
  u, vb = (0.5 * jax.random.normal(keys[i], (h, d)) for i in (3, 4))
  w_r = jax.random.normal(keys[5], (e, h, d)) / np.sqrt(e)
  valid = jnp.ones((b, prefix + lq), bool).at[0, 2].set(False)
  span = np.array([0.0, 2.5, 7.0])
  got = memory_lib.memory_attention(q, k, v, u=u, v_bias=vb, w_r=w_r, key_valid=valid,
                                    query_valid=jnp.ones((b, lq), bool),
                                    span=jnp.asarray(span), ramp=ramp)
  q, k, v, u, vb, w_r = map(np.asarray, (q, k, v, u, vb, w_r))
  want = np.zeros(got.shape, np.float64)
  for head in range(h):
    for i in range(lq):
      p = prefix + i
      seen = [j for j in range(p + 1) if j != 2
              and np_mask(np.array(p - j), span[head], ramp) > 0]
      m = np.array([float(np_mask(np.array(p - j), span[head], ramp)) for j in seen])
      r = np.asarray(relative.sinusoid([p - j for j in seen], e)) @ w_r[:, head]
      logit = (k[0, seen, head] @ (q[0, i, head] + u[head]) +
               r @ (q[0, i, head] + vb[head])) / np.sqrt(d) + np.log(m)
      w = np.exp(logit - logit.max())
      want[0, i, head] = (w / w.sum()) @ v[0, seen, head]
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  # No memory: the same as the primitive's band on the factorised q and k.
  qs, ks, vs = (jnp.asarray(x[:, -lq:]) if x.shape[1] > lq else jnp.asarray(x)
                for x in (q, k, v))
  alone = memory_lib.memory_attention(qs, ks, vs, u=jnp.asarray(u), v_bias=jnp.asarray(vb),
                                      w_r=jnp.asarray(w_r), key_valid=jnp.ones((b, lq), bool),
                                      query_valid=jnp.ones((b, lq), bool),
                                      span=jnp.asarray(span), ramp=ramp)
  qa, ka = relative.factorised_qk(qs, ks, u=jnp.asarray(u), v_bias=jnp.asarray(vb),
                                  w_r=jnp.asarray(w_r))
  band = adaptive_span_attention(qa, ka, vs, span=jnp.asarray(span), max_span=8, ramp=ramp,
                                 causal=True, block_size=8)
  np.testing.assert_allclose(np.asarray(alone), np.asarray(band), atol=1e-5)


def test_window_follows_the_largest_span():
  assert span_window(np.array([1.0, 3.0]), 4, 100, block=8) == 8
  assert span_window(np.array([1.0, 4.5]), 4, 100, block=8) == 16
  assert span_window(np.array([500.0]), 4, 100, block=8) == 104


def test_span_gradient_is_nonzero_only_inside_the_ramp():
  # Length 12, ramp 4: a head with span 3 has keys at distances 4..6 inside its ramp; a head
  # with span 30 has every key (distance <= 11) at mask 1, so none inside its ramp.
  q, k, v, _ = inputs(12, heads=2, batch=1, pad=False)
  def loss(span):
    out = adaptive_span_attention(q, k, v, span=span, max_span=40, ramp=4, causal=True,
                                  window=40, block_size=8)
    return jnp.sum(out * v)
  g = np.asarray(jax.grad(loss)(jnp.array([3.0, 30.0])))
  assert abs(g[0]) > 1e-4
  assert g[1] == 0.0


def authors_mask(current_val, max_size, ramp_size):
  """`AdaptiveMask.forward` of facebookresearch/adaptive-span (adaptive_span.py), transcribed:
  the mask over the `max_size` positions before the query, entry j for the key max_size - j
  back, and its derivative in `current_val` (z / max_size) as torch computes it, clamp's being
  1 on [0, 1] bounds included and 0 outside. Float64."""
  mask_template = np.linspace(1 - max_size, 0, max_size)
  mask = mask_template + current_val * max_size
  mask = mask / ramp_size + 1
  grad = np.where((mask >= 0) & (mask <= 1), max_size / ramp_size, 0.0)
  return np.clip(mask, 0, 1), grad


def ours_from_authors(z, distance, ramp, size=32):
  """Our mask and dm/dz at `distance` (an int array) from `authors_mask`: theirs starts at the
  key one back, ours at the query itself, so our distance x is their x + 1 (column
  size - 1 - x)."""
  mask, grad = authors_mask(z / size, size, ramp)   # size a power of 2: z / size * size == z
  col = size - 1 - np.asarray(distance)
  return mask[col], grad[col] / size


@pytest.mark.parametrize("z", [0.0, 1.0, 6.0, 13.0, 2.5, 7.25])
def test_the_ramps_value_and_span_gradient_are_the_authors_mask_at_its_kinks_too(z):
  # At integer spans the ramp is exactly 1 at x = z and exactly 0 at x = z + R; torch.clamp
  # passes the slope 1/R at both, jnp.clip would give half.
  ramp, x = 5.0, np.arange(0, 31)
  want, want_grad = ours_from_authors(z, x, ramp)
  got = span_mask(jnp.asarray(x, jnp.float32), jnp.float32(z), ramp)
  grad = jax.jacfwd(lambda s: span_mask(jnp.asarray(x, jnp.float32), s, ramp))(jnp.float32(z))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-7)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-6)
  # The values are jnp.clip's, bit for bit.
  np.testing.assert_array_equal(
      np.asarray(got), np.asarray(jnp.clip((ramp + jnp.float32(z) - x) / ramp, 0.0, 1.0)))
  if z == int(z):
    assert grad[int(z)] == grad[int(z) + int(ramp)] == np.float32(1 / ramp)


def paper_form_span_gradient(q, k, v, c, span, ramp, causal, key_mask):
  """d sum(o * c) / dz per head for the paper's o_t = sum_r m e^s v_r / sum_r m e^s over the
  real (and, causal, earlier) keys, with the authors' mask and its torch derivative
  (`ours_from_authors`): every key with dm/dz != 0 counts, m = 0 ones included."""
  q, k, v, c = (np.asarray(a, np.float64) for a in (q, k, v, c))
  b_, length, h, d = q.shape
  t, r = np.arange(length)[:, None], np.arange(length)[None, :]
  dist = (t - r) if causal else np.abs(t - r)
  out = np.zeros(h)
  for b in range(b_):
    for head in range(h):
      m, dmdz = ours_from_authors(span[head], np.clip(dist, 0, 31), ramp)
      real = key_mask[b][None, :] & ((r <= t) if causal else True)
      s = q[b, :, head] @ k[b, :, head].T / np.sqrt(d)
      s = np.where(real, s, -np.inf)
      e = np.exp(s - s.max(axis=1, keepdims=True))
      z_t = (m * e).sum(axis=1, keepdims=True)
      z_t = np.where(z_t > 0, z_t, 1.0)   # padded queries with no key in their span
      o = (m * e) @ v[b, :, head] / z_t
      do_dm = e[:, :, None] * (v[b, None, :, head] - o[:, None, :]) / z_t[:, :, None]
      per_query = np.einsum("trd,td->t", do_dm * dmdz[:, :, None], c[b, :, head])
      out[head] += per_query[key_mask[b]].sum()
  return out


@pytest.mark.parametrize("causal", [True, False])
def test_span_gradient_at_integer_spans_is_the_papers_form_with_the_authors_mask(causal):
  """At spans 0 (the paper's start), 1, 6 and S = 20 the ramp has keys exactly at both of its
  ends; the gradient there is that of m e^s / sum m e^s with torch's clamp derivative,
  including the key at x = z + R (m = 0, left out of the log form's softmax). 2.5: no kink."""
  max_span, ramp, length = 20, 5, 29
  q, k, v, key_mask = inputs(length, heads=5, seed=6)
  c = jax.random.normal(jax.random.key(8), v.shape)
  span = np.array([0.0, 1.0, 6.0, 20.0, 2.5])

  def loss(z):
    out = adaptive_span_attention(q, k, v, span=z, max_span=max_span, ramp=ramp,
                                  causal=causal, key_mask=jnp.asarray(key_mask),
                                  window=max_span + ramp, block_size=8)
    return jnp.sum(out * c)

  got = np.asarray(jax.grad(loss)(jnp.asarray(span, jnp.float32)))
  want = paper_form_span_gradient(q, k, v, c, span, ramp, causal, key_mask)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)


def test_the_modules_span_has_the_authors_gradient_at_0_and_1():
  """p = 0 (the paper's start) and p = 1 are the clip's bounds: d z / d p = S there, as for
  the authors' current_val (clamped after each update, never in the forward pass); 0 outside
  [0, 1]. The L1 term's gradient at 0 is the whole lambda / M * S."""
  from models import attention_extras
  module = attention_extras.AdaptiveSpan(
      {"max_span": 16, "ramp": 4, "penalty": 0.5}, num_heads=4, head_dim=8, max_length=64,
      rngs=nnx.Rngs(0))
  module.span[...] = jnp.array([0.0, 1.0, 0.25, -0.1])
  grad = nnx.grad(lambda m: jnp.sum(m.spans()))(module)
  np.testing.assert_array_equal(np.asarray(grad["span"][...]), [16.0, 16.0, 16.0, 0.0])
  grad = nnx.grad(lambda m: m.penalty_terms())(module)
  grad = np.asarray(grad["span"][...])
  np.testing.assert_allclose(grad, np.array([1.0, 1.0, 1.0, 0.0]) * 0.5 / 4 * 16)


def test_the_penalty_is_lambda_over_heads_times_the_clipped_spans_of_every_layer():
  from models import attention_extras

  def layer(init):
    return attention_extras.AdaptiveSpan(
        {"max_span": 10, "ramp": 4, "penalty": 0.5, "span_init": init}, num_heads=4,
        head_dim=8, max_length=64, rngs=nnx.Rngs(0))

  class Two(nnx.Module):
    def __init__(self):
      self.a, self.b = layer(3.0), layer(25.0)   # the second clipped to S = 10

  got = float(attention_extras.penalty(Two()))
  assert got == pytest.approx(0.5 / 4 * (4 * 3.0 + 4 * 10.0))
  kwargs = layer(3.0)(length=64, rng=None)
  assert kwargs["window"] == 14 and kwargs["max_span"] == 10 and kwargs["ramp"] == 4


def test_the_update_projects_the_spans_into_their_range_and_nothing_else():
  """The trainer projects p back into [0, 1] after each update, as the paper clamps it: a span
  the L1 term pushes under 0 sits at 0, where the loss's gradient can grow it again."""
  from models import attention_extras

  class Model(nnx.Module):
    def __init__(self):
      self.extras = attention_extras.AdaptiveSpan(
          {"max_span": 10, "ramp": 4}, num_heads=3, head_dim=8, max_length=64,
          rngs=nnx.Rngs(0))
      self.other = nnx.Param(jnp.array([-2.0, 0.5, 3.0]))

  _, params, _ = nnx.split(Model(), nnx.Param, ...)
  moved = jax.tree_util.tree_map(lambda x: x + jnp.array([-0.3, 0.5, 1.7]), params)
  for tree in (moved, nnx.to_pure_dict(moved)):          # a state, or its plain dict
    out = attention_extras.project(tree)
    span = out["extras"]["span"]
    np.testing.assert_allclose(span[...] if isinstance(span, nnx.Variable) else span,
                               [0.0, 0.5, 1.0])
    other = out["other"]
    np.testing.assert_allclose(other[...] if isinstance(other, nnx.Variable) else other,
                               [-2.3, 1.0, 4.7], rtol=1e-6)


def test_the_character_lm_configs_take_the_papers_settings():
  from configs import enwik8
  base = enwik8.get_config("attention=adaptive_span,size=base")
  assert (base.model.num_layers, base.model.emb_dim, base.model.num_heads) == (12, 512, 8)
  span = base.model.attention
  assert (span.kind, span.max_span, span.ramp, span.penalty) == ("adaptive_span", 8192, 32, 2e-6)
  small = enwik8.get_config("attention=adaptive_span,size=small")
  assert small.model.attention.max_span == small.data.max_length and small.data.fallback
