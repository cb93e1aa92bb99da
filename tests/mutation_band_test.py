"""Tests written to kill the surviving mutants of attention/band.py (benchmarks/mutation.py,
docs/testing.md). They run first in the module's mutation run, so they are small and broad:
band attention against a dense reference built here from the Longformer definition (query i
sees key j when |i - j| <= w d and d divides i - j, only j <= i when causal; global tokens see
and are seen by every real key; padding is neither), outputs and gradients; the block-size rule;
the limits on global tokens."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import band


def _pattern(length, window, dilations, causal, glob, real):
  """bool `[B, H, L, L]` from the definition, by loops over (i, j)."""
  b, h = real.shape[0], len(dilations)
  out = np.zeros((b, h, length, length), bool)
  for n in range(b):
    for head, d in enumerate(dilations):
      for i in range(length):
        for j in range(length):
          t = i - j
          ok = abs(t) <= window * d and t % d == 0
          ok = ok or glob[n, i] or glob[n, j]
          if causal:
            ok = ok and j <= i
          out[n, head, i, j] = ok and real[n, i] and real[n, j]
  return out


def _dense(q, k, v, allowed):
  """Softmax attention restricted to `allowed` [B, H, L, L]; rows with no key give 0."""
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  logits = jnp.where(allowed, logits, -jnp.inf)
  peak = jnp.max(jnp.where(allowed, logits, -1e30), axis=-1, keepdims=True)
  w = jnp.where(allowed, jnp.exp(logits - jax.lax.stop_gradient(peak)), 0.0)
  total = jnp.sum(w, axis=-1, keepdims=True)
  p = w / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _out_and_grads(fn, q, k, v, ct):
  out, vjp = jax.vjp(fn, q, k, v)
  return dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(ct))))


# (length, window, dilation, causal, globals per row, padded lengths, block_size)
CASES = [
    (23, 2, (1, 2, 3), False, (2, 1), (23, 17), 4),    # per-head dilation, globals, padding
    (23, 3, (2, 2, 1), True, (1, 2), (20, 23), 4),     # causal, a run of equal dilations
    (19, 5, 1, False, (0, 3), (19, 0), None),          # an all-padding row, default block
    (6, 9, (3, 1, 1), False, (1, 0), (6, 4), 2),       # window past the end, tiny blocks
    (30, 4, (1, 1, 2), True, (2, 2), (30, 25), 16),    # block over one residue class
]


# The first two cases run in the fast set; all of them in the slow set and in mutation runs.
@pytest.mark.parametrize("case", [c if i < 2 else pytest.param(c, marks=pytest.mark.slow)
                                  for i, c in enumerate(CASES)], ids=[str(c) for c in CASES])
def test_band_against_the_definition(case):
  length, window, dilation, causal, n_glob, lengths, block = case
  h = 3
  rng = np.random.default_rng(length * 100 + window)
  q, k, v = (jnp.asarray(rng.normal(size=(2, length, h, 4)), jnp.float32) for _ in range(3))
  v = jnp.concatenate([v, v[..., :1] * 2], axis=-1)                  # Dv = 5 != D
  ct = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
  real = np.arange(length)[None] < np.asarray(lengths)[:, None]
  glob = np.zeros((2, length), bool)
  for row, count in enumerate(n_glob):
    glob[row, rng.choice(length, count, replace=False)] = True
  dils = (dilation,) * h if isinstance(dilation, int) else dilation
  allowed = jnp.asarray(_pattern(length, window, dils, causal, glob & real, real))
  use_glob = jnp.asarray(glob) if any(n_glob) else None

  def fast(q, k, v):
    return band.band_attention(q, k, v, window=window, dilation=dilation, causal=causal,
                               global_mask=use_glob, key_mask=jnp.asarray(real),
                               block_size=block)

  got = _out_and_grads(fast, q, k, v, ct)
  want = _out_and_grads(lambda q, k, v: _dense(q, k, v, allowed), q, k, v, ct)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  assert np.all(np.asarray(got["out"])[~real] == 0)


@pytest.mark.parametrize("block", [1, 4])
def test_a_window_of_one_reaches_into_the_next_block(block):
  """Window 1: the last query of a block needs the first key of the next one (and block_size 1,
  the smallest, is accepted and exact)."""
  rng = np.random.default_rng(11)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 13, 2, 4)), jnp.float32) for _ in range(3))
  real = np.ones((1, 13), bool)
  for causal in (False, True):
    allowed = jnp.asarray(_pattern(13, 1, (1, 1), causal, np.zeros((1, 13), bool), real))
    got = band.band_attention(q, k, v, window=1, causal=causal, block_size=block)
    chex.assert_trees_all_close(got, _dense(q, k, v, allowed), atol=2e-5, rtol=2e-5)


def test_band_without_key_mask_equals_all_real():
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 9, 2, 4)), jnp.float32) for _ in range(3))
  allowed = jnp.asarray(_pattern(9, 2, (1, 1), True, np.zeros((1, 9), bool), np.ones((1, 9),
                                                                                      bool)))
  chex.assert_trees_all_close(band.band_attention(q, k, v, window=2, causal=True),
                              _dense(q, k, v, allowed), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [0, 1, 2, 3, 5, 63, 64, 65, 100, 128, 129, 200, 256, 257,
                                    1000])
def test_default_block_size_is_the_documented_power_of_two(window):
  """The smallest power of two >= w / 2, kept within [32, 128] (default_block_size's doc)."""
  want = 1
  while want < window / 2:
    want *= 2
  assert band.default_block_size(window) == min(128, max(32, want))


def test_block_size_must_be_a_positive_int_and_numpy_ints_are_accepted():
  x = jnp.ones((1, 8, 1, 4))
  for bad in (True, 2.0, -3):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
      band.band_attention(x, x, x, window=1, block_size=bad)
  band.band_attention(x, x, x, window=1, block_size=np.int64(4))


def test_max_global_limits():
  """A concrete mask with more global tokens than max_global is refused; exactly max_global is
  fine; under jit a row over the bound is NaN and the other rows are exact."""
  rng = np.random.default_rng(8)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 10, 2, 4)), jnp.float32) for _ in range(3))
  glob = np.zeros((2, 10), bool)
  glob[0, [1, 6]] = True
  glob[1, 3] = True
  with pytest.raises(ValueError, match="2 global tokens in a row but max_global is 1"):
    band.band_attention(q, k, v, window=1, global_mask=jnp.asarray(glob), max_global=1)
  allowed = jnp.asarray(_pattern(10, 1, (1, 1), False, glob, np.ones((2, 10), bool)))
  want = _dense(q, k, v, allowed)
  got = band.band_attention(q, k, v, window=1, global_mask=jnp.asarray(glob), max_global=2)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  fn = jax.jit(lambda g: band.band_attention(q, k, v, window=1, global_mask=g, max_global=1))
  got = np.asarray(fn(jnp.asarray(glob)))
  assert np.isnan(got[0]).all()
  np.testing.assert_allclose(got[1], np.asarray(want[1]), atol=2e-5, rtol=2e-5)
  # max_global larger than needed: extra empty slots change nothing.
  got = band.band_attention(q, k, v, window=1, global_mask=jnp.asarray(glob), max_global=5)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)


def test_empty_batch_and_no_global_token():
  x = jnp.ones((0, 8, 2, 4))
  out = band.band_attention(x, x, x, window=1, global_mask=jnp.zeros((0, 8), bool))
  assert out.shape == (0, 8, 2, 4)
  y = jnp.asarray(np.random.default_rng(9).normal(size=(1, 8, 2, 4)), jnp.float32)
  plain = band.band_attention(y, y, y, window=1)
  none = band.band_attention(y, y, y, window=1, global_mask=jnp.zeros((1, 8), bool))
  chex.assert_trees_all_close(plain, none)
