"""Tests written to kill the surviving mutants of models/memory.py (benchmarks/mutation.py,
docs/testing.md): the empty state, the convolution's starting point (mean pooling plus small
uniform noise of bound 0.1 sqrt(3 / (c E)), fan-in c E), the one-line refusals, and the layer
count of a reordered stack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import memory as memory_lib

jax.config.update("jax_disable_most_optimizations", True)
V = 11


def test_empty_state_shapes_and_every_slot_invalid():
  s = memory_lib.init_state(3, 2, 5, 4)
  assert set(s) == {"memory", "valid"}
  assert s["memory"].shape == (3, 2, 4, 5) and s["memory"].dtype == jnp.float32
  assert s["valid"].shape == (2, 4) and s["valid"].dtype == jnp.bool_
  assert not np.asarray(s["valid"]).any() and not np.asarray(s["memory"]).any()
  s = memory_lib.init_state(3, 2, 5, 4, compressed_length=6)
  assert s["compressed"].shape == (3, 2, 6, 5) and s["cvalid"].shape == (2, 6)
  assert not np.asarray(s["cvalid"]).any() and not np.asarray(s["compressed"]).any()


@pytest.mark.parametrize("rate,emb", [(2, 48), (3, 20)])
def test_conv_compression_starts_as_mean_pooling_plus_small_uniform_noise(rate, emb):
  comp = memory_lib.Compression("conv", rate, emb, rngs=nnx.Rngs(3))
  noise = (np.asarray(comp.kernel[...]) - np.eye(emb)[None] / rate) / 0.1
  bound = np.sqrt(3.0 / (rate * emb))
  assert noise.shape == (rate, emb, emb)
  assert np.abs(noise).max() <= bound * (1 + 1e-5)
  assert np.abs(noise).max() > 0.98 * bound                 # thousands of draws reach the edge
  assert abs(noise.mean()) < 0.05 * bound
  np.testing.assert_array_equal(np.asarray(comp.bias[...]), np.zeros(emb))


def test_unknown_compression_is_refused():
  with pytest.raises(ValueError, match="compression 'sum' is not one of mean, max, conv"):
    memory_lib.Compression("sum", 2, 4, rngs=nnx.Rngs(0))


def test_check_refuses_a_rate_that_does_not_divide_the_segment():
  memory_lib.check({"compressed_length": 0, "compression_rate": 3}, 8)   # no compression: fine
  memory_lib.check({"compressed_length": 4, "compression_rate": 2}, 8)
  memory_lib.check({"compressed_length": 4}, 7)                         # rate 1 by default
  memory_lib.check({"compressed_length": 4, "compression_rate": None}, 7)
  memory_lib.check({"compression_rate": 3}, 8)           # no compressed memory named: fine
  with pytest.raises(ValueError, match="compression_rate 3 must divide the segment length 8"):
    memory_lib.check({"compressed_length": 4, "compression_rate": 3}, 8)


def _cfg(layers=2, **extra):
  cfg = dict(vocab_size=V, max_length=32, emb_dim=8, num_heads=2, qkv_dim=8, mlp_dim=8,
             num_layers=layers, dropout=0.0, pos_emb="relative",
             attention={"kind": "dot_product"}, layer_attention=())
  cfg.update(extra)
  return cfg


def test_memory_layers_count_the_attention_sublayers():
  assert memory_lib.memory_layers(_cfg(layers=3)) == 3
  assert memory_lib.memory_layers(_cfg(layers=2, sublayers="ssfsff")) == 3


@pytest.mark.slow   # runs in the mutation runs (benchmarks/mutation.py) and CI
def test_a_memory_of_the_wrong_depth_is_refused():
  model = models.LanguageModel(_cfg(layers=2, memory_length=3), rngs=nnx.Rngs(0))
  state = memory_lib.init_state(1, 3, 8, 3)              # 1 layer, batch 3: the count is named
  with pytest.raises(ValueError, match="the memory has 1 layers but the model has 2 attention"):
    model(jnp.ones((3, 4), jnp.int32), memory=state)


def test_reconstruction_loss_by_the_equation_with_length_unlike_head_dim():
  """Rae et al. (2020) eq. 2 with the layer's content attention, transcribed in NumPy:
  q = h Wq, attention softmax(q k^T / sqrt(D)) v over `old` and over `compressed`, the mean
  squared difference. Lengths (5 queries, 6 old, 3 compressed) differ from D = 4."""
  model = models.LanguageModel(_cfg(layers=1, memory_length=6, compressed_length=3,
                                    compression="mean", compression_rate=2), rngs=nnx.Rngs(1))
  mha = model.encoder.blocks[0].attention
  rng = np.random.default_rng(4)
  h, old, comp = (rng.normal(size=(2, n, 8)).astype(np.float32) for n in (5, 6, 3))
  got = float(memory_lib.reconstruction_loss(mha, h, old, comp))
  wq, wk, wv = (np.asarray(getattr(mha, n)[...], np.float64) for n in ("query", "key", "value"))
  assert wq.shape == (8, 2, 4)

  def attend(x):
    q = np.einsum("ble,ehd->blhd", h, wq)
    k, v = np.einsum("ble,ehd->blhd", x, wk), np.einsum("ble,ehd->blhd", x, wv)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(4)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)

  want = np.mean((attend(old) - attend(comp)) ** 2)
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_dropout_follows_the_encoder_s_random_streams():
  """With an empty memory, a segment through the memory path equals the plain model with the
  same dropout key: the memory path folds the key per block as the encoder does."""
  model = models.LanguageModel(_cfg(layers=2, memory_length=3, dropout=0.3), rngs=nnx.Rngs(2))
  tokens = jax.random.randint(jax.random.key(3), (2, 6), 1, V).at[1, 4:].set(0)   # padding
  key = jax.random.key(4)
  with_memory = model(tokens, rng=key, memory=model.init_memory(2))[0]
  plain = model(tokens, rng=key)
  plain = plain[0] if isinstance(plain, tuple) else plain
  np.testing.assert_allclose(np.asarray(with_memory), np.asarray(plain), atol=2e-5, rtol=2e-5)
  other = model(tokens, rng=jax.random.key(5), memory=model.init_memory(2))[0]
  assert np.abs(np.asarray(other) - np.asarray(plain)).max() > 1e-3     # dropout is on


@pytest.mark.slow   # runs in the mutation runs (benchmarks/mutation.py) and CI
def test_compressed_slots_are_valid_when_all_their_states_are():
  """Rate 2, segment 6, memory 2 (empty): the oldest 6 of [memory; segment] leave, in pairs:
  (empty, empty), (t0, t1), (t2, t3); a pair is valid only if both states are real tokens."""
  model = models.LanguageModel(_cfg(layers=1, memory_length=2, compressed_length=4,
                                    compression="mean", compression_rate=2), rngs=nnx.Rngs(0))
  tokens = jnp.array([[1, 2, 3, 4, 5, 6], [1, 2, 0, 0, 0, 0], [0, 2, 3, 4, 5, 6]], jnp.int32)
  _, state, _ = model(tokens, memory=model.init_memory(3))
  # The 4 newest of [4 empty slots; (empty, empty), (t0, t1), (t2, t3)].
  want = [[False, False, True, True], [False, False, True, False], [False, False, False, True]]
  np.testing.assert_array_equal(np.asarray(state["cvalid"]), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(state["valid"]),
                                np.asarray(tokens[:, 4:] > 0))


def test_the_stop_gradient_norm_is_the_layer_norm_even_on_a_constant_row():
  """`_sg_norm` against flax's own LayerNorm (random scale and bias), with a constant row: its
  variance is 0, where only the epsilon keeps the normalisation finite."""
  ln = nnx.LayerNorm(6, rngs=nnx.Rngs(0))
  ln.scale[...] = jax.random.normal(jax.random.key(1), (6,))
  ln.bias[...] = jax.random.normal(jax.random.key(2), (6,))
  x = jax.random.normal(jax.random.key(3), (2, 3, 6)).at[1, 2].set(0.7)
  got = np.asarray(memory_lib._sg_norm(ln, x))   # pylint: disable=protected-access
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, np.asarray(ln(x)), atol=1e-5, rtol=1e-5)


@pytest.mark.slow   # runs in the mutation runs (benchmarks/mutation.py) and CI
def test_one_memory_layer_s_reconstruction_loss_is_that_layer_s():
  """The loss is averaged over the memory layers: with one layer it is that layer's loss, here
  rebuilt from the pieces (segment 4, memory 2 (empty): the oldest 4 states of [memory; x]
  leave and are compressed in pairs)."""
  sg_norm = memory_lib._sg_norm   # pylint: disable=protected-access
  model = models.LanguageModel(_cfg(layers=1, memory_length=2, compressed_length=2,
                                    compression="mean", compression_rate=2), rngs=nnx.Rngs(5))
  tokens = jax.random.randint(jax.random.key(6), (2, 4), 1, V)
  _, _, got = model(tokens, memory=model.init_memory(2))
  enc, block = model.encoder, model.encoder.blocks[0]
  x = enc.positions(enc.embed(tokens)).astype(enc.dtype)
  old = jnp.concatenate([jnp.zeros((2, 2, x.shape[-1]), x.dtype), x], axis=1)[:, :4]
  comp = model.compress[0](old)
  want = memory_lib.reconstruction_loss(block.attention, sg_norm(block.ln_attn, x),
                                        sg_norm(block.ln_attn, old), sg_norm(block.ln_attn, comp))
  assert float(want) > 1e-6
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
