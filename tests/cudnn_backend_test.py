"""The cudnn backend (attention/cudnn_backend.py) on the CPU: every function is called with
`implementation="xla"`, the same call of `jax.nn.dot_product_attention` with identical
arguments computed by jax's XLA implementation, and compared with our dense attention under the
explicit mask, outputs and gradients; then which path each call takes (cuDNN, or the kind's
own xla function) on a GPU and elsewhere."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention
from attention import band as band_module
from attention import cudnn_backend, flash, masks


def _inputs(rng, b, length, h, d, dtype=jnp.float32, k_length=None):
  k_length = length if k_length is None else k_length
  q = jnp.asarray(rng.normal(size=(b, length, h, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, k_length, h, d)), dtype) for _ in range(2))
  ct = jnp.asarray(rng.normal(size=(b, length, h, d)), dtype)
  return q, k, v, ct


def _out_and_grads(fn, q, k, v, ct):
  """Output and (dq, dk, dv) of `fn` for cotangent `ct`, as one compiled function."""
  def run(q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(ct))))
  return jax.jit(run)(q, k, v, ct)


def _trailing(rng, b, length):
  lengths = rng.integers(1, length + 1, size=b)
  lengths[0] = length                                # no padding
  lengths[-1] = 0                                    # an all-padding example
  return jnp.asarray(np.arange(length)[None] < lengths[:, None])


def _as_float32(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def _close(got, want, dtype):
  if dtype == jnp.float32:
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  else:   # bfloat16 inputs: against the float32 reference on the same (rounded) inputs
    for name in want:
      scale = float(np.abs(want[name]).max()) + 1.0
      np.testing.assert_allclose(got[name], want[name], atol=3e-2 * scale, err_msg=name)


# ---- dense attention ----

# (length, heads, head_dim, causal, padding, dtype): odd lengths, one token, bf16 and f32.
DENSE = [
    (37, 3, 8, False, True, jnp.float32),
    (37, 3, 8, True, True, jnp.float32),
    (1, 2, 16, True, False, jnp.float32),
    (50, 2, 16, False, False, jnp.float32),
    (29, 2, 16, True, True, jnp.bfloat16),
    (29, 2, 16, False, True, jnp.bfloat16),
]


@pytest.mark.parametrize("fn,length,heads,head_dim,causal,padding,dtype",
                         [("dot_product_attention", *case) for case in DENSE]
                         + [("flash_attention", *DENSE[i]) for i in (1, 4)])
def test_dense_through_jax_equals_the_dense_reference(fn, length, heads, head_dim, causal,
                                                      padding, dtype):
  rng = np.random.default_rng(length + heads)
  q, k, v, ct = _inputs(rng, 3, length, heads, head_dim, dtype)
  key_mask = _trailing(rng, 3, length) if padding else None
  got = _out_and_grads(lambda q, k, v: getattr(cudnn_backend, fn)(
      q, k, v, causal=causal, key_mask=key_mask, implementation="xla"), q, k, v, ct)
  assert got["out"].dtype == dtype
  f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
  want = _out_and_grads(lambda q, k, v: attention.dot_product_attention(
      q, k, v, causal=causal, key_mask=key_mask), *f32)
  _close(_as_float32(got), _as_float32(want), dtype)
  if padding:   # padded queries and the all-padding example output exactly 0
    assert np.all(np.asarray(got["out"], np.float32)[~np.asarray(key_mask)] == 0)


def test_cross_attention_with_its_own_query_mask_and_an_example_without_keys():
  rng = np.random.default_rng(1)
  q, k, v, ct = _inputs(rng, 3, 11, 2, 8, k_length=19)
  key_mask = jnp.asarray(np.arange(19)[None] < np.array([[19], [7], [0]]))
  query_mask = jnp.asarray(np.arange(11)[None] < np.array([[11], [4], [11]]))
  got = _out_and_grads(lambda q, k, v: cudnn_backend.dot_product_attention(
      q, k, v, key_mask=key_mask, query_mask=query_mask, implementation="xla"), q, k, v, ct)
  want = _out_and_grads(lambda q, k, v: attention.dot_product_attention(
      q, k, v, key_mask=key_mask, query_mask=query_mask), q, k, v, ct)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got["out"])[2] == 0)     # real queries, no real key: 0


def test_trailing_lengths():
  mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
  lengths, trailing = cudnn_backend.trailing_lengths(mask)
  assert lengths.tolist() == [3, 4, 0] and lengths.dtype == jnp.int32 and bool(trailing)
  for row in ([0, 1, 1, 1], [1, 0, 1, 0], [1, 1, 0, 1]):   # leading, interleaved, a hole
    assert not bool(cudnn_backend.trailing_lengths(mask.at[1].set(jnp.asarray(row, bool)))[1])


def _leading(length):
  return jnp.asarray([np.arange(length) >= 3, np.arange(length) % 4 != 1])


@pytest.mark.parametrize("fn", ["dot_product_attention", "flash_attention"])
def test_padding_that_is_not_trailing_runs_the_xla_function_and_stays_exact(fn, monkeypatch):
  rng = np.random.default_rng(2)
  q, k, v, ct = _inputs(rng, 2, 21, 2, 8)
  key_mask = _leading(21)
  call = lambda q, k, v, m: getattr(cudnn_backend, fn)(q, k, v, causal=True, key_mask=m,
                                                        implementation="xla")
  got = _out_and_grads(lambda q, k, v: call(q, k, v, key_mask), q, k, v, ct)
  want = _out_and_grads(lambda q, k, v: attention.dot_product_attention(
      q, k, v, causal=True, key_mask=key_mask), q, k, v, ct)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  # Which branch ran: with the xla function replaced by zeros, trailing padding still gives
  # the reference (jax's attention ran) and other padding gives the zeros.
  zeros = lambda q, k, v, **kw: jnp.zeros_like(q)
  monkeypatch.setattr(cudnn_backend, "_dense", zeros)
  monkeypatch.setattr(cudnn_backend, "_flash", zeros)
  assert np.all(np.asarray(call(q, k, v, key_mask)) == 0)
  trailing = _trailing(rng, 2, 21)
  np.testing.assert_allclose(call(q, k, v, trailing), attention.dot_product_attention(
      q, k, v, causal=True, key_mask=trailing), atol=1e-5)


def test_under_jit_with_a_traced_key_mask():
  rng = np.random.default_rng(3)
  q, k, v, _ = _inputs(rng, 2, 13, 2, 8)
  run = jax.jit(lambda q, m: cudnn_backend.band_attention(q, q, v, window=3, causal=True,
                                                          key_mask=m, implementation="xla"))
  for key_mask in (_trailing(rng, 2, 13), _leading(13)):
    want = attention.dot_product_attention(
        q, q, v, mask=masks.longformer_mask(13, window=3, causal=True, key_mask=key_mask),
        key_mask=key_mask)
    np.testing.assert_allclose(run(q, key_mask), want, atol=1e-5)


# ---- the causal band as cuDNN's sliding window ----

# (length, heads, window, dilation, padding, dtype): odd lengths, window 0, a window longer than
# the sequence, one dilation for every head that does or does not divide the length, per-head
# dilations, a length shorter than the dilation.
BAND = [
    (37, 2, 5, 1, True, jnp.float32),
    (37, 3, 4, (1, 2, 3), True, jnp.float32),
    (30, 2, 0, 2, False, jnp.float32),
    (32, 2, 3, 4, True, jnp.float32),
    (20, 2, 25, 1, False, jnp.float32),
    (5, 4, 2, (8, 1, 1, 3), True, jnp.float32),
    (29, 2, 6, (2, 1), True, jnp.bfloat16),
]


@pytest.mark.parametrize("length,heads,window,dilation,padding,dtype", BAND)
def test_causal_band_through_jax_equals_the_dense_reference(length, heads, window, dilation,
                                                            padding, dtype):
  rng = np.random.default_rng(length * 3 + window)
  q, k, v, ct = _inputs(rng, 3, length, heads, 8, dtype)
  key_mask = _trailing(rng, 3, length) if padding else None
  got = _out_and_grads(lambda q, k, v: cudnn_backend.band_attention(
      q, k, v, window=window, dilation=dilation, causal=True, key_mask=key_mask,
      implementation="xla"), q, k, v, ct)
  assert got["out"].dtype == dtype
  mask = masks.longformer_mask(length, window=window, dilation=dilation, causal=True,
                               key_mask=key_mask,
                               num_heads=None if isinstance(dilation, int) else heads)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
  want = _out_and_grads(lambda q, k, v: attention.dot_product_attention(
      q, k, v, mask=mask, key_mask=key_mask), *f32)
  _close(_as_float32(got), _as_float32(want), dtype)


@pytest.mark.parametrize("dilation", [1, 3])
def test_the_window_edge_the_key_window_away_is_in_and_the_next_is_out(dilation):
  # q = 0: every allowed key has the same weight, so a query's output is the mean of the
  # positions it sees; our band's window w is |i - j| <= w d with (i - j) % d == 0.
  length, window = 40, 4
  v = jnp.broadcast_to(jnp.arange(length, dtype=jnp.float32)[None, :, None, None],
                       (1, length, 1, 8))
  q = jnp.zeros_like(v)
  out = cudnn_backend.band_attention(q, q, v, window=window, dilation=dilation, causal=True,
                                     implementation="xla")
  for i in (0, 2, 13, 39):
    seen = [j for j in range(i - window * dilation, i + 1, dilation) if j >= 0]
    np.testing.assert_allclose(out[0, i, 0, 0], np.mean(seen), atol=1e-5)


def test_band_padding_that_is_not_trailing_runs_the_xla_band(monkeypatch):
  rng = np.random.default_rng(4)
  q, k, v, ct = _inputs(rng, 2, 23, 2, 8)
  key_mask = _leading(23)
  call = lambda m: cudnn_backend.band_attention(q, k, v, window=3, dilation=(1, 2),
                                                causal=True, key_mask=m, implementation="xla")
  want = attention.dot_product_attention(q, k, v, key_mask=key_mask, mask=masks.longformer_mask(
      23, window=3, dilation=(1, 2), causal=True, key_mask=key_mask, num_heads=2))
  np.testing.assert_allclose(call(key_mask), want, atol=1e-5)
  monkeypatch.setattr(band_module, "band_attention", lambda q, k, v, **kw: jnp.zeros_like(q))
  assert np.all(np.asarray(call(key_mask)) == 0)


def test_band_refuses_what_the_sliding_window_cannot_express_in_one_line():
  q = jnp.ones((1, 8, 2, 8))
  with pytest.raises(ValueError, match="no two-sided bands.*implementation=pallas"):
    cudnn_backend.band_attention(q, q, q, window=2)
  with pytest.raises(ValueError, match="no global tokens"):
    cudnn_backend.band_attention(q, q, q, window=2, causal=True,
                                 global_mask=jnp.ones((1, 8), bool))
  with pytest.raises(ValueError, match="use None .*'cudnn' or 'xla'"):
    cudnn_backend.dot_product_attention(q, q, q, implementation="tokamax")


# ---- which path a call takes ----

def test_refuses():
  ok = dict(q_length=64, k_length=64, causal=True, platform="gpu", capability=(9, 0))
  assert cudnn_backend.refuses(jnp.bfloat16, 128, **ok) is None
  assert cudnn_backend.refuses("float16", 256, **ok) is None
  assert "256, not 264" in cudnn_backend.refuses("bfloat16", 264, **ok)
  assert "up to 128, not 256" in cudnn_backend.refuses("bfloat16", 256,
                                                       **{**ok, "capability": (8, 0)})
  assert "multiples of 8" in cudnn_backend.refuses("bfloat16", 12, **ok)
  assert "not float32" in cudnn_backend.refuses(jnp.float32, 64, **ok)
  assert "GPU only" in cudnn_backend.refuses("bfloat16", 64, **{**ok, "platform": "cpu"})
  assert "causal cross-attention" in cudnn_backend.refuses(
      "bfloat16", 64, **{**ok, "k_length": 65})
  assert cudnn_backend.refuses("bfloat16", 64, **{**ok, "k_length": 65, "causal": False}) is None


@pytest.fixture
def on_a_gpu(monkeypatch):
  """A GPU as far as the backend can tell; jax's attention is recorded and computed by XLA."""
  asked = []
  real = jax.nn.dot_product_attention

  def spy(*args, implementation=None, **kwargs):
    asked.append(implementation)
    return real(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  monkeypatch.setattr(cudnn_backend.compat, "gpu_compute_capability", lambda: (9, 0))
  return asked


def test_on_a_gpu_bfloat16_goes_to_cudnn_and_float32_to_the_xla_function(on_a_gpu):
  rng = np.random.default_rng(5)
  q, k, v, _ = _inputs(rng, 2, 17, 2, 16, jnp.bfloat16)
  key_mask = _trailing(rng, 2, 17)
  got = cudnn_backend.dot_product_attention(q, k, v, causal=True, key_mask=key_mask)
  assert on_a_gpu == ["cudnn"]
  np.testing.assert_allclose(
      np.asarray(got, np.float32),
      cudnn_backend.dot_product_attention(q, k, v, causal=True, key_mask=key_mask,
                                          implementation="xla").astype(jnp.float32), atol=1e-6)
  cudnn_backend.band_attention(q, k, v, window=3, dilation=(1, 2), causal=True,
                               key_mask=key_mask)
  assert on_a_gpu == ["cudnn", "xla", "cudnn", "cudnn"]
  del on_a_gpu[:]
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  np.testing.assert_array_equal(
      cudnn_backend.flash_attention(*f32, causal=True, key_mask=key_mask),
      flash.flash_attention(*f32, causal=True, key_mask=key_mask))
  np.testing.assert_array_equal(
      cudnn_backend.band_attention(*f32, window=3, causal=True, key_mask=key_mask),
      band_module.band_attention(*f32, window=3, causal=True, key_mask=key_mask))
  cudnn_backend.dot_product_attention(q[..., :12], k[..., :12], v[..., :12])   # head dim 12
  assert on_a_gpu == []


def test_on_the_cpu_every_function_is_the_xla_function():
  rng = np.random.default_rng(6)
  q, k, v, _ = _inputs(rng, 2, 19, 2, 8, jnp.bfloat16)
  key_mask = _trailing(rng, 2, 19)
  np.testing.assert_array_equal(
      cudnn_backend.dot_product_attention(q, k, v, key_mask=key_mask).astype(jnp.float32),
      attention.dot_product_attention(q, k, v, key_mask=key_mask).astype(jnp.float32))
  np.testing.assert_array_equal(
      cudnn_backend.band_attention(q, k, v, window=2, causal=True).astype(jnp.float32),
      band_module.band_attention(q, k, v, window=2, causal=True).astype(jnp.float32))
