"""Positions inside the attention layer (rotary, position-infused) and the Sandwich order.

Rotary: logits depend only on i - j (a shift test), the layer with band equals dense attention
with the band mask on the same rotated q and k, and a model runs with dot_product, band, bigbird,
block_sparse, favor and lsh (shared q and k). Infused: positions reach q and k, never v.
Sandwich: equal s and f counts give equal parameter counts, and both orders train.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import attention
import models
from attention import masks, rotary
from configs import common
from models.attention_layer import MultiHeadAttention
from models.embeddings import sinusoidal_table
from models.settings import sublayer_order

jax.config.update("jax_disable_most_optimizations", True)

LENGTH = 16


def tiny(kind="dot_product", **overrides):
  cfg = dict(vocab_size=13, max_length=LENGTH, emb_dim=16, num_heads=2, qkv_dim=16, mlp_dim=16,
             num_layers=1, dropout=0.0, pos_emb="rotary", pool="mean", classifier_dim=8,
             num_classes=3, layer_attention=(),
             attention={"kind": kind, **common.attention_defaults(kind, window=3,
                                                                  max_length=LENGTH)})
  if kind == "favor":
    cfg["attention"]["num_features"] = 8
  cfg.update(overrides)
  return cfg


def test_rotary_logits_depend_only_on_relative_position():
  q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 8))
  logit = lambda i, j: float(jnp.sum(
      rotary.apply_rotary(q, positions=[i]) * rotary.apply_rotary(k, positions=[j])))
  for i, j in [(0, 0), (5, 2), (3, 9), (100, 40)]:
    for shift in (1, 17, 1000):
      assert logit(i + shift, j + shift) == pytest.approx(logit(i, j), abs=1e-4)
  assert abs(logit(5, 2) - logit(2, 5)) > 1e-3         # yet the sign of i - j matters
  # The table form (positions 0..L-1, float64 angles) agrees with the explicit positions.
  x = jax.random.normal(jax.random.key(1), (1, 40, 2, 8))
  np.testing.assert_allclose(rotary.apply_rotary(x), rotary.apply_rotary(x, positions=range(40)),
                             atol=1e-5)
  # And a whole sequence: scores of rotated q and k are a function of i - j (Toeplitz) when all
  # positions hold the same q and k vectors.
  same = jnp.broadcast_to(q[0], (1, 24, 1, 8))
  scores = jnp.einsum("bqhd,bkhd->qk", rotary.apply_rotary(same), rotary.apply_rotary(same))
  for d in range(-5, 6):
    diagonal = np.diagonal(np.asarray(scores), offset=d)
    np.testing.assert_allclose(diagonal, diagonal[0], atol=1e-4)


def _layer(spec, pos):
  return MultiHeadAttention(16, 2, 16, spec, max_length=LENGTH, rngs=nnx.Rngs(0),
                            positions={"kind": pos, "rotary_base": 10000.0})


def _heads(x, w):
  return jnp.einsum("ble,ehd->blhd", x, w[...])


def test_rotary_band_layer_equals_dense_with_band_mask():
  x = jax.random.normal(jax.random.key(2), (2, 13, 16))
  key_mask = jnp.arange(13)[None].repeat(2, 0) < jnp.array([[13], [10]])
  layer = _layer({"kind": "band", "window": 3}, "rotary")
  q, k = (rotary.apply_rotary(_heads(x, w)) for w in (layer.query, layer.key))
  out = attention.dot_product_attention(q, k, _heads(x, layer.value), key_mask=key_mask,
                                        mask=masks.longformer_mask(13, window=3, num_heads=2))
  expected = jnp.einsum("blhd,hde->ble", out, layer.out[...])
  np.testing.assert_allclose(layer(x, key_mask), expected, atol=1e-5)


def test_infused_positions_reach_queries_and_keys_only():
  x = jax.random.normal(jax.random.key(3), (1, 9, 16))
  layer = _layer({"kind": "dot_product"}, "infused")
  xp = x + sinusoidal_table(9, 16)[None]
  out = attention.dot_product_attention(_heads(xp, layer.query), _heads(xp, layer.key),
                                        _heads(x, layer.value))
  expected = jnp.einsum("blhd,hde->ble", out, layer.out[...])
  np.testing.assert_allclose(layer(x, None), expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["dot_product", "band", "bigbird", "block_sparse", "favor",
                                  "lsh"])
def test_rotary_model_forward_with_every_kind(kind):
  tokens = jnp.asarray(np.random.RandomState(0).randint(1, 13, (2, LENGTH)), jnp.int32)
  tokens = tokens.at[1, 11:].set(0)
  model = models.Classifier(tiny(kind), rngs=nnx.Rngs(0))
  out = model(tokens)
  assert out.shape == (2, 3) and np.isfinite(np.asarray(out)).all()
  plain = models.Classifier(tiny(kind, pos_emb="none"), rngs=nnx.Rngs(0))
  assert not np.allclose(plain(tokens), out, atol=1e-6)   # the rotation changes the output


def test_sublayer_order_and_sandwich():
  assert sublayer_order(3) == "sfsfsf"
  assert sublayer_order(4, sandwich=2) == "ss" + "sfsf" + "ff"
  assert sublayer_order(2, "ssff") == "ssff"
  with pytest.raises(ValueError, match="'s' .* and 'f'"):
    sublayer_order(2, "sxf")
  with pytest.raises(ValueError, match=r"\[0, 2\]"):
    sublayer_order(3, sandwich=3)


def _count(model):
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _train(cfg, steps=6):
  model = models.LanguageModel(cfg, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  tokens = jnp.asarray(np.tile(np.arange(1, 9), (4, 2)), jnp.int32)    # [4, 16] periodic

  @nnx.jit
  def step(model, opt):
    def loss_fn(model):
      logits = model(tokens)[:, :-1]
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  return model, [float(step(model, opt)) for _ in range(steps)]


def test_sandwich_and_interleaved_have_equal_parameters_and_both_train():
  base = tiny("dot_product", num_layers=3, pos_emb="relative")
  sandwich, losses_s = _train({**base, "sandwich": 1})          # s sfsf f
  interleaved, losses_i = _train(base)                          # sfsfsf
  assert [type(b).__name__ for b in sandwich.encoder.blocks] == [
      "AttentionSublayer", "AttentionSublayer", "FeedForwardSublayer", "AttentionSublayer",
      "FeedForwardSublayer", "FeedForwardSublayer"]
  assert _count(sandwich) == _count(interleaved)
  for losses in (losses_s, losses_i):
    assert losses[-1] < losses[0] - 0.1, losses
