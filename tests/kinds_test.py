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
            lambda n: kinds.defaults(n, window=3, max_length=8),
            lambda n: common.task_arg(f"attention={n}")]
  for check in checks:
    with pytest.raises(ValueError) as info:
      check("nope")
    assert str(info.value) == expected
  with pytest.raises(ValueError, match="valid names: band, bigbird"):
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
