"""Kill soak: `lra run` killed with SIGKILL at random moments (some inside checkpoint saves) and
restarted each time must end bit-identical to an uninterrupted run.

  .venv/bin/python benchmarks/soak_kill.py --kills 20 --workdir /tmp/soak     # ~10 minutes

It trains the ListOps CPU demo (`lra run listops --size small`) with checkpoints every
`--checkpoint_every` steps, once without interruption (the reference) and once under fire: each
attempt is either killed after a random delay of `--min_delay` to `--max_delay` seconds (start-up,
compilation, data loading, training, evaluation or a save, wherever it is), or (every third
attempt) killed inside the save of a step ahead of it, while orbax's temporary folder exists.
After `--kills` kills the run is left to finish. It then compares the checksums saved with the final
checkpoint (every array of the train state), every record of metrics.jsonl (without timings) and
results.json, and prints a table of the attempts and one verdict line.

`DRIVER` (the child that plants faults by monkeypatching, never in library code) is shared with
tests/faults_test.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from lra.rundir import RunDir  # noqa: E402

# argv: fault, step, then the `lra` command line. Faults: none, kill_in_save (SIGKILL while the
# save of `step` is unfinished), disk_full (that save fails with ENOSPC), sigkill / sigterm /
# sigint (after train step `step`), sigint_at_start (once the trainer is built).
DRIVER = textwrap.dedent("""
    import errno, os, signal, sys
    fault, at = sys.argv[1], int(sys.argv[2])
    from orbax.checkpoint._src.path import async_path
    from lra import train
    rename = async_path.rename

    async def faulty_rename(src, dst):
      if f"{os.sep}{at}.orbax-checkpoint-tmp" in str(src):
        if fault == "kill_in_save":
          os.kill(os.getpid(), signal.SIGKILL)
        if fault == "disk_full":
          raise OSError(errno.ENOSPC, "No space left on device", str(dst))
      return await rename(src, dst)
    async_path.rename = faulty_rename

    init = train.Trainer.__init__
    def faulty_init(self, config, plan=None):
      init(self, config, plan)
      if fault == "sigint_at_start":
        os.kill(os.getpid(), signal.SIGINT)
      step_fn = self.train_step
      def step(state, batch, rest):
        state, sums = step_fn(state, batch, rest)
        if int(state["step"]) == at and fault in ("sigkill", "sigterm", "sigint"):
          os.kill(os.getpid(), getattr(signal, fault.upper()))
        return state, sums
      self.train_step = step
    train.Trainer.__init__ = faulty_init

    from launch import cli
    sys.exit(cli.main(sys.argv[3:]))
    """)


def command(workdir: str, extra: list[str]) -> list[str]:
  return ["run", "listops", "--size", "small", "--workdir", workdir, "--config.progress=false",
          *extra]


def start(args: list[str], fault: str = "none", at: int = 0, env: dict | None = None):
  return subprocess.Popen([sys.executable, "-c", DRIVER, fault, str(at), *args], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def final_checksums(workdir: str, steps: int) -> dict:
  with open(os.path.join(RunDir(workdir).checkpoints, str(steps), "data", "metadata")) as f:
    return json.load(f)["checksums"]


def records(workdir: str) -> list[tuple]:
  out = []
  with open(RunDir(workdir).metrics) as f:
    for line in f:
      r = json.loads(line)
      out.append(tuple(sorted((k, v) for k, v in r.items()
                              if k not in ("time", "steps_per_second"))))
  return out


def results(workdir: str) -> dict:
  with open(RunDir(workdir).results) as f:
    r = json.load(f)
  for key in ("wall_seconds_this_run", "train_step_traces"):
    r.pop(key)
  return r


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True, help="holds reference/, soak/ and data/")
  p.add_argument("--kills", type=int, default=20)
  p.add_argument("--steps", type=int, default=800)
  p.add_argument("--checkpoint_every", type=int, default=40)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--min_delay", type=float, default=3.0)
  p.add_argument("--max_delay", type=float, default=16.0)
  a = p.parse_args(argv)
  rng = random.Random(a.seed)
  env = {**os.environ, "LRA_DATA": os.path.join(a.workdir, "data")}
  extra = [f"--config.num_train_steps={a.steps}",
           f"--config.checkpoint_every={a.checkpoint_every}"]
  ref_dir, soak_dir = os.path.join(a.workdir, "reference"), os.path.join(a.workdir, "soak")

  t0 = time.time()
  ref = start(command(ref_dir, extra), env=env)
  out, err = ref.communicate()
  if ref.returncode != 0:
    print(err[-3000:], file=sys.stderr)
    return 1
  duration = time.time() - t0
  print(f"reference run: {duration:.0f} s; {out.strip().splitlines()[-1]}", flush=True)

  rows, kills = [], 0
  saves = list(range(a.checkpoint_every, a.steps, a.checkpoint_every))
  while True:
    folder = RunDir(soak_dir).checkpoints
    done = [int(d) for d in os.listdir(folder) if d.isdigit()] if os.path.isdir(folder) else []
    position = max(done, default=0)               # where the next attempt will resume
    ahead = [step for step in saves if step > position][:3]
    in_save = kills < a.kills and kills % 3 == 2 and bool(ahead)
    at = rng.choice(ahead) if in_save else 0
    proc = start(command(soak_dir, extra), "kill_in_save" if in_save else "none", at, env)
    delay = None
    if kills < a.kills and not in_save:
      delay = rng.uniform(a.min_delay, a.max_delay)
      try:
        proc.wait(timeout=delay)
      except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate()
    resumed = [line for line in out.splitlines() if line.startswith("Resumed")]
    # "-": killed during start-up, before it had restored the checkpoint of step `position`
    start_step = int(resumed[0].rstrip(".").split()[-1]) if resumed else (
        "-" if position else 0)
    how = (f"inside the save of step {at}" if in_save else
           f"after {delay:.1f} s" if delay is not None else "not killed")
    rows.append((len(rows) + 1, how, proc.returncode, start_step))
    print(f"attempt {len(rows)}: {how}, exit {proc.returncode}, resumed at step {start_step}",
          flush=True)
    if proc.returncode == 0:
      break
    if proc.returncode != -signal.SIGKILL:
      print(err[-3000:], file=sys.stderr)
      return 1
    kills += 1

  same_state = final_checksums(soak_dir, a.steps) == final_checksums(ref_dir, a.steps)
  same_metrics = records(soak_dir) == records(ref_dir)
  logged = [dict(r)["step"] for r in records(soak_dir) if dict(r)["split"] == "train"]
  one_each = len(logged) == len(set(logged))
  same_results = results(soak_dir) == results(ref_dir)
  print("\n| attempt | killed | exit status | resumed at step |\n|---|---|---|---|")
  for row in rows:
    print("| " + " | ".join(str(x) for x in row) + " |")
  ok = same_state and same_metrics and one_each and same_results and kills == a.kills
  print(f"\n{kills} kills ({sum('inside' in r[1] for r in rows)} inside saves): final state "
        f"{'identical' if same_state else 'DIFFERENT'}, metrics.jsonl "
        f"{'identical' if same_metrics else 'DIFFERENT'} ({len(logged)} train records, "
        f"{'one per logged step' if one_each else 'DUPLICATES'}), results.json "
        f"{'identical' if same_results else 'DIFFERENT'}: {'PASS' if ok else 'FAIL'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
