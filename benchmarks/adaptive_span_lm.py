"""Adaptive attention span on a character LM at a CPU size: the learned spans per layer, the
bits per character beside the same model at fixed full spans, and the step time the learned
spans buy.

Two `lra run enwik8 --size small --attention adaptive_span` runs at one length L with S = L
(on the fallback corpus unless enwik8.zip is in the manual folder), one phase:

- `adaptive`: spans learned from `--span_init` (the paper starts at 0) under the L1 term;
- `fixed`: `train_span=false` with every span at S: the same model, nothing learned about spans
  (all keys up to S at weight 1, the ramp beyond).

From the adaptive run's metrics.jsonl it prints the mean and max span and the band window per
layer over the run (the paper's Figure 3 reports the final spans per layer) and how many window
sets the trainer compiled; from both results.json the validation and test bits per character.
Then, in this process, it times the train step of the same model with each set of windows the
adaptive run went through and with the full window S + R (the fixed model's), the sets taken in
turn (`--reps` each): the step time as the spans shrink (it depends on the windows, not on the
span values).

    .venv/bin/python benchmarks/adaptive_span_lm.py --out /tmp/adaptive_span_lm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
  sys.path[0] = ROOT                               # benchmarks/ would shadow the package
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from lra.rundir import RunDir  # noqa: E402


def overrides(args, variant: str) -> list[tuple[str, str]]:
  """The `--config.x=y` overrides of one run (both runs share all but the span's)."""
  n = args.length
  out = [("phases", "()"), ("num_train_steps", str(args.steps)),
         ("data.max_length", str(n)), ("data.eval_length", str(n)),
         ("data.eval_context", str(n // 2)), ("batch_size", str(args.batch)),
         ("learning_rate", repr(args.lr)), ("warmup_steps", str(args.steps // 10)),
         ("log_every", str(args.log_every)), ("eval_every", str(args.steps)),
         ("checkpoint_every", str(args.steps)), ("seed", str(args.seed)),
         ("model.attention.max_span", str(n)), ("model.attention.penalty", repr(args.penalty)),
         ("model.pos_emb", args.pos_emb)]
  if variant == "fixed":
    out += [("model.attention.span_init", str(n)), ("model.attention.train_span", "false")]
  else:
    out += [("model.attention.span_init", repr(args.span_init))]
  return out


def command(args, variant: str) -> list[str]:
  lra = os.path.join(os.path.dirname(sys.executable), "lra")
  return ([lra, "run", "enwik8", "--size", "small", "--attention", "adaptive_span",
           "--workdir", os.path.join(args.out, variant), "--config.progress=false"]
          + [f"--config.{k}={v}" for k, v in overrides(args, variant)])


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def span_table(records: list[dict]) -> tuple[list[int], list[list[tuple[float, float, float]]]]:
  """Steps and, per step, per layer (mean span, max span, window) from the train records."""
  steps, rows = [], []
  for r in records:
    if r.get("split") != "train" or "span_mean_0" not in r:
      continue
    layers = sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("span_mean_"))
    steps.append(int(r["step"]))
    rows.append([(r[f"span_mean_{i}"], r[f"span_max_{i}"], r[f"span_window_{i}"])
                 for i in layers])
  return steps, rows


def time_windows(args, sets: list[list[int]]) -> list[dict]:
  """Seconds per train step of the same model with each set of per-layer windows, the sets
  taken in turn `args.reps` times (medians)."""
  import jax

  import configs
  from lra import mesh as mesh_lib, preflight, train

  config = configs.build_config("enwik8", attention="adaptive_span", size="small",
                                overrides=overrides(args, "adaptive"))
  trainer = train.Trainer(config)
  paths = list(trainer.span_layers)
  options = [tuple(zip(paths, (int(w) for w in ws))) for ws in sets]
  abstract = preflight.abstract_batch(trainer.task, config.data, int(config.batch_size),
                                      trainer.mesh, "train")
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(1, trainer.task.vocab_size, v.shape).astype(v.dtype)
           for k, v in abstract.items()}
  batch = mesh_lib.global_batch(batch, trainer.mesh)
  state = trainer.state
  for w in options:                                         # compile each set first
    state, _ = trainer.train_step(state, batch, trainer.rest, windows=w)
  jax.block_until_ready(state)
  times = [[] for _ in options]
  for _ in range(args.reps):
    for i, w in enumerate(options):
      t0 = time.perf_counter()
      state, sums = trainer.train_step(state, batch, trainer.rest, windows=w)
      jax.block_until_ready(sums)
      times[i].append(time.perf_counter() - t0)
  return [{"windows": list(ws), "seconds": float(np.median(t))} for ws, t in zip(sets, times)]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="/tmp/adaptive_span_lm", help="the two runs' workdirs")
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--length", type=int, default=512, help="L, and the largest span S")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--penalty", type=float, default=2e-6, help="the L1 weight lambda")
  p.add_argument("--span_init", type=float, default=0.0, help="the adaptive spans' start")
  p.add_argument("--pos_emb", default="sinusoidal", choices=("sinusoidal", "relative"),
                 help="positions: sinusoids added to the input, or Transformer-XL's relative "
                      "ones (the paper's model has relative positions)")
  p.add_argument("--log_every", type=int, default=50)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--reps", type=int, default=20, help="timed steps per window set")
  p.add_argument("--reuse", action="store_true",
                 help="take the runs already finished in --out instead of running them again")
  p.add_argument("--json", help="also write the numbers to this file")
  args = p.parse_args(argv)
  if args.steps < 1 or args.length < 8 or args.batch < 1 or args.reps < 1:
    p.error("--steps, --batch and --reps must be positive and --length at least 8.")

  out = {"settings": vars(args), "runs": {}}
  for variant in ("adaptive", "fixed"):
    cmd = command(args, variant)
    print("$ lra " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    done = RunDir(os.path.join(args.out, variant)).results
    if not (args.reuse and os.path.exists(done)):
      subprocess.run(cmd, check=True, cwd=ROOT)
    with open(done) as f:
      res = json.load(f)
    out["runs"][variant] = {
        "wall_s": round(time.perf_counter() - t0, 1),
        "validation_bpc": res["final_validation_bpc"],
        "test_bpc": res["final_test_bpc"],
        "window_sets": res.get("span_window_sets"),
        "results": {k: v for k, v in res.items() if isinstance(v, (int, float, str))}}

  steps, rows = span_table(read_jsonl(RunDir(os.path.join(args.out, "adaptive")).metrics))
  out["spans"] = {"steps": steps, "per_layer": rows}
  print(f"\nAdaptive spans per layer (mean / max tokens, window), S = {args.length}, R = 32:")
  print("| step | " + " | ".join(f"layer {i}" for i in range(len(rows[0]))) + " |")
  print("|---|" + "---|" * len(rows[0]))
  shown = sorted(set([0, len(steps) - 1] + list(range(0, len(steps), max(1, len(steps) // 8)))))
  for j in shown:
    print(f"| {steps[j]} | " + " | ".join(f"{m:.1f} / {x:.1f} ({int(w)})"
                                          for m, x, w in rows[j]) + " |")

  print("\n| run | validation bpc | test bpc | window sets compiled | wall s |")
  print("|---|---|---|---|---|")
  for name, r in out["runs"].items():
    print(f"| {name} | {r['validation_bpc']:.4f} | {r['test_bpc']:.4f} | "
          f"{r['window_sets']} | {r['wall_s']} |")
  gap = out["runs"]["adaptive"]["validation_bpc"] - out["runs"]["fixed"]["validation_bpc"]
  print(f"adaptive - fixed validation bpc: {gap:+.4f}")

  # The step time of every set of windows the run went through, and of the full window S + R
  # (the fixed model's): the same model, the sets taken in turn.
  sets, first = [], {}
  for step, row in zip(steps, rows):
    ws = [int(w) for _, _, w in row]
    if ws not in sets:
      sets.append(ws)
      first[tuple(ws)] = step
  full = [args.length + 32] * len(rows[0])
  timing = time_windows(args, sets + [full])
  out["timing"] = timing
  base = timing[-1]["seconds"]
  print(f"\nTrain step of the same model by window set (median of {args.reps}, taken in turn):")
  print("| windows per layer | first logged at step | ms per step | full / this |")
  print("|---|---|---|---|")
  for t in timing:
    at = first.get(tuple(t["windows"]), "fixed model")
    print(f"| {t['windows']} | {at} | {t['seconds'] * 1e3:.1f} | {base / t['seconds']:.2f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
