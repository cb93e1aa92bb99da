"""`lra launch slurm`: one `lra run` as a SLURM batch job, one jax.distributed process per task.

  lra launch slurm --nodes N [--gpus_per_node G] [--ntasks_per_node T] [--cpus_per_task C]
                   [--partition P] [--time T] [--account A] [--sbatch KEY=VALUE ...] [--requeue]
                   [--python PATH] [--env NAME=VALUE ...] [--launch_dir DIR] [--follow]
                   [--dry_run] -- run TASK [lra run flags]

Writes a batch script to `<launch_dir>/job.sbatch`, asks `sbatch --test-only` whether the cluster
can ever run it (a refusal, such as `--nodes 2` on a one-node cluster, ends the launch with
sbatch's reason in one line, exit 2, instead of a job that pends forever), then submits it with
`sbatch --parsable`. The script asks for N nodes with T tasks each: T is G (one task per GPU)
by default, or 1 on a cluster without GPUs (`--gpus_per_node 0` or omitted; no GPU request is
written then), and `--cpus_per_task` gives each task its cores. `--sbatch KEY=VALUE`
(repeatable; a bare KEY for a flag such as `exclusive`) adds any other `#SBATCH --KEY=VALUE`
(`mem=64G`, `constraint=h100`, `qos=high`, `dependency=afterok:123`). `srun` starts the N x T
processes of one jax.distributed job. Each runs `python -m launch.cli run ...` (the command after
`--`; a SIGTERM during its start-up is held for the run) in this checkout with
`LRA_DISTRIBUTED=1`, so `jax.distributed.initialize()` reads the job
from SLURM's variables (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID,
SLURM_LOCALID: the coordinator is the first node). The checkout, the Python (`--python`, default
this one; checked before submitting), the data and the workdir must be on a filesystem every node
reaches; a relative `--workdir` (or `lra run`'s default one) is made absolute against the folder
the command was typed in, as `lra run` does.

Logs: the job's own lines go to `<launch_dir>/slurm-<ID>.out` and each task's output to
`job<ID>-task<T>.log`, both appended to (`--open-mode=append`), with a line naming the attempt
(`SLURM_RESTART_COUNT` + 1) at the start of each, so a requeued job keeps its earlier attempts.
With `--time`, the batch script signals itself (USR1) two minutes before the limit (a quarter of
the limit when that is under 8 minutes: `--time 1` stops at 45 s), from a timer it starts
itself: SLURM's own warning (`--signal=B:USR1@120`, also written for limits of 10 minutes and
more) is checked every 30 s only, so it may come 30 s early or, within a short limit, not before
the limit at all. On USR1
the script passes SIGTERM to the tasks, which agree on a step, save a checkpoint and stop (`lra
run`'s exit status 130, which the tasks turn into 0 and a note in `job<ID>.stopped`, so that
`--kill-on-bad-exit` spares the tasks still saving). The script reports such a stop as a clean
stop and exits 0 (the job COMPLETED, not FAILED),
and with `--requeue` puts the job back in the queue (`scontrol requeue`) to resume from that
checkpoint; otherwise submitting the same command again resumes it. `--follow` streams the job's
log and task 0's and waits for the job's end, exiting with the job's exit status (Ctrl-C stops
following, not the job). `--dry_run` prints the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import time

from launch import remote

_TIME = re.compile(r"\d+(-\d+)?(:\d+){0,2}")
_WORD = re.compile(r"[A-Za-z0-9_.,:+-]+")
_SBATCH_KEY = re.compile(r"[a-z][a-z0-9-]*")
# sbatch options the launcher writes itself: given through --sbatch they would contradict it.
_OWN = {"nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "partition", "time",
        "account", "output", "open-mode", "signal", "requeue", "job-name", "parsable", "wrap"}
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
          "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
STOPPED = 130   # `lra run`'s exit status after a clean stop (a checkpoint saved)


@dataclasses.dataclass
class Options:
  nodes: int
  gpus_per_node: int = 0
  partition: str | None = None
  time: str | None = None
  account: str | None = None
  python: str = sys.executable
  env: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  ntasks_per_node: int | None = None
  cpus_per_task: int | None = None
  sbatch: list[tuple[str, str | None]] = dataclasses.field(default_factory=list)
  requeue: bool = False

  @property
  def tasks_per_node(self) -> int:
    return self.ntasks_per_node or max(self.gpus_per_node, 1)


FLAGS = {"nodes": "--nodes", "gpus_per_node": "--gpus_per_node", "partition": "--partition",
         "time": "--time", "account": "--account", "python": "--python",
         "ntasks_per_node": "--ntasks_per_node", "cpus_per_task": "--cpus_per_task",
         "sbatch": "--sbatch", "requeue": "--requeue"}


def add_options(parser: argparse.ArgumentParser) -> None:
  g = parser.add_argument_group("SLURM (lra launch slurm, lra sweep --runner slurm)")
  g.add_argument("--nodes", type=int, default=None, help="nodes (required)")
  g.add_argument("--gpus_per_node", type=int, default=None,
                 help="GPUs per node, one task per GPU (default 0: a CPU-only cluster)")
  g.add_argument("--ntasks_per_node", type=int, default=None,
                 help="processes per node (default: the GPUs per node, or 1 without GPUs)")
  g.add_argument("--cpus_per_task", type=int, default=None,
                 help="CPU cores per task (default: the cluster's, often 1)")
  g.add_argument("--partition", default=None, help="the partition (default: the cluster's)")
  g.add_argument("--time", default=None,
                 help="the time limit, e.g. 24:00:00 or 2-00:00 (the run stops cleanly 2 "
                      "minutes before it)")
  g.add_argument("--account", default=None, help="the account to charge")
  g.add_argument("--sbatch", action="append", default=None, metavar="KEY=VALUE",
                 help="any further #SBATCH option (repeatable): mem=64G, constraint=h100, "
                      "qos=high, exclusive, dependency=afterok:123, ...")
  g.add_argument("--requeue", action="store_true", default=None,
                 help="with --time: requeue the job after its clean stop at the time limit")
  g.add_argument("--python", default=None,
                 help=f"the Python the tasks run (default {sys.executable})")


def given_options(args: argparse.Namespace) -> list[str]:
  return [flag for dest, flag in FLAGS.items() if getattr(args, dest, None) is not None]


def sbatch_items(items: list[str] | None) -> list[tuple[str, str | None]]:
  """`--sbatch KEY=VALUE` (or a bare KEY) items, checked; keys take `_` or `-`."""
  out = []
  for item in items or ():
    key, eq, value = item.partition("=")
    key = key.strip().lstrip("-").replace("_", "-")
    if not _SBATCH_KEY.fullmatch(key) or "\n" in value or (eq and not value):
      raise remote.LaunchError(f"--sbatch takes KEY=VALUE or KEY (an sbatch option without its "
                               f"dashes, e.g. mem=64G or exclusive), got {item!r}.")
    if key in _OWN:
      raise remote.LaunchError(f"--sbatch {key}: the launcher writes that option itself; use "
                               f"its own flag (lra launch slurm --help).")
    out.append((key, value if eq else None))
  return out


def check_python(path: str) -> str:
  """The absolute path of an executable `--python`; LaunchError (one line) otherwise."""
  full = os.path.abspath(os.path.expanduser(path))
  if not os.path.isfile(full) or not os.access(full, os.X_OK):
    raise remote.LaunchError(f"--python {path}: no executable there; give the Python of the "
                             f"environment the tasks run (on a filesystem every node reaches).")
  return full


def options(args: argparse.Namespace) -> Options:
  """The checked SLURM options; raises remote.LaunchError (one line)."""
  if args.nodes is None:
    raise remote.LaunchError("the SLURM launcher needs --nodes N (and --gpus_per_node G on a "
                             "cluster with GPUs).")
  if args.nodes < 1:
    raise remote.LaunchError(f"--nodes must be at least 1, got {args.nodes}.")
  for flag, value, least in (("--gpus_per_node", args.gpus_per_node, 0),
                             ("--ntasks_per_node", args.ntasks_per_node, 1),
                             ("--cpus_per_task", args.cpus_per_task, 1)):
    if value is not None and value < least:
      raise remote.LaunchError(f"{flag} must be at least {least}, got {value}.")
  if args.time is not None and not _TIME.fullmatch(args.time):
    raise remote.LaunchError(f"--time takes SLURM's forms (MINUTES, HH:MM:SS, D-HH:MM, ...), "
                             f"got {args.time!r}.")
  if args.requeue and args.time is None:
    raise remote.LaunchError("--requeue requeues the job at its time limit: give --time too.")
  for flag, value in (("--partition", args.partition), ("--account", args.account)):
    if value is not None and not _WORD.fullmatch(value):
      raise remote.LaunchError(f"{flag} takes one name, got {value!r}.")
  return Options(args.nodes, args.gpus_per_node or 0, args.partition, args.time, args.account,
                 check_python(args.python or sys.executable), remote.env_items(args.env),
                 args.ntasks_per_node, args.cpus_per_task, sbatch_items(args.sbatch),
                 bool(args.requeue))


def time_limit_s(limit: str) -> int:
  """SLURM's `--time` forms in seconds: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS,
  DAYS-HOURS, DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS (0: no limit)."""
  days, _, rest = limit.rpartition("-")
  parts = [int(x) for x in rest.split(":")]
  if days:
    hours, minutes, seconds = parts + [0] * (3 - len(parts))
  else:
    hours, (minutes, seconds) = (0, (parts + [0])[:2]) if len(parts) < 3 else (parts[0], parts[1:])
  return (((int(days or 0) * 24) + hours) * 60 + minutes) * 60 + seconds


def stop_lead_s(limit: str) -> int:
  """How long before the time limit the batch script asks the tasks to save and stop."""
  return min(STOP_LEAD_S, time_limit_s(limit) // 4)


STOP_LEAD_S = 120


def default_launch_dir(command: remote.RunCommand) -> str:
  name = os.path.basename(command.workdir.rstrip("/")) or command.task
  return os.path.join(remote.DEFAULT_LAUNCH_DIR, f"slurm-{name}")


def absolute_argv(command: remote.RunCommand) -> list[str]:
  """The run command with its workdir absolute (resolved against this folder, as `lra run`
  does; a bucket stays as it is), added when the command relies on `lra run`'s default."""
  argv = list(command.argv)
  workdir = command.workdir
  if "://" in workdir:
    return argv
  full = os.path.abspath(os.path.expanduser(workdir))
  for i, a in enumerate(argv):
    if a in ("--workdir", "-workdir") and i + 1 < len(argv):
      argv[i + 1] = full
      return argv
    if a.startswith("--workdir="):
      argv[i] = f"--workdir={full}"
      return argv
  return argv + ["--workdir", full]


# Runs each task with a first line naming the job, attempt, task and host in its (appended) log.
_TASK = ('echo "=== job $SLURM_JOB_ID attempt $LRA_ATTEMPT task $SLURM_PROCID on $(hostname -s) '
         'at $(date \'+%F %T\')"; exec "$@"')


# `lra` itself, with a SIGTERM during start-up held for the run's stop request (lra/signals.py
# `hold_early`) from the first line on: a task signalled while it imports or compiles stops
# cleanly with the others instead of dying and leaving them in a collective.
# A workdir another run holds ends the task at once, before jax (lra/lock.py `exit_if_busy`).
_ENTRY = ("import sys; from lra import signals, lock; signals.hold_early(); "
          "lock.exit_if_busy(sys.argv[1:]); from launch import slurm_task; "
          "sys.exit(slurm_task.main(sys.argv[1:]))")


def script(o: Options, command: remote.RunCommand, launch_dir: str) -> str:
  """The batch script (the config's difference from its default in comments)."""
  folder = os.path.abspath(launch_dir)
  tasks = o.nodes * o.tasks_per_node
  name = re.sub(r"[^A-Za-z0-9_.,=+-]", "_", os.path.basename(command.workdir.rstrip("/")))
  lines = ["#!/bin/bash",
           f"#SBATCH --job-name=lra-{name or command.task}"[:80],
           f"#SBATCH --nodes={o.nodes}",
           f"#SBATCH --ntasks-per-node={o.tasks_per_node}"]
  if o.gpus_per_node:
    lines.append(f"#SBATCH --gpus-per-node={o.gpus_per_node}")
  if o.cpus_per_task:
    lines.append(f"#SBATCH --cpus-per-task={o.cpus_per_task}")
  lines += [f"#SBATCH --{k}={v}" for k, v in (("partition", o.partition), ("time", o.time),
                                               ("account", o.account)) if v]
  limit = time_limit_s(o.time) if o.time else 0
  if limit >= 600:   # SLURM's warning as well, in case the limit is changed (scontrol update)
    lines.append(f"#SBATCH --signal=B:USR1@{STOP_LEAD_S}")
  lines.append("#SBATCH --requeue" if o.requeue else "#SBATCH --no-requeue")
  lines += [f"#SBATCH --output={os.path.join(folder, 'slurm-%j.out')}",
            "#SBATCH --open-mode=append",
            *(f"#SBATCH --{k}" + (f"={v}" if v is not None else "") for k, v in o.sbatch),
            "#",
            f"# lra launch slurm: `lra {shlex.join(absolute_argv(command))}` as {tasks} "
            f"task{'s' * (tasks > 1)} "
            f"({o.nodes} node{'s' * (o.nodes > 1)} x {o.tasks_per_node} task"
            f"{'s' * (o.tasks_per_node > 1)}"
            + (f", {o.gpus_per_node} GPU{'s' * (o.gpus_per_node > 1)} each node"
               if o.gpus_per_node else ", no GPUs")
            + "), one jax.distributed job: LRA_DISTRIBUTED=1 and jax reads SLURM_* itself.",
            *remote.config_lines(command)]
  srun = shlex.join(["srun", "--kill-on-bad-exit=1", "--open-mode=append",
                     f"--output={os.path.join(folder, 'job%j-task%t.log')}",
                     "bash", "-c", _TASK, "lra-task", o.python, "-c", _ENTRY,
                     *absolute_argv(command)])
  lines += ["set -uo pipefail",
            f"cd {shlex.quote(remote.ROOT)}",
            "export LRA_DISTRIBUTED=1",
            *(f"export {k}={shlex.quote(v)}" for k, v in o.env),
            "export LRA_ATTEMPT=$(( ${SLURM_RESTART_COUNT:-0} + 1 ))",
            'echo "=== job $SLURM_JOB_ID attempt $LRA_ATTEMPT on $SLURM_JOB_NODELIST at '
            '$(date \'+%F %T\')"',
            f"export LRA_STOP_MARKER={shlex.quote(os.path.join(folder, 'job'))}"
            "$SLURM_JOB_ID.stopped",
            'rm -f "$LRA_STOP_MARKER"',
            "limit=0",
            "# Near the time limit (USR1) or on scancel (TERM): SIGTERM to the tasks, which save.",
            "# Once (the timer's USR1 and SLURM's may both come). The time limit's stop signals "
            "the step's",
            "# tasks alone: srun, sent SIGTERM, would end the step, killing the tasks after "
            "KillWait.",
            'on_signal() { [ "$1" = TERM ] && limit=0; [ -n "${asked:-}" ] && return; asked=1; '
            'echo "=== $1: asking the tasks to save and stop"; if [ "$1" = USR1 ]; then limit=1; '
            'scancel --quiet --signal=TERM "$SLURM_JOB_ID.0"; '
            'else kill -TERM "${srun_pid:-0}" 2>/dev/null; fi; }',
            "trap 'on_signal USR1' USR1",
            "trap 'on_signal TERM' TERM"]
  if limit:
    lines += [f"# The time limit's stop, {stop_lead_s(o.time)} s before it (SLURM's --signal "
              f"is checked every 30 s only).",
              f"( trap 'kill $s 2>/dev/null; exit 0' TERM; sleep {limit - stop_lead_s(o.time)} & "
              f"s=$!; wait $s && kill -USR1 $$ ) >/dev/null 2>&1 &",
              "timer_pid=$!   # ended with the script (its sleep too: it holds no output open)",
              "trap 'kill $timer_pid 2>/dev/null' EXIT"]
  lines += [f"{srun} &",
            "srun_pid=$!",
            "while :; do wait $srun_pid; rc=$?; kill -0 $srun_pid 2>/dev/null || break; done",
            'if [ $rc = 0 ] && [ -e "$LRA_STOP_MARKER" ] || [ $rc = 130 ]; then',
            '  echo "=== stopped cleanly: the run saved a checkpoint; the same command resumes '
            'it"']
  if o.requeue:
    lines += ['  if [ $limit = 1 ]; then',
              '    echo "=== requeued at the time limit"',
              '    scontrol requeue "$SLURM_JOB_ID"',
              '  fi']
  lines += ["  exit 0",
            "fi",
            'echo "=== tasks ended with exit status $rc"',
            "exit $rc"]
  return "\n".join(lines) + "\n"


def sbatch_command(path: str) -> list[str]:
  return ["sbatch", "--parsable", path]


def _sbatch(argv: list[str]) -> subprocess.CompletedProcess | str:
  try:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
  except subprocess.TimeoutExpired:
    return f"{shlex.join(argv)} did not answer in 300 s."


def _last_line(p: subprocess.CompletedProcess) -> str:
  return (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["no output"])[-1]


def submit(o: Options, command: remote.RunCommand, launch_dir: str) -> tuple[int, str]:
  """Writes the script, asks `sbatch --test-only`, submits; (exit status, the job id or the
  error line): 2 when the cluster refuses the job, 1 when sbatch fails."""
  os.makedirs(launch_dir, exist_ok=True)
  path = os.path.join(launch_dir, "job.sbatch")
  with open(path + ".tmp", "w") as f:
    f.write(script(o, command, launch_dir))
  os.replace(path + ".tmp", path)
  p = _sbatch(["sbatch", "--test-only", path])
  if isinstance(p, str):
    return 1, p
  if p.returncode:
    return 2, f"the cluster refuses the job (sbatch --test-only {path}): {_last_line(p)}"
  p = _sbatch(sbatch_command(path))
  if isinstance(p, str):
    return 1, p
  if p.returncode:
    return 1, f"sbatch {path} failed (exit {p.returncode}): {_last_line(p)}"
  return 0, p.stdout.strip().split(";")[0]


def job_fields(job: str) -> dict[str, str] | None:
  """`scontrol show job -o` as {field: value}; None when SLURM no longer knows the job."""
  try:
    p = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
  except subprocess.TimeoutExpired:
    return {}
  if p.returncode:
    return None
  return dict(item.partition("=")[::2] for item in p.stdout.split() if "=" in item)


class _Tail:
  """The new complete lines of a growing file."""

  def __init__(self, path: str, prefix: str = ""):
    self.path, self.prefix, self.offset, self.rest = path, prefix, 0, ""

  def lines(self) -> list[str]:
    try:
      with open(self.path, errors="replace") as f:
        f.seek(self.offset)
        text = f.read()
        self.offset = f.tell()
    except OSError:
      return []
    text, self.rest = self.rest + text, ""
    parts = text.split("\n")
    self.rest = parts.pop()
    return [self.prefix + line for line in parts]


def follow(job: str, launch_dir: str, *, poll_s: float = 1.0) -> int:
  """Streams the job's log and task 0's until the job ends; returns its exit status (128 +
  the signal when a signal ended it; 130 for Ctrl-C here, which leaves the job running)."""
  folder = os.path.abspath(launch_dir)
  tails = [_Tail(os.path.join(folder, f"slurm-{job}.out"), "[job] "),
           _Tail(os.path.join(folder, f"job{job}-task0.log"))]
  state, fields = None, {}
  try:
    while True:
      fields = job_fields(job)
      for t in tails:
        for line in t.lines():
          print(line, flush=True)
      if fields is None:
        print(f"job {job}: SLURM no longer knows it (its log above is all there is).",
              flush=True)
        return 1
      new = fields.get("JobState")
      if new and new != state:
        state = new
        if state not in _ENDED:
          print(f"job {job}: {state}" + (f" ({fields['Reason']})" if fields.get("Reason") not in
                                         (None, "None") else ""), flush=True)
      if state in _ENDED:
        break
      time.sleep(poll_s)
  except KeyboardInterrupt:
    print(f"\nstopped following; job {job} goes on (scancel {job} stops it).", flush=True)
    return 130
  time.sleep(0.5)
  for t in tails:
    for line in t.lines():
      print(line, flush=True)
  code, _, sig = fields.get("ExitCode", "0:0").partition(":")
  rc = int(code) if int(code or 0) else (128 + int(sig) if int(sig or 0) else 0)
  if state != "COMPLETED" and rc == 0:
    rc = 1
  if rc:   # the first task's one line (srun may have killed the others before theirs)
    for t in range(int(fields.get("NumTasks", "1") or 1)):
      line = next((x for x in _Tail(os.path.join(folder, f"job{job}-task{t}.log")).lines()
                   if x.startswith("error:")), None)
      if line:
        print(f"task {t}: {line}", flush=True)
        break
  print(f"job {job} ended: {state} (exit {fields.get('ExitCode', '?')})", flush=True)
  return rc


def parser() -> remote.OneLineParser:
  p = remote.OneLineParser(prog="lra launch slurm", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
  add_options(p)
  remote.add_common_options(p)
  p.add_argument("--follow", action="store_true",
                 help="stream the job's log and wait for its end (its exit status)")
  p.add_argument("--dry_run", action="store_true", help="print the batch script; submit nothing")
  return p


def run(args: argparse.Namespace, command: remote.RunCommand) -> int:
  """`lra launch slurm`: prints the script (--dry_run), or writes and submits it (and with
  --follow waits for the job)."""
  o = options(args)
  launch_dir = os.path.abspath(args.launch_dir or default_launch_dir(command))
  path = os.path.join(launch_dir, "job.sbatch")
  if args.dry_run:
    sys.stdout.write(script(o, command, launch_dir))
    print(f"(dry run: {path} would hold this script, checked with `sbatch --test-only` and "
          f"submitted with `{shlex.join(sbatch_command(path))}`)", file=sys.stderr)
    return 0
  remote.require_program("sbatch", "run this on a SLURM login node")
  rc, out = submit(o, command, launch_dir)
  if rc:
    print(f"error: {out}", file=sys.stderr)
    return rc
  tasks = o.nodes * o.tasks_per_node
  print(f"submitted job {out}: `{command.text()}` as {tasks} task{'s' * (tasks > 1)}; script "
        f"{path}; task logs {os.path.join(launch_dir, f'job{out}-task*.log')}", flush=True)
  return follow(out, launch_dir) if args.follow else 0
