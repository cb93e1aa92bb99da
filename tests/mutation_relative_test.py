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
