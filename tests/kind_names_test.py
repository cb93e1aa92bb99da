"""The names researchers know: a paper's name picks its kind, and `lra list` explains the kinds.

`--attention performer` is favor, `longformer` is band, `reformer` is lsh, ... (each record's
`aliases`); `lra list` prints one row per kind from its record (paper, pattern, cost, causal,
backends, other names) and `lra list KIND` the whole record; a wrong name is one line, exit 2.
"""

import json
import os

import pytest

import configs
from attention import kinds
from lra import identity
from launch import cli

# The papers' names, written out here independently of the records.
PAPERS = {"performer": "favor", "longformer": "band", "reformer": "lsh",
          "sparse_transformer": "sparse", "linear_transformer": "linear", "big_bird": "bigbird",
          "transformer": "dot_product", "flash_attention": "flash"}


@pytest.mark.parametrize("alias,name", sorted(PAPERS.items()))
def test_a_papers_name_resolves_to_its_kind(alias, name):
  assert kinds.resolve(alias) == name and kinds.resolve(name) == name
  config = configs.build_config("listops", attention=alias, size="small")
  assert config.model.attention.kind == name
  assert identity.workdir_name(config) == f"listops-{name}-small"   # named by kind, not alias


def test_aliases_are_unique_and_never_a_kind_name():
  table = kinds.aliases()
  assert not set(table) & set(kinds.KINDS)
  assert sum(len(k.aliases) for k in kinds.KINDS.values()) == len(table)
  with pytest.raises(ValueError, match="the name 'performer' is already registered"):
    kinds.register(kinds.Kind("other", "dot_product", "dot_product_attention",
                              pattern="all_pairs_pattern", aliases=("performer",)))
  assert "other" not in kinds.KINDS


def test_kind_names_inside_configs_stay_exact():
  # Only the chosen kind is resolved; a kind written into the config is checked as written.
  from lra import schema
  config = configs.build_config("listops", size="small")
  config.model.attention.kind = "performer"
  with pytest.raises(ValueError, match="config.model.attention.kind = 'performer': unknown"):
    schema.check(config)


def test_lra_list_has_a_row_per_kind_from_its_record(capsys):
  assert cli.main(["list"]) == 0
  out = capsys.readouterr().out.splitlines()
  for name in kinds.names():
    kind = kinds.get(name)
    row = next(line for line in out if line.startswith(f"  {name} "))
    for cell in (kind.paper, kind.summary, kind.cost, *kind.aliases):
      assert cell in row, (name, cell)
  assert "Performer (Choromanski et al. 2021)" in "\n".join(out)


def test_lra_list_kind_prints_the_record(capsys):
  assert cli.main(["list", "reformer"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("lsh: Reformer (Kitaev et al. 2020)\n")
  assert "shared query-key: yes" in out and "num_buckets" in out
  assert "MPNet pretraining: no: its hash buckets decide the pairs" in out
  assert cli.main(["list", "linformer"]) == 0
  assert "causal: no: Linformer projects keys and values" in capsys.readouterr().out


def test_lra_list_of_an_unknown_kind_is_one_line(capsys):
  assert cli.main(["list", "performers"]) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and captured.err.count("\n") == 1
  assert captured.err.startswith("error: unknown attention 'performers'; valid names: "
                                 "adaptive_span, band,")
  assert "performer (favor)" in captured.err


@pytest.mark.slow
def test_lra_run_takes_a_papers_name(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  assert cli.main(["run", "listops", "--attention", "performer", "--size", "small",
                   "--config.num_train_steps=5", "--config.data.data_dir", str(tmp_path / "d"),
                   "--config.data.num_train=64", "--config.data.num_val=16",
                   "--config.data.num_test=16", "--config.progress=False",
                   "--workdir", workdir]) == 0
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["model"]["attention"]["kind"] == "favor"
  with open(os.path.join(workdir, "results.json")) as f:
    assert json.load(f)["steps"] == 5
  assert "test accuracy" in capsys.readouterr().out
