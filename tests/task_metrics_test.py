"""The tasks' accuracy counts predictions without an arg-reduction (`lra.tasks.base.predicted`);
it must say exactly what `argmax(logits) == target` says, ties, NaN and infinities included."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from lra.tasks.base import predicted, weighted_sums


def first_largest(row: np.ndarray) -> int:
  """The argmax by its definition: the first index of the largest value, NaN the largest."""
  best = 0
  for i, x in enumerate(row):
    b = row[best]
    if math.isnan(b):
      break
    if math.isnan(x) or x > b:
      best = i
  return best


def reference(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
  rows = logits.reshape(-1, logits.shape[-1])
  want = np.array([first_largest(r) for r in rows]).reshape(targets.shape)
  return want == targets


def awkward(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """Logits with many ties (3 levels), infinities and NaN in some rows; targets partly at the
  largest logits and partly outside [0, V)."""
  v = shape[-1]
  logits = rng.integers(0, 3, shape).astype(np.float32)
  special = rng.random(shape)
  logits[special < 0.02] = np.nan
  logits[(special >= 0.02) & (special < 0.04)] = np.inf
  logits[(special >= 0.04) & (special < 0.06)] = -np.inf
  targets = rng.integers(0, v, shape[:-1])
  largest = np.array([first_largest(r) for r in logits.reshape(-1, v)]).reshape(shape[:-1])
  pick = rng.random(shape[:-1])
  targets = np.where(pick < 0.4, largest, targets)
  targets = np.where(pick > 0.95, rng.choice([-1, v, v + 5], shape[:-1]), targets)
  return logits, targets.astype(np.int32)


@pytest.mark.parametrize("shape", [(400, 1), (300, 2), (200, 3), (7, 5, 4), (64, 33),
                                   (16, 8193)])
def test_predicted_is_argmax_equal_to_the_target(shape):
  rng = np.random.default_rng(sum(shape))
  logits, targets = awkward(rng, shape)
  got = np.asarray(predicted(jnp.asarray(logits), jnp.asarray(targets)))
  want = reference(logits, targets)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(
      got, np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1) == jnp.asarray(targets)))
  assert want.any() and not want.all()   # the draw has right and wrong predictions


def test_the_rules_one_by_one():
  t = lambda rows, targets: np.asarray(predicted(jnp.asarray(rows, jnp.float32),
                                                 jnp.asarray(targets))).tolist()
  nan, inf = np.nan, np.inf
  assert t([[1, 2, 2], [1, 2, 2], [1, 2, 2]], [0, 1, 2]) == [False, True, False]   # first max
  assert t([[nan, 2, nan], [nan, 2, nan], [nan, 2, nan]], [0, 1, 2]) == [True, False, False]
  assert t([[1, nan, 5], [1, 7, 5]], [2, 1]) == [False, True]                        # NaN wins
  assert t([[inf, inf], [-inf, -inf], [-inf, 0]], [1, 0, 1]) == [False, True, True]
  assert t([[1, 2], [1, 2], [1, 2]], [-1, 2, 1]) == [False, False, True]             # outside


def test_weighted_sums_count_with_the_same_rule():
  rng = np.random.default_rng(3)
  logits, targets = awkward(rng, (50, 6, 9))
  logits = np.nan_to_num(logits, nan=1.0, posinf=3.0, neginf=-3.0)
  targets = np.clip(targets, 0, 8)
  weights = rng.random((50, 6)).astype(np.float32)
  sums = weighted_sums(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  want = float(np.sum(reference(logits, targets) * weights))
  np.testing.assert_allclose(float(sums["correct"]), want, rtol=1e-6)
  np.testing.assert_allclose(float(sums["weight"]), float(weights.sum()), rtol=1e-6)
