"""Tests for attention.lsh: the dense definition in masks.lsh_pair_counts (outputs and
gradients), equality with dense attention for one bucket, exact causality, padding, determinism
and error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import dot_product_attention, masks
from attention.dot_product import masked_softmax_stats
from attention.lsh import lsh_attention, lsh_buckets, shared_qk_keys


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _assert_close(a, b, tol=2e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


def _dense_lsh(qk, v, counts):
  """Softmax over logits + log(count) where count > 0: the documented meaning of the rounds."""
  keys = shared_qk_keys(qk)
  logits = jnp.einsum("bqhd,bkhd->bhqk", qk, keys) / np.sqrt(qk.shape[-1])
  logits = logits + jnp.log(jnp.maximum(counts, 1).astype(jnp.float32))
  p, _, row_sum = masked_softmax_stats(logits, counts > 0)
  out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(row_sum > 0, row_sum, 1.0), v)
  return out


def _grads(fn, qk, v):
  ct = _normal(77, v.shape)
  return jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b) * ct), argnums=(0, 1)))(qk, v)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_dense_definition(causal):
  # A length that is not a multiple of the chunk, a padded row and an all-padding row; three
  # rounds of four buckets.
  length, chunk = 13, 4
  qk, v = _normal(0, (3, length, 2, 8)), _normal(1, (3, length, 2, 6))
  key_mask = jnp.arange(length)[None, :] < jnp.asarray([length, length - 4, 0])[:, None]
  key = jax.random.key(3)
  kw = dict(num_hashes=3, num_buckets=4)
  buckets = lsh_buckets(qk, key=key, key_mask=key_mask, **kw)
  counts = jnp.asarray(masks.lsh_pair_counts(buckets, chunk_size=chunk, causal=causal,
                                             key_mask=key_mask))
  assert len(np.unique(np.asarray(buckets)[0])) > 2    # the hashing really splits tokens
  fast = lambda qk, v: lsh_attention(qk, v, key=key, chunk_size=chunk, causal=causal,
                                     key_mask=key_mask, **kw)
  ref = lambda qk, v: _dense_lsh(qk, v, counts)
  out = fast(qk, v)
  _assert_close(out, jax.jit(ref)(qk, v))
  assert np.all(np.asarray(out)[2] == 0.0) and np.all(np.asarray(out)[1, length - 4:] == 0.0)
  for g, r in zip(_grads(fast, qk, v), _grads(ref, qk, v)):
    assert np.all(np.isfinite(np.asarray(g)))
    _assert_close(g, r)


@pytest.mark.parametrize("causal", [False, True])
def test_one_bucket_equals_dense_with_self_exclusion(causal):
  # With one bucket the sorted order is position order, so every round is the same, and a
  # chunk longer than the sequence sees every key: dense attention where a query attends to
  # itself only when nothing else is allowed (the first position when causal).
  length = 11
  qk, v = _normal(4, (2, length, 2, 8)), _normal(5, (2, length, 2, 8))
  exclude_self = ~np.eye(length, dtype=bool)
  if causal:
    exclude_self[0, 0] = True
  fast = lambda qk, v: lsh_attention(qk, v, key=jax.random.key(0), num_hashes=3, num_buckets=1,
                                     chunk_size=length + 5, causal=causal)
  ref = lambda qk, v: dot_product_attention(qk, shared_qk_keys(qk), v, mask=exclude_self,
                                            causal=causal)
  _assert_close(fast(qk, v), jax.jit(ref)(qk, v))
  for g, r in zip(_grads(fast, qk, v), _grads(ref, qk, v)):
    _assert_close(g, r)


def test_causality_is_exact():
  # Changing token t (and everything after it) leaves every output before t bit-identical,
  # even though the new tokens move to other buckets and shift the chunk boundaries.
  length, kw = 24, dict(num_hashes=2, num_buckets=4, chunk_size=4, causal=True)
  qk, v = _normal(6, (1, length, 2, 8)), _normal(7, (1, length, 2, 8))
  fn = jax.jit(lambda qk, v: lsh_attention(qk, v, key=jax.random.key(1), **kw))
  base = np.asarray(fn(qk, v))
  base_buckets = lsh_buckets(qk, key=jax.random.key(1), num_hashes=2, num_buckets=4)
  moved = 0
  for t in (1, 5, 11, 17, 23):
    new_qk = qk.at[:, t:].set(_normal(100 + t, (1, length - t, 2, 8)) * 3)
    new_v = v.at[:, t:].set(_normal(200 + t, (1, length - t, 2, 8)))
    out = np.asarray(fn(new_qk, new_v))
    np.testing.assert_array_equal(out[:, :t], base[:, :t])
    assert not np.allclose(out[:, t:], base[:, t:])
    new_buckets = lsh_buckets(new_qk, key=jax.random.key(1), num_hashes=2, num_buckets=4)
    moved += int(np.any(np.asarray(new_buckets) != np.asarray(base_buckets)))
  assert moved >= 3  # the perturbations really changed the sorted order


@pytest.mark.parametrize("causal", [False, True])
def test_trailing_padding_does_not_change_real_outputs(causal):
  real = 10
  qk, v = _normal(8, (1, 19, 2, 8)), _normal(9, (1, 19, 2, 8))
  kw = dict(key=jax.random.key(2), num_hashes=2, num_buckets=4, chunk_size=4, causal=causal)
  alone = lsh_attention(qk[:, :real], v[:, :real], **kw)
  padded = lsh_attention(qk, v, key_mask=jnp.arange(19)[None] < real, **kw)
  _assert_close(padded[:, :real], alone, 1e-6)
  assert np.all(np.asarray(padded)[:, real:] == 0.0)


def test_deterministic_given_key():
  qk, v = _normal(10, (1, 16, 2, 8)), _normal(11, (1, 16, 2, 8))
  kw = dict(num_hashes=1, num_buckets=8, chunk_size=4)
  a = lsh_attention(qk, v, key=jax.random.key(5), **kw)
  np.testing.assert_array_equal(a, lsh_attention(qk, v, key=jax.random.key(5), **kw))
  assert not np.allclose(a, lsh_attention(qk, v, key=jax.random.key(6), **kw))


def test_errors_say_what_to_do():
  qk, v = _normal(12, (1, 8, 2, 4)), _normal(13, (1, 8, 2, 4))
  kw = dict(key=jax.random.key(0), num_hashes=1, chunk_size=4)
  with pytest.raises(ValueError, match="num_buckets must be even.*use 4 or 6"):
    lsh_attention(qk, v, num_buckets=5, **kw)
  with pytest.raises(ValueError, match="chunk_size must be a positive int"):
    lsh_attention(qk, v, key=jax.random.key(0), num_hashes=1, num_buckets=2, chunk_size=0)
  with pytest.raises(ValueError, match="explicit random key.*jax.random.key"):
    lsh_attention(qk, v, key=None, num_hashes=1, num_buckets=2, chunk_size=4)
  with pytest.raises(ValueError, match="k and v must agree"):
    lsh_attention(qk, v[:, :6], num_buckets=2, **kw)
