"""Training steps of several attention kinds taken in turn in one process: paired step ratios.

`lra_speed.py` measures every point in its own process, as the efficiency study asks. On a
shared 2-core machine the same program's step time moves by 5-10% between processes and more
between days (band's 4K step was 1.65x identity's in the grid of one day and 1.45x on another),
which is enough to carry a kind across a 1.5x boundary. This script compiles the train step of
every kind given (and of `identity`, the attention-free lower bound) in one process, allocates
them all, and then runs rounds: each round takes one step of every kind, in the same order.
A slow spell of the machine then slows every kind of that round alike, and each kind's ratio to
identity is computed per round (its step over identity's step of the same round) before the
median over rounds is taken.

The points are those of `lra_speed.py` (the Text `base` model, the kinds' defaults for the
length, random byte batches without padding: `benchmarks/lra_step.py`). Peak memory is not
reported: one process holds every point; use `lra_speed.py` for memory.

  .venv/bin/python benchmarks/lra_interleaved.py --kinds band,bigbird,favor,linear,linformer \\
      --length 4096 --batch 8 --rounds 5
  .venv/bin/python benchmarks/lra_interleaved.py --quick          # smoke run, < 1 minute
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:   # benchmarks/attention.py shadows
  sys.path[0] = ROOT                                            # the `attention` package
elif ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import lra_speed  # noqa: E402
from benchmarks.lra_step import IDENTITY, Point  # noqa: E402
from lra import host_memory  # noqa: E402

QUICK = dict(kinds="band,linear", length=128, batch=2, rounds=2)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=__doc__.split("\n", 2)[2])
  p.add_argument("--kinds", default=None,
                 help="comma-separated kinds; identity is always added and runs first")
  p.add_argument("--length", type=int, default=None, help="sequence length (4096)")
  p.add_argument("--batch", type=int, default=None, help="batch size (8)")
  p.add_argument("--rounds", type=int, default=None, help="timed rounds (5)")
  p.add_argument("--warmup", type=int, default=1, help="untimed rounds after compiling (1)")
  p.add_argument("--out", default=None, help="also append one JSON line per kind to this file")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: 1-layer 32-wide model, band and linear, length 128, batch 2, "
                      "2 rounds")
  args = p.parse_args(argv)
  defaults = QUICK if args.quick else dict(kinds="band,bigbird,favor,linear,linformer",
                                           length=4096, batch=8, rounds=5)
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  return args


def check(args) -> str | None:
  """The first problem with the arguments, as one line, or None."""
  valid = lra_speed.all_kinds()
  kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
  unknown = [k for k in kinds if k not in valid]
  if unknown or not kinds:
    return f"unknown attention kind {unknown[0] if unknown else args.kinds!r}; valid: " \
           f"{', '.join(valid)}."
  for name in ("length", "batch", "rounds"):
    if getattr(args, name) < 1:
      return f"--{name} must be a positive integer, got {getattr(args, name)}."
  if args.warmup < 0:
    return f"--warmup must be 0 or more, got {args.warmup}."
  return None


def _seconds(t: float) -> str:
  return f"{t:.2f}" if t >= 0.1 else f"{t:.4f}"


def table(rows: list[dict], length: int, batch: int) -> str:
  out = [f"Text base train steps at length {length}, batch {batch}, taken in turn in one "
         f"process; ratio = the kind's step / identity's step of the same round.", "",
         "| kind | median step s | min step s | vs identity (median) | vs identity (range) "
         "| compile s |", "|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    if r["status"] != "ok":
      out.append(f"| {r['kind']} | {r['status']}: {r['detail']} | | | | |")
      continue
    out.append(f"| {r['kind']} | {_seconds(r['step_s'])} | {_seconds(min(r['times_s']))} | "
               f"{r['vs_identity']:.2f}x | {min(r['ratios']):.2f}-{max(r['ratios']):.2f}x | "
               f"{r['compile_s']:.1f} |")
  return "\n".join(out)


def main(argv=None) -> int:
  host_memory.keep_freed_memory()   # as every `lra` process does (LRA_MALLOC=system: glibc's own)
  args = parse_args(argv)
  problem = check(args)
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  kinds = [IDENTITY] + [k for k in dict.fromkeys(k.strip() for k in args.kinds.split(","))
                        if k and k != IDENTITY]
  points, rows = {}, {}
  for kind in kinds:
    spec = dict(kind=kind, length=args.length, batch=args.batch, quick=args.quick)
    point = Point(spec)
    rows[kind] = dict(point.info, kind=kind, length=args.length, batch=args.batch,
                      setup="quick" if args.quick else "text-base")
    if point.oom:
      rows[kind].update(status="oom", detail=point.oom)
      if kind == IDENTITY:
        print(f"error: the identity step does not fit: {point.oom}", file=sys.stderr)
        return 1
      continue
    point.allocate()
    points[kind] = point
    print(f"compiled {kind} in {point.info['compile_s']:.1f} s", file=sys.stderr, flush=True)
  times = {k: [] for k in points}
  for r in range(args.warmup + args.rounds):
    for kind, point in points.items():
      seconds = point.step()
      if r >= args.warmup:
        times[kind].append(seconds)
    if r >= args.warmup:
      print(f"round {r - args.warmup + 1}/{args.rounds}: " + ", ".join(
          f"{k} {t[-1]:.2f} s" for k, t in times.items()), file=sys.stderr, flush=True)
  date = datetime.datetime.now().isoformat(timespec="seconds")
  for kind, ts in times.items():
    ratios = [t / i for t, i in zip(ts, times[IDENTITY])]
    rows[kind].update(status="ok", times_s=ts, step_s=statistics.median(ts), ratios=ratios,
                      vs_identity=statistics.median(ratios), loss=points[kind].loss(),
                      date=date, machine=lra_speed.machine(), record="interleaved")
  ordered = [rows[k] for k in kinds]
  print(table(ordered, args.length, args.batch))
  if args.out:
    with open(args.out, "a") as f:
      for r in ordered:
        f.write(json.dumps(r) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
