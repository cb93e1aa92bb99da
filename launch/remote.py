"""`lra launch tpu|slurm -- run ...`: what the TPU and SLURM launchers share.

  lra launch tpu   --tpu NAME --zone ZONE [options] [--dry_run] -- run TASK [lra run flags]
  lra launch slurm --nodes N [--gpus_per_node G] [options] [--dry_run] -- run TASK [lra run flags]

Everything after `--` is the `lra run` command each process runs. It is checked here exactly as
`lra run` checks it before importing jax (the task name, `--attention`/`--size`/`--arg`, every
`--config.x=y` override and the resolved values), so a typo ends the launch with one line
(`error: ...`, exit status 2) before gcloud or sbatch is called. Flags the launcher does not know,
missing required flags and a missing `gcloud`/`sbatch` end it the same way.

launch/tpu.py and launch/slurm.py build on this; launch/dispatch.py picks one of them for `lra
launch` and for `lra sweep --runner tpu|slurm`. Docs: docs/launch.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
from typing import Sequence

import ml_collections

import configs
from launch import train as train_launcher
from launch.values import flag_spelling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout launched
DEFAULT_LAUNCH_DIR = os.path.join("workdirs", "launches")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class LaunchError(ValueError):
  """Bad input: printed as one `error: ...` line, exit status 2, nothing called."""


class OneLineParser(argparse.ArgumentParser):
  """An argparse parser whose errors are one line (`error: ...`) and exit status 2, and which
  takes no abbreviations (`--gpus` is not `--gpus_per_node`)."""

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
    rest, overrides = train_launcher.split_overrides(flag_spelling(argv[1:]))
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
