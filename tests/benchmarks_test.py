"""Tests of the attention benchmark harness (`benchmarks/attention.py`): child processes, results
parsing, failure reporting, FLOP counting and the tables. No timing is asserted."""

import concurrent.futures
import os
import re
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from attention import masks  # noqa: E402
from benchmarks import attention as harness  # noqa: E402
from benchmarks import impls_band  # noqa: E402

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

IMPLS = harness.discover_impls()
JAX_IMPLS = [name for name, spec in IMPLS.items() if spec.get("framework", "jax") == "jax"]
TINY = dict(batch=1, heads=2, head_dim=16, repeats=2, min_repeats=2, budget=0.0)


def _spec(name, n=256, mode="fwd", **kw):
  impl = IMPLS[name]
  return dict(kind="point", impl=name, module=impl["module"], group=impl["group"],
              framework=impl.get("framework", "jax"), n=n, mode=mode, **dict(TINY, **kw))


def _check_ok(r):
  assert r["status"] == "ok", r
  assert len(r["times_s"]) == 2 and all(t > 0 for t in r["times_s"])
  assert min(r["times_s"]) <= r["median_s"] <= max(r["times_s"])
  assert r["peak_rss_mb"] >= r["baseline_mb"] > 10          # a JAX process is tens of MB at least
  assert r["rss_increase_mb"] is not None and r["rss_increase_mb"] >= 0
  assert r["framework_version"]


def test_child_runs_one_tiny_point_per_jax_impl(monkeypatch):
  # Two children at a time (the machine has 2 cores), compiled with few XLA optimisations (no
  # timing is checked); band also runs forward+backward.
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                     + " --xla_backend_optimization_level=0")
  specs = [_spec(name) for name in JAX_IMPLS] + [_spec("band", n=200, mode="fwdbwd")]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda s: harness.run_child(s, timeout=120), specs))
  failed = {}
  for spec, r in zip(specs, results):
    try:
      _check_ok(r)
    except AssertionError:
      failed[f"{spec['impl']} {spec['mode']}"] = {k: r.get(k) for k in ("status", "detail")}
  assert not failed, failed


def test_failing_children_are_reported_not_raised(tmp_path, monkeypatch):
  (tmp_path / "fake_impls.py").write_text(textwrap.dedent("""
      import os, signal, time
      def crash(n, mode, b, h, d):
        raise RuntimeError("boom at build")
      def killed(n, mode, b, h, d):
        os.kill(os.getpid(), signal.SIGKILL)
      def slow(n, mode, b, h, d):
        return lambda: time.sleep(30)
      def missing(n, mode, b, h, d):
        import no_such_module_for_the_benchmark
      IMPLS = {k: dict(framework="jax", build=f, flops_fwd=lambda *a: 1.0, group="x", note="")
               for k, f in [("crash", crash), ("killed", killed), ("slow", slow),
                            ("missing", missing)]}
  """))
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  spec = lambda name: dict(kind="point", impl=name, module="fake_impls", group="x",
                           framework="jax", n=8, mode="fwd", **TINY)
  r = harness.run_child(spec("crash"), timeout=60)
  assert r["status"] == "error" and "boom at build" in r["detail"]
  r = harness.run_child(spec("killed"), timeout=60)
  assert r["status"] == "died" and "signal 9" in r["detail"]
  r = harness.run_child(spec("slow"), timeout=3)
  assert r["status"] == "timeout"
  r = harness.run_child(spec("missing"), timeout=60)
  assert r["status"] == "skip" and "no_such_module_for_the_benchmark" in r["detail"]


@pytest.mark.parametrize("n", [1, 100, 256, 257, 300, 513, 1000])
def test_band_pairs_counts_the_band_mask(n):
  want = int(np.asarray(masks.band_mask(n, window=impls_band.WINDOW)).sum())
  assert impls_band.band_pairs(n) == want
  assert impls_band.band_flops(n, 2, 3, 4) == 4 * 4 * 3 * 2 * want


def test_plan_points_skips_what_does_not_fit():
  shape = dict(TINY)
  points = harness.plan_points(IMPLS, ["band", "dense_jax"], [8192, 16384], ["fwd"], shape)
  by = {(p["impl"], p["n"]): p for p in points}
  assert "status" not in by[("band", 16384)] and "status" not in by[("dense_jax", 8192)]
  assert by[("dense_jax", 16384)]["status"] == "skip"


def _record(impl, n, median, rss, mode="fwdbwd", flops=1e9, status="ok"):
  return dict(impl=impl, group="band", mode=mode, n=n, batch=1, heads=8, head_dim=64,
              status=status, median_s=median, min_s=median, build_s=1.0, peak_rss_mb=rss and rss + 300,
              rss_increase_mb=rss, flops_fwd=flops, note=f"{impl} note", framework="jax",
              framework_version="0.0")


def test_tables_ratios_floor_and_targets():
  header = dict(matmul=dict(flops_per_s=1e11, rates={"2048": 1e11}), machine={}, date="d")
  records = [
      _record("band", 8192, 0.5, 100.0),                    # floor 3e9 / 1e11 = 30 ms
      _record("torch_sdpa", 8192, 2.5, 50.0),               # 5x slower than band
      _record("hf_longformer", 8192, 1.5, 400.0),           # 3x slower than band
      _record("band", 16384, 1.0, 250.0),                   # +RSS ratio 2.5, peak RSS 550/400
      _record("torch_sdpa", 16384, None, None, status="died"),
  ]
  records[-1]["detail"] = "killed by signal 9"
  text = harness.render_markdown(header, records, ["band", "torch_sdpa", "hf_longformer"])
  assert re.search(r"\| 8192 \| band \| 500\.0 \| 500\.0 \| 30\.0 \| 16\.7 \|", text)
  assert "| 8192 | torch_sdpa | 2500.0 |" in text and "| 5.00x |" in text
  assert "| 16384 | torch_sdpa | died: killed by signal 9 |" in text
  assert "speedup vs torch_sdpa: 5.00 (target >= 4.0x): met" in text
  assert "speedup vs hf_longformer: 3.00 (target >= 4.0x): NOT met" in text
  assert "time / FLOP floor: 16.67 (target <= 4.0): NOT met" in text
  assert "+RSS n=16384 / n=8192: 2.50 (target <= 2.3): NOT met" in text
  assert "peak RSS n=16384 / n=8192: 1.38 (target <= 2.3): met" in text
