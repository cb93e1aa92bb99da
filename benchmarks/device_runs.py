"""The `env`, `tests` and `lra` parts of the device check (see benchmarks/device_check.py)."""

from __future__ import annotations

import glob
import importlib
import json
import os
import pkgutil
import shlex
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from benchmarks.device_common import ROOT, Budget, Recorder
from lra.rundir import RunDir

TEST_FILES = ("band_test.py", "block_sparse_test.py", "flash_test.py", "sparse_patterns_test.py",
              "favor_test.py", "linear_test.py", "linformer_test.py", "lsh_test.py",
              "kinds_test.py", "models_test.py", "checkpoint_test.py", "precision_test.py",
              "splash_test.py", "pallas_band_test.py", "pallas_block_sparse_test.py",
              "backends_test.py")
REHEARSE_TEST_FILES = ("precision_test.py", "kinds_test.py")
LRA_STEPS = 5000
LRA_KINDS = ("dot_product", "band")


# ------------------------------------------------------------------------------------------------
# env


def import_every_module() -> dict[str, str]:
  """Imports every module of attention/, models/, lra/, configs/ and launch/; returns the
  failures (module -> error)."""
  failures = {}
  for package in ("attention", "models", "lra", "configs", "launch"):
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
      try:
        importlib.import_module(info.name)
      except Exception as e:  # every failure is reported, none stops the others
        failures[info.name] = f"{type(e).__name__}: {e}"
  return failures


def part_env(rec: Recorder, budget: Budget, toy: bool) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from attention import compat

  rec.log(f"jax {jax.__version__} on {jax.default_backend()}: {jax.devices()}")
  supported = compat.supported()
  rec.record(name="versions", supported_range=[".".join(map(str, v)) for v in compat.SUPPORTED],
             jax_supported=supported, default_backend=jax.default_backend(),
             devices=[dict(id=d.id, platform=d.platform, kind=d.device_kind)
                      for d in jax.devices()])
  failures = import_every_module()
  rec.log(f"imported every module: {len(failures)} failed" +
          "".join(f"\n  {k}: {v}" for k, v in failures.items()))
  rec.record(name="imports", failures=failures, ok=not failures)

  n = 256 if toy else 4096
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
  ref = a.astype(np.float64) @ b.astype(np.float64)
  for precision in ("highest", "default"):
    fn = jax.jit(lambda x, y, p=precision: jnp.matmul(x, y, precision=p))
    out = np.asarray(fn(a, b).block_until_ready(), np.float64)
    t0 = time.perf_counter()
    reps = 3 if toy else 20
    for _ in range(reps):
      fn(a, b).block_until_ready()
    seconds = (time.perf_counter() - t0) / reps
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    rec.log(f"float32 matmul {n}^3 precision={precision}: relative error {err:.2e}, "
            f"{2 * n ** 3 / seconds / 1e12:.2f} TFLOP/s")
    rec.record(name="matmul_f32", precision=precision, n=n, rel_error=err,
               tflops=2 * n ** 3 / seconds / 1e12, ok=(err < 1e-5) if precision == "highest"
               else True)
  rec.record(name="memory", stats=jax.devices()[0].memory_stats())


# ------------------------------------------------------------------------------------------------
# tests


def junit_counts(path: str) -> dict:
  """Totals and per-file counts (passed, failed, errors, skipped) of a junit xml file, and the
  ids of the failing tests."""
  root = ET.parse(path).getroot()
  per_file: dict[str, dict[str, int]] = {}
  failing = []
  for case in root.iter("testcase"):
    name = (case.get("classname") or "").split(".")[-1] + ".py"
    counts = per_file.setdefault(name, dict(passed=0, failed=0, errors=0, skipped=0))
    if case.find("failure") is not None:
      counts["failed"] += 1
      failing.append(f"{case.get('classname')}::{case.get('name')}")
    elif case.find("error") is not None:
      counts["errors"] += 1
      failing.append(f"{case.get('classname')}::{case.get('name')}")
    elif case.find("skipped") is not None:
      counts["skipped"] += 1
    else:
      counts["passed"] += 1
  totals = {k: sum(c[k] for c in per_file.values())
            for k in ("passed", "failed", "errors", "skipped")}
  return dict(totals=totals, per_file=per_file, failing=failing)


def verbose_counts(output: str) -> dict:
  """Counts and failing ids from pytest's `-v` lines (`[gw0] PASSED tests/x.py::t`, or
  `tests/x.py::t PASSED`): what a run stopped at its time limit had finished."""
  per_file: dict[str, dict[str, int]] = {}
  failing = []
  words = dict(PASSED="passed", FAILED="failed", ERROR="errors", SKIPPED="skipped",
               XFAIL="skipped", XPASS="passed")
  for line in output.splitlines():
    parts = line.split()
    test = next((p for p in parts if "::" in p), None)
    word = next((p for p in parts if p in words), None)
    if test is None or word is None:
      continue
    name = os.path.basename(test.split("::")[0])
    counts = per_file.setdefault(name, dict(passed=0, failed=0, errors=0, skipped=0))
    counts[words[word]] += 1
    if word in ("FAILED", "ERROR"):
      failing.append(test)
  totals = {k: sum(c[k] for c in per_file.values())
            for k in ("passed", "failed", "errors", "skipped")}
  return dict(totals=totals, per_file=per_file, failing=failing)


def part_tests(rec: Recorder, budget: Budget, toy: bool, out: str) -> None:
  names = REHEARSE_TEST_FILES if toy else TEST_FILES
  present = [n for n in names if os.path.exists(os.path.join(ROOT, "tests", n))]
  files = [os.path.join("tests", n) for n in present]
  absent = [n for n in names if n not in present]
  xml = os.path.join(out, "tests-junit.xml")
  cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-m", "not slow", f"--junitxml={xml}", *([] if toy else ["-n", "8"]), *files]
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  rec.log(f"$ {shlex.join(cmd)}  (absent: {', '.join(absent) or 'none'})")
  t0 = time.monotonic()
  # Its own process group, so that a run stopped at the time limit takes its workers along.
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    output, _ = proc.communicate(timeout=max(10.0, budget.left() - 5))
    timed_out = False
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    output, _ = proc.communicate()
    timed_out = True
  rc = None if timed_out else proc.returncode
  rec.logfile.write(output)
  tail = "\n".join(output.strip().splitlines()[-3:])
  rec.log(f"pytest rc={rc} in {time.monotonic() - t0:.0f} s{' (timed out)' if timed_out else ''}"
          f"\n{tail}")
  if os.path.exists(xml) and not timed_out:
    counts, source = junit_counts(xml), "junit"
  else:
    counts, source = verbose_counts(output), "pytest -v output (no junit xml: stopped)"
  rec.record(name="pytest", files=files, absent=absent, returncode=rc, timed_out=timed_out,
             seconds=round(time.monotonic() - t0, 1), counts_from=source,
             junit=os.path.basename(xml), pytest_command=shlex.join(cmd), **counts)


# ------------------------------------------------------------------------------------------------
# lra


def _lra_command(attention: str, workdir: str, steps: int, toy: bool) -> list[str]:
  size = "small" if toy else "base"
  return [sys.executable, "-m", "launch.cli", "run", "listops", "--size", size, "--attention",
          attention, "--workdir", workdir, f"--config.num_train_steps={steps}"]


def part_lra(rec: Recorder, budget: Budget, toy: bool, scratch: str,
             kinds: tuple[str, ...] = LRA_KINDS) -> None:
  steps = 4 if toy else LRA_STEPS
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.setdefault("LRA_DATA", os.path.join(scratch, "lra_data"))   # generated, never fetched
  for index, attention in enumerate(kinds):
    workdir = os.path.join(scratch, f"listops-{attention}")
    share = budget.left() / (len(kinds) - index)
    eval_reserve = 10.0 if toy else 45.0
    cmd = _lra_command(attention, workdir, steps, toy)
    rec.log(f"$ {shlex.join(cmd)}  (stopped after {share - eval_reserve:.0f} s)")
    t0 = time.monotonic()
    with open(rec.logfile.name, "a") as log:
      proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
      try:
        proc.wait(timeout=max(5.0, share - eval_reserve))
        stopped = False
      except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)        # the trainer saves the step it reached
        stopped = True
        try:
          proc.wait(timeout=eval_reserve)
        except subprocess.TimeoutExpired:
          proc.kill()
          proc.wait()
    train_seconds = time.monotonic() - t0
    results = _read_json(RunDir(workdir).results)
    reached = None
    if stopped or results is None:
      reached = _last_step(workdir)
      if reached:                                 # evaluate the step it reached
        cmd2 = _lra_command(attention, workdir, reached, toy)
        rec.log(f"stopped at step {reached}; $ {shlex.join(cmd2)}")
        with open(rec.logfile.name, "a") as log:
          try:
            subprocess.run(cmd2, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                           timeout=max(5.0, budget.left() - 2))
          except subprocess.TimeoutExpired:
            pass
        results = _read_json(RunDir(workdir).results)
    rates = _train_rates(workdir)
    row = dict(attention=attention, steps_asked=steps, stopped_early=stopped,
               steps_reached=(results or {}).get("steps") or reached,
               train_steps_per_s=statistics.median(rates) if rates else None,
               wall_s=round(train_seconds, 1),     # data, compile, steps and evaluation
               test_accuracy=(results or {}).get("test_accuracy"),
               results={k: v for k, v in (results or {}).items()
                        if isinstance(v, (int, float, str, bool))},
               run_command=shlex.join(cmd))
    rec.record(name="listops", **row)
    rec.log(f"listops {attention}: test accuracy {row['test_accuracy']} after "
            f"{row['steps_reached']} steps, {row['train_steps_per_s']} steps/s, "
            f"{train_seconds:.0f} s in all")


def _read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _train_rates(workdir: str) -> list[float]:
  """The trainer's logged steps per second (metrics.jsonl, train rows)."""
  rates = []
  try:
    with open(RunDir(workdir).metrics) as f:
      for line in f:
        r = json.loads(line)
        if r.get("split") == "train" and r.get("steps_per_second"):
          rates.append(float(r["steps_per_second"]))
  except (OSError, ValueError):
    pass
  return rates


def _last_step(workdir: str) -> int | None:
  """The last step a stopped run saved (its checkpoint folders are named by step)."""
  steps = []
  for path in glob.glob(os.path.join(workdir, "**", "[0-9]*"), recursive=True):
    name = os.path.basename(path)
    if name.isdigit() and os.path.isdir(path):
      steps.append(int(name))
  return max(steps) if steps else None


