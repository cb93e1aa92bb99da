"""Tests for benchmarks/longest_sequence.py: the doubling-then-bisecting search, the tables it
prints and bad input. (The measurement itself runs in child processes for minutes; the
`--quick` run is what to try by hand.)"""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import longest_sequence as bench  # noqa: E402


def fake_point(fits_up_to: int, tried: list):
  """A run_point whose model fits up to `fits_up_to` tokens: peak = length bytes + 100."""
  def run_point(model, setup, length, args):
    tried.append(length)
    if length > fits_up_to:
      return {"model": model, "setup": setup, "length": length, "status": "over_limit",
              "estimate_bytes": length * 1e6, "limit_bytes": fits_up_to * 1e6}
    return {"model": model, "setup": setup, "length": length, "status": "ok",
            "step_s": length / 1000, "compile_s": 1.0, "estimate_bytes": length,
            "peak_bytes": 100 + length * 1e5, "base_bytes": 100, "finite": True}
  return run_point


def test_search_doubles_then_bisects_to_a_multiple(monkeypatch):
  tried, kept = [], []
  monkeypatch.setattr(bench, "run_point", fake_point(300_000, tried))
  args = bench.argparse.Namespace(min_length=16384, max_length=1 << 21, bisect=3,
                                  multiple=8192)
  bench.search("band", "bf16_remat", args, lambda r: kept.append(r) or r)
  # 16K .. 256K fit, 512K does not; then 384K (no), 320K (no), 288K (yes)
  assert tried == [16384, 32768, 65536, 131072, 262144, 524288, 393216, 327680, 294912]
  assert all(n % 8192 == 0 for n in tried)
  best = bench.longest(kept).splitlines()[2]
  assert best.startswith("| band | bf16_remat | 294,912 | 294.9 |")
  assert best.endswith("| 327,680 (over the limit (estimate 327.7 GB > 300.0 GB; not run)) |")
  # growth per doubling: peak - base doubles with the length
  rows = [line for line in bench.table(kept).splitlines() if "| 32,768 |" in line]
  assert rows[0].split("|")[10].strip() == "2.00"


def test_search_stops_at_the_largest_length_when_everything_fits(monkeypatch):
  tried = []
  monkeypatch.setattr(bench, "run_point", fake_point(10 ** 9, tried))
  args = bench.argparse.Namespace(min_length=1000, max_length=5000, bisect=2, multiple=10)
  bench.search("favor", "f32", args, lambda r: r)
  assert tried == [1000, 2000, 4000]


def test_render_reads_the_last_record_of_each_point(tmp_path, capsys):
  out = tmp_path / "points.jsonl"
  tried = []
  point = fake_point(20_000, tried)
  args = None
  rows = [point("band", "remat", 8192, args), point("band", "remat", 16384, args),
          point("band", "remat", 32768, args),
          {**point("band", "remat", 8192, args), "step_s": 9.5}]   # measured again
  out.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert bench.main(["--render", "--models", "band", "--setups", "remat", "--out", str(out),
                     "--plot", str(tmp_path / "p.png")]) == 0
  text = capsys.readouterr().out
  assert "| band | remat | 8,192 | 9.50 |" in text and text.count("| band | remat | 8,192 |") == 1
  assert "| band | remat | 16,384 | 16.4 |" in text        # the longest that ran
  assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--models", "lsh"], "error: unknown model 'lsh'; valid: band, favor, band_small."),
    (["--setups", "bf16"], "error: unknown setup 'bf16'; valid: f32, remat, bf16_remat, seq8."),
    (["--min_length", "0"], "error: need 1 <= --min_length <= --max_length"),
])
def test_bad_input_one_line_exit_2(argv, message, capsys, tmp_path):
  assert bench.main(argv + ["--out", str(tmp_path / "x.jsonl")]) == 2
  err = capsys.readouterr().err
  assert err.startswith(message) and err.count("\n") == 1
  assert not (tmp_path / "x.jsonl").exists()
