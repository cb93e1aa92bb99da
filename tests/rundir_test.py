"""lra/rundir.py: the one module that names a run folder's entries, and the reads built on them."""

import ast
import json
import os
import pathlib

import pytest

from lra import rundir
from lra.rundir import RunDir

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a run folder holds, as docs/training.md and the module docstring name them.
NAMES = {"config.json", "checkpoints", "best", "metrics.jsonl", "results.json", "error.log",
         "error.previous.log", "lock", "leftovers", "tensorboard"}


@pytest.mark.parametrize("base, sep", [("/tmp/runs/a", os.sep), ("gs://bucket/runs/a", "/"),
                                       ("gs://bucket/runs/a/", "/")])
def test_every_entry_is_one_name_under_the_folder(base, sep):
  run = RunDir(base)
  stem = base.rstrip("/")
  expected = {"config": "config.json", "checkpoints": "checkpoints", "best": "best",
              "metrics": "metrics.jsonl", "results": "results.json", "error_log": "error.log",
              "error_previous_log": "error.previous.log", "lock": "lock",
              "leftovers": "leftovers", "tensorboard": "tensorboard"}
  for attribute, name in expected.items():
    assert getattr(run, attribute) == f"{stem}{sep}{name}", attribute
  assert set(expected.values()) == NAMES
  assert run.phase(2) == RunDir(f"{stem}{sep}phase2")
  assert run.phase(12).checkpoints == f"{stem}{sep}phase12{sep}checkpoints"
  with pytest.raises(ValueError, match="numbered from 1"):
    run.phase(0)


def test_phases_steps_and_results_as_the_folder_holds_them(tmp_path):
  run = RunDir(tmp_path)
  for name in ("phase10", "phase2", "phase1", "phasex", "phase", "phase2b"):
    (tmp_path / name).mkdir()
  (tmp_path / "phase3").write_text("a file named like a phase is listed too")
  assert run.phase_names() == ["phase1", "phase2", "phase3", "phase10"]
  assert run.steps() == [] and RunDir(tmp_path / "missing").phase_names() == []
  for name in ("40", "8", "120", "60.orbax-checkpoint-tmp-3", "x1", "7a"):
    (tmp_path / "checkpoints" / name).mkdir(parents=True)
  (tmp_path / "best" / "60").mkdir(parents=True)
  assert run.steps() == [8, 40, 120] and run.steps("best") == [60]
  with pytest.raises(ValueError, match="'phase1'"):
    run.steps("phase1")
  assert run.read_results() is None and not run.finished()
  for text in ("{", "[1, 2]", "\xff"):
    (tmp_path / "results.json").write_bytes(text.encode("latin-1"))
    assert run.read_results() is None and not run.finished()
  (tmp_path / "results.json").write_text(json.dumps({"steps": 4}))
  (tmp_path / "config.json").write_text(json.dumps({"task": "listops"}))
  assert run.read_results() == {"steps": 4} and run.finished()
  assert run.read_config() == {"task": "listops"}
  assert not run.finished(staged_phases=2)
  (tmp_path / "phase2" / "results.json").write_text("{}")
  assert run.finished(staged_phases=2) and not run.finished(staged_phases=1)


def _spelled(tree: ast.AST) -> list[tuple[int, str]]:
  """Run-folder names given as path parts: an argument of a `join` call (os.path.join,
  storage.join, epath's joinpath, ...) that is one of NAMES or an f-string `phase{...}`, and an
  f-string ending in `/name`."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      func = node.func
      name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
      if "join" not in name:
        continue
      for arg in node.args:
        if isinstance(arg, ast.Constant) and arg.value in NAMES:
          found.append((node.lineno, arg.value))
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(
            arg.values[0], ast.Constant) and str(arg.values[0].value).startswith("phase"):
          found.append((node.lineno, "phase{...}"))
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[-1],
                                                                      ast.Constant):
      tail = str(node.values[-1].value)
      if tail.startswith("/") and tail[1:] in NAMES:
        found.append((node.lineno, tail))
  return found


def test_no_module_but_rundir_spells_a_run_folder_entry():
  offenders = []
  for folder in ("lra", "launch", "benchmarks"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      if path.name == "rundir.py":
        continue
      for line, name in _spelled(ast.parse(path.read_text(), str(path))):
        offenders.append(f"{path.relative_to(ROOT)}:{line}: {name}")
  assert not offenders, "ask lra.rundir.RunDir for these paths:\n" + "\n".join(offenders)


def test_the_guard_finds_each_way_of_spelling_a_name():
  source = ("a = storage.join(w, 'results.json')\nb = os.path.join(w, f'phase{k}', 'x')\n"
            "c = f'{w}/lock'\nd = epath.Path(w).joinpath('best')\ne = {'best': 1}\n")
  assert [name for _, name in _spelled(ast.parse(source))] == [
      "results.json", "phase{...}", "/lock", "best"]
