"""Tests for models/settings.py: the one place of the models' names and rules.

Each bad value is refused when the settings are made, in the one line the config schema gives
for it (`lra run` and a model constructor say the same); a valid mapping round-trips, the
record is frozen, and the module imports without jax (the config schema depends on that).
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import configs
from lra import schema
from models import settings
from models.settings import AttentionSpec, ModelSettings

REPO = Path(__file__).resolve().parents[1]


def cfg(**overrides):
  out = dict(vocab_size=17, max_length=12, num_layers=2, num_heads=2, emb_dim=16, qkv_dim=16,
             mlp_dim=32, dropout=0.1, pos_emb="sinusoidal", pool="cls", classifier_dim=16,
             num_classes=10, attention={"kind": "band", "window": 3, "dilation": [1, 2]},
             layer_attention=({}, {"window": 4}), remat="none", dtype="float32")
  out.update(overrides)
  return out


# (overrides, the exact message)
BAD = [
    ({"pool": "max"}, "config.model.pool = 'max': must be one of cls, mean (how the classifier "
     "pools the sequence)."),
    ({"dtype": "float16"}, "config.dtype = 'float16': must be one of float32, bfloat16 (the "
     "activations' dtype (parameters stay float32))."),
    ({"remat": "blocks"}, "config.remat = 'blocks': must be one of none, block, dots_saveable, "
     "dots_with_no_batch_dims_saveable (what each block keeps for the backward pass (none keeps "
     "everything; block recomputes the block; dots_* keep only matmul outputs))."),
    ({"pos_emb": "bogus"}, "config.model.pos_emb = 'bogus': must be one of sinusoidal, learned, "
     "none, rotary, infused, relative (the position embedding)."),
    ({"pos_emb": "rotary", "num_heads": 4, "qkv_dim": 12}, "config.model.pos_emb = 'rotary': "
     "needs an even head dimension, but qkv_dim / num_heads = 3."),
    ({"num_heads": 3, "qkv_dim": 16}, "config.model.qkv_dim = 16: must be a multiple of "
     "config.model.num_heads = 3 (each head gets qkv_dim // num_heads features)."),
    ({"sublayers": "sfx"}, "config.model.sublayers = 'sfx': must be a string of 's' "
     "(self-attention) and 'f' (feed-forward) only, or '' for 'sf' * num_layers (the sublayer "
     "order)."),
    ({"sandwich": 2}, "config.model.sandwich = 2: must be an integer in [0, 1] (num_layers - 1; "
     "the Sandwich coefficient k of s^k (sf)^(n-k) f^k)."),
    ({"sandwich": 1, "sublayers": "ssff"}, "config.model.sandwich = 1: give "
     "config.model.sublayers or config.model.sandwich, not both (sublayers = 'ssff')."),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[str(o) for o, _ in BAD])
def test_each_bad_value_is_refused_with_the_schemas_message(overrides, message):
  with pytest.raises(ValueError) as e:
    ModelSettings.from_mapping(cfg(**overrides))
  assert str(e.value) == message
  config = configs.build_config("listops", size="small")   # lra run says the same
  with config.unlocked():
    for name, value in overrides.items():
      if name in ("remat", "dtype"):
        config[name] = value
      else:
        config.model[name] = value
  with pytest.raises(ValueError) as e:
    schema.check(config)
  assert str(e.value) == message


def test_a_missing_setting_is_named():
  with pytest.raises(ValueError, match="config.model.emb_dim is missing"):
    ModelSettings.from_mapping({k: v for k, v in cfg().items() if k != "emb_dim"})
  settings_ = ModelSettings.from_mapping(cfg(pool=None))
  with pytest.raises(ValueError, match="config.model.pool is missing: the classifier needs it"):
    settings_.require("pool", model="the classifier")


def test_a_valid_mapping_round_trips():
  given = cfg(sandwich=1, rotary_base=500, pos_emb="rotary", memory_length=4, unused_key=3)
  s = ModelSettings.from_mapping(given)
  assert ModelSettings.from_mapping(s) is s
  assert ModelSettings.from_mapping(s.as_dict()) == s
  assert s.attention == AttentionSpec("band", (("window", 3), ("dilation", (1, 2))))
  assert s.layer_attention == (AttentionSpec(None), AttentionSpec(None, (("window", 4),)))
  assert s.as_dict()["attention"] == {"kind": "band", "window": 3, "dilation": (1, 2)}
  for name, value in given.items():
    if name not in ("attention", "layer_attention", "unused_key"):
      assert s.as_dict()[name] == value, name
  assert isinstance(s.rotary_base, float)
  assert s.order == "s" + "sf" + "f" and s.head_dim == 8
  assert s.positions == {"kind": "rotary", "rotary_base": 500.0}
  assert s.layer_specs() == [{"kind": "band", "window": 3, "dilation": (1, 2)},
                             {"kind": "band", "window": 4, "dilation": (1, 2)}]


def test_defaults_fill_what_a_mapping_leaves_out_or_sets_to_none():
  s = ModelSettings.from_mapping(cfg(sublayers=None, memory_length=None))
  assert (s.sublayers, s.sandwich, s.memory_length, s.remat) == ("", 0, 0, "none")
  assert s.order == "sfsf"


def test_the_splash_tiles_are_carried_as_given_and_default_to_none():
  import ml_collections
  assert ModelSettings.from_mapping(cfg()).splash == ()             # absent: the defaults
  assert ModelSettings.from_mapping(cfg(splash=None)).splash_tiles == {}
  given = ml_collections.ConfigDict(dict(block_q=128, block_kv=256, use_fused_bwd_kernel=True))
  s = ModelSettings.from_mapping(cfg(splash=given))
  assert s.splash == (("block_kv", 256), ("block_q", 128), ("use_fused_bwd_kernel", True))
  assert s.splash_tiles == dict(given) and s.as_dict()["splash"] == dict(given)
  assert ModelSettings.from_mapping(s.as_dict()) == s
  assert hash(s) == hash(ModelSettings.from_mapping(cfg(splash=dict(given))))
  with pytest.raises(ValueError, match=r"^config\.model\.splash = 128: must be a mapping"):
    ModelSettings.from_mapping(cfg(splash=128))


def test_the_settings_are_frozen():
  s = ModelSettings.from_mapping(cfg())
  with pytest.raises(dataclasses.FrozenInstanceError):
    s.pool = "mean"
  with pytest.raises(dataclasses.FrozenInstanceError):
    s.attention.kind = "dot_product"
  assert hash(s) == hash(ModelSettings.from_mapping(cfg()))
  assert dataclasses.replace(s, pool="mean").pool == "mean"
  with pytest.raises(ValueError, match="config.model.pool = 'max'"):
    dataclasses.replace(s, pool="max")      # the rules run on every new record


def test_sublayer_order():
  assert settings.sublayer_order(3) == "sfsfsf"
  assert settings.sublayer_order(4, sandwich=2) == "ss" + "sfsf" + "ff"
  assert settings.sublayer_order(2, "ssff") == "ssff"


def test_the_schema_uses_the_settings_names():
  assert (schema.POOLINGS, schema.DTYPES, schema.REMATS, schema.POSITIONS) == (
      settings.POOLINGS, settings.DTYPES, settings.REMATS, settings.POSITIONS)
  assert set(settings.IN_LAYER) <= set(settings.POSITIONS)


def test_imports_without_jax():
  code = ("import sys\n"
          "from models import settings\n"
          "settings.ModelSettings.from_mapping(dict(vocab_size=3, max_length=4, num_layers=1, "
          "num_heads=1, emb_dim=2, qkv_dim=2, mlp_dim=2, dropout=0.0, pos_emb='none', "
          "attention={'kind': 'dot_product'}))\n"
          "heavy = sorted(m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules)\n"
          "print('HEAVY', heavy)\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 0, out.stderr
  assert "HEAVY []" in out.stdout, out.stdout
