"""The docs' generated results tables are what benchmarks/doc_tables.py prints from the recorded
JSON beside them: a hand edit of a table, or a JSON rewritten without the doc, fails here."""

import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import doc_tables  # noqa: E402


@pytest.mark.parametrize("table", doc_tables.TABLES, ids=[t.name for t in doc_tables.TABLES])
def test_the_doc_table_is_what_its_json_gives(table):
  with open(os.path.join(ROOT, table.doc)) as f:
    text = f.read()
  assert doc_tables.in_doc(text, table) == doc_tables.generated(table), (
      f"{table.doc}: the {table.name} table is not what {', '.join(table.sources)} give; "
      f"rerun .venv/bin/python benchmarks/doc_tables.py")


def test_the_listops_kinds_table_from_the_runs():
  """Against an independent reading of the runs: each kind's seeds in percent and their mean."""
  with open(os.path.join(ROOT, "docs", "listops_small_kinds.json")) as f:
    runs = json.load(f)
  table = doc_tables.generated(doc_tables.TABLES[0]).splitlines()
  assert table[2].startswith("| dot_product | ")   # the reference first
  assert len(table) == 2 + len({r["attention"] for r in runs})
  rows = {line.split(" | ")[0][2:]: line for line in table[2:]}
  for kind in ("band", "favor", "lsh"):
    tests = [r["test"] for r in sorted(runs, key=lambda r: r["seed"]) if r["attention"] == kind]
    shown = " / ".join(f"{100 * t:.2f}" for t in tests)
    assert f"| {kind} | {shown} (" in rows[kind], rows[kind]
    mean = float(rows[kind].split("(")[1].split(")")[0])
    assert abs(mean - 50 * (tests[0] + tests[1])) <= 0.005 + 1e-9, rows[kind]
  means = [float(line.split("(")[1].split(")")[0]) for line in table[3:]]
  assert means == sorted(means, reverse=True)
  assert rows["dot_product"].endswith("| OOM |")


@pytest.fixture
def copy(tmp_path):
  """The docs and the recorded files the tables read, in a folder of their own."""
  (tmp_path / "docs").mkdir()
  for name in {t.doc for t in doc_tables.TABLES} | {s for t in doc_tables.TABLES
                                                     for s in t.sources}:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(ROOT, name), tmp_path / name)
  return tmp_path


def test_a_hand_edit_or_a_rerun_is_found_and_the_command_rewrites_the_table(copy, capsys):
  assert doc_tables.main(["--check", "--root", str(copy)]) == 0
  doc = copy / "docs" / "efficiency.md"
  doc.write_text(doc.read_text().replace("| band | 37.70 / 38.30 (38.00) |",
                                         "| band | 37.30 / 38.30 (37.80) |"))
  runs_path = copy / "docs" / "listops_small_kinds.json"
  runs = json.loads(runs_path.read_text())
  next(r for r in runs if r["attention"] == "lsh" and r["seed"] == 0)["test"] = 0.361
  runs_path.write_text(json.dumps(runs))
  capsys.readouterr()
  assert doc_tables.main(["--check", "--root", str(copy)]) == 1
  assert capsys.readouterr().out == (
      "docs/efficiency.md: listops kinds differs from docs/listops_small_kinds.json, "
      "docs/efficiency.jsonl\n")
  before = doc.read_text()
  assert doc_tables.main(["--root", str(copy)]) == 0
  after = doc.read_text()
  assert "| band | 37.70 / 38.30 (38.00) |" in after and "| lsh | 36.10 / 35.45 (35.77) |" in after
  # only the table changed: the prose around it is kept
  outside = lambda t: t.split("<!-- listops kinds: begin -->")[0] + t.split(
      "<!-- listops kinds: end -->")[1]
  assert outside(before) == outside(after)
  assert doc_tables.main(["--check", "--root", str(copy)]) == 0


def test_missing_markers_are_an_error():
  table = doc_tables.TABLES[0]
  with pytest.raises(ValueError, match="has no line <!-- listops kinds: begin -->"):
    doc_tables.in_doc("no table here", table)
