"""benchmarks/adaptive_span_lm.py at a tiny size: both runs finish, the span table has every
layer at every logging step, and every window set the run went through is timed beside the
fixed model's window."""

import json

import numpy as np
import pytest

from benchmarks import adaptive_span_lm as bench


def test_the_runs_share_every_override_but_the_spans():
  class Args:
    steps, length, batch, lr, penalty, span_init, log_every, seed = 10, 64, 8, 1e-3, 2e-6, 0.0, 5, 0
    pos_emb = "sinusoidal"
  learned, fixed = dict(bench.overrides(Args, "adaptive")), dict(bench.overrides(Args, "fixed"))
  assert fixed.pop("model.attention.train_span") == "false"
  assert fixed.pop("model.attention.span_init") == "64" and learned.pop(
      "model.attention.span_init") == "0.0"
  assert learned == fixed and learned["model.attention.max_span"] == "64"


@pytest.mark.slow
def test_a_tiny_run_reports_spans_bpc_and_step_times(tmp_path, capsys):
  out = tmp_path / "r.json"
  assert bench.main(["--out", str(tmp_path / "runs"), "--steps", "4", "--length", "64",
                     "--log_every", "2", "--reps", "1", "--span_init", "40", "--penalty", "5",
                     "--json", str(out)]) == 0
  r = json.loads(out.read_text())
  assert r["spans"]["steps"] == [2, 4]
  assert all(len(row) == 4 for row in r["spans"]["per_layer"])        # 4 layers at each step
  for run in ("adaptive", "fixed"):
    assert np.isfinite(r["runs"][run]["validation_bpc"])
  sets = {tuple(int(w) for _, _, w in row) for row in r["spans"]["per_layer"]}
  timed = [tuple(t["windows"]) for t in r["timing"]]
  assert set(timed[:-1]) == sets and timed[-1] == (64 + 32,) * 4     # then the fixed model's
  assert all(t["seconds"] > 0 for t in r["timing"])
  assert "adaptive - fixed validation bpc" in capsys.readouterr().out
