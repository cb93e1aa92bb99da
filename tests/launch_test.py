"""Tests for launch/: the `lra` command's names, overrides and errors (no training here)."""

import pytest

import attention
from launch import cli, train as launcher


def test_list_shows_tasks_and_every_attention_kind(capsys):
  assert cli.main(["list"]) == 0
  out = capsys.readouterr().out
  assert "listops" in out
  for kind in attention.REGISTRY:
    assert f"  {kind}\n" in out + "\n"


def test_unknown_task_and_attention_are_errors_with_the_valid_names(capsys):
  assert cli.main(["run", "listop"]) == 2
  assert "valid tasks: enwik8, image, listops, pathfinder" in capsys.readouterr().err
  assert cli.main(["run", "listops", "--attention", "flash"]) == 2
  assert "valid names: " in capsys.readouterr().err


def test_overrides_are_typed_and_checked():
  c = launcher.build_config("listops", attention="band", size="small", overrides=[
      ("num_train_steps", "7"), ("learning_rate", "0.01"), ("progress", "false"),
      ("model.attention.window", "5"), ("model.attention.dilation", "(1, 2, 1, 2)"),
      ("mesh.tensor", "2"), ("data.data_dir", "/tmp/x")])
  assert c.num_train_steps == 7 and c.learning_rate == 0.01 and c.progress is False
  assert c.model.attention.window == 5 and c.model.attention.dilation == (1, 2, 1, 2)
  assert c.mesh.tensor == 2 and c.data.data_dir == "/tmp/x"
  with pytest.raises(ValueError, match="valid fields of model: .*emb_dim"):
    launcher.build_config("listops", overrides=[("model.emb", "3")])
  with pytest.raises(ValueError, match="expected"):
    launcher.build_config("listops", overrides=[("num_train_steps", "many")])
  with pytest.raises(ValueError, match="unknown config field 'optim'"):
    launcher.build_config("listops", overrides=[("optim.lr", "1")])


def test_split_overrides_accepts_both_spellings():
  rest, overrides = launcher.split_overrides(
      ["run", "listops", "--config.seed=3", "--config.batch_size", "16", "--workdir", "w"])
  assert rest == ["run", "listops", "--workdir", "w"]
  assert overrides == [("seed", "3"), ("batch_size", "16")]


def test_default_workdir_names_the_run():
  c = launcher.build_config("listops", attention="band", size="small")
  assert launcher.default_workdir("listops", c) == "workdirs/listops-band-small"
