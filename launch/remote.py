"""`lra launch tpu|slurm -- run ...`: what the TPU and SLURM launchers share.

  lra launch tpu   --tpu NAME --zone ZONE [options] [--dry_run] -- run TASK [lra run flags]
  lra launch slurm --nodes N --gpus-per-node G [options] [--dry_run] -- run TASK [lra run flags]

Everything after `--` is the `lra run` command each process runs. It is checked here exactly as
`lra run` checks it before importing jax (the task name, `--attention`/`--size`/`--arg`, every
`--config.x=y` override and the resolved values), so a typo ends the launch with one line
(`error: ...`, exit status 2) before gcloud or sbatch is called. Flags the launcher does not know,
missing required flags and a missing `gcloud`/`sbatch` end it the same way.

launch/tpu.py and launch/slurm.py build on this; launch/sweep.py uses them for `--runner tpu` and
`--runner slurm`. Docs: docs/launch.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import sys
from typing import Sequence

import ml_collections

import configs
from launch import train as train_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout launched
DEFAULT_LAUNCH_DIR = os.path.join("workdirs", "launches")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class LaunchError(ValueError):
  """Bad input: printed as one `error: ...` line, exit status 2, nothing called."""


class OneLineParser(argparse.ArgumentParser):
  """An argparse parser whose errors are one line (`error: ...`) and exit status 2, and which
  takes no abbreviations (`--gpus` is not `--gpus-per-node`)."""

  def __init__(self, allow_abbrev: bool = False, **kwargs):
    super().__init__(allow_abbrev=allow_abbrev, **kwargs)

  def error(self, message: str):
    raise LaunchError(f"{self.prog}: {message}")


@dataclasses.dataclass
class RunCommand:
  """The checked `lra run` command that every process of a launch runs."""
  argv: list[str]                 # as given after `--`, starting with "run"
  task: str
  config: ml_collections.ConfigDict
  workdir: str                    # as given, or `lra run`'s default (relative to the run's cwd)
  workdir_given: bool

  def text(self) -> str:
    return "lra " + shlex.join(self.argv)


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(the launcher's own arguments, the command after the first `--`)."""
  argv = list(argv)
  if "--" not in argv:
    raise LaunchError("nothing after `--`: end the launcher's flags with `--` and give the run "
                      "command, e.g. `-- run listops --size base --workdir gs://BUCKET/runs/x`.")
  i = argv.index("--")
  if not argv[i + 1:]:
    raise LaunchError("nothing after `--`: give the run command, e.g. `-- run listops --size "
                      "base --workdir gs://BUCKET/runs/x`.")
  return argv[:i], argv[i + 1:]


def parse_run(argv: Sequence[str]) -> RunCommand:
  """Checks `run TASK ...` as `lra run` would before jax (raises LaunchError, one line)."""
  argv = list(argv)
  if not argv or argv[0] != "run":
    got = " ".join(argv[:3])
    raise LaunchError(f"the command after `--` must be `run TASK ...` (an `lra run` command), "
                      f"got {got!r}.")
  try:
    rest, overrides = train_launcher.split_overrides(argv[1:])
    parser = OneLineParser(prog="lra run", add_help=False, allow_abbrev=True)  # as `lra run`
    train_launcher.add_run_arguments(parser)
    args = parser.parse_args(rest)
    config = configs.build_config(args.task, attention=args.attention, size=args.size,
                                  arg=args.arg, overrides=overrides)
    train_launcher.check_config(config)
    train_launcher.dry_run_steps(args.dry_run)
  except LaunchError:
    raise
  except ValueError as e:
    raise LaunchError(f"the run command after `--`: {e}") from None
  workdir = args.workdir or train_launcher.default_workdir(args.task, config)
  return RunCommand(argv, args.task, config, workdir, args.workdir is not None)


def config_lines(command: RunCommand) -> list[str]:
  """The resolved config's difference from the task's default, as `# ` comment lines."""
  default, changes = train_launcher.config_changes(command.config)
  n = len(changes)
  head = (f"# config: {n} field{'s' * (n != 1)} {'differs' if n == 1 else 'differ'} from the "
          f"default {command.task} ({default})")
  return [head, *(f"#{line}" for line in changes)]


def workdir_note(command: RunCommand, what: str) -> str | None:
  """A note when the workdir is not a bucket (a pod's workers do not share their disks)."""
  if command.workdir.startswith(("gs://", "s3://", "az://")):
    return None
  return (f"note: the workdir {command.workdir} is not in a bucket: {what} need one folder "
          f"they all reach (--workdir gs://BUCKET/runs/NAME), or they do not share checkpoints.")


def env_items(items: Sequence[str] | None) -> list[tuple[str, str]]:
  """`--env NAME=VALUE` items, checked."""
  out = []
  for item in items or ():
    name, eq, value = item.partition("=")
    if not eq or not _ENV_NAME.fullmatch(name):
      raise LaunchError(f"--env takes NAME=VALUE (a shell variable name), got {item!r}.")
    out.append((name, value))
  return out


def require_program(name: str, what: str) -> str:
  path = shutil.which(name)
  if path is None:
    raise LaunchError(f"`{name}` is not on PATH; {what} (or use --dry_run to see the commands).")
  return path


def add_common_options(parser: argparse.ArgumentParser) -> None:
  """Options both launchers take (and `lra sweep` for its remote runners)."""
  parser.add_argument("--env", action="append", default=None, metavar="NAME=VALUE",
                      help="an environment variable for every process of the run (repeatable), "
                           "e.g. LRA_DATA=gs://BUCKET/lra_data")
  parser.add_argument("--launch_dir", default=None,
                      help=f"local folder for the launch's files and logs (default "
                           f"{DEFAULT_LAUNCH_DIR}/...)")


def main(argv: Sequence[str]) -> int:
  """`lra launch tpu|slurm ... -- run ...`; returns the exit status."""
  from launch import slurm, tpu
  argv = list(argv)
  kinds = {"tpu": tpu, "slurm": slurm}
  try:
    if argv and argv[0] in ("-h", "--help"):
      print(__doc__.strip().split("\n\n")[0])
      print("\nSee `lra launch tpu --help`, `lra launch slurm --help` and docs/launch.md.")
      return 0
    if not argv:
      raise LaunchError("lra launch needs a launcher: `lra launch tpu ...` or `lra launch slurm "
                        "...` (see docs/launch.md).")
    if argv[0] not in kinds:
      raise LaunchError(f"unknown launcher {argv[0]!r}; valid launchers: tpu, slurm.")
    module = kinds[argv[0]]
    if "--" not in argv and any(a in ("-h", "--help") for a in argv):
      module.parser().print_help()
      return 0
    own, command_argv = split_command(argv[1:])
    args = module.parser().parse_args(own)
    command = parse_run(command_argv)
    return module.run(args, command)
  except LaunchError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


def sweep_runner(args: argparse.Namespace):
  """For `lra sweep`: (the launcher module, its checked options) for --runner tpu|slurm, None
  for local. Raises LaunchError for a flag of another runner."""
  from launch import slurm, tpu
  for runner, module in (("tpu", tpu), ("slurm", slurm)):
    flags = module.given_options(args)
    if flags and args.runner != runner:
      raise LaunchError(f"{', '.join(flags)}: only with --runner {runner}.")
  if args.runner == "local":
    flags = [f for f, v in (("--env", args.env), ("--launch_dir", args.launch_dir)) if v]
    if flags:
      raise LaunchError(f"{', '.join(flags)}: only with --runner tpu or --runner slurm.")
    return None
  if args.parallel != 1:
    raise LaunchError("--parallel applies to --runner local: TPU points run one after another, "
                      "SLURM points are separate jobs.")
  module = tpu if args.runner == "tpu" else slurm
  return module, module.options(args)


def run_sweep(args: argparse.Namespace, points: Sequence, module, opts) -> int:
  """A sweep's points (launch/sweep.py `Point`s) through the TPU or SLURM launcher: prints
  their commands (--dry_run), or launches the unfinished ones, the TPU's one after another and
  SLURM's as one job each. Each point's launch files go to `<launch_dir>/<point name>/`."""
  from launch import slurm, sweep, tpu
  name = os.path.basename(args.workdir.rstrip("/"))
  base = args.launch_dir or os.path.join(DEFAULT_LAUNCH_DIR, f"sweep-{args.task}-{name}")
  total, todo, skipped, failed, done = len(points), [], 0, [], 0
  for p in points:
    command = parse_run(p.argv(args.task, args.workdir))
    folder = os.path.join(base, p.name)
    if args.dry_run:
      print(f"# [{p.index}/{total}] {p.name}: {command.text()}")
      if module is tpu:
        print("\n".join(x for x in tpu.plan(opts, command, folder)
                        if not x.startswith("# ") or x.startswith("# then for each worker")))
      else:
        print("# " + slurm.script(opts, command, folder).splitlines()[-1])
        print(shlex.join(slurm.sbatch_command(os.path.join(folder, "job.sbatch"))))
    elif sweep.finished(os.path.join(args.workdir, p.name), p):
      skipped += 1
      print(f"[{p.index}/{total}] {p.name}: finished earlier (results.json exists); skipped.")
    else:
      todo.append((p, command, folder))
  if args.dry_run:
    return 0
  if module is tpu:
    require_program("gcloud", "install the Google Cloud SDK and run `gcloud auth login`")
  else:
    require_program("sbatch", "run this on a SLURM login node")
  verb = f"launched one after another on TPU {opts.tpu}" if module is tpu else "submitted"
  print(f"Sweep of {args.task}: {total} runs in {args.workdir}: {skipped} finished earlier "
        f"(skipped), {len(todo)} to be {verb}.", flush=True)
  for p, command, folder in todo:
    if module is tpu:
      print(f"[{p.index}/{total}] {p.name}: launching `{command.text()}` (launch files in "
            f"{folder})", flush=True)
      rc = tpu.launch(opts, command, folder)
      line = "finished" if rc == 0 else f"FAILED (exit {rc}); launch files in {folder}"
    else:
      rc, out = slurm.submit(opts, command, folder)
      line = f"submitted job {out} (script {folder}/job.sbatch)" if rc == 0 else f"FAILED: {out}"
    print(f"[{p.index}/{total}] {p.name}: {line}", flush=True)
    done += rc == 0
    if rc == 130:
      print("Sweep interrupted; run the same command again to continue.", flush=True)
      return 130
    if rc:
      failed.append(p.name)
  what = "finished now" if module is tpu else "submitted"
  print(f"Summary: {total} runs: {done} {what}, {skipped} finished earlier (skipped), "
        f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}.", flush=True)
  return 1 if failed else 0
