"""The longest trainable sequence: whole training steps of a band-attention character LM at
doubling lengths, float32 against bfloat16 activations with rematerialised blocks.

The model is the enwik8 `small` config (4 layers, 128 wide, 4 heads, MLP 256, causal band
attention with window 32 in every layer), batch 1, one CPU device (or one accelerator). Each (setup, length)
point runs in its own process: it builds the real trainer (`lra.train.Trainer`), runs one
untimed step and `--steps` timed steps (forward, backward, AdamW update) on random characters,
and reports the median step time, the compile time, the peak resident memory of the process
during the steps (VmHWM, reset after compiling; on an accelerator, the device's peak bytes in
use) and the RSS it had before the state was allocated, and whether every loss and gradient norm was finite. A setup stops at its first
failure (out of memory, time budget). The table gives the growth of the peak (measured minus
the RSS before the state) per doubling of the length: 2.0 is linear.

  .venv/bin/python benchmarks/long_context.py                      # 16K .. 256K, both setups
  .venv/bin/python benchmarks/long_context.py --max_length 1048576 --setups bf16_remat
  .venv/bin/python benchmarks/long_context.py --quick              # a smoke run (tests)

Writes `--out` (JSON lines, default docs/long_context.jsonl) and `--plot` (default
docs/long_context.png).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# setup -> config overrides
SETUPS = {
    "f32": [("dtype", "float32"), ("remat", "none")],
    "bf16_remat": [("dtype", "bfloat16"), ("remat", "block")],
}


def _status_kb(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  return 0


def measure(setup: str, length: int, steps: int, quick: bool) -> dict:
  """One point, in this process."""
  import jax
  import numpy as np

  import configs
  from lra import mesh as mesh_lib, train

  overrides = [("data.max_length", str(length)), ("data.eval_length", "0"),
               ("batch_size", "1"), ("eval_batch_size", "1"), ("mesh.data", "1"),
               ("progress", "false"), *SETUPS[setup]]
  if quick:
    overrides += [("model.emb_dim", "32"), ("model.qkv_dim", "32"), ("model.mlp_dim", "64"),
                  ("model.attention.window", "8")]
  config = configs.build_config("enwik8", size="small", attention="band", overrides=overrides)
  with config.unlocked():
    config.phases = ()
    # One window for every layer (the config's per-layer windows would unroll the blocks,
    # and XLA:CPU does not rematerialise unrolled blocks; docs/training.md).
    config.model.layer_attention = ()
    if quick:
      config.model.num_layers = 1
  t0 = time.perf_counter()
  trainer = train.Trainer.abstract(config)
  spec = trainer.task.batch_spec(config.data, 1, "train")
  rng = np.random.default_rng(0)
  batch = {name: (np.ones(s.shape, np.int32) if name == "mask" else
                  rng.integers(1, trainer.task.vocab_size, s.shape).astype(np.int32))
           for name, s in spec.items()}
  rss_before = _status_kb("VmRSS") * 1024
  trainer.allocate()
  batch = mesh_lib.global_batch(batch, trainer.mesh)
  compiled = trainer.train_step.lower(trainer.state, batch, trainer.rest).compile()
  compile_s = time.perf_counter() - t0
  try:   # forget the compiler's own peak: VmHWM from here on is the training steps'
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    pass
  state, times, finite = trainer.state, [], True
  for k in range(steps + 1):
    t = time.perf_counter()
    state, sums = compiled(state, batch, trainer.rest)
    jax.block_until_ready(sums)
    finite &= bool(np.isfinite(float(sums["loss_sum"])) and np.isfinite(float(sums["grad_norm"])))
    if k:
      times.append(time.perf_counter() - t)
  device = jax.devices()[0]
  peak = _status_kb("VmHWM") * 1024
  if device.platform != "cpu":
    peak = int((device.memory_stats() or {}).get("peak_bytes_in_use", 0))
    rss_before = 0
  return {"setup": setup, "length": length, "status": "ok", "step_s": statistics.median(times),
          "compile_s": round(compile_s, 2), "peak_bytes": peak, "base_bytes": rss_before,
          "finite": finite, "device": device.device_kind, "params": sum(
              x.size for x in jax.tree.leaves(state["params"]))}


def run_point(setup: str, length: int, steps: int, quick: bool, timeout: float) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}
  env.pop("XLA_FLAGS", None)    # one device
  cmd = [sys.executable, os.path.abspath(__file__), "--child",
         json.dumps({"setup": setup, "length": length, "steps": steps, "quick": quick})]
  try:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"setup": setup, "length": length, "status": "timeout"}
  for line in done.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  text = (done.stderr or "") + (done.stdout or "")
  oom = done.returncode in (-9, 137) or "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
  return {"setup": setup, "length": length, "status": "oom" if oom else "error",
          "error": text.strip().splitlines()[-1][:300] if text.strip() else f"rc {done.returncode}"}


def table(records: list[dict]) -> str:
  lines = ["| setup | length | step s | tokens/s | compile s | peak GB | peak - base GB | "
           "x per doubling | finite |", "|---|---|---|---|---|---|---|---|---|"]
  previous: dict[str, float] = {}
  for r in records:
    if r["status"] != "ok":
      lines.append(f"| {r['setup']} | {r['length']:,} | {r['status'].upper()} | | | | | | |")
      continue
    grown = (r["peak_bytes"] - r["base_bytes"]) / 1e9
    ratio = previous.get(r["setup"])
    ratio_text = f"{grown / ratio:.2f}" if ratio else ""
    previous[r["setup"]] = grown
    lines.append(f"| {r['setup']} | {r['length']:,} | {r['step_s']:.2f} | "
                 f"{r['length'] / r['step_s']:,.0f} | {r['compile_s']:.1f} | "
                 f"{r['peak_bytes'] / 1e9:.2f} | {grown:.2f} | {ratio_text} | "
                 f"{'yes' if r['finite'] else 'NO'} |")
  return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
  from benchmarks import lra_speed_plot
  rows = [{"kind": r["setup"], "length": r["length"], "status": r["status"],
           "steps_per_s": 1.0 / r["step_s"] if r["status"] == "ok" else None,
           "peak_gb": r["peak_bytes"] / 1e9 if r["status"] == "ok" else None,
           "batch": 1, "setup": "band char LM (enwik8 small)"} for r in records]
  lra_speed_plot.plot_lengths(rows, path)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--setups", default=",".join(SETUPS),
                      help=f"comma-separated, of: {', '.join(SETUPS)}")
  parser.add_argument("--min_length", type=int, default=16384)
  parser.add_argument("--max_length", type=int, default=262144)
  parser.add_argument("--steps", type=int, default=2, help="timed steps per point")
  parser.add_argument("--timeout", type=float, default=1200, help="seconds per point")
  parser.add_argument("--quick", action="store_true", help="a tiny model at 256 and 512")
  parser.add_argument("--out", default=os.path.join(ROOT, "docs", "long_context.jsonl"))
  parser.add_argument("--plot", default=os.path.join(ROOT, "docs", "long_context.png"))
  args = parser.parse_args(argv)
  if args.child:
    spec = json.loads(args.child)
    print("RESULT " + json.dumps(measure(spec["setup"], spec["length"], spec["steps"],
                                         spec["quick"])), flush=True)
    return 0
  setups = [s for s in args.setups.split(",") if s]
  unknown = [s for s in setups if s not in SETUPS]
  if unknown:
    print(f"error: unknown setup {unknown[0]!r}; valid: {', '.join(SETUPS)}.", file=sys.stderr)
    return 2
  if args.min_length < 1 or args.max_length < args.min_length:
    print("error: need 1 <= --min_length <= --max_length.", file=sys.stderr)
    return 2
  lengths = [256, 512] if args.quick else [
      args.min_length * 2 ** i
      for i in range(int(math.log2(args.max_length / args.min_length)) + 1)]
  records = []
  for setup in setups:
    for length in lengths:
      print(f"{setup} at {length:,} tokens ...", file=sys.stderr, flush=True)
      r = run_point(setup, length, args.steps, args.quick, args.timeout)
      records.append(r)
      with open(args.out, "a") as f:
        f.write(json.dumps(r) + "\n")
      if r["status"] != "ok":
        break
  print(table(records))
  if args.plot:
    plot(records, args.plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())
