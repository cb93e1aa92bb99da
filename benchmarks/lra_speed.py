"""LRA Table 2 redone: whole training steps of the Text `base` model for every attention kind.

One point = (attention kind, sequence length). Each point runs in its own Python process, which
builds `lra.train.Trainer` from `configs.build_config("text", size="base", ...)` with the length
and batch as overrides (the kind's defaults sized for that length, as `get_config` sizes them
for 1,000 bytes), compiles the trainer's own train step (forward, backward, AdamW, donated
state), allocates the state, runs `--warmup` steps on random byte batches and then times
`--min_steps` to `--steps` more, stopping early once `--budget` seconds were spent timing. The
table gives the median step. Compile seconds (trace + lower + compile of the train step) are
reported separately. Peak memory is the process's peak RSS (VmHWM: Python, the compiled code,
the state and the step's buffers) on a CPU and the device's `peak_bytes_in_use` elsewhere.

Besides every kind registered in `attention.kinds` there is `identity`: the model of
`dot_product` with the layer's attention primitive replaced by the values themselves (no
attention at all; the Performer paper's attention-free lower bound). Ratios are steps/s over
those of `dot_product` (the exact dense Transformer) and of `identity` at the same length in the
same file; both references are always measured.

A point whose estimated peak (the compiled step's memory analysis, `lra.preflight`) exceeds the
memory available, or whose process is killed or runs out of memory, is "oom"; one over
`--max_seconds` is "timeout". A kind's longer lengths after that are "skipped", as are those its
last step time (scaled by the length) predicts to exceed `--max_seconds`.

  .venv/bin/python benchmarks/lra_speed.py --quick                   # smoke run, < 1 minute
  .venv/bin/python benchmarks/lra_speed.py --lengths 1024,2048 --out runs.jsonl --resume
  .venv/bin/python benchmarks/lra_speed.py --render --out runs.jsonl --accuracy results.json

Every point is appended to `--out` (JSON lines) as soon as it is measured; with `--resume`, points
already in that file (same kind, length, batch and model) are not measured again. Plots
(Pillow): steps/s and peak memory against length (`--plot`), and with `--accuracy` (the output of
`lra results DIR --format json`) steps/s against test accuracy (`--accuracy_plot`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# As a script, sys.path[0] is benchmarks/, where attention.py shadows the `attention` package.
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
  sys.path[0] = ROOT
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from attention import kinds as kinds_lib  # noqa: E402  (pure Python, no jax)
from benchmarks.lra_step import DENSE, IDENTITY, Point, status_kb  # noqa: E402
from lra import host_memory  # noqa: E402  (standard library only)

EXACT_FALLBACK = "flash"        # exact dense reference where dot_product runs out of memory
RESULTS = os.path.join(HERE, "results")
LENGTHS = "1024,2048,3072,4096,8192,16384"
# --quick: a 1-layer, 32-wide model at two short lengths, dense and band (plus identity).
QUICK = dict(kinds="dot_product,band", lengths="128,256", batch=2, steps=3, min_steps=2,
             warmup=1, budget=5.0, max_seconds=120.0, parallel=2)
# The fields of a measured ("ok") record in the JSON lines; the others have the first six and
# `detail` (why), and sometimes more.
FIELDS = ("record", "setup", "kind", "length", "batch", "status", "steps_per_s",
          "step_s", "step_min_s", "times_s", "warmup_s", "warmup_steps", "compile_s", "peak_gb",
          "peak_source", "baseline_gb", "estimate_gb", "loss", "params", "attention", "device",
          "vs_dense", "dense_ref", "vs_identity", "memory_vs_dense", "wall_s", "date", "command", "machine")


def all_kinds() -> list[str]:
  """The references first (dense, identity), then every other registered kind, sorted."""
  return [DENSE, IDENTITY] + [k for k in kinds_lib.names() if k != DENSE]


# ------------------------------------------------------------------------------------------------
# Child side: one point


def measure(spec: dict) -> dict:
  """Builds, compiles, allocates and times one point (in this process)."""
  import jax

  point = Point(spec)
  if point.oom:
    return dict(point.info, status="oom", detail=point.oom)
  baseline = status_kb("VmRSS") * 1024
  point.allocate()
  t0 = time.perf_counter()
  for _ in range(spec["warmup"]):
    point.step()
  warmup_s = time.perf_counter() - t0
  times = []
  while len(times) < spec["steps"] and (len(times) < spec["min_steps"]
                                        or sum(times) < spec["budget"]):
    times.append(point.step())
  device = jax.devices()[0]
  if device.platform == "cpu":
    peak, source = status_kb("VmHWM") * 1024, "peak RSS (VmHWM)"
  else:
    peak, source = device.memory_stats()["peak_bytes_in_use"], "peak_bytes_in_use"
  median = statistics.median(times)
  return dict(point.info, status="ok", times_s=times, step_s=median, step_min_s=min(times),
              steps_per_s=1.0 / median, warmup_s=warmup_s, peak_gb=peak / 1e9,
              peak_source=source, loss=point.loss(), baseline_gb=baseline / 1e9)


def child_main(spec_json: str) -> None:
  spec = json.loads(spec_json)
  host_memory.keep_freed_memory()   # as every `lra` process does (LRA_MALLOC=system: glibc's own)
  try:
    result = measure(spec)
  except Exception as e:  # reported as a row; the run goes on
    text = f"{type(e).__name__}: {e}".strip()
    oom = re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|bad_alloc", text)
    lines = [x for x in text.splitlines() if x.strip()]
    result = dict(status="oom" if oom else "error", detail=(lines[0] if lines else text)[:300])
  print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------
# Parent side


def _child_env(quick: bool) -> dict:
  """The child's environment, without the test suite's fake multi-device CPU setting; --quick
  children compile with few XLA optimisations (faster to compile, their times mean nothing)."""
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = (flags + (" --xla_backend_optimization_level=0" if quick else "")).strip()
  return env


def run_point(spec: dict, timeout: float) -> dict:
  """Runs one point in a fresh process; never raises."""
  cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=_child_env(spec["quick"]), cwd=ROOT)
  except subprocess.TimeoutExpired:
    return dict(status="timeout", detail=f"over --max_seconds ({timeout:.0f} s)",
                wall_s=time.perf_counter() - t0)
  wall = time.perf_counter() - t0
  for line in proc.stdout.splitlines()[::-1]:
    if line.startswith("RESULT "):
      return dict(json.loads(line[len("RESULT "):]), wall_s=wall)
  if proc.returncode == -9:
    return dict(status="oom", detail="killed by SIGKILL (out of memory)", wall_s=wall)
  lines = [x for x in proc.stderr.splitlines() if x.strip()]
  return dict(status="error", wall_s=wall,
              detail=f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"[:300])


def key(r: dict) -> tuple:
  return (r["setup"], r["batch"], r["kind"], r["length"])


def read_records(path: str) -> list[dict]:
  """The point records of a JSONL file (none when it does not exist)."""
  if not path or not os.path.exists(path):
    return []
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r.get("record") == "point"]


def latest(records: list[dict]) -> dict:
  """{key: the last record of that point}, records that count as measured winning over
  "skipped" and "error" ones written later."""
  out = {}
  for r in records:
    old = out.get(key(r))
    if old is None or not (measured(old) and not measured(r)):
      out[key(r)] = r
  return out


def measured(r: dict) -> bool:
  """Points that a resumed run does not measure again (errors and skips are retried)."""
  return r.get("status") in ("ok", "oom", "timeout")


def skip_reason(kind: str, length: int, done: dict, setup: str, batch: int,
                max_seconds: float) -> str | None:
  """Why `kind` is not run at `length`, from its records at shorter lengths (else None)."""
  shorter = sorted((r for r in done.values() if r["kind"] == kind and r["setup"] == setup
                    and r["batch"] == batch and r["length"] < length),
                   key=lambda r: r["length"])
  for r in shorter:
    if r["status"] in ("oom", "timeout"):
      return f"after {r['status']} at {r['length']}"
  ok = [r for r in shorter if r["status"] == "ok"]
  if ok:
    r = ok[-1]
    scale = length / r["length"]
    steps = r.get("warmup_steps", 1) + len(r["times_s"])
    predicted = r["compile_s"] + steps * r["step_s"] * scale
    if predicted > max_seconds:
      return (f"predicted over --max_seconds: {predicted:.0f} s from {r['step_s']:.1f} s per "
              f"step at {r['length']}")
  return None


def dense_reference(r: dict, done: dict) -> dict | None:
  """The exact dense Transformer point at r's length: dot_product, or, where dot_product ran
  out of memory, the memory-efficient exact kind (`EXACT_FALLBACK`), as the LRA paper's
  Transformer at 4K (9.48 GB on a TPU) is an exact dense model that fits."""
  for name in (DENSE, EXACT_FALLBACK):
    ref = done.get((r["setup"], r["batch"], name, r["length"]))
    if ref is not None and ref.get("status") == "ok":
      return ref
  return None


def add_ratios(r: dict, done: dict) -> None:
  """Speed ratios to the exact dense and identity points, and memory ratio to the exact dense
  point, when measured; `dense_ref` names the dense kind used."""
  ok = r.get("status") == "ok"
  ref = dense_reference(r, done) if ok else None
  r["dense_ref"] = ref["kind"] if ref else None
  r["vs_dense"] = r["steps_per_s"] / ref["steps_per_s"] if ref else None
  r["memory_vs_dense"] = r["peak_gb"] / ref["peak_gb"] if ref else None
  ident = done.get((r["setup"], r["batch"], IDENTITY, r["length"]))
  ok = ok and ident is not None and ident.get("status") == "ok"
  r["vs_identity"] = r["steps_per_s"] / ident["steps_per_s"] if ok else None


def machine() -> dict:
  cpu = "?"
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), cpu)
  mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
  return dict(cpu=cpu, cores=os.cpu_count(), mem_gib=round(mem, 1))


def measure_all(args, kinds: list[str], lengths: list[int]) -> list[dict]:
  """Runs every point not measured yet (length-major, references first); returns this run's
  records (with --resume, the earlier ones of the same points too)."""
  setup = "quick" if args.quick else "text-base"
  earlier = latest(read_records(args.out)) if args.resume else {}
  done = {k: r for k, r in earlier.items() if measured(r)}
  todo = [(n, k) for n in lengths for k in kinds if (setup, args.batch, k, n) not in done]
  print(f"{len(lengths) * len(kinds)} points, {len(todo)} to measure; results: {args.out}",
        file=sys.stderr, flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  command = " ".join([os.path.relpath(sys.executable, ROOT), "benchmarks/lra_speed.py"]
                     + sys.argv[1:])
  count = 0
  for length in lengths:   # the kinds of one length run close together in time
    planned = []
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
      for kind in kinds:
        if (setup, args.batch, kind, length) in done:
          continue
        base = dict(record="point", setup=setup, kind=kind, length=length, batch=args.batch)
        why = skip_reason(kind, length, done, setup, args.batch, args.max_seconds)
        spec = dict(kind=kind, length=length, batch=args.batch, quick=args.quick,
                    steps=args.steps, min_steps=min(args.min_steps, args.steps),
                    warmup=args.warmup, budget=args.budget)
        planned.append((base, why, None if why else
                        pool.submit(run_point, spec, args.max_seconds)))
      pending = []   # written once both references of the length are done, with ratios
      for base, why, future in planned:   # in order: the references come first
        if future is None:
          r = dict(base, status="skipped", detail=why)
        else:
          r = dict(base, **future.result(), warmup_steps=args.warmup)
        r.update(date=datetime.datetime.now().isoformat(timespec="seconds"),
                 command=command, machine=machine())
        done[key(r)] = r
        pending.append(r)
        if all((setup, args.batch, ref, length) in done for ref in (DENSE, IDENTITY)):
          for r in pending:
            add_ratios(r, done)
            with open(args.out, "a") as f:
              f.write(json.dumps(r) + "\n")
            count += 1
            shown = (f"{r['steps_per_s']:.3f} steps/s, {r['peak_gb']:.2f} GB, compile "
                     f"{r['compile_s']:.1f} s" if r["status"] == "ok" else
                     f"{r['status']}: {r.get('detail', '')}")
            print(f"[{count}/{len(todo)}] {r['kind']} n={length}: {shown}", file=sys.stderr,
                  flush=True)
          pending = []
  return [done[(setup, args.batch, k, n)] for n in lengths for k in kinds
          if (setup, args.batch, k, n) in done]


# ------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=__doc__.split("\n", 2)[2])
  p.add_argument("--kinds", default=None,
                 help="comma-separated kinds (default: every registered kind); dot_product and "
                      "identity are always added")
  p.add_argument("--lengths", default=None, help=f"comma-separated lengths (default {LENGTHS})")
  p.add_argument("--batch", type=int, default=None, help="batch size (default 32, as in LRA)")
  p.add_argument("--steps", type=int, default=None, help="timed steps per point, at most (5)")
  p.add_argument("--min_steps", type=int, default=None, help="timed steps, at least (3)")
  p.add_argument("--warmup", type=int, default=None, help="untimed steps after compiling (1)")
  p.add_argument("--budget", type=float, default=None,
                 help="seconds of timed steps after which no more than --min_steps run (60)")
  p.add_argument("--max_seconds", type=float, default=None,
                 help="seconds per point (process start to end) before it counts as timeout; "
                      "also the limit of the prediction that skips longer lengths (1200)")
  p.add_argument("--parallel", type=int, default=None,
                 help="points of one length measured at once (default 1; 2 with --quick, "
                      "whose times mean nothing): more than 1 distorts the timings")
  p.add_argument("--out", default=None,
                 help="JSON lines file, appended per point (default "
                      "benchmarks/results/lra_speed[-quick].jsonl)")
  p.add_argument("--resume", action="store_true",
                 help="do not measure points already in --out (same kind, length, batch, model)")
  p.add_argument("--render", action="store_true",
                 help="measure nothing: tables and plots from every point in --out")
  p.add_argument("--markdown", default=None,
                 help="also write the tables to this file (only between its marker lines "
                      "`<!-- lra_speed tables: begin -->` and `... end -->` when it has them)")
  p.add_argument("--plot", default=None, help="PNG of steps/s and peak memory vs length "
                 "(default: --out with .png)")
  p.add_argument("--accuracy", default=None,
                 help="`lra results DIR --format json` output: plot steps/s vs test accuracy")
  p.add_argument("--accuracy_task", default="text", help="the task whose accuracy is used")
  p.add_argument("--accuracy_length", type=int, default=None,
                 help="the length whose steps/s are plotted against accuracy (default: the "
                      "shortest measured)")
  p.add_argument("--accuracy_plot", default=None, help="PNG path (default: --out with "
                 "-accuracy.png)")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: 1-layer 32-wide model, lengths 128 and 256, batch 2, "
                      "dot_product and band (plus identity)")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  defaults = dict(kinds=None, lengths=LENGTHS, batch=32, steps=5, min_steps=3, warmup=1,
                  budget=60.0, max_seconds=1200.0, parallel=1)
  for name, value in (QUICK if args.quick else defaults).items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.out is None:
    args.out = os.path.join(RESULTS, "lra_speed-quick.jsonl" if args.quick else
                            "lra_speed.jsonl")
  stem = os.path.splitext(args.out)[0]
  args.plot = args.plot or stem + ".png"
  args.accuracy_plot = args.accuracy_plot or stem + "-accuracy.png"
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.child is not None:
    child_main(args.child)
    return 0
  from benchmarks import lra_speed_plot as report

  valid = all_kinds()
  wanted = [k.strip() for k in (args.kinds or ",".join(valid)).split(",") if k.strip()]
  unknown = [k for k in wanted if k not in valid]
  if unknown:
    print(f"error: unknown attention kind {unknown[0]!r}; valid: {', '.join(valid)}.",
          file=sys.stderr)
    return 2
  try:
    lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
  except ValueError:
    print(f"error: --lengths must be integers, got {args.lengths!r}.", file=sys.stderr)
    return 2
  kinds = [k for k in valid if k in {DENSE, IDENTITY, *wanted}]
  if args.render:
    records = list(latest(read_records(args.out)).values())
    if not records:
      print(f"error: no points in {args.out}.", file=sys.stderr)
      return 2
  else:
    records = measure_all(args, kinds, lengths)
  done = {key(r): r for r in records}
  for r in records:            # a reference measured after a point, or merged runs: ratios anew
    add_ratios(r, done)
  text = "\n\n".join(x for x in (report.describe(records), report.render_table(records),
                                 report.render_lra_layout(records),
                                 report.render_growth(records)) if x)
  print(text)
  if args.markdown:
    report.write_markdown(args.markdown, text)
  report.plot_lengths(records, args.plot)
  print(f"plot: {args.plot}", file=sys.stderr)
  if args.accuracy:
    accuracy = report.read_accuracy(args.accuracy, args.accuracy_task)
    points = report.speed_accuracy_points(records, accuracy, args.accuracy_length)
    if not points:
      print(f"no kind has both a test accuracy in {args.accuracy} (task "
            f"{args.accuracy_task}) and a measured speed.", file=sys.stderr)
      return 1
    report.plot_accuracy(points, args.accuracy_plot,
                         report.describe_accuracy(args.accuracy, args.accuracy_task))
    for p in points:
      print(f"accuracy point: {p['kind']} n={p['length']} {p['accuracy']:.2f}% "
            f"{p['steps_per_s']:.4g} steps/s ({p['runs']} runs)")
    print(f"accuracy plot: {args.accuracy_plot}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
