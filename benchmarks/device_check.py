"""The device check: one prepared script that measures this codebase on a GPU in a short lease.

  python3 benchmarks/device_check.py PART[,PART...] --out DIR [--budget SECONDS] [--rehearse]

PART is `env`, `tests`, `speed`, `grid`, `lra`, `all` (every part in turn), or `lease`: the
one command for a short lease, under 9 minutes of GPU time (`LEASE_BUDGETS`): `env`, `tests` on
the files that failed on the H100 (`LEASE_TEST_FILES`), `speed` on the target points only
(`device_targets.target_points`: dense through `auto` against cuDNN called directly, the band,
BigBird, strided, FAVOR+ and linear targets, the band kernel's block-size sweep, cuDNN's causal
sliding window, on a TPU the splash tile sweep; then the table of targets, met or not and how
far), and `lra` with dense attention only. Each part writes
JSON lines to `DIR/<part>.jsonl` and its log to `DIR/<part>.log` (and `tests` its junit xml);
every record carries the machine (GPU model, memory, clocks, power limit and driver from
nvidia-smi when present; jax, jaxlib, CUDA plugin, flax, optax, orbax and tokamax versions) and
the exact command. Each part keeps to a wall budget (`BUDGETS`, at most 280 s, inside the 5
minutes it is sized for on one H100): it stops adding sizes when the budget is near and records
what it skipped. LRA runs, their generated data and the step grid's own files go to `--scratch`
(a temporary folder by default), so DIR holds at most 11 small files.

- `env` (benchmarks/device_runs.py): versions, devices, memory, nvidia-smi, the supported-range
  check of `attention.compat`, an import of every module of the codebase (a jax, flax or orbax
  difference shows here first), a float32 matmul against a float64 reference at precision
  highest and at the default precision (TF32 on Hopper).
- `tests` (device_runs.py): pytest on the attention, model, kinds, training-step and checkpoint
  test files (`device_runs.TEST_FILES`, those present) with `-m "not slow"`, `-n 8` and
  `XLA_PYTHON_CLIENT_PREALLOCATE=false`; counts per file and the failing tests in the jsonl
  (from the junit xml, or from pytest's `-v` lines when the budget stopped it).
- `speed` (benchmarks/device_speed.py): forward and forward+backward time of band (window 256
  and 512, with and without per-head dilation, 0 and 16 global tokens), BigBird, strided
  sparse, FAVOR+, linear, Linformer and our flash, each through
  `attention.backends.function(kind, "auto")` (the backend it resolved to is recorded), and of
  the peers tokamax dense and cuDNN dense (bfloat16 only); head dim 128 then 64, bfloat16 then
  float32, 1K-64K tokens in tiers of importance (`device_speed.TIERS`); batch x length = 16K
  tokens and heads x head dim = 2048 fill the GPU. TFLOP/s of the kind's own work and of the
  dense-equivalent work, the fraction of the measured matmul peak, the compiled programs'
  memory, and per kind the length where it overtakes cuDNN dense.
- `grid` (device_speed.py): the Text-base training-step grid of benchmarks/lra_speed.py.
- `lra` (device_runs.py): `lra run listops --size base` with each of `--lra_kinds` (default
  dense and band; they share the budget), 5,000 steps or as many as fit: a run still going
  near the end is stopped cleanly (SIGTERM) and evaluated at the step it reached. Test
  accuracy, steps per second and wall time in the jsonl. ListOps is generated, never fetched.

Packages the GPU machine lacks (tensorflow-datasets, grain, tokamax, ...) are installed when
their imports are missing, from the wheels `make device-wheels` staged in
`device-wheels/cp<python>/` (`pip install --no-index --no-deps --target` a temporary folder,
put on sys.path and PYTHONPATH).

`--rehearse` runs the parts named at toy sizes on this CPU from a fresh virtual environment
built like the GPU machine's: jax, flax, optax, orbax, chex, etils, numpy, Pillow, tqdm, pytest
and what else that machine holds (`device_wheels.TARGET_HAS`) installed from the registry, the
rest only from the staged wheels for this machine's Python (`make device-wheels
PYTHON_TAG=311`), which proves the staging list complete.

On a 15-minute lease (docs/accelerators.md): `lease` in one call with a 600 s limit (its parts
take at most about 9 minutes), leaving time for one rerun; the first run's `env,tests` and
`speed` calls (360 s limits), `lra` with band (one kind per call, `--budget 330`) and `grid`
in later leases.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# As a script, sys.path[0] is benchmarks/, where attention.py shadows the `attention` package.
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
  sys.path[0] = ROOT
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import device_runs, device_speed, device_targets, device_wheels  # noqa: E402
from benchmarks.device_common import Budget, Recorder, machine  # noqa: E402

PARTS = ("env", "tests", "speed", "grid", "lra")
# Wall seconds per part; each part is sized to finish within 5 minutes on one H100.
BUDGETS = dict(env=60.0, tests=260.0, speed=280.0, grid=280.0, lra=280.0)
# `lease`: one command that fits a short GPU lease. Its parts' budgets sum to 505 s, which
# leaves about 35 s of the 9 minutes for installing the staged wheels, starting the processes
# and the parts' own ends (each stops adding work at its budget and writes what it has).
LEASE = "lease"
LEASE_BUDGETS = dict(env=25.0, tests=140.0, speed=230.0, lra=110.0)
# The test files that failed on the first H100 run (docs/gpu.md), then those its budget did not
# reach.
LEASE_TEST_FILES = ("flash_test.py", "kinds_test.py", "models_test.py", "backends_test.py",
                    "pallas_block_sparse_test.py")
LEASE_LRA_KINDS = ("dot_product",)
TOY_BUDGET = 150.0
# Imports the GPU machine lacks -> the package whose wheel provides it.
NEEDED_IMPORTS = {"tensorflow_datasets": "tensorflow-datasets", "grain": "grain",
                  "ml_collections": "ml-collections", "tensorboardX": "tensorboardX",
                  "tokamax": "tokamax"}
SITE_ENV = "DEVICE_CHECK_SITE"      # the folder the staged wheels were installed into


# ------------------------------------------------------------------------------------------------
# Staged wheels


def missing_imports() -> list[str]:
  return [m for m in NEEDED_IMPORTS if importlib.util.find_spec(m) is None]


def ensure_packages(wheels_root: str) -> dict:
  """Installs the staged wheels into a temporary folder on sys.path and PYTHONPATH when any of
  `NEEDED_IMPORTS` is missing. Returns what was done; raises SystemExit with one line when the
  wheels are not staged."""
  missing = missing_imports()
  if not missing:
    inherited = os.environ.get(SITE_ENV)      # a parent of this process installed them
    return dict(installed=bool(inherited), missing=[], target=inherited, inherited=True)
  tag = f"{sys.version_info.major}{sys.version_info.minor}"
  wheels = device_wheels.wheels_dir(wheels_root, tag)
  files = sorted(glob.glob(os.path.join(wheels, "*.whl")))
  if not files:
    raise SystemExit(f"error: {', '.join(missing)} not importable and no wheels in {wheels}: "
                     f"run `make device-wheels PYTHON_TAG={tag}` where a registry is reachable.")
  target = tempfile.mkdtemp(prefix="device-check-site-")
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                  "--no-compile", "--no-cache-dir", "--target", target, *files], check=True)
  sys.path.insert(0, target)
  importlib.invalidate_caches()
  os.environ[SITE_ENV] = target
  os.environ["PYTHONPATH"] = os.pathsep.join(
      [target, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
  still = missing_imports()
  if still:
    raise SystemExit(f"error: {', '.join(still)} still not importable after installing "
                     f"{wheels}: restage with `make device-wheels PYTHON_TAG={tag}`.")
  return dict(installed=True, missing=missing, target=target, wheels=len(files))


# ------------------------------------------------------------------------------------------------
# Rehearsal


def _target_requirements() -> list[str]:
  """`device_wheels.TARGET_HAS` pinned to the versions installed here (setup.py's pins)."""
  import importlib.metadata

  reqs = []
  for name in device_wheels.TARGET_HAS:
    try:
      reqs.append(f"{name}=={importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
      reqs.append(name)
  return reqs


def rehearse(parts: list[str], out: str, wheels_root: str, budget: float | None,
             targets: bool = False) -> int:
  """Builds a fresh virtual environment like the GPU machine's and runs the parts at toy sizes
  in it; returns the worst exit status."""
  tag = f"{sys.version_info.major}{sys.version_info.minor}"
  wheels = device_wheels.wheels_dir(wheels_root, tag)
  if not glob.glob(os.path.join(wheels, "*.whl")):
    print(f"error: no wheels in {wheels}: run `make device-wheels PYTHON_TAG={tag}` first.",
          file=sys.stderr)
    return 2
  venv = os.path.join(out, "venv")
  python = os.path.join(venv, "bin", "python")
  t0 = time.monotonic()
  if not os.path.exists(python):
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *_target_requirements()], check=True)
  print(f"fresh environment {venv} ready in {time.monotonic() - t0:.0f} s", flush=True)
  # Nothing of ours is installed there: the code is read from the checkout, and the packages
  # the GPU machine lacks come from the staged wheels (the parts install them themselves).
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  cmd = [python, os.path.abspath(__file__), ",".join(parts), "--out", out, "--toy",
         "--wheels", wheels_root, "--scratch", os.path.join(out, "scratch")]
  cmd += [] if budget is None else ["--budget", str(budget)]
  cmd += ["--targets"] if targets else []
  print(f"$ {shlex.join(cmd)}", flush=True)
  return subprocess.run(cmd, cwd=ROOT, env=env).returncode


@contextlib.contextmanager
def _test_files(names: tuple[str, ...] | None):
  """`device_runs.part_tests` on `names` instead of its `TEST_FILES` (None: unchanged)."""
  saved = device_runs.TEST_FILES
  if names is not None:
    device_runs.TEST_FILES = names
  try:
    yield
  finally:
    device_runs.TEST_FILES = saved


# ------------------------------------------------------------------------------------------------
# Command line


class _Parser(argparse.ArgumentParser):
  """Argument errors as one line on stderr, exit status 2."""

  def error(self, message: str) -> None:
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = _Parser(prog="device_check.py", description=__doc__.split("\n")[0],
              formatter_class=argparse.RawDescriptionHelpFormatter,
              epilog=__doc__.split("\n", 2)[2])
  p.add_argument("part", help=f"one of {', '.join(PARTS)}, all, or several joined by commas "
                              "(env,tests)")
  p.add_argument("--out", required=True,
                 help="folder for <part>.jsonl, <part>.log and the tests' junit xml")
  p.add_argument("--budget", type=float, default=None,
                 help="wall seconds per part (default: " + ", ".join(
                     f"{k} {v:.0f}" for k, v in BUDGETS.items()) + f"; {TOY_BUDGET:.0f} with "
                 "--toy or --rehearse)")
  p.add_argument("--rehearse", action="store_true",
                 help="toy sizes on this CPU, from a fresh virtual environment in OUT/venv")
  p.add_argument("--toy", action="store_true", help="toy sizes here, no fresh environment")
  p.add_argument("--wheels", default=device_wheels.DEFAULT_DEST,
                 help="root of the staged wheels (default device-wheels)")
  p.add_argument("--scratch", default=None,
                 help="folder for the LRA runs, their data and the step grid's files "
                      "(default: a new temporary folder)")
  p.add_argument("--lra_kinds", default=",".join(device_runs.LRA_KINDS),
                 help="attention kinds of the lra part, sharing its budget (default "
                      f"{','.join(device_runs.LRA_KINDS)}; one kind per call gives it the whole "
                      "budget)")
  p.add_argument("--targets", action="store_true",
                 help="the speed part measures the target points only (what `lease` runs)")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  names = [x.strip() for x in args.part.split(",")]
  args.lease = names == [LEASE]
  parts = list(PARTS) if names == ["all"] else list(LEASE_BUDGETS) if args.lease else names
  bad = [x for x in parts if x not in PARTS]
  if bad or not parts:
    p.error(f"part must be one of {', '.join(PARTS)}, all, lease (or several parts joined by "
            f"commas); got {args.part!r}")
  args.parts = parts
  args.lra_kinds = tuple(k.strip() for k in args.lra_kinds.split(",") if k.strip())
  if args.lease and args.lra_kinds == device_runs.LRA_KINDS:
    args.lra_kinds = LEASE_LRA_KINDS
  args.targets = args.targets or args.lease
  from attention import kinds as kinds_lib     # pure Python: no jax
  unknown = [k for k in args.lra_kinds if k not in kinds_lib.names()]
  if unknown or not args.lra_kinds:
    p.error(f"--lra_kinds must name attention kinds ({', '.join(kinds_lib.names())}); got "
            f"{', '.join(unknown) or 'none'}")
  if args.budget is not None and args.budget <= 0:
    p.error(f"--budget must be positive, got {args.budget}")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  out = os.path.abspath(args.out)
  os.makedirs(out, exist_ok=True)
  toy = args.toy or args.rehearse
  if args.rehearse:
    return rehearse([LEASE] if args.lease else args.parts, out, args.wheels, args.budget,
                    args.targets and not args.lease)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  staged = ensure_packages(args.wheels)
  scratch = args.scratch or tempfile.mkdtemp(prefix="device-check-")
  os.makedirs(scratch, exist_ok=True)
  command = shlex.join([sys.executable] + (sys.argv if argv is None else [__file__] + argv))
  info = dict(machine(), staged_wheels=staged)
  if args.worker:                           # the speed part's child process
    budget = Budget(args.budget or BUDGETS["speed"])
    worker = device_targets.targets_worker if args.targets else device_speed.speed_worker
    worker(Recorder(out, "speed", command, info), budget, toy, out)
    return 0
  worst = 0
  for part in args.parts:
    rec = Recorder(out, part, command, info)
    seconds = args.budget or (TOY_BUDGET if toy else (LEASE_BUDGETS if args.lease
                                                       else BUDGETS)[part])
    budget = Budget(seconds)
    rec.log(f"part {part}: budget {seconds:.0f} s{' (toy sizes)' if toy else ''}")
    try:
      if part == "env":
        device_runs.part_env(rec, budget, toy)
      elif part == "tests":
        with _test_files(LEASE_TEST_FILES if args.lease else None):
          device_runs.part_tests(rec, budget, toy, out)
      elif part == "speed":
        device_targets.part_speed(rec, budget, toy, out, args.wheels, targets=args.targets)
      elif part == "grid":
        device_speed.part_grid(rec, budget, toy, out, scratch)
      else:
        device_runs.part_lra(rec, budget, toy, scratch, args.lra_kinds)
      rec.record(name="done", seconds=round(budget.used(), 1), ok=True)
    except Exception as e:  # one part failing must not cost the others
      import traceback
      rec.log(traceback.format_exc())
      rec.record(name="done", seconds=round(budget.used(), 1), ok=False,
                 error=f"{type(e).__name__}: {e}")
      worst = 1
    rec.log(f"part {part} done in {budget.used():.0f} s")
  return worst


if __name__ == "__main__":
  sys.exit(main())
