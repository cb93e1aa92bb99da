"""`config.remat` (models/settings.py REMATS, models/encoder.py REMAT): rematerialised blocks
give the same loss and gradients as stored ones, in every family and with dropout on, and the
compiled backward pass keeps less memory; bad names fail in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from lra import schema
from models import encoder, settings
from tests import models_test


def loss_and_grads(family: str, remat: str, kind: str = "dot_product"):
  cfg = models_test.tiny_config(kind, num_layers=2, remat=remat)
  model = models_test.FAMILIES[family](cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x = models_test.tokens()

  def loss(p):
    out = models_test.call(nnx.merge(graphdef, p, rest), family, x, rng=jax.random.key(3))
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  value, grads = jax.value_and_grad(loss)(params)
  return value, jax.tree.leaves(grads)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(models_test.FAMILIES))
@pytest.mark.parametrize("remat", [r for r in encoder.REMAT if r != "none"])
def test_remat_gives_the_same_loss_and_gradients(family, remat):
  value, grads = loss_and_grads(family, "none")
  value_r, grads_r = loss_and_grads(family, remat)
  np.testing.assert_allclose(value_r, value, rtol=1e-5)
  assert len(grads_r) == len(grads)
  for g_r, g in zip(grads_r, grads):
    np.testing.assert_allclose(g_r, g, rtol=1e-5, atol=1e-5)


def test_remat_with_a_kind_that_owns_state():
  value, grads = loss_and_grads("classifier", "none", kind="favor")
  value_r, grads_r = loss_and_grads("classifier", "block", kind="favor")
  np.testing.assert_allclose(value_r, value, rtol=1e-5)
  for g_r, g in zip(grads_r, grads):
    np.testing.assert_allclose(g_r, g, rtol=1e-5, atol=1e-5)


def temporaries(remat: str) -> int:
  """Temporary bytes of the compiled gradient of a 4-layer dense classifier at length 256."""
  cfg = models_test.tiny_config("dot_product", num_layers=4, max_length=256, remat=remat,
                                dropout=0.0)
  model = models_test.FAMILIES["classifier"](cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x = jnp.ones((8, 256), jnp.int32)

  def loss(p):
    return jnp.sum(nnx.merge(graphdef, p, rest)(x))

  compiled = jax.jit(jax.grad(loss)).lower(params).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_block_remat_keeps_less_for_the_backward_pass():
  # Without remat the backward pass keeps every layer's [8, 2, 256, 256] attention
  # probabilities (2 MiB each); with block remat only the layer being differentiated has them.
  none, block = temporaries("none"), temporaries("block")
  assert block < 0.6 * none, (block, none)


def test_bad_remat_names_are_refused():
  config = configs.build_config("listops", size="small")
  with config.unlocked():
    config.remat = "blocks"
  with pytest.raises(ValueError, match=r"config.remat = 'blocks'.*none, block"):
    schema.check(config)
  with pytest.raises(ValueError, match=r"config.remat = 'everything': must be one of none, block"):
    encoder.block_runner("everything")
  with pytest.raises(ValueError, match=r"config.remat = 'blocks'.*none, block"):
    models_test.FAMILIES["classifier"](models_test.tiny_config("dot_product", remat="blocks"),
                                       rngs=nnx.Rngs(0))


def test_every_remat_name_has_a_policy():
  assert tuple(encoder.REMAT) == settings.REMATS


def test_blocks_of_different_structures_are_unrolled_with_the_same_values():
  def run(remat):
    cfg = models_test.tiny_config("band", num_layers=2, remat=remat,
                                  layer_attention=({"window": 1}, {"window": 2}))
    model = models_test.FAMILIES["classifier"](cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = models_test.tokens()
    loss = lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p, rest)(x, rng=jax.random.key(1))))
    return jax.tree.leaves(jax.grad(loss)(params))

  for g_r, g in zip(run("block"), run("none")):
    np.testing.assert_allclose(g_r, g, rtol=1e-5, atol=1e-5)
