"""Tests for the measuring parts of `benchmarks/favor_trained.py` (no training here): the recorded
layer inputs are exactly what the model's attention saw, padded queries are left out of the
error, and the statistics match a direct computation."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import attention  # noqa: E402
import models  # noqa: E402
from benchmarks import favor_trained  # noqa: E402

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file


def _classifier(kind):
  cfg = dict(vocab_size=17, max_length=10, emb_dim=16, num_heads=2, qkv_dim=16, mlp_dim=32,
             num_layers=2, dropout=0.0, pos_emb="sinusoidal", pool="mean", classifier_dim=16,
             num_classes=3, layer_attention=(), attention={"kind": kind})
  if kind == "favor":
    cfg["attention"]["num_features"] = 16
  return models.Classifier(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind", ["favor", "dot_product"])
def test_recording_captures_each_layer_and_restores_the_registry(kind):
  model = _classifier(kind)
  x = np.random.RandomState(0).randint(1, 17, (3, 10)).astype(np.int32)
  x[1, 4:] = 0
  original = attention.REGISTRY[kind]
  with favor_trained.recording(kind) as records:
    logits = model(jnp.asarray(x))
  assert attention.REGISTRY[kind] is original
  assert len(records) == 2                                   # one per layer
  np.testing.assert_array_equal(records[0]["key_mask"], x > 0)
  np.testing.assert_array_equal(logits, model(jnp.asarray(x)))   # the wrapper changed nothing
  rec = records[1]
  assert rec["q"].shape == (3, 10, 2, 8) and not rec["causal"]
  assert (rec["features"] is not None) == (kind == "favor")
  # Layer 0's recorded q and v are the layer's projections of its normalised input.
  enc = model.encoder
  h = enc.blocks[0].ln_attn(enc.positions(enc.embed(jnp.asarray(x))))
  layer = enc.blocks[0].attention
  for name, kernel in (("q", layer.query), ("v", layer.value)):
    np.testing.assert_allclose(records[0][name], jnp.einsum("ble,ehd->blhd", h, kernel[...]),
                               rtol=1e-5, atol=1e-6)

def test_error_ignores_padded_queries_and_is_relative():
  exact = jnp.ones((1, 4, 1, 2))
  out = exact.at[:, 3].set(100.0)                             # wrong only at a padded query
  mask = jnp.asarray([[True, True, True, False]])
  assert favor_trained.masked_relative_error(out, exact, mask) == 0.0
  out = exact * 1.5
  np.testing.assert_allclose(favor_trained.masked_relative_error(out, exact, mask), 0.5,
                             rtol=1e-6)


def test_input_stats_and_exact_features_error():
  rng = np.random.default_rng(0)
  d = 8
  q = rng.normal(size=(2, 6, 1, d)) * 0.3
  k = rng.normal(size=(2, 6, 1, d)) * 0.3
  v = rng.normal(size=(2, 6, 1, d))
  mask = np.ones((2, 6), bool)
  mask[1, 4:] = False
  rec = {"q": q, "k": k, "v": v, "key_mask": mask, "causal": False, "features": None}
  stats = favor_trained.input_stats(rec)
  real_q = q[:, :, 0][mask]
  np.testing.assert_allclose(stats["s_q"], np.mean(np.sum(real_q ** 2, -1)) / np.sqrt(d),
                             rtol=1e-6)
  logits = np.einsum("bld,bkd->blk", q[:, :, 0], k[:, :, 0]) / np.sqrt(d)
  stds = [np.std(logits[b, i][mask[b]]) for b in range(2) for i in range(6) if mask[b, i]]
  np.testing.assert_allclose(stats["logit_std"], np.mean(stds), rtol=1e-5)
  errors = favor_trained.layer_errors(rec, seeds=2)
  assert set(errors) == {(kind, m) for kind in ("orthogonal", "iid")
                         for m in favor_trained.FEATURES}
  assert all(np.isfinite(e) and e > 0 for e in errors.values())
  # small norms: the estimate is already close, and more features help
  assert errors["orthogonal", 256] < errors["orthogonal", 16] and errors["orthogonal", 256] < 0.1
  rec["features"] = attention.favor_features(jax.random.key(0), 32, d)
  assert "trained" in favor_trained.layer_errors(rec, seeds=1)
