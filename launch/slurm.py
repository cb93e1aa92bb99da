"""`lra launch slurm`: one `lra run` as a SLURM batch job, one task per GPU.

  lra launch slurm --nodes N --gpus_per_node G [--partition P] [--time T] [--account A]
                   [--python PATH] [--env NAME=VALUE ...] [--launch_dir DIR] [--dry_run]
                   -- run TASK [lra run flags]

Writes a batch script to `<launch_dir>/job.sbatch` and submits it with `sbatch --parsable`.
The script asks for N nodes with G GPUs each and one task per GPU (`--ntasks-per-node=G`), and
starts the tasks with `srun`: N x G processes of one jax.distributed job. Each runs `python -m
launch.cli run ...` (the command after `--`) in this checkout with `LRA_DISTRIBUTED=1`, so
`jax.distributed.initialize()` reads the job from SLURM's variables (SLURM_JOB_ID,
SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID: the coordinator is the first
node, each task uses the GPU of its local id). The checkout, the Python environment (`--python`,
default this one), the data and the workdir must be on a filesystem every node reaches. Each
task's output goes to `<launch_dir>/job<ID>-task<T>.log`, the job's own to `slurm-<ID>.out`.
With `--time`, SLURM sends SIGTERM two minutes before the limit: the run saves a checkpoint and
stops, and submitting the same command again resumes it. `--dry_run` prints the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys

from launch import remote

_TIME = re.compile(r"\d+(-\d+)?(:\d+){0,2}")
_WORD = re.compile(r"[A-Za-z0-9_.,:+-]+")


@dataclasses.dataclass
class Options:
  nodes: int
  gpus_per_node: int
  partition: str | None = None
  time: str | None = None
  account: str | None = None
  python: str = sys.executable
  env: list[tuple[str, str]] = dataclasses.field(default_factory=list)


FLAGS = {"nodes": "--nodes", "gpus_per_node": "--gpus_per_node", "partition": "--partition",
         "time": "--time", "account": "--account", "python": "--python"}


def add_options(parser: argparse.ArgumentParser) -> None:
  g = parser.add_argument_group("SLURM (lra launch slurm, lra sweep --runner slurm)")
  g.add_argument("--nodes", type=int, default=None, help="nodes (required)")
  g.add_argument("--gpus_per_node", type=int, default=None,
                 help="GPUs per node (required); one task per GPU")
  g.add_argument("--partition", default=None, help="the partition (default: the cluster's)")
  g.add_argument("--time", default=None,
                 help="the time limit, e.g. 24:00:00 or 2-00:00 (SIGTERM 2 minutes before it)")
  g.add_argument("--account", default=None, help="the account to charge")
  g.add_argument("--python", default=None,
                 help=f"the Python the tasks run (default {sys.executable})")


def given_options(args: argparse.Namespace) -> list[str]:
  return [flag for dest, flag in FLAGS.items() if getattr(args, dest, None) is not None]


def options(args: argparse.Namespace) -> Options:
  """The checked SLURM options; raises remote.LaunchError (one line)."""
  if args.nodes is None or args.gpus_per_node is None:
    raise remote.LaunchError("the SLURM launcher needs --nodes N and --gpus_per_node G.")
  if args.nodes < 1:
    raise remote.LaunchError(f"--nodes must be at least 1, got {args.nodes}.")
  if args.gpus_per_node < 1:
    raise remote.LaunchError(f"--gpus_per_node must be at least 1, got {args.gpus_per_node}.")
  if args.time is not None and not _TIME.fullmatch(args.time):
    raise remote.LaunchError(f"--time takes SLURM's forms (MINUTES, HH:MM:SS, D-HH:MM, ...), "
                             f"got {args.time!r}.")
  for flag, value in (("--partition", args.partition), ("--account", args.account)):
    if value is not None and not _WORD.fullmatch(value):
      raise remote.LaunchError(f"{flag} takes one name, got {value!r}.")
  return Options(args.nodes, args.gpus_per_node, args.partition, args.time, args.account,
                 args.python or sys.executable, remote.env_items(args.env))


def default_launch_dir(command: remote.RunCommand) -> str:
  name = os.path.basename(command.workdir.rstrip("/")) or command.task
  return os.path.join(remote.DEFAULT_LAUNCH_DIR, f"slurm-{name}")


def script(o: Options, command: remote.RunCommand, launch_dir: str) -> str:
  """The batch script (the config's difference from its default in comments)."""
  folder = os.path.abspath(launch_dir)
  tasks = o.nodes * o.gpus_per_node
  name = re.sub(r"[^A-Za-z0-9_.,=+-]", "_", os.path.basename(command.workdir.rstrip("/")))
  lines = ["#!/bin/bash",
           f"#SBATCH --job-name=lra-{name or command.task}"[:80],
           f"#SBATCH --nodes={o.nodes}",
           f"#SBATCH --ntasks-per-node={o.gpus_per_node}",
           f"#SBATCH --gpus-per-node={o.gpus_per_node}"]
  lines += [f"#SBATCH --{k}={v}" for k, v in (("partition", o.partition), ("time", o.time),
                                               ("account", o.account)) if v]
  if o.time:
    lines.append("#SBATCH --signal=TERM@120")
  lines += [f"#SBATCH --output={os.path.join(folder, 'slurm-%j.out')}",
            "#",
            f"# lra launch slurm: `{command.text()}` as {tasks} task{'s' * (tasks > 1)} "
            f"({o.nodes} node{'s' * (o.nodes > 1)} x {o.gpus_per_node} GPU"
            f"{'s' * (o.gpus_per_node > 1)}), one jax.distributed job: LRA_DISTRIBUTED=1 and "
            f"jax reads SLURM_* itself.",
            *remote.config_lines(command)]
  lines += ["set -euo pipefail",
            f"cd {shlex.quote(remote.ROOT)}",
            "export LRA_DISTRIBUTED=1",
            *(f"export {k}={shlex.quote(v)}" for k, v in o.env),
            shlex.join(["srun", "--kill-on-bad-exit=1",
                        f"--output={os.path.join(folder, 'job%j-task%t.log')}",
                        o.python, "-m", "launch.cli", *command.argv])]
  return "\n".join(lines) + "\n"


def sbatch_command(path: str) -> list[str]:
  return ["sbatch", "--parsable", path]


def submit(o: Options, command: remote.RunCommand, launch_dir: str) -> tuple[int, str]:
  """Writes the script and submits it; (exit status, the job id or the error line)."""
  os.makedirs(launch_dir, exist_ok=True)
  path = os.path.join(launch_dir, "job.sbatch")
  with open(path + ".tmp", "w") as f:
    f.write(script(o, command, launch_dir))
  os.replace(path + ".tmp", path)
  try:
    p = subprocess.run(sbatch_command(path), capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
  except subprocess.TimeoutExpired:
    return 1, f"sbatch {path} did not answer in 300 s."
  if p.returncode:
    last = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["no output"])[-1]
    return 1, f"sbatch {path} failed (exit {p.returncode}): {last}"
  return 0, p.stdout.strip().split(";")[0]


def parser() -> remote.OneLineParser:
  p = remote.OneLineParser(prog="lra launch slurm", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
  add_options(p)
  remote.add_common_options(p)
  p.add_argument("--dry_run", action="store_true", help="print the batch script; submit nothing")
  return p


def run(args: argparse.Namespace, command: remote.RunCommand) -> int:
  """`lra launch slurm`: prints the script (--dry_run) or writes and submits it."""
  o = options(args)
  launch_dir = args.launch_dir or default_launch_dir(command)
  path = os.path.join(launch_dir, "job.sbatch")
  if args.dry_run:
    sys.stdout.write(script(o, command, launch_dir))
    print(f"(dry run: {path} would hold this script, submitted with "
          f"`{shlex.join(sbatch_command(path))}`)", file=sys.stderr)
    return 0
  remote.require_program("sbatch", "run this on a SLURM login node")
  rc, out = submit(o, command, launch_dir)
  if rc:
    print(f"error: {out}", file=sys.stderr)
    return rc
  folder = os.path.abspath(launch_dir)
  print(f"submitted job {out}: `{command.text()}` as {o.nodes * o.gpus_per_node} tasks; script "
        f"{path}; task logs {os.path.join(folder, f'job{out}-task*.log')}")
  return 0
