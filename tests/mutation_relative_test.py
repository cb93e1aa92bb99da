"""Tests written to kill the surviving mutants of attention/relative.py (benchmarks/mutation.py,
docs/testing.md): the shift on score tensors of any rank, against a direct NumPy gather of the
distance i - j from a table whose rows run from distance L - 1 down to -(L - 1)."""

import numpy as np
import pytest

from attention import relative


def _direct_shift(x: np.ndarray, lk: int) -> np.ndarray:
  """out[..., i, j] = x[..., i, m] with m the row of distance i - j: m = (L - 1) - (i - j)."""
  lq, rows = x.shape[-2:]
  length = (rows + 1) // 2
  out = np.zeros(x.shape[:-2] + (lq, lk), x.dtype)
  for i in range(lq):
    for j in range(lk):
      out[..., i, j] = x[..., i, (length - 1) - (i - j)]
  return out


@pytest.mark.parametrize("lead", [(), (3,), (2, 3), (2, 1, 3)])
@pytest.mark.parametrize("lq,lk", [(4, 4), (3, 5), (1, 6)])
def test_rel_shift_on_any_number_of_leading_axes(lead, lq, lk):
  rows = 2 * max(lq, lk) - 1
  x = np.random.default_rng(lq * 10 + lk).normal(size=lead + (lq, rows)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(relative.rel_shift(x, lk)), _direct_shift(x, lk))


def test_odd_sinusoid_dimension_is_refused():
  with pytest.raises(ValueError, match="even sinusoid dimension, got 5"):
    relative.sinusoid([0, 1], 5)
  assert relative.sinusoid([0, 1], 4).shape == (2, 4)


def test_relative_attention_is_bidirectional_by_default():
  """Without `causal`, query i attends to every key: Transformer-XL's logit
  ((q + u)_i . k_j + (q + v)_i . R[i - j]) / sqrt(D), R[t] = [sin(t w), cos(t w)] @ w_r with
  w_f = 10000^(-2f/E), transcribed with loops."""
  rng = np.random.default_rng(3)
  b, length, h, d, e = 1, 5, 2, 4, 6
  q, k, v = (rng.normal(size=(b, length, h, d)).astype(np.float32) for _ in range(3))
  u, vb = (0.3 * rng.normal(size=(h, d)).astype(np.float32) for _ in range(2))
  w_r = rng.normal(size=(e, h, d)).astype(np.float32) / np.sqrt(e)
  got = np.asarray(relative.relative_attention(q, k, v, u=u, v_bias=vb, w_r=w_r))
  inv = 10000.0 ** (-np.arange(0, e, 2) / e)
  want = np.zeros_like(got, dtype=np.float64)
  for head in range(h):
    for i in range(length):
      logit = np.zeros(length)
      for j in range(length):
        s = np.concatenate([np.sin((i - j) * inv), np.cos((i - j) * inv)])
        r = s @ w_r[:, head]
        logit[j] = ((q[0, i, head] + u[head]) @ k[0, j, head]
                    + (q[0, i, head] + vb[head]) @ r) / np.sqrt(d)
      p = np.exp(logit - logit.max())
      want[0, i, head] = (p / p.sum()) @ v[0, :, head]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
