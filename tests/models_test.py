"""Tests for models/: every model family with every registered attention kind.

The kinds come from the records in `attention.kinds` at collection time, so each primitive
that lands is exercised here: forward shapes and finiteness, gradients reaching every
parameter, padding invariance, per-layer attention settings, and the clear errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention
import models
from attention import kinds, linformer
from configs import common
from models.encoder import layer_specs

jax.config.update("jax_disable_most_optimizations", True)

KINDS = kinds.names()
LENGTH = 12


def tiny_config(kind: str, **overrides):
  cfg = dict(vocab_size=17, max_length=LENGTH, emb_dim=16, num_heads=2, qkv_dim=16, mlp_dim=32,
             num_layers=1, dropout=0.1, pos_emb="sinusoidal", pool="cls", classifier_dim=16,
             num_classes=10, layer_attention=(),
             attention={"kind": kind, **common.attention_defaults(kind, window=3,
                                                                  max_length=LENGTH + 1)})
  if kind == "linformer":
    cfg["attention"]["k"] = 4
  if kind == "favor":
    cfg["attention"]["num_features"] = 8
  cfg.update(overrides)
  return cfg


def tokens(batch=3, length=LENGTH, seed=0, pad_from=None):
  x = np.random.RandomState(seed).randint(1, 17, (batch, length)).astype(np.int32)
  x[-1, length // 2:] = 0                       # a half-padded row
  if pad_from is not None:
    x[:, pad_from:] = 0
  return jnp.asarray(x)


def call(model, family, x, rng=None):
  if family == "dual_encoder":
    return model(x, x[::-1], rng=rng)
  return model(x, rng=rng)


FAMILIES = {"classifier": models.Classifier, "dual_encoder": models.DualEncoder,
            "lm": models.LanguageModel}


# The dual encoder runs its kind's non-causal path on LENGTH tokens (mean pooling, no CLS token),
# the classifier on LENGTH + 1 (a CLS token). For the kinds below nothing in that path depends on
# the length (no blocks, buckets or strides to pad to: adaptive_span's one block is 16 either
# way), so their classifier case takes the same branches and their dual-encoder case is
# exhaustive; the kinds with blocks, buckets, strides or a length projection keep theirs, and with
# them the dual encoder's own code.
SAME_PATH_AT_BOTH_LENGTHS = {"adaptive_span", "dot_product", "entmax", "favor", "flash", "linear",
                             "synthesizer"}
FORWARD_AND_BACKWARD_CASES = [
    pytest.param(kind, family, marks=pytest.mark.exhaustive)
    if family == "dual_encoder" and kind in SAME_PATH_AT_BOTH_LENGTHS else (kind, family)
    for kind in KINDS for family in sorted(FAMILIES)]


@pytest.mark.parametrize("kind,family", FORWARD_AND_BACKWARD_CASES)
def test_forward_and_backward(kind, family):
  cfg = tiny_config(kind, pool="mean" if family == "dual_encoder" else "cls")
  if family == "lm" and not kinds.get(kind).supports_causal:
    with pytest.raises(ValueError, match="cannot be causal"):
      FAMILIES[family](cfg, rngs=nnx.Rngs(0))
    return
  model = FAMILIES[family](cfg, rngs=nnx.Rngs(0))
  x = tokens()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    m = nnx.merge(graphdef, p, rest)
    return jnp.sum(call(m, family, x, rng=jax.random.key(1)) ** 2)

  # One program for the forward pass (no key: no dropout) and the gradients (op-by-op dispatch
  # of the forward pass on CPU took longer than compiling it with the gradients).
  out, grads = jax.jit(lambda p: (call(nnx.merge(graphdef, p, rest), family, x),
                                  jax.grad(loss)(p)))(params)
  expected = (3, LENGTH, 17) if family == "lm" else (3, 10)
  assert out.shape == expected and out.dtype == jnp.float32
  assert np.isfinite(np.asarray(out)).all()

  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  assert flat
  for path, g in flat:
    name = jax.tree_util.keystr(path)
    assert np.isfinite(np.asarray(g)).all(), name
    if "proj" in name or "factor" in name or "logits" in name:
      continue  # low-rank/synthetic rows past the sequence get no gradient
    if family == "lm" and "cls" in name:
      continue
    assert np.abs(np.asarray(g)).max() > 0, f"no gradient reaches {name}"


@pytest.mark.parametrize("kind", KINDS)
def test_padding_does_not_change_the_classifier(kind):
  cfg = tiny_config(kind, pool="mean", dropout=0.0)
  model = models.Classifier(cfg, rngs=nnx.Rngs(0))
  x = tokens(length=8)
  padded = jnp.pad(x, ((0, 0), (0, LENGTH - 8)))
  if kind == "lsh":  # hashing is on the padded length's buckets; only the shapes must agree
    assert model(x).shape == model(padded).shape
    return
  np.testing.assert_allclose(model(x), model(padded), rtol=2e-4, atol=2e-4)


def test_cls_and_mean_pooling_differ_and_ignore_padding_for_cls():
  cfg = tiny_config("dot_product", dropout=0.0)
  model = models.Classifier(cfg, rngs=nnx.Rngs(0))
  x = tokens(length=8)
  np.testing.assert_allclose(model(x), model(jnp.pad(x, ((0, 0), (0, 4)))), atol=1e-5)
  assert models.Classifier(dict(cfg, pool="mean"), rngs=nnx.Rngs(0))(x).shape == (3, 10)


def test_lm_is_causal():
  cfg = tiny_config("dot_product", dropout=0.0, pos_emb="learned")
  model = models.LanguageModel(cfg, rngs=nnx.Rngs(0))
  x = tokens(batch=2, seed=1)
  y = x.at[:, 7:].set(5)
  out_x, out_y = model(x), model(y)
  np.testing.assert_allclose(out_x[:, :7], out_y[:, :7], atol=1e-5)
  assert not np.allclose(out_x[:, 7:], out_y[:, 7:])


def test_dropout_only_with_a_key():
  model = models.Classifier(tiny_config("dot_product", dropout=0.5), rngs=nnx.Rngs(0))
  x = tokens()
  np.testing.assert_array_equal(model(x), model(x))
  assert not np.allclose(model(x, rng=jax.random.key(0)), model(x, rng=jax.random.key(1)))


def test_layer_attention_overrides_per_layer():
  specs = layer_specs({"kind": "band", "window": 2}, ({}, {"window": 8},
                      {"kind": "dot_product"}), 3)
  assert specs == [{"kind": "band", "window": 2}, {"kind": "band", "window": 8},
                   {"kind": "dot_product"}]
  with pytest.raises(ValueError, match="one dict per layer"):
    layer_specs({"kind": "band", "window": 2}, ({},), 3)


def test_growing_windows_and_per_head_dilation_change_the_output():
  base = tiny_config("band", dropout=0.0, num_layers=2)
  grown = dict(base, layer_attention=({"window": 1}, {"window": 4, "dilation": (1, 2)}))
  x = tokens()
  a = models.Classifier(base, rngs=nnx.Rngs(0))
  b = models.Classifier(grown, rngs=nnx.Rngs(0))
  assert b.encoder.blocks[1].attention.args == {"window": 4, "dilation": (1, 2)}
  assert not np.allclose(a(x), b(x))


def test_unknown_names_list_the_valid_ones():
  with pytest.raises(ValueError, match="valid names: .*dot_product"):
    models.Classifier(tiny_config("no_such_kind"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"config\.model\.pos_emb = 'bogus': must be one of "
                     r"sinusoidal, learned"):
    models.Classifier(tiny_config("dot_product", pos_emb="bogus"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"config\.model\.pool = 'max': must be one of cls, mean"):
    models.Classifier(tiny_config("dot_product", pool="max"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="config.model.pool is missing"):
    models.Classifier(dict(tiny_config("dot_product"), pool=None), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_settings_and_their_mapping_build_the_same_model(family):
  cfg = tiny_config("band", num_layers=2, pool="mean", layer_attention=({}, {"window": 5}))
  settings = models.ModelSettings.from_mapping(cfg)
  a, b = (FAMILIES[family](c, rngs=nnx.Rngs(0)) for c in (cfg, settings))
  assert nnx.graphdef(a) == nnx.graphdef(b)
  for u, v in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
    np.testing.assert_array_equal(u, v)
  x = tokens()
  np.testing.assert_array_equal(call(a, family, x), call(b, family, x))


def test_too_long_input_says_what_to_raise():
  model = models.Classifier(tiny_config("dot_product", pos_emb="learned"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_length"):
    model(tokens(length=LENGTH + 5))


def test_parameters_carry_logical_axis_names():
  model = models.Classifier(tiny_config("dot_product"), rngs=nnx.Rngs(0))
  _, params, _ = nnx.split(model, nnx.Param, ...)
  names = {}
  for path, var in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    names[jax.tree_util.keystr(path)] = var.get_metadata().get("out_sharding")
  q = [v for k, v in names.items() if "query" in k]
  assert q and q[0] == ("embed", "heads", "head_dim")
  assert any(v == ("embed", "mlp") for v in names.values())


@pytest.mark.skipif("linformer" not in attention.REGISTRY, reason="linformer not registered")
def test_linformer_shared_across_layers_is_one_parameter():
  cfg = tiny_config("linformer", attention={"kind": "linformer", "k": 4, "sharing": "layer"},
                    num_layers=2)
  model = models.Classifier(cfg, rngs=nnx.Rngs(0))
  blocks = model.encoder.blocks
  assert blocks[0].attention.extras is blocks[1].attention.extras
  separate = models.Classifier(tiny_config("linformer", num_layers=2), rngs=nnx.Rngs(0))
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert count(model) < count(separate)


def test_favor_redraw_draws_fresh_features_in_training_only():
  fixed = models.Classifier(tiny_config("favor", dropout=0.0), rngs=nnx.Rngs(0))
  cfg = tiny_config("favor", dropout=0.0)
  cfg["attention"]["redraw"] = True
  redraw = models.Classifier(cfg, rngs=nnx.Rngs(0))
  x = tokens()
  fixed_eval, fixed_train = fixed(x), fixed(x, rng=jax.random.key(1))
  np.testing.assert_array_equal(redraw(x), fixed_eval)                 # eval: the init draw
  a, b = (redraw(x, rng=jax.random.key(s)) for s in (1, 2))
  assert not np.allclose(a, b)                                          # a new draw per step
  np.testing.assert_array_equal(a, redraw(x, rng=jax.random.key(1)))
  assert not np.allclose(a, fixed_train)
  np.testing.assert_array_equal(fixed_train, fixed_eval)
  cfg["attention"]["redraw"] = "yes"
  with pytest.raises(ValueError, match="redraw must be true or false"):
    models.Classifier(cfg, rngs=nnx.Rngs(0))


@pytest.mark.skipif("favor" not in attention.REGISTRY, reason="favor not registered")
def test_favor_features_are_not_trained():
  model = models.Classifier(tiny_config("favor"), rngs=nnx.Rngs(0))
  _, params, rest = nnx.split(model, nnx.Param, ...)
  assert any(x.shape == (8, 8) for x in jax.tree.leaves(rest))
  assert not any(x.shape == (8, 8) for x in jax.tree.leaves(params))


@pytest.mark.parametrize("sharing,pos,fast", [
    ("none", "none", True), ("kv", "none", True), ("layer", "none", True),
    ("none", "infused", True), ("kv", "infused", True),
    ("headwise", "none", False), ("none", "rotary", False)])
def test_linformer_layer_projects_inputs_first_when_it_can(monkeypatch, sharing, pos, fast):
  """The layer's Linformer path that length-projects the inputs before the key and value
  projections gives the same outputs and parameter gradients as projecting computed keys and
  values; it is taken for projections shared by the heads and unrotated keys only."""
  from models import attention_layer
  spec = {"kind": "linformer", "k": 5, "sharing": sharing}
  layer = attention_layer.MultiHeadAttention(
      16, 2, 16, spec, max_length=LENGTH, positions={"kind": pos}, rngs=nnx.Rngs(3))
  x = jnp.asarray(np.random.RandomState(4).standard_normal((3, LENGTH, 16)), jnp.float32)
  key_mask = jnp.arange(LENGTH)[None, :] < jnp.asarray([LENGTH, 5, 0])[:, None]
  ct = jnp.asarray(np.random.RandomState(5).standard_normal((3, LENGTH, 16)), jnp.float32)
  calls = []
  spy = linformer.linformer_from_inputs
  monkeypatch.setattr(linformer, "linformer_from_inputs",
                      lambda *a, **kw: calls.append(1) or spy(*a, **kw))

  def run():
    loss = lambda m: jnp.sum(m(x, key_mask) * ct)
    return layer(x, key_mask), nnx.grad(loss)(layer)

  out, grads = run()
  assert bool(calls) == fast
  monkeypatch.setattr(attention_layer.MultiHeadAttention, "_takes_inputs",
                      lambda self: False)
  ref_out, ref_grads = run()
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=1e-5)
  assert np.all(np.asarray(out)[2] == 0.0)
  for a, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=2e-5, rtol=1e-5)
