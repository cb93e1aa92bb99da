"""What a new user meets first: `lra run --help` covers what the docs use, flags work in either
spelling, and banners say the values a run really has."""

import re

import pytest

import configs
from launch import cli, remote
from launch.values import flag_spelling
from lra import identity, schema
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
    assert configs.build_config(task, size=size).size == size
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
  assert identity.label(config) == label


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


# benchmarks/first_hour.py: the docs' numbers read from the docs, compared with a command's output.

from pathlib import Path   # noqa: E402

from benchmarks import first_hour   # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _docs(planted=None):
  """The docs the checks read, with the `planted` {file: (old, new)} slips."""
  docs = {c.doc: (REPO / c.doc).read_text() for c in first_hour.CHECKS}
  for doc, (old, new) in (planted or {}).items():
    assert old in docs[doc], old
    docs[doc] = docs[doc].replace(old, new)
  return docs


def _check(name):
  return next(c for c in first_hour.CHECKS if c.name == name)


def test_every_check_finds_its_one_doc_line():
  docs = _docs()
  for check in first_hour.CHECKS:
    value = first_hour.doc_value(docs[check.doc], check.pattern)
    assert value, check.name
    if check.tolerance_pattern:
      assert float(first_hour.doc_value(docs[check.doc], check.tolerance_pattern)) > 1
  assert first_hour.doc_value(docs["README.md"], _check("demo").pattern) == "0.39"


@pytest.mark.parametrize("kind,expected,got,ok", [
    ("exact", "0.39", "0.3925", True),      # the doc's digits: 0.3925 reads 0.39
    ("exact", "0.39", "0.3895", True),
    ("exact", "0.39", "0.3849", False),
    ("exact", "0.15", "0.1450", True),     # half up, as the docs round
    ("exact", "0.14", "0.1450", False),
    ("exact", "0.3925", "0.3925", True),
    ("exact", "0.3925", "0.3895", False),
    ("exact", "77,258", "77,258", True),
    ("exact", "77,258", "77,259", False),
    ("exact", "0.39", None, False),
    ("factor", "87", "60", True),
    ("factor", "87", "130", True),
    ("factor", "87", "50", False),
    ("text", "favor", "favor", True),
    ("text", "favor", "performer", False),
    ("line", "band  Longformer   x", "band Longformer x", True),
    ("line", "band  Longformer   x", "band Longformer y", False),
])
def test_compare(kind, expected, got, ok):
  assert first_hour.compare(kind, expected, got, factor=1.5) is ok


DEMO_OUT = ("Training listops (attention=dot_product,size=small) in /x\n"
            "test accuracy 0.3925 (majority class 0.1450), best validation accuracy 0.3920 at "
            "step 800; results in /x/results.json\n")


def test_a_run_that_prints_the_documented_numbers_matches():
  docs = _docs()
  for name in ("demo", "demo_majority", "demo_training_md", "demo_seed0"):
    row = first_hour.evaluate(_check(name), docs, 0, DEMO_OUT)
    assert row.ok, (name, row)
  row = first_hour.evaluate(_check("demo"), docs, 0, DEMO_OUT)
  assert (row.expected, row.got) == ("0.39", "0.3925")


def test_every_output_pattern_reads_the_line_the_tasks_print():
  """The result lines as the tasks themselves write them (`Task.result_line`), for the
  classifier runs and the character LM, read by every check of a training run."""
  from lra.tasks import get_task
  docs = _docs()
  accuracy = get_task("listops").result_line(
      {"test_accuracy": 0.3925, "majority_class_rate": 0.145, "best_validation_accuracy": 0.392,
       "best_validation_step": 800}, "/x/results.json")
  bpc = get_task("enwik8").result_line(
      {"test_bpc": 1.829, "best_validation_bpc": 2.071, "best_validation_step": 200},
      "/x/results.json")
  for name in ("demo", "demo_training_md", "demo_seed0", "enwik8_small",
               "enwik8_small_positions"):
    out = bpc if name.startswith("enwik8") else accuracy
    row = first_hour.evaluate(_check(name), docs, 0, f"Training ...\n{out}\n")
    assert row.ok and row.got in ("0.3925", "1.8290"), row
  # a staged run prints its phase 1 line first: the final phase's is the run's result
  phase1 = bpc.replace("1.8290", "1.9728")
  row = first_hour.evaluate(_check("enwik8_small"), docs, 0, f"{phase1}\n{bpc}\n")
  assert row.ok and row.got == "1.8290", row
  row = first_hour.evaluate(_check("enwik8_small_phase1"), docs, 0, f"{phase1}\n{bpc}\n")
  assert row.ok and (row.expected, row.got) == ("1.973", "1.9728"), row
  row = first_hour.evaluate(_check("enwik8_small"), docs, 0, "test BPC 1.829\n")
  assert not row.ok and row.note == "its last line: test BPC 1.829"


def test_a_stale_doc_number_is_a_mismatch():
  docs = _docs({"README.md": ("`test accuracy 0.39 (majority", "`test accuracy 0.41 (majority")})
  row = first_hour.evaluate(_check("demo"), docs, 0, DEMO_OUT)
  assert not row.ok and (row.expected, row.got) == ("0.41", "0.3925")
  docs = _docs({"docs/training.md": ("parameters: 77,258", "parameters: 77,259")})
  row = first_hour.evaluate(_check("dry_run_params"), docs, 0, "parameters: 77,258\n")
  assert not row.ok
  assert "MISMATCH" in first_hour.table([row])


def test_a_dropped_doc_line_a_wrong_exit_or_a_missing_number_is_reported():
  docs = _docs({"docs/pretraining.md": ("| ListOps | scratch (800 steps) |",
                                       "| ListOps | scratch |")})
  row = first_hour.evaluate(_check("demo_seed0"), docs, 0, DEMO_OUT)
  assert not row.ok and "0 lines match" in row.note
  row = first_hour.evaluate(_check("demo"), _docs(), 1, DEMO_OUT)
  assert not row.ok and "exit 1, documented 0" in row.note
  row = first_hour.evaluate(_check("demo"), _docs(), 0, "Training listops\n")
  assert not row.ok and row.got == "(not printed)"


def test_the_list_rows_of_the_readme_against_lra_list(capsys):
  from launch import cli
  assert cli.main(["list"]) == 0
  out = capsys.readouterr().out
  for name in ("list_band", "list_favor", "list_lsh"):
    assert first_hour.evaluate(_check(name), _docs(), 0, out).ok, name
  docs = _docs({"README.md": ("FAVOR+ random features", "FAVOR+ random feature maps")})
  assert not first_hour.evaluate(_check("list_favor"), docs, 0, out).ok


def test_quick_and_only_select_the_checks():
  quick = first_hour.select(True, "")
  assert quick and all(c.quick for c in quick)
  assert {c.name for c in first_hour.select(False, "")} == {c.name for c in first_hour.CHECKS}
  assert [c.name for c in first_hour.select(False, "demo")] == [
      "demo", "demo_majority", "demo_training_md", "demo_seed0"]
  assert len(first_hour.select(False, "sweep_kinds_small")) == 4
  with pytest.raises(SystemExit, match="no check named nosuch"):
    first_hour.select(False, "nosuch")


@pytest.mark.slow
def test_the_quick_first_hour_runs_from_a_fresh_clone(capsys):
  """benchmarks/first_hour.py --quick end to end (about a minute): a clone of the committed
  checkout, the dry run, the refusal and a 5-step run, every row ok."""
  status = first_hour.main(["--quick"])
  out = capsys.readouterr().out
  rows = {line.split()[0]: line for line in out.splitlines()
          if line.split()[:1] and line.split()[0] in {c.name for c in first_hour.CHECKS}}
  assert set(rows) == {c.name for c in first_hour.CHECKS if c.quick}, out
  # The hours are an estimate from the machine's matmul rate at start-up: a machine busier
  # than the doc's may take it past the doc's factor, so that row must only have refused; and
  # where other jobs hold the memory, the base size is refused for memory first (also one line,
  # exit 2, before anything is trained).
  memory_refusal = re.compile(r"its last line: error: .* needs about [\d.]+ GB per device but "
                              r"[\d.]+ GB is available")
  for name, line in rows.items():
    assert line.endswith("  ok") or (name == "base_hours" and "exit" not in line and (
        "(not printed)" not in line or memory_refusal.search(line))), out
  assert status == 0 or "mismatched: base_hours" in out, out
