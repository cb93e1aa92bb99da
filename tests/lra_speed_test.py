"""Tests of `benchmarks/lra_speed.py`: the --quick run end to end (table, JSON lines, ratios,
plot), --resume, argument errors, the skipping rules and the speed-vs-accuracy plot (from a
fabricated `lra results --format json` file). No timing is asserted."""

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import lra_speed  # noqa: E402
from benchmarks import lra_speed_plot  # noqa: E402

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

SCRIPT = os.path.join(ROOT, "benchmarks", "lra_speed.py")
KINDS = ("dot_product", "identity", "band")
LENGTHS = (128, 256)


def run(*args, timeout=300):
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


def lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  folder = tmp_path_factory.mktemp("lra_speed")
  out = str(folder / "quick.jsonl")
  done = run("--quick", "--out", out, "--markdown", str(folder / "table.md"))
  assert done.returncode == 0, done.stderr[-3000:]
  return folder, out, done


def test_quick_prints_the_table_and_writes_every_point(quick):
  folder, out, done = quick
  rows = [l for l in done.stdout.splitlines() if l.startswith("| ")]
  for kind in KINDS:
    for n in LENGTHS:
      assert any(l.startswith(f"| {kind} | {n} | ") for l in rows), done.stdout
  assert "| kind | speed 128 | speed 256 | memory 128 | memory 256 |" in done.stdout
  with open(folder / "table.md") as f:
    assert f.read().strip() == done.stdout.strip()
  records = lines(out)
  assert sorted((r["kind"], r["length"]) for r in records) == sorted(
      (k, n) for k in KINDS for n in LENGTHS)
  for r in records:
    assert r["status"] == "ok", r
    assert set(lra_speed.FIELDS) <= set(r), set(lra_speed.FIELDS) - set(r)
    assert r["setup"] == "quick" and r["batch"] == 2 and r["record"] == "point"
    assert len(r["times_s"]) >= 2 and r["step_min_s"] <= r["step_s"] <= max(r["times_s"])
    assert r["steps_per_s"] == pytest.approx(1 / r["step_s"])
    assert r["compile_s"] > 0 and r["peak_gb"] > 0.05 and r["params"] > 0
    assert r["loss"] == r["loss"]                       # finite, not NaN
  with Image.open(out[:-len(".jsonl")] + ".png") as image:
    assert image.size == (1500, 660)


def test_ratios_agree_with_the_measured_numbers(quick):
  _, out, done = quick
  records = {(r["kind"], r["length"]): r for r in lines(out)}
  for (kind, n), r in records.items():
    dense, ident = records[("dot_product", n)], records[("identity", n)]
    assert r["vs_dense"] == pytest.approx(r["steps_per_s"] / dense["steps_per_s"])
    assert r["vs_identity"] == pytest.approx(r["steps_per_s"] / ident["steps_per_s"])
    assert r["memory_vs_dense"] == pytest.approx(r["peak_gb"] / dense["peak_gb"])
    row = next(l for l in done.stdout.splitlines() if l.startswith(f"| {kind} | {n} | "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) == pytest.approx(r["steps_per_s"], abs=1e-3)
    assert float(cells[3].rstrip("x")) == pytest.approx(r["vs_dense"], abs=0.01)
    assert float(cells[4].rstrip("x")) == pytest.approx(r["vs_identity"], abs=0.01)
    assert float(cells[5]) == pytest.approx(r["peak_gb"], abs=0.01)


def test_resume_measures_nothing_again(quick):
  folder, out, first = quick
  before = lines(out)
  done = run("--quick", "--out", out, "--resume", timeout=120)
  assert done.returncode == 0, done.stderr
  assert "6 points, 0 to measure" in done.stderr
  assert lines(out) == before
  table = lambda text: [l for l in text.splitlines() if l.startswith("|")]
  assert table(done.stdout) == table(first.stdout)


def test_an_unknown_kind_fails_in_one_line(tmp_path):
  done = run("--quick", "--kinds", "band,no_such_kind", "--out", str(tmp_path / "x.jsonl"),
             timeout=60)
  assert done.returncode == 2
  assert done.stderr.strip().count("\n") == 0, done.stderr
  assert "'no_such_kind'" in done.stderr and "dot_product" in done.stderr
  assert not (tmp_path / "x.jsonl").exists()


def _record(kind, n, status="ok", step=1.0, compile_s=10.0):
  r = dict(record="point", setup="text-base", batch=4, kind=kind, length=n, status=status)
  if status == "ok":
    r.update(step_s=step, step_min_s=step, steps_per_s=1 / step, times_s=[step] * 3,
             warmup_steps=1,
             compile_s=compile_s, peak_gb=1.0)
  return r


def test_points_after_an_oom_or_timeout_or_over_the_budget_are_skipped():
  done = {lra_speed.key(r): r for r in (
      _record("band", 1024), _record("band", 2048, "oom"),
      _record("favor", 1024, "timeout"), _record("linear", 1024, step=20.0),
      _record("lsh", 1024, "error"))}
  skip = lambda kind, n: lra_speed.skip_reason(kind, n, done, "text-base", 4, 300.0)
  assert skip("band", 2048) is None                    # its own record is not "shorter"
  assert skip("band", 4096) == "after oom at 2048"
  assert skip("favor", 2048) == "after timeout at 1024"
  # 10 s compile + 4 steps of 20 s x 2 = 170 s fits 300 s; x 4 = 330 s does not
  assert skip("linear", 2048) is None
  assert skip("linear", 4096).startswith("predicted over --max_seconds: 330 s")
  assert skip("lsh", 2048) is None                     # errors are not a reason
  assert lra_speed.skip_reason("band", 4096, done, "text-base", 8, 300.0) is None


def test_flash_is_the_dense_reference_where_dot_product_ran_out_of_memory():
  done = {lra_speed.key(r): r for r in (
      _record("dot_product", 1024, step=2.0), _record("flash", 1024, step=4.0),
      _record("dot_product", 4096, "oom"), _record("flash", 4096, step=8.0),
      _record("identity", 4096, step=1.0), _record("band", 4096, step=2.0),
      _record("band", 1024, step=1.0))}
  for r in done.values():
    lra_speed.add_ratios(r, done)
  band_1k, band_4k = done[("text-base", 4, "band", 1024)], done[("text-base", 4, "band", 4096)]
  assert band_1k["dense_ref"] == "dot_product" and band_1k["vs_dense"] == pytest.approx(2.0)
  assert band_4k["dense_ref"] == "flash" and band_4k["vs_dense"] == pytest.approx(4.0)
  assert band_4k["vs_identity"] == pytest.approx(0.5)
  assert done[("text-base", 4, "dot_product", 4096)]["vs_dense"] is None
  table = lra_speed_plot.render_table(list(done.values()))
  assert "| band | 4096 | 0.500 | 4.00x† | 0.50x |" in table
  assert "| band | 1024 | 1.000 | 2.00x | " in table
  assert lra_speed_plot.FALLBACK_NOTE in table
  assert "| 4.00x† |" in lra_speed_plot.render_lra_layout(list(done.values()))


def test_growth_table_is_the_peak_above_the_baseline_per_doubling():
  records = []
  for kind, peaks in (("band", (1.5, 2.5, 4.5)), ("dot_product", (2.0, 5.0, None))):
    for n, peak in zip((1024, 2048, 4096), peaks):
      r = _record(kind, n, "ok" if peak else "oom")
      if peak:
        r.update(peak_gb=peak, baseline_gb=0.5)
      records.append(r)
  table = lra_speed_plot.render_growth(records)
  assert "| band | 2.00 (1.00 -> 2.00 GB) | 2.00 (2.00 -> 4.00 GB) |" in table
  assert "| dot_product | 3.00 (1.50 -> 4.50 GB) | - |" in table
  assert lra_speed_plot.render_growth(records[:1]) == ""


def test_resume_keeps_measured_points_over_later_skips_and_errors():
  records = [_record("band", 1024), _record("band", 1024, "skipped"),
             _record("lsh", 1024, "error"), _record("lsh", 1024)]
  kept = lra_speed.latest(records)
  assert kept[("text-base", 4, "band", 1024)]["status"] == "ok"
  assert kept[("text-base", 4, "lsh", 1024)]["status"] == "ok"
  assert not lra_speed.measured(_record("lsh", 1024, "error"))


def test_speed_accuracy_plot_from_lra_results_json(tmp_path, quick):
  _, out, _ = quick
  rows = [dict(task="text", attention="band", status="finished", metric="accuracy", test=0.60),
          dict(task="text", attention="band", status="finished", metric="accuracy", test=0.64),
          dict(task="text", attention="dot_product", status="finished", metric="accuracy",
               test=0.65),
          dict(task="text", attention="favor", status="running", metric="accuracy", test=None),
          dict(task="listops", attention="band", status="finished", metric="accuracy",
               test=0.37)]
  results = tmp_path / "results.json"
  results.write_text(json.dumps(rows))
  assert lra_speed_plot.read_accuracy(str(results), "text") == {
      "band": [pytest.approx(60.0), pytest.approx(64.0)], "dot_product": [pytest.approx(65.0)]}
  cells = tmp_path / "cells.json"
  cells.write_text(json.dumps({"common": [], "cells": [
      dict(row="band", task="text", mean=62.0), dict(row="linear size=base", task="text",
                                                    mean=55.5)]}))
  assert lra_speed_plot.read_accuracy(str(cells)) == {"band": [62.0], "linear": [55.5]}
  plot = tmp_path / "speed_accuracy.png"
  done = run("--render", "--out", out, "--plot", str(tmp_path / "lengths.png"), "--accuracy",
             str(results), "--accuracy_length", "256", "--accuracy_plot", str(plot),
             timeout=120)
  assert done.returncode == 0, done.stderr
  speed = {r["kind"]: r["steps_per_s"] for r in lines(out) if r["length"] == 256}
  points = [l.split() for l in done.stdout.splitlines() if l.startswith("accuracy point:")]
  assert [(p[2], p[3], p[4]) for p in points] == [
      ("band", "n=256", "62.00%"), ("dot_product", "n=256", "65.00%")]
  for p in points:
    assert float(p[5]) == pytest.approx(speed[p[2]], rel=1e-3)
  with Image.open(plot) as image:
    assert image.size == (1000, 700) and len(image.getcolors(1 << 16)) > 3


def test_markdown_replaces_only_the_tables_between_the_markers(tmp_path):
  doc = tmp_path / "efficiency.md"
  doc.write_text(f"# prose before\n{lra_speed_plot.BEGIN}\nold table\n{lra_speed_plot.END}\nprose after\n")
  lra_speed_plot.write_markdown(str(doc), "| new | table |")
  assert doc.read_text() == (f"# prose before\n{lra_speed_plot.BEGIN}\n| new | table |\n"
                             f"{lra_speed_plot.END}\nprose after\n")
  plain = tmp_path / "tables.md"
  lra_speed_plot.write_markdown(str(plain), "| t |")
  assert plain.read_text() == "| t |\n"


def test_speed_accuracy_labels_stay_inside_the_frame(tmp_path):
  # The most accurate point sits at the right edge: its label goes to the left of the point.
  points = [dict(kind="dot_product", length=4096, accuracy=36.0, steps_per_s=0.05),
            dict(kind="block_sparse_with_a_long_name", length=4096, accuracy=39.0,
                 steps_per_s=0.1)]
  path = tmp_path / "accuracy.png"
  lra_speed_plot.plot_accuracy(points, str(path))
  with Image.open(path) as image:
    right = image.convert("L").crop((962, 0, 1000, 700))
    assert right.getextrema() == (255, 255), "ink right of the frame: a label was clipped"
