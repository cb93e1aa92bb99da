"""A kind added at run time works everywhere without touching any other file.

`attention/kinds.py` is the only place that knows about a kind. This test writes a throwaway
"scaled dot product" kind in its own package (outside this repository), registers its record
with `kinds.register`, and uses it through the public doors: `attention.get`, the config check,
`lra list`, `lra run --dry_run` (the preflight), a short `lra run`, and the self-pretraining
refusal for MPNet, which reads the record's `no_pattern`. If any module kept its own list of
kind names, one of these would refuse the new kind.
"""

import json
import os
import textwrap

import jax
import numpy as np
import pytest

import attention
import configs
from attention import kinds
from launch import cli
from lra import schema

NAME = "scaled_dot_product"
REFUSAL = "its temperature is a test's invention, not a pattern over positions."
PLUGIN = textwrap.dedent('''\
    """A kind defined outside the attention package: dot product with a temperature."""
    import attention


    def scaled_dot_product_attention(q, k, v, *, key_mask=None, causal=False, temperature=1.0):
      return attention.dot_product_attention(q / temperature, k, v, key_mask=key_mask,
                                             causal=causal)
    ''')
# A listops run small enough for a test: a 1-layer, 16-wide model on 64 generated examples.
TINY = ["--config.data.num_train=64", "--config.data.num_val=16", "--config.data.num_test=16",
        "--config.data.max_length=24", "--config.data.gen_min_length=4",
        "--config.data.gen_max_length=25", "--config.model.emb_dim=16",
        "--config.model.qkv_dim=16", "--config.model.mlp_dim=32",
        "--config.model.classifier_dim=16", "--config.model.num_heads=2",
        "--config.model.num_layers=1", "--config.batch_size=16", "--config.eval_batch_size=16",
        "--config.num_train_steps=2", "--config.warmup_steps=1", "--config.log_every=1",
        "--config.progress=False"]


@pytest.fixture
def new_kind(tmp_path, monkeypatch):
  package = tmp_path / "plugins" / "my_kinds"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "scaled.py").write_text(PLUGIN)
  monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
  record = kinds.register(kinds.Kind(
      NAME, "my_kinds.scaled", "scaled_dot_product_attention", cost="quadratic",
      defaults=lambda window, max_length: {"temperature": 2.0}, arguments=("temperature",),
      no_pattern=REFUSAL))
  yield record
  kinds.unregister(NAME)


def test_the_new_kind_is_a_function_of_the_package(new_kind):
  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 10, 2, 8))
  out = attention.get(NAME)(q, k, v, temperature=2.0)
  np.testing.assert_allclose(np.asarray(out),
                             np.asarray(attention.dot_product_attention(q / 2.0, k, v)),
                             rtol=1e-6, atol=1e-6)
  assert NAME in attention.REGISTRY and NAME in kinds.names()


def test_registering_twice_or_an_unknown_copy_is_refused(new_kind):
  with pytest.raises(ValueError, match="already registered"):
    kinds.register(new_kind)
  with pytest.raises(ValueError, match="unknown attention 'nothing'"):
    kinds.register(kinds.Kind("other", "dot_product", "dot_product_attention",
                              copy_of="nothing", pattern="all_pairs_pattern"))
  assert "other" not in kinds.KINDS


def test_the_config_check_reads_the_new_record(new_kind):
  config = configs.build_config("listops", attention=NAME, size="small")
  assert dict(config.model.attention) == {"kind": NAME, "temperature": 2.0}
  schema.check(config)
  config.model.attention.window = 4
  with pytest.raises(ValueError, match=f"{NAME} takes no argument 'window'; valid: temperature"):
    schema.check(config)


@pytest.mark.slow
def test_lra_list_run_and_the_preflight_take_the_new_kind(new_kind, tmp_path, capsys):
  assert cli.main(["list"]) == 0
  assert any(line.startswith(f"  {NAME} ") for line in capsys.readouterr().out.splitlines())
  data = ["--config.data.data_dir", str(tmp_path / "data")]
  workdir = str(tmp_path / "run")
  assert cli.main(["run", "listops", "--size", "small", "--attention", NAME, "--dry_run",
                   "--workdir", workdir, *data, *TINY]) == 0
  assert "fits" in capsys.readouterr().out
  assert cli.main(["run", "listops", "--size", "small", "--attention", NAME, "--workdir",
                   workdir, *data, *TINY]) == 0
  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["model"]["attention"] == {"kind": NAME, "temperature": 2.0}
  assert results["steps"] == 2 and 0.0 <= results["test_accuracy"] <= 1.0


def test_mpnet_pretraining_refuses_the_new_kind_with_its_reason(new_kind, tmp_path, capsys):
  assert cli.main(["run", "listops", "--size", "small", "--attention", NAME,
                   "--config.protocol=spt", "--config.pretrain.objective=mpnet",
                   "--workdir", str(tmp_path / "w")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1, err
  assert REFUSAL in err and NAME in err
