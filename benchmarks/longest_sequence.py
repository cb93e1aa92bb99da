"""The longest trainable sequence: whole training steps of a long-context character LM at
doubling lengths, then bisected up to the first length that does not fit, per memory setup.

Models (`--models`), batch 1, causal, on the enwik8 character LM (`lra.tasks.charlm`):
  band        4 layers, width 256, 4 heads, MLP 1024, band attention with window 256 in every layer
  favor       the same with causal FAVOR+ (256 random features)
  band_small  the enwik8 `small` config: 4 layers, width 128, MLP 256, window 32 (the model of
              the first measurements in docs/long_context.md)
Setups (`--setups`): f32 (float32, no remat), remat (float32, `config.remat=block`), bf16_remat
(bfloat16 activations and block remat), seq8 (bf16_remat on 8 fake CPU devices with the length
split over them, `config.mesh.sequence=8`; one device's figures times 8 on a CPU, where the
devices share the memory).

Each (model, setup, length) point runs in its own process: it builds the real trainer
(`lra.train.Trainer`), compiles the train step on abstract inputs and reads XLA's memory
estimate (`lra.preflight.Program`, the preflight's figure). A point whose estimate is over the
memory limit (`--limit_gb`, default: the machine's available memory when the benchmark starts)
is not run and counts as out of memory ("over limit"); the others allocate the state, run one
untimed step and `--steps` timed ones (forward, backward, AdamW update) on random characters,
and report the median step time, the compile time, the peak resident memory of the process
during the steps (VmHWM, reset after compiling; on an accelerator, the device's peak bytes in
use), the RSS before the state was allocated, and whether every loss and gradient norm was
finite. Lengths double from `--min_length` until the first failure (out of memory, over the
limit, an error or `--timeout`) or `--max_length`; then `--bisect` halvings of the gap between
the last length that ran and the first that did not find the longest one, to a multiple of
`--multiple` tokens.

  .venv/bin/python benchmarks/longest_sequence.py --models band --setups bf16_remat
  .venv/bin/python benchmarks/longest_sequence.py --render          # tables and plot from --out
  .venv/bin/python benchmarks/longest_sequence.py --quick           # a smoke run (tests)

Writes `--out` (JSON lines, appended per point; default docs/longest_sequence.jsonl) and `--plot`
(peak memory and steps/s against length, log-log; default: --out with .png). Tables: every
point with the growth of the peak above the pre-state RSS per doubling (2.0 is linear), and the
longest length per (model, setup).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GB = 1e9
# model -> (attention kind, config overrides)
MODELS = {
    "band": ("band", [("model.emb_dim", "256"), ("model.qkv_dim", "256"),
                      ("model.mlp_dim", "1024"), ("model.num_heads", "4"),
                      ("model.attention.window", "256")]),
    "favor": ("favor", [("model.emb_dim", "256"), ("model.qkv_dim", "256"),
                        ("model.mlp_dim", "1024"), ("model.num_heads", "4"),
                        ("model.attention.num_features", "256")]),
    "band_small": ("band", []),
}
# setup -> (config overrides, fake CPU devices)
SETUPS = {
    "f32": ([("dtype", "float32"), ("remat", "none")], 1),
    "remat": ([("dtype", "float32"), ("remat", "block")], 1),
    "bf16_remat": ([("dtype", "bfloat16"), ("remat", "block")], 1),
    "seq8": ([("dtype", "bfloat16"), ("remat", "block"), ("mesh.sequence", "8")], 8),
}
QUICK = [("model.emb_dim", "32"), ("model.qkv_dim", "32"), ("model.mlp_dim", "64"),
         ("model.num_heads", "2")]


def _status_kb(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  return 0


def mem_available() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no MemAvailable in /proc/meminfo")


def build_config(model: str, setup: str, length: int, quick: bool):
  import configs

  kind, model_overrides = MODELS[model]
  overrides = [("data.max_length", str(length)), ("data.eval_length", "0"),
               ("batch_size", "1"), ("eval_batch_size", "1"), ("mesh.data", "1"),
               ("progress", "false"), ("model.dropout", "0.0"), *SETUPS[setup][0]]
  config = configs.build_config("enwik8", size="small", attention=kind, overrides=overrides)
  with config.unlocked():
    config.phases = ()
    # One window for every layer (per-layer windows unroll the blocks, and XLA:CPU does not
    # rematerialise unrolled blocks; docs/training.md).
    config.model.layer_attention = ()
  for dotted, text in model_overrides + (QUICK if quick else []):
    configs.apply_override(config, dotted, text)
  if quick:
    with config.unlocked():
      config.model.num_layers = 2
      if kind == "band":
        config.model.attention.window = 8
      else:
        config.model.attention.num_features = 16
  return config


def measure(model: str, setup: str, length: int, steps: int, quick: bool,
            limit: float) -> dict:
  """One point, in this process."""
  import jax
  import numpy as np

  from lra import mesh as mesh_lib, preflight, train

  config = build_config(model, setup, length, quick)
  point = {"model": model, "setup": setup, "length": length}
  t0 = time.perf_counter()
  trainer = train.Trainer.abstract(config)
  batch_abs = preflight.abstract_batch(trainer.task, config.data, 1, trainer.mesh)
  program = preflight.Program.compile("train step", trainer.train_step,
                                      trainer.abstract_state(), batch_abs, trainer.abstract_rest)
  compile_s = time.perf_counter() - t0
  devices = SETUPS[setup][1]
  estimate = program.peak * devices if jax.devices()[0].platform == "cpu" else program.peak
  point.update(compile_s=round(compile_s, 2), estimate_bytes=estimate,
               params=sum(int(np.prod(x.shape)) for x in
                          jax.tree.leaves(trainer.abstract_state()["params"])))
  if estimate > limit:
    return {**point, "status": "over_limit", "limit_bytes": int(limit)}
  rng = np.random.default_rng(0)
  batch = {k: (np.ones(s.shape, np.int32) if k == "mask" else
               rng.integers(1, trainer.task.vocab_size, s.shape).astype(np.int32))
           for k, s in trainer.task.batch_spec(config.data, 1, "train").items()}
  rss_before = _status_kb("VmRSS") * 1024
  trainer.allocate()
  batch = mesh_lib.global_batch(batch, trainer.mesh)
  try:   # forget the compiler's own peak: VmHWM from here on is the training steps'
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    pass
  state, times, finite = trainer.state, [], True
  for k in range(steps + 1):
    t = time.perf_counter()
    state, sums = program.compiled(state, batch, trainer.rest)
    jax.block_until_ready(sums)
    finite &= bool(np.isfinite(float(sums["loss_sum"])) and np.isfinite(float(sums["grad_norm"])))
    if k:
      times.append(time.perf_counter() - t)
  device = jax.devices()[0]
  peak = _status_kb("VmHWM") * 1024
  if device.platform != "cpu":
    peak = max(int((d.memory_stats() or {}).get("peak_bytes_in_use", 0))
               for d in jax.local_devices())
    rss_before = 0
  return {**point, "status": "ok", "step_s": statistics.median(times), "peak_bytes": peak,
          "base_bytes": rss_before, "finite": finite, "device": device.device_kind,
          "devices": devices}


def run_point(model: str, setup: str, length: int, args) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}
  env.pop("XLA_FLAGS", None)
  if SETUPS[setup][1] > 1:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={SETUPS[setup][1]}"
    # XLA:CPU's pool of max(cores, devices) threads deadlocks a loop of collective steps with
    # this many faked devices; four threads a device do not (lra/cpus.py `cpu_threads`).
    env.setdefault("NPROC", str(4 * SETUPS[setup][1]))
    env["JAX_PLATFORMS"] = "cpu"
  spec = {"model": model, "setup": setup, "length": length, "steps": args.steps,
          "quick": args.quick, "limit": args.limit_gb * GB}
  cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
  started = time.time()
  try:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
  except subprocess.TimeoutExpired:
    return {"model": model, "setup": setup, "length": length, "status": "timeout"}
  for line in done.stdout.splitlines():
    if line.startswith("RESULT "):
      return {**json.loads(line[len("RESULT "):]), "wall_s": round(time.time() - started, 1)}
  text = (done.stderr or "") + (done.stdout or "")
  oom = done.returncode in (-9, 137) or "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
  return {"model": model, "setup": setup, "length": length, "status": "oom" if oom else "error",
          "error": text.strip().splitlines()[-1][:300] if text.strip() else f"rc {done.returncode}"}


def search(model: str, setup: str, args, record) -> None:
  """Doubles from --min_length until the first failure, then bisects the gap."""
  ok, bad, length = None, None, args.min_length
  while length <= args.max_length:
    r = record(run_point(model, setup, length, args))
    if r["status"] != "ok":
      bad = length
      break
    ok, length = length, length * 2
  if ok is None or bad is None:
    return
  for _ in range(args.bisect):
    mid = (ok + bad) // 2 // args.multiple * args.multiple
    if mid <= ok or mid >= bad:
      break
    r = record(run_point(model, setup, mid, args))
    if r["status"] == "ok":
      ok = mid
    else:
      bad = mid


def read_records(path: str) -> list[dict]:
  """The points of `path`, the last record of each (model, setup, length)."""
  if not os.path.exists(path):
    return []
  latest = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        r = json.loads(line)
        latest[(r.get("model", "band_small"), r["setup"], r["length"])] = r
  return [latest[k] for k in sorted(latest)]


def _status_text(r: dict) -> str:
  if r["status"] == "over_limit":
    return (f"over the limit (estimate {r['estimate_bytes'] / GB:.1f} GB > "
            f"{r['limit_bytes'] / GB:.1f} GB; not run)")
  return r["status"].upper()


def table(records: list[dict]) -> str:
  lines = ["| model | setup | length | step s | tokens/s | compile s | estimate GB | peak GB | "
           "peak - base GB | x per doubling | finite |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  grown_at: dict[tuple, float] = {}
  for r in records:
    model = r.get("model", "band_small")
    if r["status"] != "ok":
      lines.append(f"| {model} | {r['setup']} | {r['length']:,} | {_status_text(r)} "
                   f"| | | | | | | |")
      continue
    grown = (r["peak_bytes"] - r["base_bytes"]) / GB
    grown_at[(model, r["setup"], r["length"])] = grown
    half = grown_at.get((model, r["setup"], r["length"] // 2)) if r["length"] % 2 == 0 else None
    estimate = f"{r['estimate_bytes'] / GB:.2f}" if "estimate_bytes" in r else ""
    lines.append(f"| {model} | {r['setup']} | {r['length']:,} | {r['step_s']:.2f} | "
                 f"{r['length'] / r['step_s']:,.0f} | {r['compile_s']:.1f} | {estimate} | "
                 f"{r['peak_bytes'] / GB:.2f} | {grown:.2f} | "
                 f"{f'{grown / half:.2f}' if half else ''} | {'yes' if r['finite'] else 'NO'} |")
  return "\n".join(lines)


def longest(records: list[dict]) -> str:
  lines = ["| model | setup | longest length run | step s | peak GB | first that did not run |",
           "|---|---|---|---|---|---|"]
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    groups.setdefault((r.get("model", "band_small"), r["setup"]), []).append(r)
  for (model, setup), rs in groups.items():
    good = [r for r in rs if r["status"] == "ok"]
    best = max(good, key=lambda r: r["length"]) if good else None
    above = [r for r in rs if r["status"] != "ok" and (not best or r["length"] > best["length"])]
    first = min(above, key=lambda r: r["length"]) if above else None
    cells = ([f"{best['length']:,}", f"{best['step_s']:.1f}", f"{best['peak_bytes'] / GB:.2f}"]
             if best else ["none", "", ""])
    cells.append(f"{first['length']:,} ({_status_text(first)})" if first else "-")
    lines.append(f"| {model} | {setup} | {' | '.join(cells)} |")
  return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
  """Steps/s and peak memory against length (log-log), one line per (model, setup), the points
  that ran (the table names the ones that did not)."""
  from benchmarks import lra_speed_plot
  ok = [r for r in records if r["status"] == "ok"]
  rows = [{"kind": f"{r.get('model', 'band_small')} {r['setup']}", "length": r["length"],
           "status": "ok", "steps_per_s": 1.0 / r["step_s"], "peak_gb": r["peak_bytes"] / GB,
           "batch": 1, "setup": "causal char LM"} for r in ok]
  lengths = sorted({r["length"] for r in ok})
  ticks = [n for n in lengths if n & (n - 1) == 0] or lengths     # powers of two
  lra_speed_plot.plot_lengths(rows, path, xticks=ticks)


def _names(text: str, valid: dict, what: str) -> list[str]:
  names = [s for s in text.split(",") if s]
  unknown = [s for s in names if s not in valid]
  if unknown or not names:
    raise SystemExit(f"error: unknown {what} {unknown[0] if unknown else text!r}; valid: "
                     f"{', '.join(valid)}.")
  return names


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n", 2)[2])
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--models", default=None, help=f"of: {', '.join(MODELS)} (default: band and "
                      "favor; with --render, every model)")
  parser.add_argument("--setups", default=",".join(SETUPS), help=f"of: {', '.join(SETUPS)}")
  parser.add_argument("--min_length", type=int, default=16384)
  parser.add_argument("--max_length", type=int, default=1 << 21)
  parser.add_argument("--bisect", type=int, default=2, help="halvings after the first failure")
  parser.add_argument("--multiple", type=int, default=8192,
                      help="bisected lengths are multiples of this")
  parser.add_argument("--limit_gb", type=float, default=None,
                      help="points whose compiled estimate is above this are not run "
                           "(default: the available memory at the start)")
  parser.add_argument("--steps", type=int, default=1, help="timed steps per point")
  parser.add_argument("--timeout", type=float, default=3600, help="seconds per point")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny model at 256 to 1,024 tokens (a smoke run; the times mean nothing)")
  parser.add_argument("--render", action="store_true", help="run nothing: tables and plot "
                      "from every point in --out")
  parser.add_argument("--out", default=os.path.join(ROOT, "docs", "longest_sequence.jsonl"))
  parser.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
  args = parser.parse_args(argv)
  if args.child:
    spec = json.loads(args.child)
    print("RESULT " + json.dumps(measure(spec["model"], spec["setup"], spec["length"],
                                         spec["steps"], spec["quick"], spec["limit"])),
          flush=True)
    return 0
  try:
    models = _names(args.models or (",".join(MODELS) if args.render else "band,favor"),
                    MODELS, "model")
    setups = _names(args.setups, SETUPS, "setup")
  except SystemExit as e:
    print(e, file=sys.stderr)
    return 2
  if args.quick:
    args.min_length, args.multiple = 256, 64
    args.max_length = min(args.max_length, 1024)
  if not 1 <= args.min_length <= args.max_length or args.multiple < 1 or args.steps < 1:
    print("error: need 1 <= --min_length <= --max_length, --multiple >= 1 and --steps >= 1.",
          file=sys.stderr)
    return 2
  args.plot = args.plot or os.path.splitext(args.out)[0] + ".png"
  if not args.render:
    if args.limit_gb is None:
      args.limit_gb = mem_available() / GB
    print(f"memory limit {args.limit_gb:.1f} GB; points to {args.out}", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def record(r: dict) -> dict:
      with open(args.out, "a") as f:
        f.write(json.dumps(r) + "\n")
      shown = (f"{r['step_s']:.1f} s/step, peak {r['peak_bytes'] / GB:.2f} GB"
               if r["status"] == "ok" else _status_text(r))
      print(f"{r['model']} {r['setup']} {r['length']:,}: {shown}", file=sys.stderr, flush=True)
      return r

    for model in models:
      for setup in setups:
        search(model, setup, args, record)
  records = [r for r in read_records(args.out)
             if r.get("model", "band_small") in models and r["setup"] in setups]
  if not records:
    print(f"error: no points in {args.out}.", file=sys.stderr)
    return 2
  print(table(records) + "\n\n" + longest(records))
  plot(records, args.plot)
  print(f"plot: {args.plot}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
