"""Matrix-multiply work of one LRA Text `base` training step per attention kind, beside its time.

The efficiency issue's target (every linear-cost kind within 1.5x of the attention-free lower
bound's step time) is a statement about work as much as about kernels: on a machine whose
matrix multiplies run at one rate, a kind whose step does 1.6x the multiply work of the
identity model cannot be within 1.5x of its time. This script counts that work for the same
points `benchmarks/lra_speed.py` times.

For each kind it builds the trainer's own train step (forward, backward, AdamW) exactly as
`lra_speed.py` does (same config, overrides and identity replacement), traces it to a jaxpr,
removes what the outputs do not use (as XLA does: the identity model's query and key
projections), and sums 2 x M x N x K over every `dot_general`, scans counted `length` times.
Nothing is compiled or run, so a point takes seconds. XLA's own `cost_analysis()` is not used:
it counts a loop's body once, whatever its trip count, which undercounts the scanned kernels
(band, flash, block-sparse) by their number of steps.

With `--times FILE` (the JSON lines of `lra_speed.py`) the table adds each kind's measured step
time at the same length and batch, its ratio to identity's, and the multiply rate it implies.

  .venv/bin/python benchmarks/lra_flops.py --length 4096 --batch 8 --times docs/efficiency.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:   # benchmarks/attention.py shadows
  sys.path[0] = ROOT                                            # the `attention` package
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import lra_speed, lra_step  # noqa: E402


def _subjaxprs(eqn):
  """(multiplier, jaxpr) of every jaxpr inside `eqn`'s parameters."""
  from attention import compat
  closed_jaxpr, open_jaxpr = compat.jaxpr_types()
  name, out = eqn.primitive.name, []
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, closed_jaxpr):
        out.append(v.jaxpr)
      elif isinstance(v, open_jaxpr):
        out.append(v)
  if name == "scan":
    return [(eqn.params["length"], j) for j in out]
  if name == "while":
    raise ValueError("a while loop of unknown trip count: its work cannot be counted")
  return [(1, j) for j in out]


def matmul_flops(jaxpr) -> int:
  """2 x M x N x K summed over the `dot_general`s of `jaxpr` (scans times their length; of a
  `cond`'s branches the largest)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
      continue
    subs = _subjaxprs(eqn)
    if eqn.primitive.name == "cond":
      total += max((matmul_flops(j) for _, j in subs), default=0)
    else:
      total += sum(m * matmul_flops(j) for m, j in subs)
  return total


def step_flops(kind: str, length: int, batch: int, quick: bool = False) -> dict:
  """Matrix-multiply FLOPs of one train step of the Text base model with attention `kind`."""
  import jax

  import configs
  from attention import compat
  from lra import preflight, train

  if kind == lra_step.IDENTITY:
    lra_step.identity_attention()
  config = configs.build_config(
      "text", attention=lra_step.DENSE if kind == lra_step.IDENTITY else kind, size="base",
      overrides=lra_step.overrides(kind, length, batch, quick))
  trainer = train.Trainer.abstract(config)
  abstract = preflight.abstract_batch(trainer.task, config.data, batch, trainer.mesh, "train")
  closed = jax.make_jaxpr(trainer.train_step)(trainer.abstract_state(), abstract,
                                              trainer.abstract_rest)
  jaxpr, _ = compat.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  return dict(kind=kind, length=length, batch=batch, gflop=matmul_flops(jaxpr) / 1e9)


def _child(spec: str) -> None:
  """One kind per process: the identity replacement patches the attention layer for good."""
  s = json.loads(spec)
  print(json.dumps(step_flops(s["kind"], s["length"], s["batch"], s["quick"])))


def count_point(kind: str, length: int, batch: int, quick: bool = False) -> dict:
  """`step_flops` in a fresh process (one device, as `lra_speed.py` measures); raises
  RuntimeError with the child's last line when it fails."""
  import subprocess
  spec = json.dumps(dict(kind=kind, length=length, batch=batch, quick=quick))
  done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec],
                        capture_output=True, text=True, env=lra_speed._child_env(False))
  if done.returncode:
    raise RuntimeError((done.stderr.strip().splitlines() or ["?"])[-1])
  return json.loads(done.stdout.strip().splitlines()[-1])


def _measured_times(path: str, length: int, batch: int) -> dict[str, float]:
  times = {}
  for r in lra_speed.read_records(path):
    if r.get("length") == length and r.get("batch") == batch and r.get("status") == "ok":
      times[r["kind"]] = r["step_s"]       # the file's latest record of a point wins
  return times


def table(rows: list[dict], times: dict[str, float]) -> str:
  base = next(r["gflop"] for r in rows if r["kind"] == lra_step.IDENTITY)
  base_s = times.get(lra_step.IDENTITY)
  head = "| kind | matmul GFLOP per step | vs identity |"
  sep = "| --- | ---: | ---: |"
  if times:
    head += " measured step | vs identity | GFLOP/s |"
    sep += " ---: | ---: | ---: |"
  lines = [head, sep]
  for r in sorted(rows, key=lambda r: r["gflop"]):
    line = f"| {r['kind']} | {r['gflop']:,.0f} | {r['gflop'] / base:.2f}x |"
    if times:
      t = times.get(r["kind"])
      line += (f" {t:.2f} s | {t / base_s:.2f}x | {r['gflop'] / t:.0f} |"
               if t is not None and base_s else " - | - | - |")
    lines.append(line)
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--length", type=int, default=4096)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--kinds", default="", help="comma-separated (default: identity, dot_product "
                 "and every registered kind)")
  p.add_argument("--times", default="", help="lra_speed.py JSON lines: add measured step times")
  p.add_argument("--quick", action="store_true", help="the small model of lra_speed --quick")
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    _child(args.child)
    return 0
  known = lra_speed.all_kinds()
  kinds = [k for k in args.kinds.split(",") if k] or known
  bad = [k for k in kinds if k not in known]
  if bad or args.length < 1 or args.batch < 1:
    print(f"lra_flops: unknown kind {bad[0]!r} (known: {', '.join(known)})" if bad else
          "lra_flops: --length and --batch must be positive", file=sys.stderr)
    return 2
  if lra_step.IDENTITY not in kinds:
    kinds.insert(0, lra_step.IDENTITY)
  if args.times and not os.path.exists(args.times):
    print(f"lra_flops: --times {args.times}: no such file", file=sys.stderr)
    return 2
  rows = []
  for kind in kinds:
    try:
      rows.append(count_point(kind, args.length, args.batch, args.quick))
    except RuntimeError as e:
      print(f"{kind}: not counted ({e})", file=sys.stderr)
      continue
    print(f"{kind}: {rows[-1]['gflop']:,.1f} GFLOP", file=sys.stderr, flush=True)
  if not any(r["kind"] == lra_step.IDENTITY for r in rows):
    print("lra_flops: the identity step could not be counted", file=sys.stderr)
    return 1
  times = _measured_times(args.times, args.length, args.batch) if args.times else {}
  print(f"Text base train step, length {args.length}, batch {args.batch}:\n")
  print(table(rows, times))
  return 0


if __name__ == "__main__":
  sys.exit(main())
