"""benchmarks/device_check.py and benchmarks/device_wheels.py: argument errors, the staging list,
the junit and overtaking summaries, and (slow; needs the package registry) the rehearsal of every
part at toy sizes from a fresh virtual environment built like the GPU machine's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import (device_check, device_runs, device_speed, device_targets,  # noqa: E402
                        device_wheels)
SCRIPT = os.path.join(ROOT, "benchmarks", "device_check.py")


def _run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        cwd=ROOT, timeout=60)


@pytest.mark.parametrize("args, words", [
    (["gpu", "--out", "x"], "part must be one of env, tests, speed, grid, lra, all"),
    (["env,gpu", "--out", "x"], "got 'env,gpu'"),
    (["env"], "--out"),
    (["env", "--out", "x", "--budget", "-3"], "--budget must be positive"),
    (["lra", "--out", "x", "--lra_kinds", "band,banana"], "got banana"),
])
def test_argument_errors_are_one_line_and_exit_2(args, words, tmp_path):
  if "--out" in args:
    args = [str(tmp_path / a) if a == "x" else a for a in args]
  proc = _run(*args)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and words in lines[0], proc.stderr
  assert not any(tmp_path.iterdir())   # nothing written


def test_setup_pins_equal_staged_versions():
  text = open(os.path.join(ROOT, "setup.py")).read()
  pins = {device_wheels.canonical(n): v for n, v in re.findall(r'"([A-Za-z0-9_.\-]+)==([^"]+)"',
                                                                   text)}
  staged = {device_wheels.canonical(n): v for n, v in device_wheels.MISSING.items()}
  shared = set(pins) & set(staged)
  assert {"tokamax", "grain", "tensorflow-datasets", "ml-collections", "tensorboardx"} <= shared
  for name in shared:
    assert staged[name] == pins[name], name
  # What the device lacks and what it holds do not overlap.
  assert not shared & {device_wheels.canonical(n) for n in device_wheels.TARGET_HAS}


def _wheel(path, name: str, version: str, requires: list[str]) -> str:
  import zipfile
  file = os.path.join(path, f"{name}-{version}-py3-none-any.whl")
  with zipfile.ZipFile(file, "w") as z:
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    z.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n{meta}")
  return file


def test_completeness_check_names_the_gap(tmp_path, monkeypatch):
  monkeypatch.setattr(device_wheels, "MISSING", {"alpha": "1.0", "beta": "2.0"})
  monkeypatch.setattr(device_wheels, "TARGET_HAS", ("numpy",))
  _wheel(tmp_path, "alpha", "1.0", ["beta>=2", "numpy", "gamma; python_version < '3.0'",
                                    "delta; extra == 'test'"])
  with pytest.raises(ValueError, match="no wheel .* for beta"):
    device_wheels.check_complete(str(tmp_path), "312")
  _wheel(tmp_path, "beta", "2.0", ["epsilon"])
  with pytest.raises(ValueError, match="beta-2.0-py3-none-any.whl needs epsilon"):
    device_wheels.check_complete(str(tmp_path), "312")
  monkeypatch.setattr(device_wheels, "TARGET_HAS", ("numpy", "epsilon"))
  device_wheels.check_complete(str(tmp_path), "312")
  manifest = device_wheels.write_manifest(str(tmp_path), "312")
  assert [w["name"] for w in manifest["wheels"]] == ["alpha", "beta"]
  assert manifest["total_bytes"] == sum(os.path.getsize(tmp_path / w["file"])
                                        for w in manifest["wheels"])


def test_wheel_tags():
  assert device_wheels._tag_matches("a-1-cp312-cp312-manylinux_2_17_x86_64.whl", "312")
  assert not device_wheels._tag_matches("a-1-cp311-cp311-manylinux_2_17_x86_64.whl", "312")
  assert device_wheels._tag_matches("toml-0.10.2-py2.py3-none-any.whl", "311")


def test_junit_counts(tmp_path):
  xml = tmp_path / "j.xml"
  xml.write_text(
      '<testsuites><testsuite>'
      '<testcase classname="tests.band_test" name="a"/>'
      '<testcase classname="tests.band_test" name="b"><failure message="x"/></testcase>'
      '<testcase classname="tests.flash_test" name="c"><skipped/></testcase>'
      '<testcase classname="tests.flash_test" name="d"><error message="y"/></testcase>'
      '</testsuite></testsuites>')
  counts = device_runs.junit_counts(str(xml))
  assert counts["totals"] == dict(passed=1, failed=1, errors=1, skipped=1)
  assert counts["per_file"]["band_test.py"] == dict(passed=1, failed=1, errors=0, skipped=0)
  assert counts["failing"] == ["tests.band_test::b", "tests.flash_test::d"]


def test_verbose_counts_of_a_stopped_run():
  output = ("[gw0] [ 10%] PASSED tests/band_test.py::test_a[1]\n"
            "[gw1] [ 20%] FAILED tests/band_test.py::test_b\n"
            "tests/flash_test.py::test_c SKIPPED (no gpu)\n"
            "[gw0] [ 30%] ERROR tests/flash_test.py::test_d\n"
            "collected 40 items\n")
  counts = device_runs.verbose_counts(output)
  assert counts["totals"] == dict(passed=1, failed=1, errors=1, skipped=1)
  assert counts["failing"] == ["tests/band_test.py::test_b", "tests/flash_test.py::test_d"]


def test_overtaking_length():
  def row(case, n, s):
    return dict(case=case, dtype="bfloat16", head_dim=64, length=n, fwdbwd_s=s)
  rows = [row("cudnn_dense", n, s) for n, s in ((1, 1.0), (2, 2.0), (4, 8.0), (8, 32.0))]
  rows += [row("band", n, s) for n, s in ((1, 0.5), (2, 3.0), (4, 6.0), (8, 12.0))]
  rows += [row("slow", n, 99.0) for n in (1, 2, 4, 8)]
  out = {o["case"]: o["overtakes_at"] for o in device_speed.overtaking(rows, "cudnn_dense")}
  assert out == {"band": 4, "slow": None}   # faster at 1 but not at 2: overtakes from 4


def test_speed_plan():
  names = {c["name"] for c in device_speed.speed_cases()}
  assert set(device_speed.TARGET_CASES) <= names          # no misspelt case in a tier
  for toy in (False, True):
    points = device_speed.planned_points(toy)
    keys = [device_speed._point_key(p) for p in points]
    assert len(keys) == len(set(keys))
    assert not any(p["case"] == "cudnn_dense" and p["dtype"] != "bfloat16" for p in points)
  full = device_speed.planned_points(False)
  assert {p["length"] for p in full} == {1024, 4096, 16384, 32768, 65536}
  assert all(p["batch"] * p["length"] >= device_speed.TOKENS and
             p["heads"] * p["head_dim"] == device_speed.WIDTH for p in full)


def test_dilated_band_pairs_match_the_mask():
  import numpy as np

  from attention import masks
  for n, w, d in ((37, 3, 1), (37, 3, 2), (64, 5, 4)):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    dense = (np.abs(i - j) <= w * d) & ((i - j) % d == 0)
    assert device_speed._dilated_band_pairs(n, w, d) == int(dense.sum())
  del masks


def test_lease_is_one_command_under_nine_minutes(tmp_path):
  args = device_check.parse_args(["lease", "--out", str(tmp_path)])
  assert args.parts == ["env", "tests", "speed", "lra"] and args.lease and args.targets
  assert args.lra_kinds == ("dot_product",)
  assert sum(device_check.LEASE_BUDGETS.values()) <= 540 - 30     # room to start and end
  assert device_check.LEASE_TEST_FILES[:3] == ("flash_test.py", "kinds_test.py",
                                               "models_test.py")  # the H100's failures first
  for name in device_check.LEASE_TEST_FILES:
    assert os.path.exists(os.path.join(ROOT, "tests", name)), name
  with device_check._test_files(device_check.LEASE_TEST_FILES):
    assert device_runs.TEST_FILES == device_check.LEASE_TEST_FILES
  assert "flash_test.py" in device_runs.TEST_FILES and "band_test.py" in device_runs.TEST_FILES
  plain = device_check.parse_args(["env,tests", "--out", str(tmp_path)])
  assert not plain.lease and not plain.targets and plain.lra_kinds == device_runs.LRA_KINDS


def test_target_points_cover_every_target():
  points = device_targets.target_points(False, "gpu")
  keys = [device_targets._target_key(p) for p in points]
  assert len(keys) == len(set(keys))
  have = set(keys)
  for d in (64, 128):
    for n in (4096, 16384, 32768):
      for case in ("cudnn_dense", "dot_product"):
        assert (case, "", "bfloat16", d, n) in have
  for case, n in (("band_w256_g16", 32768), ("band_w512_dil", 32768), ("bigbird", 32768),
                  ("sparse_strided", 4096), ("sparse_strided", 65536)):
    assert (case, "", "bfloat16", 128, n) in have
  for case in ("favor", "linear"):
    for p in ("fast", "exact"):
      assert (case, f"precision={p}", "bfloat16", 128, 16384) in have
  assert {k[1] for k in keys if k[0] == "cudnn_window"} == {"window=256", "window=512"}
  sweep = [p for p in points if "sweep" in p]
  assert len(sweep) == len(device_targets.BAND_SWEEP) >= 4
  assert not any("tiles" in p for p in points)                      # splash: TPU only
  assert sum("tiles" in p for p in device_targets.target_points(False, "tpu")) == len(
      device_targets.SPLASH_SWEEP)
  from attention import splash
  for tiles in device_targets.SPLASH_SWEEP:
    splash.splash_tiles(tiles)                                      # valid tiles
  assert all(p["batch"] * p["length"] >= device_speed.TOKENS and
             p["heads"] * p["head_dim"] == device_speed.WIDTH for p in points)
  for p in points + device_targets.target_points(True, "cpu"):
    assert device_targets._target_case(p)["name"] == p["case"]


def _target_rows(times, toy=False):
  rows = []
  for (case, variant, d, n), value in times.items():
    r = dict(case=case, variant=variant, dtype="bfloat16", head_dim=d, length=n, status="ok")
    if case == "sparse_strided":
      r["fwdbwd_tflops_own"], r["fwdbwd_s"] = value, 1.0
    else:
      r["fwdbwd_s"] = value * 1e-3
    rows.append(r)
  return rows


class _Verdicts(dict):
  """The verdicts by target; `v[prefix]` is the one target starting with `prefix`."""

  def __getitem__(self, prefix):
    found = [t for name, t in self.items() if name.startswith(prefix)]
    assert len(found) == 1, (prefix, list(self))
    return found[0]


def _verdicts(times):
  return _Verdicts({v["target"]: v for v in device_targets.target_verdicts(_target_rows(times))})


def test_target_verdicts_at_their_bounds():
  dense = {(c, "", d, n): t for d in (64, 128) for n in (4096, 16384, 32768)
           for c, t in (("cudnn_dense", 10.0), ("dot_product", 10.5))}
  times = {**dense, **{("band_w256_g16", "", 128, 32768): 2.0,
                         ("band_w256_g16", "block_q=64,block_k=64", 128, 32768): 1.5,
                         ("band_w512_dil", "", 128, 32768): 3.01,
                         ("bigbird", "", 128, 32768): 4.0,
                         ("favor", "precision=fast", 128, 16384): 1.4,
                         ("linear", "precision=fast", 128, 16384): 0.6,
                         ("sparse_strided", "", 128, 4096): 100.0,
                         ("sparse_strided", "", 128, 65536): 70.0,
                         ("favor", "precision=fast", 128, 4096): 9.9,
                         ("linear", "precision=fast", 128, 4096): 10.0}}
  v = _verdicts(times)
  assert v["dense through auto within 5% of cuDNN direct"]["met"] is True     # 1.05x: the bound
  assert v["band w256 + 16 globals"]["met"] is True
  assert "best of the sweep 1.50 ms (block_q=64,block_k=64)" in v["band w256 + 16 globals"][
      "measured"]
  assert v["band w512 dilated"]["met"] is False
  assert v["band w512 dilated"]["measured"] == "3.01 ms = 1.00x the bound"
  assert v["BigBird"]["met"] is True and v["FAVOR+"]["met"] is True
  assert v["linear (fast), 16K"]["met"] is False
  assert v["linear (fast), 16K"]["ratio"] == pytest.approx(1.2)
  assert v["strided sparse own TFLOP/s at 64K >= 70% of 4K's"]["met"] is True
  assert v["favor (fast) faster than cuDNN dense at 4K"]["met"] is True
  assert v["linear (fast) faster than cuDNN dense at 4K"]["met"] is False   # equal: not faster
  times[("dot_product", "", 64, 32768)] = 10.6                         # 1.06x
  times[("sparse_strided", "", 128, 65536)] = 69.0
  v = _verdicts(times)
  assert v["dense through auto within 5% of cuDNN direct"]["met"] is False
  assert "worst 1.06x cuDNN's time at d=64 32K" in v[
      "dense through auto within 5% of cuDNN direct"]["measured"]
  assert v["strided sparse own TFLOP/s at 64K >= 70% of 4K's"]["met"] is False


def test_target_verdicts_say_what_was_not_measured():
  rows = _target_rows({("cudnn_dense", "", 128, 4096): 10.0, ("dot_product", "", 128, 4096): 9.0})
  rows.append(dict(case="bigbird", variant="", dtype="bfloat16", head_dim=128, length=32768,
                   status="skipped: budget"))
  v = {t["target"]: t for t in device_targets.target_verdicts(rows)}
  dense = v["dense through auto within 5% of cuDNN direct, 4K-32K, d 64 and 128"]
  assert dense["met"] is None and "not measured: d=128 16K (no record)" in dense["measured"]
  assert v["BigBird, 32K, fwd+bwd <= 4 ms"] == dict(
      target="BigBird, 32K, fwd+bwd <= 4 ms", measured="not measured: skipped: budget",
      met=None, ratio=None)
  table = device_targets.verdicts_table(device_targets.target_verdicts(rows))
  assert table.count("| not measured |") == len(device_targets.target_verdicts(rows))


def test_the_sweep_passes_only_what_the_kernel_takes(monkeypatch):
  def old_kernel(q, k, v, *, window, block_q=None, block_k=None):
    return q

  def new_kernel(q, k, v, *, window, block_q=None, block_k=None, num_warps=None,
                 num_stages=None):
    return q

  point = next(p for p in device_targets.target_points(True, "cpu") if "sweep" in p)
  case = device_targets._target_case(point)
  for kernel, available in ((old_kernel, False), (new_kernel, True)):
    monkeypatch.setattr(device_targets, "_kind_function", lambda *a, **k: (
        lambda q, k_, v, **more: kernel(q, k_, v, window=256, **more), "pallas", kernel))
    attend, backend, why = device_targets._target_function(point, case, None)
    if available:
      assert attend is not None and why == ""
    else:
      assert attend is None and why == ("not available: the band kernel takes no num_warps, "
                                        "num_stages")
  assert device_targets.accepted(lambda q, **kw: q, ("num_warps",)) == ["num_warps"]


def test_precision_setting_is_read_from_the_kinds():
  import inspect

  import attention
  assert device_targets.precision_argument("dot_product") is None
  for kind in ("favor", "linear"):
    name = device_targets.precision_argument(kind)
    assert name is not None and name in inspect.signature(attention.get(kind)).parameters


@pytest.mark.slow
def test_rehearsal_of_every_part(tmp_path):
  """Stages the wheels for this Python, builds a fresh environment like the GPU machine's and
  runs every part at toy sizes there (about 6 minutes on 2 cores; needs the registry)."""
  tag = f"{sys.version_info.major}{sys.version_info.minor}"
  device_wheels.stage(python_tag=tag)
  out = tmp_path / "check"
  proc = subprocess.run([sys.executable, SCRIPT, "all", "--out", str(out), "--rehearse",
                         "--budget", "150"], capture_output=True, text=True, cwd=ROOT,
                        timeout=1500)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  records = {}
  for part in device_check.PARTS:
    assert (out / f"{part}.log").exists()
    with open(out / f"{part}.jsonl") as f:
      rows = [json.loads(line) for line in f]
    for r in rows:
      assert r["part"] == part and r["command"] and r["machine"]["versions"]["jax"]
      assert r["machine"]["staged_wheels"]["installed"], "the fresh environment lacked nothing?"
    assert rows[-1]["name"] == "done" and rows[-1]["ok"], rows[-1]
    records[part] = rows
  env = {r["name"]: r for r in records["env"]}
  assert env["imports"]["ok"], env["imports"]["failures"]
  assert all(r["rel_error"] < 1e-5 for r in records["env"] if r["name"] == "matmul_f32"
             and r["precision"] == "highest")
  pytest_row = next(r for r in records["tests"] if r["name"] == "pytest")
  assert pytest_row["returncode"] == 0 and pytest_row["totals"]["passed"] > 0
  assert pytest_row["totals"]["failed"] == pytest_row["totals"]["errors"] == 0
  timed = [r for r in records["speed"] if r["name"] == "attention" and r.get("fwdbwd_s")]
  assert {"tokamax_dense", "band_w256", "favor", "flash"} <= {r["case"] for r in timed}
  assert all(r["backend"] and r["own_flops_fwd"] > 0 for r in timed)
  cudnn = [r for r in records["speed"] if r.get("case") == "cudnn_dense"]
  assert cudnn and all(r["status"].startswith(("error", "skipped")) for r in cudnn)  # no GPU
  assert {r["dtype"] for r in timed} == {"bfloat16", "float32"}
  assert any(r["name"] == "overtaking" for r in records["speed"])
  steps = [r for r in records["grid"] if r["name"] == "text_base_step"]
  assert steps and all(r["point"].get("kind") for r in steps)
  listops = [r for r in records["lra"] if r["name"] == "listops"]
  assert [r["attention"] for r in listops] == ["dot_product", "band"]
  assert all(r["test_accuracy"] is not None for r in listops)
