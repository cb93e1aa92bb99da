"""The compiled training step of one task config, timed on a random batch, and where its time
goes (`--ops`: the XLA operations of a profiled step, longest first, with their output shapes).

  python benchmarks/task_step.py mqar --arg attention=band,size=small,width=64 [--steps 60]
                                 [--config.x=y ...] [--ops 20]

The batch has the shapes of the task's training batch (`Task.batch_spec`), random token ids,
random answer positions and a mask of about 6% ones; the numbers are the step's time, not a
training run's. Prints one line: milliseconds per step (the mean over `--steps` after 3 warm-up
steps), steps per second and the first step's time (compiling). With `--ops N`, a profile of 5
steps follows: the N operations with the most time per step. Pin it to one core with
`taskset -c 0` to time it as `lra sweep --parallel 2` runs each run on the 2-core machine.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def random_batch(spec, seed: int = 0) -> dict:
  import numpy as np
  rng = np.random.default_rng(seed)
  batch = {}
  for name, s in spec.items():
    if name == "answers":
      length = spec["inputs"].shape[1]
      batch[name] = np.sort(rng.integers(0, length, s.shape), axis=1).astype(s.dtype)
    elif name == "mask":
      batch[name] = (rng.random(s.shape) < 0.06).astype(s.dtype)
    elif name == "weights":
      batch[name] = np.ones(s.shape, s.dtype)
    else:
      batch[name] = rng.integers(1, 500, s.shape).astype(s.dtype)
  return batch


def op_table(trace_dir: str, steps: int, hlo_text: str, top: int) -> list[str]:
  """The `top` operations of a profile with the most time per step, with their output shape."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  events = json.load(gzip.open(files[-1]))
  events = events["traceEvents"] if isinstance(events, dict) else events
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      total[e["name"]] += e["dur"]
  rows = []
  for name, us in total.most_common():
    match = re.search(rf"\n\s*%?{re.escape(name)} = (\S+?)(?:\{{| )", hlo_text)
    if match is None:
      continue                                   # host-side events (dispatch, waiting)
    rows.append(f"{us / steps / 1000:8.2f} ms  {name}  {match.group(1)}")
    if len(rows) == top:
      break
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("task")
  parser.add_argument("--arg", default="")
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--ops", type=int, default=0)
  args, rest = parser.parse_known_args(argv)
  overrides = []
  for item in rest:
    if not item.startswith("--config.") or "=" not in item:
      parser.error(f"unknown argument {item!r}: give config fields as --config.x=y")
    key, value = item[len("--config."):].split("=", 1)
    overrides.append((key, value))
  if args.steps < 1:
    parser.error("--steps must be at least 1")

  import jax

  import configs
  from lra import train
  size = dict(p.split("=", 1) for p in args.arg.split(",") if p).get("size", "small")
  config = configs.build_config(args.task, size=size, arg=args.arg or None, overrides=overrides)
  trainer = train.Trainer(config)
  spec = trainer.task.batch_spec(config.data, int(config.batch_size))
  batch = random_batch(spec)
  state = trainer.state
  start = time.perf_counter()
  state, sums = trainer.train_step(state, batch, trainer.rest)
  jax.block_until_ready(sums)
  compile_s = time.perf_counter() - start                           # the first step compiles
  for _ in range(3):
    state, sums = trainer.train_step(state, batch, trainer.rest)
  jax.block_until_ready(sums)
  start = time.perf_counter()
  for _ in range(args.steps):
    state, sums = trainer.train_step(state, batch, trainer.rest)
  jax.block_until_ready(sums)
  step_s = (time.perf_counter() - start) / args.steps
  print(f"{args.task} {args.arg or size}: {1000 * step_s:.1f} ms/step, {1 / step_s:.2f} steps/s "
        f"({args.steps} steps), first step {compile_s:.1f} s", flush=True)
  if args.ops:
    with tempfile.TemporaryDirectory() as trace_dir:
      jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
      for _ in range(5):
        state, sums = trainer.train_step(state, batch, trainer.rest)
      jax.block_until_ready(sums)
      jax.profiler.stop_trace()
      hlo = trainer.train_step.lower(state, batch, trainer.rest).compile().as_text()
      print("\n".join(op_table(trace_dir, 5, hlo, args.ops)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
