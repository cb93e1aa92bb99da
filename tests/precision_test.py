"""`config.dtype = "bfloat16"` (models/encoder.py): bfloat16 activations with float32 parameters
for every attention kind and model family; the outputs follow the float32 model closely, the
gradients are float32 and finite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention import kinds
from models import encoder
from tests import models_test


# Every kind in the classifier; the other families with two kinds (the model code around the
# attention is shared, so what differs by family is the head and the objective's inputs).
CASES = [(kind, "classifier") for kind in models_test.KINDS] + [
    (kind, family) for kind in ("band", "favor") for family in ("dual_encoder", "lm")]


@pytest.mark.slow
@pytest.mark.parametrize("kind,family", CASES)
def test_bfloat16_activations_follow_float32(kind, family):
  if family == "lm" and not kinds.get(kind).supports_causal:
    pytest.skip(f"{kind} cannot be causal")
  x = models_test.tokens()
  outs, grads = {}, {}
  for dtype in ("float32", "bfloat16"):
    model = models_test.FAMILIES[family](models_test.tiny_config(kind, dtype=dtype),
                                         rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    if family != "dual_encoder":
      features, _ = nnx.merge(graphdef, params, rest).encoder(x)
      assert features.dtype == jnp.dtype(dtype)

    def loss(p):
      out = models_test.call(nnx.merge(graphdef, p, rest), family, x)
      return jnp.mean(out.astype(jnp.float32) ** 2), out

    (_, outs[dtype]), g = jax.value_and_grad(loss, has_aux=True)(params)
    grads[dtype] = jax.tree.leaves(g)
  assert outs["bfloat16"].dtype == jnp.float32          # logits come back in float32
  np.testing.assert_allclose(outs["bfloat16"], outs["float32"], rtol=0.1, atol=0.1)
  for g in grads["bfloat16"]:
    assert g.dtype == jnp.float32 and np.isfinite(np.asarray(g)).all()


def test_unknown_dtypes_are_refused():
  with pytest.raises(ValueError, match="must be one of float32, bfloat16"):
    encoder.compute_dtype({"dtype": "float16"})
