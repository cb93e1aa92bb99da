"""Tests of `benchmarks/lra_interleaved.py`: the --quick run end to end (table, JSON lines, paired
ratios) and one-line errors for bad arguments. No timing is asserted."""

import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "lra_interleaved.py")
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import lra_speed  # noqa: E402

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file


def run(*args, timeout=300):
  # The environment lra_speed.py gives its --quick children: one CPU device, few optimisations.
  env = lra_speed._child_env(quick=True)
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=env)


def test_quick_run_takes_every_kind_in_turn_and_pairs_ratios_by_round(tmp_path):
  out = tmp_path / "runs.jsonl"
  done = run("--quick", "--kinds", "linear,band", "--rounds", "3", "--out", str(out))
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [l for l in done.stdout.splitlines() if l.startswith("| ") and "---" not in l]
  assert [r.split(" | ")[0] for r in rows[1:]] == ["| identity", "| linear", "| band"]
  assert "| identity |" in rows[1] and "| 1.00x | 1.00-1.00x |" in rows[1]
  rounds = [l for l in done.stderr.splitlines() if l.startswith("round ")]
  assert len(rounds) == 3 and all("identity" in l and "band" in l for l in rounds)
  with open(out) as f:
    records = [json.loads(line) for line in f]
  assert [r["kind"] for r in records] == ["identity", "linear", "band"]
  ident = records[0]["times_s"]
  for r in records:
    assert r["status"] == "ok" and r["length"] == 128 and r["batch"] == 2, r
    assert len(r["times_s"]) == 3 and r["step_s"] == statistics.median(r["times_s"])
    assert r["ratios"] == pytest.approx([t / i for t, i in zip(r["times_s"], ident)])
    assert r["vs_identity"] == pytest.approx(statistics.median(r["ratios"]))
    assert r["loss"] > 0 and r["record"] == "interleaved"
  band = next(l for l in rows if l.startswith("| band |"))
  assert f"| {records[2]['vs_identity']:.2f}x |" in band


@pytest.mark.parametrize("args,message", [
    (("--kinds", "band,nope"), "unknown attention kind 'nope'; valid: "),
    (("--rounds", "0"), "--rounds must be a positive integer, got 0."),
    (("--length", "-5"), "--length must be a positive integer, got -5."),
    (("--warmup", "-1"), "--warmup must be 0 or more, got -1."),
])
def test_bad_arguments_fail_in_one_line_with_exit_2(args, message):
  done = run("--quick", *args, timeout=60)
  assert done.returncode == 2, (done.stdout, done.stderr)
  assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
  assert done.stdout == ""
