"""Runs one task by name: builds its config, applies overrides, trains and prints the result.

  python -m launch.train listops --attention band --size small --workdir runs/x \
      --config.num_train_steps=300 --config.model.attention.window=8

`--config.a.b=V` overrides an existing field (`configs.build_config`; V is converted against the
field's current type by the converter the config arguments use too). Unknown fields raise with
the valid names at that level. The resolved values (and each phase's) are then checked by
`configs.validate`: a bad one ends the command at once with one line naming the field, exit
status 2, before jax is imported. The `lra` console command (launch/cli.py) calls this. Staged
configs (`config.phases`, the character-LM ones) run through `lra.phases`, one workdir per phase;
rerunning the command continues the schedule.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
from typing import Sequence

import ml_collections

import configs
from configs import validate
from lra import phases  # pure Python: the trainer is imported by its functions only
from lra import tasks as tasks_lib


def default_workdir(task: str, config: ml_collections.ConfigDict) -> str:
  arg = dict(p.split("=", 1) for p in config.config_arg.split(","))
  return os.path.join("workdirs", f"{task}-{arg['attention']}-{arg['size']}")


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """Separates `--config.a.b=v` (or `--config.a.b v`) from the other arguments.

  Raises ValueError when a `--config.a.b` has no value: it ends the command line, or the next
  argument is another flag (`--...`), which is never taken as the value.
  """
  rest, overrides, i = [], [], 0
  argv = list(argv)
  while i < len(argv):
    a = argv[i]
    if a.startswith("--config."):
      key, eq, value = a[len("--config."):].partition("=")
      if not eq:
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
          raise ValueError(f"{a} needs a value: {a}=VALUE.")
        value, i = argv[i + 1], i + 1
      overrides.append((key, value))
    else:
      rest.append(a)
    i += 1
  return rest, overrides


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("task", help=f"one of: {', '.join(sorted(tasks_lib.TASKS))}")
  parser.add_argument("--attention", default=None, help="an attention kind (see `lra list`)")
  parser.add_argument("--size", default=None, help="base (LRA settings) or small (CPU)")
  parser.add_argument("--arg", default="", help="more get_config arguments, e.g. window=8")
  parser.add_argument("--workdir", default=None,
                      help="run directory (default workdirs/TASK-ATTENTION-SIZE); rerunning in "
                           "it resumes")


def check_config(config: ml_collections.ConfigDict) -> None:
  """Checks every value of `config` and, for a staged one, of each phase's config (no jax)."""
  validate.check(config)
  for k in range(len(config.get("phases") or ())):
    validate.check(phases.phase_config(config, k), context=f"config.phases[{k}] gives ")


def run(args: argparse.Namespace, overrides: Sequence[tuple[str, str]]) -> int:
  """Trains; returns the process exit status (130 when interrupted by Ctrl-C)."""
  try:  # a bad name, override or value: say which in one line, before any heavy import
    config = configs.build_config(args.task, attention=args.attention, size=args.size,
                                  arg=args.arg, overrides=overrides)
    check_config(config)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  workdir = args.workdir or default_workdir(args.task, config)
  from lra import train  # heavy imports only once the arguments are valid
  from lra.data import archives
  task = tasks_lib.get_task(config.task)
  try:  # names, combinations and phases first, then the data: all before anything compiles
    train.validate_config(phases.phase_config(config, 0) if config.get("phases") else config,
                          task)
    task.prepare(config.data)
  except (ValueError, archives.DataMissingError, archives.CorruptArchiveError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"Training {args.task} ({config.config_arg}) in {workdir}", flush=True)
  try:
    results = phases.run(config, workdir)
  except KeyboardInterrupt:
    print("error: interrupted (Ctrl-C twice); rerun the same command to resume from the last "
          "checkpoint.", file=sys.stderr)
    return 130
  except Exception as e:  # noqa: BLE001 - one line naming the cause; the traceback to a file
    line = failure_line(e, workdir)
    print(f"error: {line}", file=sys.stderr, flush=True)
    if line.startswith("no space left"):   # orbax's abandoned writes report as they end
      from lra import checkpoint
      checkpoint.stderr_to(os.path.join(workdir, "error.log"))
    return 2
  if results["interrupted"]:
    return 130
  print(task.result_line(results, phases.results_path(workdir, results)), flush=True)
  return 0


def _chain(e: BaseException) -> list[BaseException]:
  out = []
  while e is not None and e not in out:
    out.append(e)
    e = e.__cause__ or e.__context__
  return out


def failure_line(e: Exception, workdir: str) -> str:
  """The one line a failed run ends with: the cause and what to do (the known failures), or
  the exception with its traceback written to `<workdir>/error.log`."""
  from lra import checkpoint, lock
  chain = _chain(e)
  if any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in chain) or any(
      "No space left on device" in str(x) for x in chain):
    return (f"no space left on device while writing in {workdir} ({type(e).__name__}); free "
            f"some space and rerun the same command: it resumes from the last finished "
            f"checkpoint, and an unfinished save is discarded.")
  if isinstance(e, (lock.WorkdirBusy, checkpoint.CheckpointError, FloatingPointError)):
    return str(e).splitlines()[0] if str(e) else type(e).__name__
  log = os.path.join(workdir, "error.log")
  try:
    os.makedirs(workdir, exist_ok=True)
    with open(log, "a") as f:
      traceback.print_exception(e, file=f)
    where = f"the traceback is in {log}"
  except OSError:
    where = "no traceback could be written"
  first = str(e).splitlines()[0][:300] if str(e) else ""
  if isinstance(e, ValueError):   # a setting the checks before the run could not see
    return f"{first} ({where})."
  return f"{type(e).__name__}: {first} ({where}; rerun the same command to resume)."


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    rest, overrides = split_overrides(argv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add_run_arguments(parser)
  return run(parser.parse_args(rest), overrides)


if __name__ == "__main__":
  sys.exit(main())
