"""Tests for attention/kinds.py: every record names things that exist and work together.

For each kind: its function is exported by the `attention` package (and is `REGISTRY[name]`),
its mask builders exist in `attention.masks`, its extras class exists in
`models.attention_extras`, its config defaults build a layer that runs, and a kind that cannot
be causal is refused in a causal layer with its reason. Plus: an unknown name lists every kind,
wherever it is checked, and `attention.kinds` loads without jax.
"""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention
from attention import kinds, masks
from configs import common
from models import attention_extras
from models.attention_layer import MultiHeadAttention, split_spec

REPO = Path(__file__).resolve().parents[1]
NAMES = kinds.names()
LENGTH, EMB, HEADS = 12, 16, 2


def layer(name: str, *, causal: bool = False, **args) -> MultiHeadAttention:
  spec = {"kind": name, **kinds.defaults(name, window=3, max_length=LENGTH), **args}
  return MultiHeadAttention(EMB, HEADS, EMB, spec, max_length=LENGTH, causal=causal,
                            rngs=nnx.Rngs(0))


def inputs(batch: int = 2):
  x = jax.random.normal(jax.random.key(0), (batch, LENGTH, EMB))           # [B, L, E]
  key_mask = jnp.arange(LENGTH)[None] < jnp.array([[LENGTH], [LENGTH - 5]])  # [B, L]
  return x, key_mask


def test_registry_is_one_literal_keyed_by_name():
  assert NAMES == tuple(sorted(kinds.KINDS))
  for name, kind in kinds.KINDS.items():
    assert kind.name == name
  assert set(attention.REGISTRY) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_function_is_exported_by_the_package(name):
  kind = kinds.get(name)
  fn = getattr(attention, kind.function)
  assert callable(fn)
  assert fn is getattr(getattr(attention, kind.module), kind.function)
  assert attention.REGISTRY[name] is fn
  assert attention.get(name) is fn
  assert kind.function in attention.__all__ and kind.function in dir(attention)


@pytest.mark.parametrize("name", [n for n in NAMES if kinds.get(n).masks])
def test_mask_builders_exist(name):
  for builder in kinds.get(name).masks:
    assert callable(getattr(masks, builder)), builder


@pytest.mark.parametrize("name", NAMES)
def test_extras_class_exists(name):
  kind = kinds.get(name)
  cls = attention_extras.extras_class(name)
  if kind.extras is None:
    assert cls is None
    assert attention_extras.consumed_args(name) == ()
  else:
    assert cls is getattr(attention_extras, kind.extras)
    assert issubclass(cls, attention_extras.Extras)
    assert isinstance(cls.CONSUMES, tuple)


@pytest.mark.parametrize("name", NAMES)
def test_defaults_build_a_layer_that_runs(name):
  kind = kinds.get(name)
  mha = layer(name)
  assert (mha.key is None) == kind.shared_qk
  x, key_mask = inputs()
  for rng in (None, jax.random.key(1)):
    out = mha(x, key_mask, rng=rng)
    assert out.shape == x.shape and np.isfinite(np.asarray(out)).all()
  if kind.supports_causal:
    out = layer(name, causal=True)(x, key_mask)
    assert out.shape == x.shape and np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("name", [n for n in NAMES if not kinds.get(n).supports_causal])
def test_non_causal_kinds_are_refused_with_their_reason(name):
  reason = kinds.get(name).causal
  assert isinstance(reason, str) and reason
  with pytest.raises(ValueError, match=re.escape(f"attention {name!r} cannot be causal: {reason}")):
    layer(name, causal=True)
  with pytest.raises(ValueError, match=re.escape(reason)):
    kinds.get(name).check_causal()


def test_causal_kinds_pass_the_check():
  for name in NAMES:
    if kinds.get(name).supports_causal:
      kinds.get(name).check_causal()


def test_a_record_needs_true_or_a_reason_for_causal():
  with pytest.raises(ValueError, match="causal must be True or the reason"):
    kinds.Kind("x", "x", "x_attention", causal=False)


def test_unknown_name_lists_every_valid_kind_wherever_it_is_checked():
  expected = f"unknown attention 'nope'; valid names: {', '.join(NAMES)}."
  checks = [kinds.get, attention.get, lambda n: split_spec({"kind": n}),
            lambda n: kinds.defaults(n, window=3, max_length=8)]
  for check in checks:
    with pytest.raises(ValueError) as info:
      check("nope")
    assert str(info.value) == expected
  for check in (kinds.resolve, lambda n: common.task_arg(f"attention={n}")):   # names a user types
    with pytest.raises(ValueError) as info:
      check("nope")
    assert str(info.value).startswith(expected[:-1] + "; or a paper's name: ")
    assert "performer (favor)" in str(info.value)
  with pytest.raises(ValueError, match="valid names: adaptive_span, band, bigbird"):
    kinds.get(None)


def test_defaults_are_fresh_dicts_and_configs_delegate():
  for name in NAMES:
    a = kinds.defaults(name, window=8, max_length=1024)
    a["changed"] = True
    assert "changed" not in kinds.defaults(name, window=8, max_length=1024)
    assert common.attention_defaults(name, window=8, max_length=1024) == kinds.defaults(
        name, window=8, max_length=1024)
  assert kinds.defaults("dot_product", window=8, max_length=64) == {}
  assert kinds.defaults("lsh", window=8, max_length=4096) == {
      "num_hashes": 2, "chunk_size": 64, "num_buckets": 64}


def test_layer_sharing_is_a_property_of_the_extras_class():
  for name in NAMES:
    cls = attention_extras.extras_class(name)
    if cls is not None:
      assert not cls.shared_across_layers(kinds.defaults(name, window=3, max_length=LENGTH))
  cls = attention_extras.LinformerProjections
  assert cls.shared_across_layers({"sharing": "layer"})
  assert not cls.shared_across_layers({"sharing": "kv"})


def _fresh_python(code: str) -> None:
  subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120,
                 env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_kinds_import_without_jax():
  _fresh_python(
      "import sys\n"
      "import attention.kinds\n"
      "from attention import kinds\n"
      "assert kinds.defaults('band', window=4, max_length=64) == {'window': 4}\n"
      "loaded = sorted(m for m in ('jax', 'numpy', 'flax') if m in sys.modules)\n"
      "assert not loaded, loaded\n")


def test_package_attributes_load_lazily():
  _fresh_python(
      "import sys\n"
      "import attention\n"
      "assert 'jax' not in sys.modules\n"
      "from attention import band_attention, masks\n"
      "assert 'jax' in sys.modules and attention.masks is masks\n"
      "assert attention.REGISTRY['band'] is band_attention is attention.get('band')\n"
      "assert attention.block_sparse_plan.make_plan\n")


# ---- The record's other fields: each is checked against what the code does. ----

def _qkv(length: int = LENGTH, heads: int = HEADS, seed: int = 3):
  q, k, v = jax.random.normal(jax.random.key(seed), (3, 2, length, heads, 8))
  key_mask = jnp.arange(length)[None] < jnp.array([[length], [length - 3]])
  return q, k, v, key_mask


def _pattern_cases():
  """(name, args) for every kind with a pattern, with the variants its builder branches on."""
  cases = []
  for name in kinds.names_where(lambda k: k.pattern):
    args = kinds.defaults(name, window=3, max_length=LENGTH)
    if name == "entmax":   # "learned" is the model's alpha; alpha = 1 is softmax over the pairs
      args = {"alpha": 1.0}
    cases.append((name, args))
    if name == "band":
      cases.append((name, {**args, "dilation": (1, 2)}))
    if name == "sparse":
      cases += [(name, {"pattern": "strided", "stride": 4}),
                (name, {"pattern": "fixed", "stride": 6, "summary_width": 2})]
  return cases


@pytest.mark.parametrize("name,args", _pattern_cases())
def test_pattern_is_the_pairs_the_kind_attends(name, args):
  # The pattern MPNet's permutation masks are composed with must be exactly what the kind's
  # own function computes: dense attention with it gives the same output.
  kind = kinds.get(name)
  q, k, v, key_mask = _qkv()
  pattern = getattr(masks, kind.pattern)(LENGTH, HEADS, args)
  assert pattern.dtype == bool and pattern.shape[0] in (1, HEADS)
  assert pattern.shape[1:] == (LENGTH, LENGTH)
  out = attention.get(name)(q, k, v, key_mask=key_mask, **args)
  ref = attention.dot_product_attention(q, k, v, key_mask=key_mask, mask=pattern[None])
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_a_record_has_a_pattern_or_says_why_not():
  for name in NAMES:
    kind = kinds.get(name)
    assert (kind.pattern is None) == bool(kind.no_pattern), name
  with pytest.raises(ValueError, match="give either pattern"):
    kinds.Kind("x", "x", "x_attention")
  with pytest.raises(ValueError, match="give either pattern"):
    kinds.Kind("x", "x", "x_attention", pattern="band_pattern", no_pattern="why")


@pytest.mark.parametrize("name", kinds.names_where(lambda k: k.copy_of))
def test_an_exact_copy_computes_its_original(name):
  kind = kinds.get(name)
  q, k, v, key_mask = _qkv(length=37)
  args = kinds.defaults(name, window=3, max_length=37)
  for causal in (False, True):
    out = attention.get(name)(q, k, v, key_mask=key_mask, causal=causal, **args)
    ref = attention.get(kind.copy_of)(q, k, v, key_mask=key_mask, causal=causal)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_sequence_parallel_names_a_function_or_is_refused(name):
  from attention import sequence_parallel
  from models import sequence
  kind = kinds.get(name)
  if kind.sequence_parallel:
    assert callable(getattr(sequence_parallel, kind.sequence_parallel))
  else:
    q, k, v, key_mask = _qkv()
    with pytest.raises(ValueError, match=f"attention {name!r} cannot run with the sequence "
                                         f"split over devices; use one of band, favor, linear"):
      sequence.attend(name, q, k, v, key_mask, {})


@pytest.mark.parametrize("name", NAMES)
def test_relative_positions_follow_the_record(name):
  kind = kinds.get(name)
  spec = {"kind": name, **kinds.defaults(name, window=3, max_length=LENGTH)}
  build = lambda: MultiHeadAttention(EMB, HEADS, EMB, spec, max_length=LENGTH,
                                     positions={"kind": "relative"}, rngs=nnx.Rngs(0))
  if kind.relative is None:
    with pytest.raises(ValueError, match="pos_emb='relative' works with attention "
                                         f"adaptive_span, band and dot_product, not {name!r}"):
      build()
    return
  x, key_mask = inputs()
  assert build()(x, key_mask).shape == x.shape
  assert kind.memory == kind.supports_causal   # every relative kind carries a memory


def test_the_record_refuses_inconsistent_fields():
  ok = dict(pattern="all_pairs_pattern")
  for bad, message in ((dict(cost="cubic"), "cost 'cubic' must be one of"),
                       (dict(relative="sideways"), "relative 'sideways' must be None"),
                       (dict(memory=True), "a memory needs relative positions"),
                       (dict(memory=True, relative="dense", causal="no"),
                        "a memory needs relative positions and a causal kind"),
                       (dict(backends=("tokamax",)), "must include 'xla'")):
    with pytest.raises(ValueError, match=message):
      kinds.Kind("x", "x", "x_attention", **ok, **bad)


def test_from_inputs_names_a_function_beside_the_kind_and_its_extras_decide():
  for name in kinds.names_where(lambda k: k.from_inputs):
    kind = kinds.get(name)
    assert callable(getattr(getattr(attention, kind.module), kind.from_inputs))
    assert isinstance(getattr(attention_extras, kind.extras), type)
  shared = layer("linformer", sharing="kv")
  per_head = layer("linformer", sharing="headwise")
  assert shared._takes_inputs() and not per_head._takes_inputs()
  assert not layer("dot_product")._takes_inputs()


def test_quadratic_kinds_are_the_ones_that_score_every_pair():
  assert kinds.names_where(lambda k: k.cost == "quadratic") == (
      "dot_product", "entmax", "flash", "synthesizer")


def test_a_pallas_backend_takes_the_keywords_of_the_kinds_own_function():
  # The layer calls whichever backend with the xla function's keywords: every one must exist,
  # with the same default.
  import inspect
  from attention import backends
  listed = kinds.names_where(lambda k: "pallas" in k.backends)
  assert set(listed) == {"band", "bigbird", "block_local", "block_sparse", "sparse"}
  for name in listed:
    want = inspect.signature(attention.get(name)).parameters
    got = inspect.signature(backends.function(name, "pallas")).parameters
    assert set(want) <= set(got), (name, set(want) - set(got))
    assert all(got[k].default == want[k].default for k in want), name
