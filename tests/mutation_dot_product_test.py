"""Tests written to kill the surviving mutants of attention/dot_product.py
(benchmarks/mutation.py, docs/testing.md)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from attention import dot_product


def test_a_mask_that_does_not_broadcast_is_named_with_the_shape_it_must_fit():
  q = jnp.zeros((1, 5, 2, 4))
  want = "mask of shape (3, 5, 5) does not broadcast to [batch, heads, Lq, Lk] = (1, 2, 5, 5)."
  with pytest.raises(ValueError, match=re.escape(want)):
    dot_product.dot_product_attention(q, q, q, mask=np.ones((3, 5, 5), bool))
