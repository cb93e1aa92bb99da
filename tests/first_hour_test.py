"""What a new user meets first: `lra run --help` covers what the docs use, flags work in either
spelling, and banners say the values a run really has."""

import pytest

import configs
from launch import cli, remote
from launch.values import flag_spelling
from lra import schema
from lra import tasks as tasks_lib


@pytest.mark.parametrize("argv,want", [
    (["run", "listops", "--dry-run"], ["run", "listops", "--dry_run"]),
    (["run", "x", "--dry-run=steps:2", "--no-preflight"],
     ["run", "x", "--dry_run=steps:2", "--no_preflight"]),
    (["data", "prepare", "text", "--no-download", "--manual-dir", "/a-b"],
     ["data", "prepare", "text", "--no_download", "--manual_dir", "/a-b"]),
    # overrides, values and the command after `--` are left alone
    (["run", "x", "--config.model.attention.num-features=3", "--arg", "a-b=c-d"],
     ["run", "x", "--config.model.attention.num-features=3", "--arg", "a-b=c-d"]),
    (["run", "x", "--workdir=/tmp/a-b"], ["run", "x", "--workdir=/tmp/a-b"]),
    (["launch", "slurm", "--gpus-per-node", "2", "--", "run", "x", "--dry-run"],
     ["launch", "slurm", "--gpus_per_node", "2", "--", "run", "x", "--dry-run"]),
    (["-h"], ["-h"]),
])
def test_flags_are_read_in_the_underscore_spelling(argv, want):
  assert flag_spelling(argv) == want


def test_both_spellings_reach_the_same_parsed_run():
  a = remote.parse_run(["run", "listops", "--size", "small", "--no-preflight", "--dry-run"])
  b = remote.parse_run(["run", "listops", "--size", "small", "--no_preflight", "--dry_run"])
  assert a.workdir == b.workdir and a.config == b.config


def test_run_help_documents_overrides_every_size_and_the_arg(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["run", "--help"])
  assert e.value.code == 0
  text = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
  for needle in ("--config.FIELD=VALUE", "--config.model.attention.implementation", "--arg",
                 "window=W", "hyphen spelling"):
    assert needle in text, needle
  for task in tasks_lib.TASKS:
    sizes = configs.sizes(task)
    assert f"{task}: {', '.join(sizes)}" in text.replace("- ", "-"), task


@pytest.mark.parametrize("task", sorted(tasks_lib.TASKS))
def test_every_listed_size_builds_and_no_other_does(task):
  for size in configs.sizes(task):
    assert configs.build_config(task, size=size).config_arg
  with pytest.raises(ValueError, match="unknown size 'huge'; valid sizes: " +
                     ", ".join(configs.sizes(task))):
    configs.build_config(task, size="huge")


@pytest.mark.parametrize("task,attention,size,overrides,label", [
    ("listops", "band", "small", [], "attention=band,size=small,window=16"),
    ("listops", "band", "small", [("model.attention.window", "4")],
     "attention=band,size=small,window=4"),
    ("listops", "dot_product", "base", [], "attention=dot_product,size=base"),
    ("listops", "performer", "small", [], "attention=favor,size=small"),
    ("listops", "band", "small", [("model.attention.implementation", "pallas")],
     "attention=band,size=small,window=16,implementation=pallas"),
])
def test_banners_name_the_effective_values(task, attention, size, overrides, label):
  config = configs.build_config(task, attention=attention, size=size, overrides=overrides)
  assert schema.run_label(config) == label


@pytest.mark.parametrize("seconds,text", [(0.0612, "0.06 s"), (42.4, "42 s"), (750, "12.5 min"),
                                          (457200, "127 hours")])
def test_durations_read_in_the_unit_that_fits(seconds, text):
  from lra import preflight
  assert preflight.duration_text(seconds) == text


def test_a_cpu_run_longer_than_the_limit_stops_in_one_line_unless_yes(monkeypatch, tmp_path,
                                                                      capsys):
  from launch import train as launcher
  from lra import preflight
  config = configs.build_config("listops", attention="band", size="small")
  monkeypatch.setattr(preflight, "LONG_RUN_SECONDS", 1e-6)   # any run is long
  status, plans = launcher.run_preflight(config, str(tmp_path))
  err = capsys.readouterr().err.strip()
  assert (status, plans) == (2, [])
  assert "\n" not in err and err.startswith("error: listops (attention=band,size=small,window=16)"
                                            " would train for about ")
  assert "pass --yes to run it anyway, or a smaller --size (base, cpu)" in err
  status, plans = launcher.run_preflight(config, str(tmp_path), yes=True)
  assert status == 0 and len(plans) == 1
  # a resumed run is charged only the steps it has left
  (tmp_path / "checkpoints" / "800").mkdir(parents=True)
  assert launcher._steps_left(config, str(tmp_path), "") == 0
  monkeypatch.setattr(preflight, "LONG_RUN_SECONDS", 1e-6)
  assert launcher.run_preflight(config, str(tmp_path))[0] == 0


@pytest.mark.slow
def test_the_lra_base_size_on_this_cpu_stops_naming_the_hours_and_the_sizes(tmp_path, capsys,
                                                                             monkeypatch):
  from lra import preflight
  # The hours, not the memory: a busy machine's MemAvailable may refuse the base size first.
  monkeypatch.setattr(preflight, "available_memory", lambda devices: (64 * 10**9, "a test"))
  status = cli.main(["run", "listops", "--attention", "band", "--workdir", str(tmp_path / "w")])
  err = capsys.readouterr().err
  assert status == 2
  assert " hours on this CPU" in err and "--size (small, cpu)" in err and "--yes" in err
  assert not (tmp_path / "w").exists()


def test_a_preflight_compile_that_takes_a_while_says_what_it_compiles(monkeypatch, tmp_path,
                                                                      capsys):
  from launch import train as launcher
  from lra import preflight
  config = configs.build_config("listops", attention="band", size="small")
  monkeypatch.setattr(launcher, "COMPILE_NOTE_SECONDS", 0.0)   # any compile takes a while
  monkeypatch.setattr(preflight, "LONG_RUN_SECONDS", 1e9)
  status, _ = launcher.run_preflight(config, str(tmp_path), yes=True)
  out = capsys.readouterr().out.splitlines()
  assert status == 0
  assert out[0] == ("Preflight: compiling the steps of listops (attention=band,size=small,"
                    "window=16), 2 layers, to measure their memory and time (--no_preflight "
                    "skips this)..."), out
  assert out[1].startswith("Preflight: about ")
