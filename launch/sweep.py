"""`lra sweep TASK`: the runs of a config file's sweep, each in its own folder, K at a time.

  lra sweep TASK [--sweep NAME] [--arg k=v,...] [--only k=v,...] --workdir DIR [--parallel K]
                 [--dry_run]
                 [--runner local | --runner tpu --tpu NAME --zone Z ... |
                  --runner slurm --nodes N --gpus_per_node G ...] [--config.x=y ...]

A config file `configs/<task>.py` defines its sweeps as functions of one argument, `add`: `sweep`
is the default, `sweep_<name>` is selected by `--sweep <name>`. Each call
`add(config_arg="attention=band,size=small", seed=1, num_train_steps=200)` is one point: the
`get_config` argument plus config-field overrides (dotted names through `**{"model.dropout": 0.1}`,
or a dict per sub-config: `model={"dropout": 0.1}`). `--arg` items replace or extend every point's
`config_arg`; `--config.x=y` overrides apply to every point, after the point's own. `--only
width=64` keeps the points whose arguments or overrides have every item of the group (exact
values; `seed=0` too); repeated, any group may match (`select`). Points are checked, and folders
named, as in the whole sweep, so a column run alone is the same runs a whole sweep skips later.

Before anything runs, every point's config is resolved and checked exactly as `lra run` would
(`configs.build_config`, `lra.schema`); a bad field, a repeated point (two points with the
same resolved config) or two points with the same folder name end the command with one line and
exit status 2. Point i runs as `lra run TASK --arg ... --workdir DIR/<name> --config.x=y ...`,
where `<name>` is its arguments and overrides, seed last (`attention=band,size=small,seed=1`).

A run whose `results.json` exists (for a staged config, its last phase's) is skipped; any other
is started, and the trainer resumes it from its last checkpoint. Up to `--parallel` runs go at
once, one process each (on the CPU: each on its own share of the sweep's CPUs, lra/cpus.py;
`--no_pin` lets each use all of them), its output appended to `DIR/<name>/log.txt`;
`DIR/<name>/sweep.json` records the command and each attempt's exit status, time and last line. A failed run does not
stop the others; the summary names each failure with the last line of its log. SIGTERM or Ctrl-C
stops the sweep: the runs save a checkpoint and the same command continues later.

`--runner tpu` launches the unfinished points one after another on a TPU pod through
launch/tpu.py (each a whole `lra launch tpu`, with its retries); `--runner slurm` submits each as
its own SLURM job through launch/slurm.py (launch/dispatch.py runs both). The runner's flags
(`--tpu`, `--zone`, `--nodes`, `--env`, ...) pass through; each point's launch files go to
`<launch_dir>/<name>/`. For these runners the folders of the runs are left to `lra run` (no
log.txt or sweep.json), and `--dry_run` prints each point's `lra run` command as a `#` line and
then its gcloud commands or its sbatch command.

DIR may be a bucket (`gs://...`): the sweep's files go through lra.storage like the trainer's.
An object cannot be appended to while a run writes it, so a run's output goes to a local file
(`spool_path`, printed when the run starts) while it runs, and is appended to its `log.txt` in
the bucket when it ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import configs
from launch import dispatch, remote, run_state, slurm, tpu
from launch import train as train_launcher
from launch.run_state import LOG, RECORD
from launch.values import flatten, value_text
from lra import cpus as cpus_lib
from lra import host_memory, signals, storage
from lra import tasks as tasks_lib

_NAME_SAFE = re.compile(r"[^A-Za-z0-9._,=+-]")
_MAX_NAME = 180


@dataclasses.dataclass
class Point:
  """One run of a sweep: its `get_config` argument, its overrides and its folder name."""
  index: int                          # 1-based, in the order `add` was called
  config_arg: str
  overrides: list[tuple[str, str]]    # the point's own, then the command line's
  name: str
  staged_phases: int = 0              # the number of phases of a staged config (0: none)

  def argv(self, task: str, workdir: str) -> list[str]:
    """The `lra run` arguments of this point (without the `lra` itself)."""
    return ["run", task, "--arg", self.config_arg, "--workdir", os.path.join(workdir, self.name),
            *(f"--config.{k}={v}" for k, v in self.overrides)]


def _merge_arg(config_arg: str, extra: str) -> str:
  """`config_arg` with the items of `extra` replacing or extending its own (order kept)."""
  items: dict[str, str] = {}
  for text in (config_arg, extra):
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
      key, _, value = item.partition("=")
      items[key.strip()] = value.strip()
  return ",".join(f"{k}={v}" for k, v in items.items())


def run_name(config_arg: str, overrides: Sequence[tuple[str, str]]) -> str:
  """A readable, filesystem-safe folder name: the arguments, the overrides, the seed last."""
  parts = [p for p in config_arg.split(",") if p]
  parts += [f"{k}={v}" for k, v in overrides if k != "seed"]
  parts += [f"{k}={v}" for k, v in overrides if k == "seed"]
  name = _NAME_SAFE.sub("_", ",".join(p.replace(" ", "") for p in parts)) or "default"
  if len(name) > _MAX_NAME:
    name = f"{name[:_MAX_NAME - 13]}...{hashlib.sha1(name.encode()).hexdigest()[:10]}"
  return name


def sweep_names(module) -> list[str]:
  """The sweeps a config module defines: `default` for `sweep`, NAME for `sweep_NAME`."""
  names = ["default"] if callable(getattr(module, "sweep", None)) else []
  return names + sorted(n[len("sweep_"):] for n in dir(module)
                        if n.startswith("sweep_") and callable(getattr(module, n)))


def sweep_function(task: str, name: str | None) -> Callable[[Callable[..., None]], None]:
  """The sweep `name` (None or "default": `sweep`) of `configs/<task>.py`; raises ValueError
  listing the module's sweeps when it has no such function."""
  module = configs.config_module(task)
  attribute = "sweep" if name in (None, "", "default") else f"sweep_{name}"
  fn = getattr(module, attribute, None)
  if not callable(fn):
    raise ValueError(f"configs/{task}.py has no sweep {name or 'default'!r} (no function "
                     f"{attribute}); its sweeps: {', '.join(sweep_names(module)) or 'none'}.")
  return fn


def expand(task: str, sweep: str | None = None, *, arg: str = "",
           overrides: Sequence[tuple[str, str]] = ()) -> list[Point]:
  """The points of a sweep, each resolved and checked like `lra run` would.

  Raises ValueError (one line, naming the point) for an unknown field or a bad value, a
  repeated point, or two points with the same folder name.
  """
  tasks_lib.check_name(task)
  calls: list[dict[str, Any]] = []
  sweep_function(task, sweep)(lambda **kw: calls.append(kw))
  if not calls:
    raise ValueError(f"the sweep {sweep or 'default'!r} of configs/{task}.py adds no point.")
  points, seen, names = [], {}, {}
  for i, call in enumerate(calls, 1):
    call = dict(call)
    config_arg = _merge_arg(str(call.pop("config_arg", "")), arg)
    given = {k for k, _ in overrides}   # the command line's win over the point's own
    own = [(k, value_text(v)) for k, v in flatten(call).items() if k not in given]
    name = run_name(config_arg, own)
    where = f"sweep point {i} ({name})"
    try:
      config = configs.build_config(task, arg=config_arg, overrides=[*own, *overrides])
      train_launcher.check_config(config)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    text = config.to_json_best_effort(sort_keys=True)
    if text in seen:
      raise ValueError(f"{where} repeats sweep point {seen[text]}: both resolve to the same "
                       f"config; change or remove one.")
    if name in names:
      raise ValueError(f"{where} has the same folder name as sweep point {names[name]}.")
    seen[text], names[name] = i, i
    points.append(Point(i, config_arg, [*own, *overrides], name,
                        len(config.get("phases") or ())))
  return points


def _items(point: Point) -> dict[str, str]:
  """A point's `key=value` items: its `get_config` arguments, then its overrides."""
  items = {}
  for part in filter(None, (p.strip() for p in point.config_arg.split(","))):
    key, _, value = part.partition("=")
    items[key.strip()] = value.strip()
  items.update((k, str(v)) for k, v in point.overrides)
  return items


def select(points: Sequence[Point], only: Sequence[str], label: str) -> list[Point]:
  """The points matching any `--only` group (each `KEY=VALUE[,KEY=VALUE...]`, every item of a
  group matched exactly by a point's arguments or overrides), numbered again from 1; raises
  ValueError (one line) for an item that is not KEY=VALUE, a key no point has, or no match."""
  if not only:
    return list(points)
  keys = {k for p in points for k in _items(p)}
  groups = []
  for text in only:
    group = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
      key, eq, value = item.partition("=")
      if not eq or not key.strip():
        raise ValueError(f"--only {text}: give KEY=VALUE items, e.g. --only width=64,seed=0.")
      if key.strip() not in keys:
        raise ValueError(f"--only {text}: no point of {label} has {key.strip()!r}; its keys: "
                         f"{', '.join(sorted(keys))}.")
      group[key.strip()] = value.strip()
    if not group:
      raise ValueError("--only: give KEY=VALUE items, e.g. --only width=64,seed=0.")
    groups.append(group)
  chosen = [p for p in points
            if any(all(_items(p).get(k) == v for k, v in g.items()) for g in groups)]
  if not chosen:
    raise ValueError(f"--only {' --only '.join(only)} matches none of the {len(points)} points "
                     f"of {label}; they are named like {points[0].name}.")
  return [dataclasses.replace(p, index=i) for i, p in enumerate(chosen, 1)]


def _write_record(run_dir: str, record: dict[str, Any]) -> None:
  storage.write_text(storage.join(run_dir, RECORD), json.dumps(record, indent=2))


def _note(run_dir: str, text: str) -> None:
  storage.append_text(storage.join(run_dir, LOG),
                      f"[sweep {time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")


def spool_path(run_dir: str) -> str:
  """Where a run's output goes while it runs: its log.txt, or for a run in a bucket a local
  file (in the temporary folder, named after the run's path) appended to log.txt at its end."""
  if not storage.is_remote(run_dir):
    return storage.join(run_dir, LOG)
  digest = hashlib.sha256(run_dir.encode()).hexdigest()[:16]
  return os.path.join(tempfile.gettempdir(), f"lra-sweep-{digest}.log")


def _send(children: Sequence[subprocess.Popen], signum: int) -> None:
  """Sends `signum` to the children still running."""
  for child in children:
    if child.poll() is None:
      try:
        child.send_signal(signum)
      except ProcessLookupError:
        pass


def _new_record(point: Point, task: str, workdir: str, attempts: list[dict[str, Any]]
                ) -> dict[str, Any]:
  return {"task": task, "config_arg": point.config_arg,
          "overrides": [list(o) for o in point.overrides],
          "staged_phases": point.staged_phases, "command": point.argv(task, workdir),
          "attempts": attempts}


def _start(point: Point, task: str, workdir: str, total: int,
           cpus: tuple[int, ...] | None = None) -> tuple[subprocess.Popen, float]:
  """Starts one run, on the CPUs `cpus` (`lra.cpus`) when given, otherwise on the sweep's."""
  run_dir = storage.join(workdir, point.name)
  argv = point.argv(task, workdir)
  record = run_state.read_record(run_dir)
  if record.get("command") and record["command"] != argv:
    _note(run_dir, "the command differs from the previous attempt's; the trainer resumes with "
                   "the new config and keeps the old one as config.previous.json.")
  _note(run_dir, f"starting: lra {shlex.join(argv)}")
  spool = spool_path(run_dir)
  log = open(spool, "a" if spool == storage.join(run_dir, LOG) else "w")   # noqa: SIM115
  env = None if cpus is None else {**os.environ, cpus_lib.ENV: cpus_lib.format_cpus(cpus)}
  child = subprocess.Popen([sys.executable, "-m", "launch.cli", *argv], stdout=log,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
  log.close()
  attempts = record.get("attempts", [])
  attempt = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(),
             "pid": child.pid}
  if cpus is not None:
    attempt["cpus"] = list(cpus)
  attempts.append(attempt)
  _write_record(run_dir, _new_record(point, task, workdir, attempts))
  where = storage.join(run_dir, LOG)
  where = where if spool == where else f"{spool}, then appended to {where}"
  on = "" if cpus is None else f" on CPU{'s' * (len(cpus) > 1)} {cpus_lib.format_cpus(cpus)}"
  print(f"[{point.index}/{total}] {point.name}: started{on} (log {where})", flush=True)
  return child, time.time()


def _finish(point: Point, workdir: str, rc: int, seconds: float) -> str:
  run_dir = storage.join(workdir, point.name)
  spool = spool_path(run_dir)
  line = run_state.last_line(spool)
  if spool != storage.join(run_dir, LOG):   # a run in a bucket: its output joins its log.txt
    with open(spool, encoding="utf-8", errors="replace") as f:
      storage.append_text(storage.join(run_dir, LOG), f.read())
    os.remove(spool)
  record = run_state.read_record(run_dir)
  if record.get("attempts"):
    record["attempts"][-1].update(exit_code=rc, seconds=round(seconds, 1), last_line=line)
    _write_record(run_dir, record)
  return line


def cpu_slots(parallel: int, pin: bool) -> list[tuple[int, ...]] | None:
  """The CPUs of each of `parallel` runs at once (`lra.cpus.slots` over the sweep's own CPUs),
  or None: one run at a time, `--no_pin`, runs that compute on an accelerator (whose input
  pipelines use the host's cores; `host_memory.cpu_backend`), or a system that cannot restrict
  a process."""
  cpus = cpus_lib.available()
  if not pin or parallel < 2 or cpus is None or not host_memory.cpu_backend():
    return None
  return cpus_lib.slots(parallel, cpus)


def run_points(points: Sequence[Point], task: str, workdir: str, parallel: int,
               pin: bool = True) -> int:
  """Runs the unfinished points, `parallel` at a time, each on its own CPUs unless `pin` is
  false (`cpu_slots`); prints progress and the summary. Returns 0 when every run finished, 130
  when interrupted, 1 when some failed."""
  total = len(points)
  slots = cpu_slots(parallel, pin)
  todo, skipped, busy = [], [], []
  for p in points:
    run_dir = storage.join(workdir, p.name)
    storage.makedirs(run_dir)
    if run_state.finished(run_dir, p.staged_phases):
      _note(run_dir, "finished earlier (results.json exists); skipped.")
      skipped.append(p)
      earlier = run_state.read_record(run_dir).get("command")
      if earlier and earlier != p.argv(task, workdir):
        print(f"[{p.index}/{total}] {p.name}: finished earlier with another command (see its "
              f"{RECORD}); its results are kept: delete the folder to run it again.",
              flush=True)
    elif (pid := run_state.live_pid(run_dir)) is not None:
      _note(run_dir, f"running in process {pid}; skipped.")
      busy.append((p, pid))
    else:
      todo.append(p)
      if not run_state.read_record(run_dir):   # `lra results` lists it as pending until it starts
        _write_record(run_dir, _new_record(p, task, workdir, []))
  runs = f"{total} run{'' if total == 1 else 's'}"
  print(f"Sweep of {task}: {runs} in {workdir}: {len(skipped)} finished earlier "
        f"(skipped), {len(busy)} running elsewhere, {len(todo)} to run, {parallel} at a time"
        + ("." if slots is None else ", each on its own CPUs ("
           + "; ".join(cpus_lib.format_cpus(s) for s in slots) + ")."), flush=True)
  done, failed, stopped = [], [], []
  running: dict[subprocess.Popen, tuple[Point, float]] = {}
  holds: dict[subprocess.Popen, int] = {}   # a running run's slot
  # The first SIGINT/SIGTERM stops starting runs and sends SIGTERM to the running ones (they
  # save a checkpoint); a second Ctrl-C passes SIGINT on (they stop without saving).
  with signals.StopRequest(
      "Sweep interrupted: stopping the running runs (each saves a checkpoint); rerun the same "
      "command to continue.", on_request=lambda _: _send(list(running), signal.SIGTERM),
      on_abort=lambda _: _send(list(running), signal.SIGINT)) as stop:
    pending = list(todo)
    while pending or running:
      while pending and len(running) < parallel and not stop.requested:
        slot = None if slots is None else min(set(range(parallel)) - set(holds.values()))
        child, t0 = _start(p := pending.pop(0), task, workdir, total,
                           None if slot is None else slots[slot])
        running[child] = (p, t0)
        if slot is not None:
          holds[child] = slot
      if stop.requested:
        stopped += pending
        pending = []
      for child in [c for c in running if c.poll() is not None]:
        p, t0 = running.pop(child)
        holds.pop(child, None)
        rc = child.returncode
        seconds = time.time() - t0
        line = _finish(p, workdir, rc, seconds)
        if rc == 0:
          done.append(p)
          print(f"[{p.index}/{total}] {p.name}: finished in {seconds:.0f} s: {line}", flush=True)
        elif rc == 130 or rc < 0:
          stopped.append(p)
          print(f"[{p.index}/{total}] {p.name}: stopped (exit {rc}): {line}", flush=True)
        else:
          failed.append((p, rc, line))
          print(f"[{p.index}/{total}] {p.name}: FAILED (exit {rc}): {line}", flush=True)
      time.sleep(0.1)
  print(f"Summary: {runs}: {len(done)} finished now, {len(skipped)} finished earlier "
        f"(skipped), {len(busy)} running elsewhere, {len(stopped)} stopped, "
        f"{len(failed)} failed.", flush=True)
  for p, pid in busy:
    print(f"  running elsewhere: {p.name} (process {pid})", flush=True)
  for p, rc, line in sorted(failed, key=lambda f: f[0].index):
    log = storage.join(workdir, p.name, LOG)
    print(f"  failed: {p.name} (exit {rc}): {line or 'no output'} [log {log}]", flush=True)
  if stopped:
    stopped.sort(key=lambda p: p.index)
    print("  stopped: " + ", ".join(p.name for p in stopped) + "; rerun the same command to "
          "continue.", flush=True)
  if failed:
    return 1
  return 130 if stopped or stop.requested else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("task", help=f"one of: {', '.join(sorted(tasks_lib.TASKS))}")
  parser.add_argument("--sweep", default=None,
                      help="which sweep of configs/TASK.py: NAME runs sweep_NAME (default: sweep)")
  parser.add_argument("--arg", default="",
                      help="get_config arguments replacing or extending every point's, e.g. "
                           "size=small")
  parser.add_argument("--workdir", required=True,
                      help="the sweep's folder: one sub-folder per run, named after its point")
  parser.add_argument("--parallel", type=int, default=1,
                      help="runs at once (default 1), each on its own share of the CPUs")
  parser.add_argument("--no_pin", action="store_true",
                      help="let every run of --parallel use every CPU (by default each has its "
                           "own: XLA:CPU's threads of runs side by side then do not share cores)")
  parser.add_argument("--runner", default="local", choices=("local", "tpu", "slurm"),
                      help="where the runs go: here (local, --parallel at a time), on a TPU pod "
                           "one after another (tpu), or one SLURM job each (slurm)")
  parser.add_argument("--only", action="append", default=[], metavar="KEY=VALUE[,...]",
                      help="run only the points whose arguments or overrides have every item, "
                           "e.g. --only width=64 (one column of a figure) or --only "
                           "attention=band,seed=0; repeat for more groups")
  parser.add_argument("--dry_run", action="store_true",
                      help="print one `lra run` command per point (and a remote runner's "
                           "commands) and run nothing")
  remote.add_common_options(parser)
  tpu.add_options(parser)
  slurm.add_options(parser)


def run(args: argparse.Namespace, overrides: Sequence[tuple[str, str]]) -> int:
  """`lra sweep`: checks every point, then prints the commands or runs them."""
  if args.parallel < 1:
    print("error: --parallel must be at least 1.", file=sys.stderr)
    return 2
  try:
    runner = dispatch.sweep_runner(args)
    points = expand(args.task, args.sweep, arg=args.arg, overrides=overrides)
    points = select(points, args.only,
                    f"sweep {args.sweep or 'default'!r} of configs/{args.task}.py")
    if runner is not None:
      return dispatch.run_sweep(args, points, *runner)
  except ValueError as e:   # remote.LaunchError too
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.dry_run:
    for p in points:
      print("lra " + shlex.join(p.argv(args.task, args.workdir)))
    done = sum(run_state.finished(storage.join(args.workdir, p.name), p.staged_phases)
               for p in points)
    if done:
      print(f"({done} of {len(points)} have finished in {args.workdir}; a sweep skips them.)",
            file=sys.stderr)
    return 0
  try:
    storage.check_remote(args.workdir)   # a bucket: one line when it cannot be used
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return run_points(points, args.task, args.workdir, args.parallel, pin=not args.no_pin)
