"""Picking the remote launcher: `lra launch tpu|slurm ... -- run ...` and `lra sweep --runner
tpu|slurm`.

`main` reads `lra launch`'s own arguments, checks the command after `--` (launch/remote.py
`parse_run`) and hands both to launch/tpu.py or launch/slurm.py. `sweep_runner` and `run_sweep`
are `lra sweep`'s remote runners (launch/sweep.py): a sweep's points through the same launchers,
the TPU's one after another and SLURM's as one job each. The launchers build on launch/remote.py
and never import this module.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from types import ModuleType
from typing import Any, Sequence

from launch import remote, run_state, slurm, tpu
from launch.remote import LaunchError, parse_run, require_program, split_command

LAUNCHERS = {"tpu": tpu, "slurm": slurm}


def main(argv: Sequence[str]) -> int:
  """`lra launch tpu|slurm ... -- run ...`; returns the exit status."""
  argv = list(argv)
  try:
    if argv and argv[0] in ("-h", "--help"):
      print(remote.__doc__.strip().split("\n\n")[0])
      print("\nSee `lra launch tpu --help`, `lra launch slurm --help` and docs/launch.md.")
      return 0
    if not argv:
      raise LaunchError("lra launch needs a launcher: `lra launch tpu ...` or `lra launch slurm "
                        "...` (see docs/launch.md).")
    if argv[0] not in LAUNCHERS:
      raise LaunchError(f"unknown launcher {argv[0]!r}; valid launchers: tpu, slurm.")
    module = LAUNCHERS[argv[0]]
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


def sweep_runner(args: argparse.Namespace) -> tuple[ModuleType, Any] | None:
  """For `lra sweep`: (the launcher module, its checked options) for --runner tpu|slurm, None
  for local. Raises LaunchError for a flag of another runner."""
  for runner, module in LAUNCHERS.items():
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


def run_sweep(args: argparse.Namespace, points: Sequence, module: ModuleType, opts: Any) -> int:
  """A sweep's points (launch/sweep.py `Point`s) through the TPU or SLURM launcher: prints
  their commands (--dry_run), or launches the unfinished ones, the TPU's one after another and
  SLURM's as one job each. Each point's launch files go to `<launch_dir>/<point name>/`."""
  name = os.path.basename(args.workdir.rstrip("/"))
  base = args.launch_dir or os.path.join(remote.DEFAULT_LAUNCH_DIR, f"sweep-{args.task}-{name}")
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
        print("# " + next(x for x in slurm.script(opts, command, folder).splitlines()
                          if x.startswith("srun ")))
        print(shlex.join(slurm.sbatch_command(os.path.join(folder, "job.sbatch"))))
    elif run_state.finished(os.path.join(args.workdir, p.name), p.staged_phases):
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
