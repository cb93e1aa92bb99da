"""Tests for launch/: the `lra` command's names, overrides and errors (no training here)."""

import ast
import json
import os
import subprocess
import sys

import pytest

import attention
import configs
from configs import common
from launch import cli, train as launcher, values
from lra import identity

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_list_shows_tasks_and_every_attention_kind(capsys):
  assert cli.main(["list"]) == 0
  out = capsys.readouterr().out
  assert "listops" in out
  for kind in attention.REGISTRY:   # one row per kind (tests/kind_names_test.py: its cells)
    assert any(line.startswith(f"  {kind} ") for line in out.splitlines()), kind


def test_unknown_task_and_attention_are_errors_with_the_valid_names(capsys):
  assert cli.main(["run", "listop"]) == 2
  assert ("valid tasks: enwik8, image, listops, mqar, needle, pathfinder"
          in capsys.readouterr().err)
  assert cli.main(["run", "listops", "--attention", "flashy"]) == 2
  assert "valid names: " in capsys.readouterr().err


def test_overrides_are_typed_and_checked():
  c = configs.build_config("listops", attention="band", size="small", overrides=[
      ("num_train_steps", "7"), ("learning_rate", "0.01"), ("progress", "false"),
      ("model.attention.window", "5"), ("model.attention.dilation", "(1, 2, 1, 2)"),
      ("mesh.tensor", "2"), ("data.data_dir", "/tmp/x")])
  assert c.num_train_steps == 7 and c.learning_rate == 0.01 and c.progress is False
  assert c.model.attention.window == 5 and c.model.attention.dilation == (1, 2, 1, 2)
  assert c.mesh.tensor == 2 and c.data.data_dir == "/tmp/x"
  with pytest.raises(ValueError, match="valid fields of model: .*emb_dim"):
    configs.build_config("listops", overrides=[("model.emb", "3")])
  with pytest.raises(ValueError, match="expected"):
    configs.build_config("listops", overrides=[("num_train_steps", "many")])
  with pytest.raises(ValueError, match="unknown config field 'optim'"):
    configs.build_config("listops", overrides=[("optim.lr", "1")])


def test_split_overrides_accepts_both_spellings():
  rest, overrides = launcher.split_overrides(
      ["run", "listops", "--config.seed=3", "--config.batch_size", "16", "--workdir", "w"])
  assert rest == ["run", "listops", "--workdir", "w"]
  assert overrides == [("seed", "3"), ("batch_size", "16")]


def test_a_config_flag_without_value_never_takes_the_next_flag(capsys):
  message = "--config.seed needs a value: --config.seed=VALUE."
  for argv in (["run", "listops", "--config.seed", "--size", "small"],
               ["run", "listops", "--config.seed"]):
    with pytest.raises(ValueError) as e:
      launcher.split_overrides(argv)
    assert str(e.value) == message
  # a negative number is a value, not a flag
  assert launcher.split_overrides(["--config.seed", "-1"])[1] == [("seed", "-1")]
  assert cli.main(["run", "listops", "--config.seed", "--size", "small"]) == 2
  assert launcher.main(["listops", "--config.seed", "--size", "small"]) == 2
  assert capsys.readouterr() == ("", f"error: {message}\n" * 2)


def test_default_workdir_names_the_run():
  c = configs.build_config("listops", attention="band", size="small")
  assert launcher.default_workdir("listops", c) == "workdirs/listops-band-small"


def test_data_status_and_prepare(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("LRA_DATA", str(tmp_path))
  overrides = ["--config.data.num_train=40", "--config.data.num_val=8",
               "--config.data.num_test=8"]
  assert cli.main(["data", "status", "--size", "small"]) == 0
  out = capsys.readouterr().out
  assert f"data root: {tmp_path}" in out and "\nsizes: small\n" in out   # the size checked
  lines = {line.split()[0]: line for line in out.splitlines()[2:]}
  assert set(lines) == {"listops", "text", "retrieval", "image", "pathfinder", "pathx",
                        "enwik8", "text8", "sort_marked", "mqar", "needle"}
  assert "missing" in lines["listops"] and "generator" in lines["listops"]
  assert cli.main(["data", "prepare", "listops", "--size", "small", *overrides]) == 0
  assert "listops: dataset ready in " + str(tmp_path / "listops") in capsys.readouterr().out
  assert cli.main(["data", "status", "--size", "small", *overrides]) == 2  # prepare-only flags
  # A missing release: the error names the address and the directory, exit status 2.
  assert cli.main(["data", "prepare", "listops", "--manual_dir", str(tmp_path / "m"),
                   "--config.data.generate=false"]) == 2
  err = capsys.readouterr().err
  assert "lra_release.gz" in err and str(tmp_path / "m") in err
  assert cli.main(["data", "prepare", "listops_x"]) == 2
  assert "valid tasks: enwik8" in capsys.readouterr().err


def test_run_with_missing_data_prints_what_to_get(tmp_path, capsys):
  manual = tmp_path / "manual"
  assert cli.main(["run", "text", "--workdir", str(tmp_path / "w"), "--no_preflight",
                   f"--config.data.manual_dir={manual}", "--config.data.download=false"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and "Traceback" not in err
  assert "aclImdb_v1.tar.gz" in err and str(manual) in err and "https://" in err
  assert not (tmp_path / "w").exists()  # nothing was started


def test_missing_data_is_reported_before_the_preflight_compiles(tmp_path, capsys):
  """The line a run without the preflight ends with (the data step's), before the preflight:
  `lra data status` knows at once."""
  from lra import tasks
  manual = tmp_path / "manual"
  args = ["--size", "small", f"--config.data.manual_dir={manual}", "--config.data.download=false"]
  assert cli.main(["run", "text", "--workdir", str(tmp_path / "w"), "--no_preflight", *args]) == 2
  after = capsys.readouterr().err
  assert cli.main(["run", "text", "--workdir", str(tmp_path / "w"), *args]) == 2
  out, err = capsys.readouterr()
  assert "Preflight" not in out and "compil" not in out, out
  assert err == after and err.startswith("error: ") and err.count("\n") == 1
  config = configs.build_config("text", size="small", overrides=[
      ("data.manual_dir", str(manual)), ("data.download", "false")])
  status = tasks.get_task("text").status(config.data)
  assert status.missing and not status.ready
  assert "aclImdb_v1.tar.gz" in err and not (tmp_path / "w").exists()


def test_dry_run_values_and_config_changes():
  assert launcher.dry_run_steps(None) is None
  assert launcher.dry_run_steps("steps:0") == 0 and launcher.dry_run_steps("steps:12") == 12
  for bad in ("3", "steps", "steps:x", "step:2"):
    with pytest.raises(ValueError, match="--dry_run takes no value or steps:N"):
      launcher.dry_run_steps(bad)
  c = configs.build_config("listops", attention="band", size="small", arg="window=8",
                           overrides=[("batch_size", "16"), ("model.attention.dilation", "2")])
  default, changes = launcher.config_changes(c)
  assert default == "attention=band,size=small,window=16"   # the effective window
  assert changes == ["  batch_size: 32 -> 16",
                     "  model.attention.dilation: '(absent)' -> 2",
                     "  model.attention.window: 16 -> 8"]
  assert launcher.config_changes(configs.build_config("text8", size="small"))[1] == []


def test_a_bad_dry_run_value_is_one_line_before_jax():
  code = ("import sys; from launch import cli; rc = cli.main(sys.argv[1:]); "
          "assert 'jax' not in sys.modules, 'jax was imported'; sys.exit(rc)")
  proc = subprocess.run([sys.executable, "-c", code, "run", "listops", "--dry_run=fast"],
                        cwd=REPO, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr == ("error: --dry_run takes no value or steps:N (N timed steps), got "
                         "'fast'.\n")


def _launch_imports() -> dict[str, set[str]]:
  """launch/'s modules -> the launch modules each imports, at top level or in a function."""
  folder = os.path.join(REPO, "launch")
  names = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
  graph = {}
  for name in names:
    with open(os.path.join(folder, f"{name}.py")) as f:
      tree = ast.parse(f.read())
    deps = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("launch.")}
      elif isinstance(node, ast.ImportFrom) and node.module == "launch":
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("launch."):
        deps.add(node.module.split(".")[1])
    graph[name] = (deps & names) - {name}
  return graph


def test_no_launch_module_imports_one_that_imports_it_back():
  graph = _launch_imports()
  assert graph["cli"] >= {"dispatch", "sweep", "results"} and "dispatch" not in graph["remote"]
  for start in graph:   # everything reachable from `start` must not lead back to it
    seen, todo = set(), list(graph[start])
    while todo:
      name = todo.pop()
      assert name != start, f"launch/{start}.py imports a module that imports it back"
      if name not in seen:
        seen.add(name)
        todo += graph[name]


def test_value_text_reads_back_through_the_override_converter():
  for value in (3, 0.25, 1e-9, True, False, "band", None, (1, 2), [1, 2], ("a",), (),
                ((1, 2), (3,)), ({"kind": "band", "window": 8},), (0.5, True, None)):
    text = values.value_text(value)
    assert " " not in text or isinstance(value, str)
    current = tuple(value) if isinstance(value, list) else value
    assert common.convert(text, current) == current, (value, text)
  assert values.value_text((1, 2)) == "(1,2)" and values.value_text(True) == "true"
  assert values.flatten({"a": {"b": 1, "c": {}}, "d": (1,)}) == {"a.b": 1, "a.c": {}, "d": (1,)}


def test_a_runs_identity_is_read_from_its_fields_and_from_an_older_config_json():
  """lra.identity: the label, the default workdir and the argument of the default config come
  from config.task, config.size and config.model.attention; a config.json written before the
  size was a field gives them from its config_arg text; nothing else parses that text."""
  c = configs.build_config("enwik8", arg="size=xl-small")
  assert (identity.kind(c), identity.size(c)) == ("dot_product", "xl-small")
  assert identity.workdir_name(c) == f"{c.task}-dot_product-xl-small"
  assert configs.build_config(c.task, arg=identity.arg(c)).to_dict() == c.to_dict()
  band = configs.build_config("listops", size="small", attention="band", arg="window=8")
  assert identity.label(band) == "attention=band,size=small,window=8"
  assert identity.arg(band) == "attention=band,size=small"        # the window shows as a change
  spt = configs.build_config("listops", size="small", overrides=[("protocol", "spt")])
  assert launcher.default_workdir("listops", spt) == os.path.join(
      "workdirs", f"listops-dot_product-small-spt-{spt.pretrain.objective}")
  older = {"task": "listops", "config_arg": "attention=band,size=small,window=0",
           "model": {"attention": {"window": 16}}}
  assert (identity.kind(older), identity.size(older)) == ("band", "small")
  assert identity.label(older) == "attention=band,size=small,window=16"
  assert identity.size({"config_arg": 5}) == identity.kind({"model": [1]}) == ""


# Where the text `config_arg` may still appear: the sweep files' point argument (the sweep, its
# record and `lra results`' reading of that record), and lra.identity's read of an older
# config.json. No module reads a run's identity back from text otherwise.
CONFIG_ARG_READERS = {"lra/identity.py", "launch/sweep.py", "launch/results.py"}


def test_no_module_parses_a_runs_identity_back_from_text():
  found = set()
  for top in ("lra", "launch", "models", "attention", "benchmarks"):
    for folder, _, files in os.walk(os.path.join(REPO, top)):
      for name in files:
        path = os.path.join(folder, name)
        if name.endswith(".py") and "config_arg" in open(path).read():
          found.add(os.path.relpath(path, REPO))
  assert found <= CONFIG_ARG_READERS, sorted(found - CONFIG_ARG_READERS)
  for name in sorted(os.listdir(os.path.join(REPO, "configs"))):   # sweep points only
    text = open(os.path.join(REPO, "configs", name)).read() if name.endswith(".py") else ""
    assert all(line.strip().startswith(("add(config_arg=", "#")) or "add(config_arg=" in line
               for line in text.splitlines() if "config_arg" in line), name


def test_lra_launch_help_and_unknown_launcher(capsys):
  assert cli.main(["launch", "--help"]) == 0
  assert capsys.readouterr().out.startswith("`lra launch tpu|slurm -- run ...`: what the TPU")
  assert cli.main(["launch", "gpu", "--", "run", "listops"]) == 2
  assert capsys.readouterr().err == "error: unknown launcher 'gpu'; valid launchers: tpu, slurm.\n"


def test_a_config_json_from_before_the_size_field_is_the_same_run():
  """A finished run's config.json written with `config_arg` instead of `size` compares equal to
  the same command's config today (run_state.config_differences, what a rerun checks), and
  peer_timeout_s, which changes how processes wait and not what is trained, is no change."""
  from launch import run_state
  config = json.loads(configs.build_config("listops", size="small", attention="band")
                      .to_json_best_effort())
  older = {k: v for k, v in config.items() if k not in ("size", "peer_timeout_s")}
  older["config_arg"] = "attention=band,size=small,window=0"
  assert run_state.config_differences(older, config) == []
  assert run_state.config_differences(older, {**config, "size": "base"}) == [
      "size: small -> base"]
  assert run_state.config_differences(config, {**config, "peer_timeout_s": 60}) == []
