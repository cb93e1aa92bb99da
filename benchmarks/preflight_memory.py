"""How close the preflight's memory estimate (`lra.preflight`) is to the memory a run takes.

Each config runs in its own process on the CPU (one device): the preflight compiles its train
and eval steps on abstract inputs and estimates the peak bytes per device; then, from the
resident set size (RSS) of that moment (jax started, the programs compiled, no array of the run
allocated), the process allocates the train state and a random batch of each kind, runs a few
train steps and one eval step with the compiled programs, and reads its peak RSS (VmHWM from
/proc/self/status, reset through /proc/self/clear_refs after the state is built so that the
initialisation's own compilation is not counted, and with malloc_trim before each reading).
Measured = peak RSS - RSS before the state; both sides count the state, the batches, the
temporaries and the outputs, neither counts Python, jax or the compiled code. The table: config,
estimate, measured, measured / estimate.

  .venv/bin/python benchmarks/preflight_memory.py            # the seven configs, about 6 minutes
  .venv/bin/python benchmarks/preflight_memory.py --steps 2 --only listops-small-dense

`--cache` times the persistent compile cache instead: `lra run listops --size small
--config.num_train_steps=5` (data prepared beforehand; `--attention` picks the kind) in fresh
workdirs: with an empty cache folder, then with the one that run filled, the same two with
`--no_preflight`, and with `--no_compile_cache` (with and without the preflight), each
`--repeats` times; `--size base` runs the LRA base model at length 2,000 instead (batch 8, and
fewer examples, so that the test evaluation stays short). It prints the median seconds from the
command's start to the start and to the end of its first train step (the command runs in a
child that notes when its first step is called and when it returns) and to its exit.

  .venv/bin/python benchmarks/preflight_memory.py --cache --repeats 3
  .venv/bin/python benchmarks/preflight_memory.py --cache --repeats 3 --size base --attention band
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (task, size, attention, overrides). "mid": the LRA base model (4 layers, 512 wide,
# 8 heads) at a length and batch that fit a 24 GB, 2-core machine and step in a few seconds.
CONFIGS = {
    "listops-small-dense": ("listops", "small", "dot_product", {}),
    "listops-mid-dense": ("listops", "base", "dot_product",
                          {"data.max_length": 1000, "batch_size": 8, "eval_batch_size": 8}),
    "listops-mid-band": ("listops", "base", "band",
                         {"data.max_length": 2000, "batch_size": 8, "eval_batch_size": 8}),
    "listops-mid-dense-remat": ("listops", "base", "dot_product",
                                {"data.max_length": 1000, "batch_size": 8, "eval_batch_size": 8,
                                 "remat": "block"}),
    "listops-mid-band-remat": ("listops", "base", "band",
                               {"data.max_length": 2000, "batch_size": 8, "eval_batch_size": 8,
                                "remat": "block"}),
    "text-small-favor": ("text", "small", "favor", {}),
    "text-mid-favor": ("text", "base", "favor",
                       {"data.max_length": 2000, "batch_size": 8, "eval_batch_size": 8}),
}

CHILD = textwrap.dedent("""
    import ctypes, gc, json, re, sys
    import jax, numpy as np
    import configs
    from lra import mesh as mesh_lib, preflight

    def status(field):
      with open("/proc/self/status") as f:
        return int(re.search(field + r":\\s+(\\d+) kB", f.read()).group(1)) * 1024

    def settle():
      gc.collect()
      ctypes.CDLL("libc.so.6").malloc_trim(0)

    task, size, attention, overrides, steps = json.loads(sys.argv[1])
    config = configs.build_config(task, size=size, attention=attention,
                                  overrides=[(k, str(v)) for k, v in overrides.items()])
    report = preflight.check(config)
    settle()
    before = status("VmRSS")
    trainer = report.trainer.allocate()
    rng = np.random.default_rng(0)

    def batch(split, size):
      spec = trainer.task.batch_spec(config.data, size, split)
      out = {}
      for name, leaf in spec.items():
        high = {"targets": trainer.task.num_classes, "mask": 2, "weights": 2}.get(
            name, trainer.task.vocab_size)
        out[name] = rng.integers(0, high, leaf.shape).astype(leaf.dtype)
      return mesh_lib.global_batch(out, trainer.mesh)

    train_batch = batch("train", int(config.batch_size))
    eval_batch = batch("test", int(config.eval_batch_size))
    state = trainer.state
    settle()
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")                      # the peak RSS starts again from here
    for _ in range(steps):
      state, sums = report.train.compiled(state, train_batch, trainer.rest)
      jax.block_until_ready(sums)
    sums = report.eval.compiled(state["params"], eval_batch, trainer.rest)
    jax.block_until_ready(sums)
    print("RESULT " + json.dumps({"estimate": report.peak, "train": report.train_peak,
                                  "eval": report.eval_peak,
                                  "measured": status("VmHWM") - before}), flush=True)
""")


def run(name: str, steps: int) -> dict:
  task, size, attention, overrides = CONFIGS[name]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)   # one CPU device, as `lra run` has
  done = subprocess.run([sys.executable, "-c", CHILD,
                         json.dumps([task, size, attention, overrides, steps])],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
  if done.returncode or not lines:
    raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT "):])


# argv: start time, then the `lra` command line. Prints FIRST_STEP <seconds since start> when the
# first train step has returned (with its results ready).
TIMED_RUN = textwrap.dedent("""
    import os, sys, time
    start = float(sys.argv[1])
    import jax
    from lra import train
    init = train.Trainer.__init__
    def timed_init(self, config):
      init(self, config)
      step_fn = self.train_step
      def step(*args):
        if self.__dict__.get("_timed") is None:
          print(f"STEP_START {time.time() - start:.3f}", flush=True)
        out = step_fn(*args)
        if self.__dict__.get("_timed") is None:
          jax.block_until_ready(out)
          self._timed = True
          print(f"FIRST_STEP {time.time() - start:.3f}", flush=True)
          if os.environ.get("STOP_AFTER_FIRST_STEP"):
            os._exit(0)
        return out
      self.train_step = step
    train.Trainer.__init__ = timed_init
    from launch import cli
    print(f"IMPORTED {time.time() - start:.3f}", flush=True)
    sys.exit(cli.main(sys.argv[2:]))
""")


def timed_command(argv: list[str], env: dict) -> tuple[float, float, float, float]:
  """Seconds from the start of `lra` + argv to: the end of its first train step, its exit, the
  end of its imports (the modules `lra run` needs, loaded before it starts), the start of its
  first train step."""
  start = time.time()
  done = subprocess.run([sys.executable, "-c", TIMED_RUN, repr(start), *argv], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=1800)
  total = time.time() - start
  marks = dict(l.split() for l in done.stdout.splitlines()
               if l.startswith(("FIRST_STEP ", "IMPORTED ", "STEP_START ")))
  if done.returncode or "FIRST_STEP" not in marks:
    raise RuntimeError(f"{argv} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
  return (float(marks["FIRST_STEP"]), total, float(marks["IMPORTED"]),
          float(marks["STEP_START"]))


# With --size base: fewer examples, so that the final test evaluation does not dominate the
# time to exit, and batch 8 (the LRA base model and length; batch 32 with band attention holds
# 18 GB of this machine's 24).
BASE_DATA = ["--config.data.num_train=256", "--config.data.num_val=64",
             "--config.data.num_test=64"]
BASE_BATCH = ["--config.batch_size=8", "--config.eval_batch_size=8"]


def cache_table(repeats: int, attention: str, size: str = "small", only_cache: bool = False
                ) -> None:
  """Cold and warm cache, with and without the preflight and the cache, `repeats` times each
  (`only_cache`: the first two)."""
  root = tempfile.mkdtemp(prefix="lra-cache-bench-")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "LRA_DATA": os.path.join(root, "data")}
  env.pop("XLA_FLAGS", None)
  data = BASE_DATA if size == "base" else []
  run = ["run", "listops", "--size", size, "--attention", attention,
         "--config.num_train_steps=5", "--config.progress=false", *data,
         *(BASE_BATCH if size == "base" else [])]
  subprocess.run([sys.executable, "-m", "launch.cli", "data", "prepare", "listops", "--size",
                  size, *data], cwd=ROOT, env=env, check=True, capture_output=True)
  # name -> (cache folder, flags): "a" is filled by the first run and read by the second
  kinds = {"cold cache": ("a", []), "warm cache": ("a", []),
           "cold cache, --no_preflight": ("b", ["--no_preflight"]),
           "warm cache, --no_preflight": ("a", ["--no_preflight"]),
           "--no_compile_cache": ("none", ["--no_compile_cache"]),
           "--no_compile_cache --no_preflight": ("none", ["--no_compile_cache",
                                                          "--no_preflight"])}
  if only_cache:   # and each run stops after its first step
    kinds = dict(list(kinds.items())[:2])
    env["STOP_AFTER_FIRST_STEP"] = "1"
  rows: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in kinds}
  for r in range(repeats):
    for k, (name, (cache_name, extra)) in enumerate(kinds.items()):
      cache = {**env, "XDG_CACHE_HOME": os.path.join(root, f"cache{r}-{cache_name}")}
      workdir = os.path.join(root, f"w{r}-{k}")
      rows[name].append(timed_command(run + ["--workdir", workdir] + extra, cache))
  print(f"lra {' '.join(run)} --workdir (fresh), {repeats} times each; median seconds")
  print(f"{'run':<34} {'to the start of step 1':>23} {'to its end':>11} "
        f"{'(after the imports)':>20} {'to exit':>8}")
  start, first, working, total = {}, {}, {}, {}
  for name, times in rows.items():
    start[name] = statistics.median(t[3] for t in times)
    first[name] = statistics.median(t[0] for t in times)
    working[name] = statistics.median(t[0] - t[2] for t in times)
    total[name] = statistics.median(t[1] for t in times)
    print(f"{name:<34} {start[name]:23.2f} {first[name]:11.2f} {working[name]:20.2f} "
          f"{'-' if only_cache else f'{total[name]:.2f}':>8}")
  cold, warm = "cold cache", "warm cache"
  print(f"first step starts {start[cold] / start[warm]:.1f}x sooner with the warm cache and "
        f"ends {first[cold] / first[warm]:.1f}x sooner ({working[cold] / working[warm]:.1f}x "
        f"counted from the end of the imports)")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=3, help="train steps per config")
  parser.add_argument("--only", nargs="*", default=None, choices=sorted(CONFIGS),
                      help="run only these configs")
  parser.add_argument("--cache", action="store_true",
                      help="time the compile cache instead (see above)")
  parser.add_argument("--only_cache", action="store_true",
                      help="with --cache: only the cold and the warm cache runs")
  parser.add_argument("--repeats", type=int, default=3, help="runs of each kind with --cache")
  parser.add_argument("--attention", default="dot_product", help="the kind --cache runs")
  parser.add_argument("--size", default="small", choices=("small", "base"),
                      help="the ListOps config --cache runs (base: the LRA model and length, "
                           "%s)" % " ".join(BASE_DATA + BASE_BATCH))
  args = parser.parse_args(argv)
  if args.cache:
    cache_table(args.repeats, args.attention, args.size, args.only_cache)
    return 0
  print(f"{len(args.only or CONFIGS)} configs, {args.steps} train steps and one eval step each")
  print(f"{'config':<22} {'estimate GB':>12} {'(train':>8} {'eval)':>7} {'measured GB':>12} "
        f"{'measured/estimate':>18}")
  worst = 0.0
  for name in args.only or CONFIGS:
    r = run(name, args.steps)
    ratio = r["measured"] / r["estimate"]
    worst = max(worst, abs(ratio - 1))
    print(f"{name:<22} {r['estimate'] / 1e9:12.3f} {r['train'] / 1e9:8.3f} {r['eval'] / 1e9:7.3f} "
          f"{r['measured'] / 1e9:12.3f} {ratio:18.2f}", flush=True)
  print(f"largest difference: {worst:.0%}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
