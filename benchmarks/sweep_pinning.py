"""Runs side by side with and without their own CPUs: `lra sweep --parallel 2` against the same
sweep with `--no_pin`, kind by kind, on the points of the MQAR zoology sweep (lra/cpus.py).

  python benchmarks/sweep_pinning.py [--kinds dot_product,band,...] [--width 64] [--steps 300]
                                     [--workdir DIR]

For each kind, the two seeds of its point of `sweep_zoology` at the width run together, once
each way; which way goes first alternates from kind to kind, so that drift of the machine and a
warm compilation cache favour neither. Each run trains `--steps` steps (evaluation only at the
end). Prints a Markdown table: the training steps per second of each run (the trainer's last
progress line: the average over its steps, compiling excluded), their mean each way, the ratio
pinned / not pinned, and the wall time of each sweep (start to end, compiling included).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = ("dot_product", "band", "sparse", "linear", "lsh", "favor")
# The trainer prints "N steps/s", or "N s/step" below one step a second.
RATE = re.compile(r"train: step \d+/\d+ \(100%\), loss [\d.]+, ([\d.]+) (steps/s|s/step), took")


def rates(workdir: str) -> list[float]:
  """The steps per second of each run under `workdir` (its log's last 100% line)."""
  found = []
  for name in sorted(os.listdir(workdir)):
    log = os.path.join(workdir, name, "log.txt")
    if os.path.exists(log):
      hits = RATE.findall(open(log, encoding="utf-8", errors="replace").read())
      if hits:
        value, unit = hits[-1]
        found.append(float(value) if unit == "steps/s" else 1 / float(value))
  return found


def sweep(kind: str, width: int, steps: int, workdir: str, pin: bool) -> tuple[list[float], float]:
  argv = [sys.executable, "-m", "launch.cli", "sweep", "mqar", "--sweep", "zoology",
          "--only", f"attention={kind},width={width}", "--workdir", workdir, "--parallel", "2",
          f"--config.num_train_steps={steps}", f"--config.eval_every={10 * steps}"]
  if not pin:
    argv.append("--no_pin")
  t0 = time.time()
  done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
  seconds = time.time() - t0
  if done.returncode != 0:
    raise SystemExit(f"error: the sweep failed ({' '.join(argv[2:])}):\n{done.stdout[-2000:]}")
  found = rates(workdir)
  if len(found) != 2:
    raise SystemExit(f"error: expected two runs' rates under {workdir}, found {found}")
  return found, seconds


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--kinds", default=",".join(KINDS))
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--workdir", default=None,
                      help="where the runs go (default: a temporary folder, removed at the end)")
  args = parser.parse_args(argv)
  kinds = [k for k in args.kinds.split(",") if k]
  if args.steps < 1 or args.width < 1 or not kinds:
    print("error: --steps and --width must be positive and --kinds name a kind.", file=sys.stderr)
    return 2
  top = args.workdir or tempfile.mkdtemp(prefix="sweep-pinning-")
  rows = []
  try:
    for i, kind in enumerate(kinds):
      got = {}
      for pin in ((True, False) if i % 2 == 0 else (False, True)):
        where = os.path.join(top, "pinned" if pin else "shared", kind)
        got[pin] = sweep(kind, args.width, args.steps, where, pin)
        print(f"{kind}: {'pinned' if pin else 'not pinned'}: steps/s {got[pin][0]}, "
              f"wall {got[pin][1]:.0f} s", file=sys.stderr, flush=True)
      rows.append((kind, got))
  finally:
    if args.workdir is None:
      shutil.rmtree(top, ignore_errors=True)
  print(f"Two runs at once (seeds 0 and 1), width {args.width}, {args.steps} steps each; "
        f"steps/s of each run, and the sweep's wall time.\n")
  print("| kind | not pinned: steps/s | pinned: steps/s | pinned / not pinned | wall not pinned "
        "| wall pinned |")
  print("|---|---|---|---|---|---|")
  for kind, got in rows:
    shared, pinned = statistics.mean(got[False][0]), statistics.mean(got[True][0])
    print(f"| {kind} | {' / '.join(f'{r:.2f}' for r in got[False][0])} | "
          f"{' / '.join(f'{r:.2f}' for r in got[True][0])} | {pinned / shared:.2f}x | "
          f"{got[False][1]:.0f} s | {got[True][1]:.0f} s |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
