"""Attention speed and memory benchmark: one child process per (impl, mode, n) point.

Every `benchmarks/impls_*.py` module contributes a literal `IMPLS` dict (interface: see
`benchmarks/impls_band.py`). Each point runs in a fresh Python process that builds the step,
warms it up once and times several calls (median and min). Memory: "peak RSS" is the process's
peak resident set size (`VmHWM`, imports and compilation included); "+RSS" its increase over the
RSS right before the first call (reset through `/proc/self/clear_refs`), the calls' own need.
The FLOP floor of a point is the impl's `flops_fwd` (3x for forward+backward) over the float32
matmul rate a separate child measures. Failed, killed (usually out of memory) or timed-out
children are reported as such. In each table group the first impl is compared with its peers
(speedup = peer time / its time).

  .venv/bin/python benchmarks/attention.py --demo                     # ~2 minutes
  .venv-bench/bin/python benchmarks/attention.py --markdown out.md    # full run (`make bench`)
  .venv/bin/python benchmarks/attention.py --impls band,dense_jax --lengths 1024,2048 --modes fwd
  .venv/bin/python benchmarks/attention.py --from-jsonl benchmarks/results/<run>.jsonl

Raw results go to `benchmarks/results/attention-<time>.jsonl` (one JSON object per line).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util  # also binds importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# As a script, sys.path[0] is benchmarks/, where this file shadows the `attention` package.
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
  sys.path[0] = ROOT
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.attention_report import MODES, _fmt, plot, render_markdown  # noqa: E402

RESULTS_DIR = os.path.join(HERE, "results")
DEMO = dict(impls="band,dense_jax,torch_sdpa,hf_longformer", lengths="1024,2048,4096",
            repeats=3, budget=4.0)


def discover_impls() -> dict:
  """{name: spec} from every benchmarks/impls_*.py, with the spec's `module` added."""
  impls = {}
  for path in sorted(glob.glob(os.path.join(HERE, "impls_*.py")),
                     key=lambda p: (not p.endswith("impls_band.py"), p)):
    module_name = "benchmarks." + os.path.basename(path)[:-3]
    try:
      module = importlib.import_module(module_name)
    except Exception as e:  # a peer module under construction must not stop the others
      print(f"warning: cannot import {module_name}: {type(e).__name__}: {e}", file=sys.stderr)
      continue
    for name, spec in getattr(module, "IMPLS", {}).items():
      if name in impls:
        raise ValueError(f"impl {name!r} is defined in {impls[name]['module']} and "
                         f"{module_name}: rename one of them.")
      impls[name] = dict(spec, module=module_name)
  return impls


# ------------------------------------------------------------------------------------------------
# Child side


def _memory_kb(field: str) -> int:
  """A `Vm*` field of /proc/self/status in KiB (0 when unavailable)."""
  try:
    with open("/proc/self/status") as f:
      return next((int(x.split()[1]) for x in f if x.startswith(field + ":")), 0)
  except OSError:
    return 0


def _reset_peak() -> bool:
  """Resets the process's RSS high-water mark (Linux >= 4.0); False when not possible."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _child_point(spec: dict) -> dict:
  impl = importlib.import_module(spec["module"]).IMPLS[spec["impl"]]
  t0 = time.perf_counter()
  try:
    step = impl["build"](spec["n"], spec["mode"], spec["batch"], spec["heads"], spec["head_dim"])
  except ImportError as e:
    return dict(status="skip", detail=f"missing dependency: {e}")
  build_s = time.perf_counter() - t0
  peak_before = _memory_kb("VmHWM")
  reset = _reset_peak()
  baseline = _memory_kb("VmRSS")
  t0 = time.perf_counter()
  step()
  first_s = time.perf_counter() - t0
  times = []
  while len(times) < spec["repeats"] and (len(times) < spec["min_repeats"]
                                          or sum(times) < spec["budget"]):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
  peak_calls = _memory_kb("VmHWM")
  version = getattr(sys.modules.get(spec["framework"]), "__version__", None)
  return dict(status="ok", times_s=times, median_s=statistics.median(times), min_s=min(times),
              build_s=build_s, first_call_s=first_s, baseline_mb=baseline / 1024,
              peak_rss_mb=max(peak_before, peak_calls) / 1024,
              rss_increase_mb=(peak_calls - baseline) / 1024 if reset else None,
              framework_version=version)


def _child_matmul(spec: dict) -> dict:
  import jax
  import jax.numpy as jnp

  rates = {}
  for size, repeats in ((2048, 10), (4096, 4)):
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (size, size), jnp.float32)
    y = jax.random.normal(ky, (size, size), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(x, y).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
      t0 = time.perf_counter()
      dot(x, y).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    rates[str(size)] = 2.0 * size ** 3 / best
  return dict(status="ok", rates=rates, flops_per_s=max(rates.values()),
              framework_version=jax.__version__)


def _child_main(spec_json: str) -> None:
  spec = json.loads(spec_json)
  result = _child_matmul(spec) if spec["kind"] == "matmul" else _child_point(spec)
  print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------
# Parent side


def _child_env() -> dict:
  """The environment of a child: without the test suite's fake multi-device CPU setting."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                            env.get("XLA_FLAGS", "")).strip()
  return env


def run_child(spec: dict, timeout: float) -> dict:
  """Runs one point (or the matmul measurement) in a fresh process; never raises."""
  cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_child_env(),
                          cwd=ROOT)
  except subprocess.TimeoutExpired:
    return dict(spec, status="timeout", detail=f"no result within {timeout:.0f} s",
                wall_s=time.perf_counter() - t0)
  wall = time.perf_counter() - t0
  for line in proc.stdout.splitlines()[::-1]:
    if line.startswith("RESULT "):
      return dict(spec, **json.loads(line[len("RESULT "):]), wall_s=wall)
  if proc.returncode < 0:
    sig = -proc.returncode
    why = " (SIGKILL: most likely out of memory)" if sig == 9 else ""
    return dict(spec, status="died", detail=f"killed by signal {sig}{why}", wall_s=wall)
  lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
  return dict(spec, status="error", wall_s=wall,
              detail=f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"[:300])


def _importable(module: str) -> bool:
  return importlib.util.find_spec(module) is not None


def plan_points(impls: dict, names, lengths, modes, shape: dict) -> list:
  """Specs of the points to run, or records saying why a point is skipped."""
  points = []  # n-major, so the impls compared at one n run close together in time
  for n in lengths:
    for mode in modes:
      for name in names:
        impl = impls[name]
        spec = dict(kind="point", impl=name, module=impl["module"], group=impl["group"],
                    framework=impl.get("framework", "jax"), n=n, mode=mode, **shape)
        if impl.get("max_n") is not None and n > impl["max_n"]:
          spec.update(status="skip", detail=f"does not fit (max_n={impl['max_n']})")
        elif not _importable(impl.get("framework", "jax")):
          spec.update(status="skip", detail=f"{impl.get('framework')} is not installed")
        points.append(spec)
  return points


def machine_info() -> dict:
  cpu = platform.processor() or platform.machine()
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
  return dict(cpu=cpu, cores=os.cpu_count(), mem_gib=round(mem_gib, 1),
              python=platform.python_version())


# ------------------------------------------------------------------------------------------------
# Tables


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--demo", action="store_true",
                 help=f"short run: n={DEMO['lengths']}, band and dense_jax (torch peers when "
                      f"installed), {DEMO['repeats']} repeats")
  p.add_argument("--impls", default=None, help="comma-separated impl names (default: all)")
  p.add_argument("--groups", default=None, help="comma-separated groups (default: all)")
  p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
  p.add_argument("--modes", default="fwd,fwdbwd")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5, help="timed calls per point (max)")
  p.add_argument("--min-repeats", type=int, default=3)
  p.add_argument("--budget", type=float, default=20.0,
                 help="stop timing a point after this many seconds once min-repeats are done")
  p.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
  p.add_argument("--markdown", default=None, help="also write the markdown tables to this file")
  p.add_argument("--plot-dir", default=None,
                 help="where <group>_attention.png go (default: docs/, or the results folder "
                      "with --demo)")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--from-jsonl", default=None, help="render tables/plots from a saved run")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.child is not None:
    _child_main(args.child)
    return 0
  if args.from_jsonl:
    with open(args.from_jsonl) as f:
      lines = [json.loads(x) for x in f if x.strip()]
    header, records = lines[0], lines[1:]
    order = list(dict.fromkeys([r["impl"] for r in records]))
  else:
    header, records, order = run_all(args, discover_impls())
  text = render_markdown(header, records, order)
  print(text)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(text + "\n")
  if not args.no_plot:
    plot_dir = args.plot_dir or (RESULTS_DIR if args.demo else os.path.join(ROOT, "docs"))
    for path in plot(header, records, order, plot_dir):
      print(f"wrote {path}", file=sys.stderr)
  return 0


def run_all(args, impls: dict):
  """Runs the matmul child and every point; streams JSON lines to benchmarks/results/."""
  if args.demo:
    args.lengths, args.repeats, args.budget = DEMO["lengths"], DEMO["repeats"], DEMO["budget"]
    args.impls = args.impls or DEMO["impls"]
  wanted = list(impls) if args.impls is None else args.impls.split(",")
  unknown = [x for x in wanted if x not in impls]
  if unknown:
    raise SystemExit(f"unknown impl(s) {', '.join(unknown)}; valid: {', '.join(impls)}.")
  names = [x for x in impls if x in wanted]  # module order: a group's first impl is its subject
  if args.groups:
    names = [x for x in names if impls[x]["group"] in args.groups.split(",")]
  modes = args.modes.split(",")
  bad = [m for m in modes if m not in MODES]
  if bad:
    raise SystemExit(f"unknown mode(s) {bad}; valid: {', '.join(MODES)}.")
  if args.demo:  # the torch peers only when they can run
    names = [x for x in names if _importable(impls[x].get("framework", "jax"))]
  shape = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim,
               repeats=args.repeats, min_repeats=min(args.min_repeats, args.repeats),
               budget=args.budget)
  points = plan_points(impls, names, [int(x) for x in args.lengths.split(",")], modes, shape)
  os.makedirs(RESULTS_DIR, exist_ok=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  jsonl = os.path.join(RESULTS_DIR, f"attention-{stamp}.jsonl")
  print(f"measuring the float32 matmul rate, then {len(points)} points; raw results: {jsonl}",
        file=sys.stderr)
  matmul = run_child(dict(kind="matmul"), args.timeout)
  header = dict(kind="run", date=datetime.datetime.now().isoformat(timespec="seconds"),
                command=" ".join([os.path.relpath(sys.executable, ROOT)] + sys.argv),
                machine=machine_info(), matmul=matmul)
  with open(jsonl, "w") as f:
    f.write(json.dumps(header) + "\n")
  records = []
  for i, spec in enumerate(points):
    impl = impls[spec["impl"]]
    r = spec if "status" in spec else run_child(spec, args.timeout)
    r.update(note=impl.get("note", ""),
             flops_fwd=float(impl["flops_fwd"](r["n"], r["batch"], r["heads"], r["head_dim"])))
    records.append(r)
    with open(jsonl, "a") as f:
      f.write(json.dumps(r) + "\n")
    shown = (f"{r['median_s'] * 1e3:.1f} ms, +RSS {_fmt(r.get('rss_increase_mb'), '{:.0f}')} MB"
             if r.get("status") == "ok" else f"{r['status']}: {r.get('detail', '')}")
    print(f"[{i + 1}/{len(points)}] {r['impl']} {r['mode']} n={r['n']}: {shown}",
          file=sys.stderr, flush=True)
  return header, records, names


if __name__ == "__main__":
  sys.exit(main())
