"""The `lra` console command.

  lra run TASK [--attention NAME] [--size base|small] [--workdir DIR] [--config.x=y ...]
  lra sweep TASK [--sweep NAME] [--arg k=v,...] [--only k=v,...] --workdir DIR [--parallel K]
            [--runner local|tpu|slurm [runner flags]] [--dry_run] [--config.x=y ...]
  lra launch tpu --tpu NAME --zone ZONE [--project P] [--create --accelerator TYPE
            --runtime VERSION] [--retries N] [--dry_run] -- run TASK [run flags]
  lra launch slurm --nodes N --gpus_per_node G [--partition P] [--time T] [--account A]
            [--dry_run] -- run TASK [run flags]
  lra results DIR [--format markdown|csv|json] [--sort COLUMN] [--lra]
  lra list
  lra data status [--size SIZE] [--manual_dir DIR]
  lra data prepare TASK [--size SIZE] [--manual_dir DIR] [--no_download]

`run` trains and evaluates a task (see launch/train.py); `sweep` runs the points of a config
file's sweep, each in its own folder, here or through a launcher (launch/sweep.py); `launch tpu`
runs one `lra run` on every worker of a Cloud TPU pod through gcloud (launch/tpu.py), `launch
slurm` submits it as a SLURM job with one task per GPU (launch/slurm.py), both picked by
launch/dispatch.py; `results` prints every run under a folder as one table (launch/results.py);
`list` prints the tasks and the attention kinds; `data` shows which datasets are ready and builds
one (see launch/data.py).
Flags are spelled with underscores (`--dry_run`); the same flag with hyphens (`--dry-run`) works
too. Unknown names fail with the list of valid ones; a bad config value or a `--config.x` without
its value fails in one line (`error: ...`, exit status 2) before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Sequence

from launch import data as data_launcher
from launch import dispatch
from launch import results as results_launcher
from launch import sweep as sweep_launcher
from launch import train as train_launcher
from launch.remote import LaunchError, OneLineParser
from launch.values import flag_spelling
from lra import host_memory


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
  line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
  return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def list_names() -> str:
  """`lra list`: the tasks, and one row per attention kind from its record."""
  from attention import kinds
  from lra import tasks
  rows = [[k.name, k.paper, k.summary, k.cost, "yes" if k.supports_causal else "no",
           ",".join(k.backends), ", ".join(k.aliases)]
          for k in (kinds.get(name) for name in kinds.names())]
  lines = ["tasks:", *(f"  {t}" for t in sorted(tasks.TASKS)), "", "attention kinds:",
           *("  " + line for line in _table(
               ["kind", "paper", "pattern", "cost", "causal", "backends", "also"], rows)),
           "", "`lra list KIND` shows one kind's record; --attention takes a kind or a name in "
           "the `also` column."]
  return "\n".join(lines)


def describe_kind(name: str) -> str:
  """`lra list KIND`: everything the record says about one kind (a paper's name works too)."""
  from attention import kinds
  k = kinds.get(kinds.resolve(name))
  relative = {None: "no", "dense": "yes (its own relative logits)",
              "factorised": "yes (relative features appended to q and k)"}[k.relative]
  lines = [
      f"{k.name}: {k.paper}", f"  pattern: {k.summary}",
      f"  function: {k.module_path}.{k.function}",
      f"  also called: {', '.join(k.aliases) or '-'}",
      f"  cost: {k.cost}", f"  causal: {'yes' if k.supports_causal else 'no: ' + k.causal}",
      f"  shared query-key: {'yes' if k.shared_qk else 'no'}",
      f"  arguments (--config.model.attention.NAME): {', '.join(k.arguments) or '-'}",
      f"  defaults for window=64, length 1024: {kinds.defaults(k.name, window=64, max_length=1024)}",
      f"  relative positions: {relative}",
      f"  Transformer-XL memory: {'yes' if k.memory else 'no'}",
      f"  sequence split over devices: {k.sequence_parallel or 'no'}",
      f"  MPNet pretraining: {'yes' if k.pattern else 'no: ' + k.no_pattern}",
      f"  exact copy of: {k.copy_of or '-'}", f"  backends: {', '.join(k.backends)}"]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  if (code := host_memory.command_start()) is not None:   # before JAX starts its threads
    return code
  argv = flag_spelling(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] == "launch":  # its own parser: the command after `--` is left whole
    return dispatch.main(argv[1:])
  try:
    rest, overrides = train_launcher.split_overrides(argv)
  except ValueError as e:  # a `--config.x` without its value
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    return _command(rest, overrides)
  except LaunchError as e:   # argparse's own refusals (usage), in one line as every other
    command = str(e).split(":", 1)[0]
    print(f"error: {str(e).rstrip('.')} (`{command} --help` lists the flags).",
          file=sys.stderr)
    return 2


def _command(rest: Sequence[str], overrides: list[tuple[str, str]]) -> int:
  """Parses and runs one command; argparse's errors are raised as LaunchError."""
  parser = OneLineParser(prog="lra", description=__doc__, allow_abbrev=True,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True,
                              parser_class=functools.partial(OneLineParser, allow_abbrev=True))
  train_launcher.add_run_arguments(sub.add_parser(
      "run", help="train and evaluate a task", description=train_launcher.RUN_HELP,
      epilog=train_launcher.RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter))
  sweep_launcher.add_arguments(sub.add_parser("sweep", help="run a config file's sweep"))
  results_launcher.add_arguments(sub.add_parser("results", help="every run under a folder as "
                                                                 "one table"))
  listing = sub.add_parser("list", help="list tasks and attention kinds (lra list KIND: one "
                                         "kind's record)")
  listing.add_argument("kind", nargs="?", help="an attention kind, or a paper's name for one")
  sub.add_parser("launch", help="run on a TPU pod (launch tpu) or a SLURM cluster (launch "
                                "slurm); see `lra launch tpu --help`", add_help=False)
  data_launcher.add_arguments(sub.add_parser("data", help="dataset status and preparation"))
  args, extra = parser.parse_known_args(rest)
  if extra:   # named by the command they were given to, not by `lra`
    raise LaunchError(f"lra {args.command}: unrecognized arguments: {' '.join(extra)}")
  if args.command == "data":
    return data_launcher.run(args, overrides)
  if args.command == "sweep":
    try:
      train_launcher.check_workdir(args.workdir)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    return sweep_launcher.run(args, overrides)
  if args.command in ("list", "results"):
    if overrides:
      parser.error("--config.* overrides only apply to `lra run`, `lra sweep` and `lra data`.")
    if args.command == "results":
      return results_launcher.run(args)
    if args.kind is not None:
      try:
        print(describe_kind(args.kind))
      except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
      return 0
    print(list_names())
    return 0
  return train_launcher.run(args, overrides)


if __name__ == "__main__":
  # `python -m launch.cli`, as a sweep starts each run, sizes XLA:CPU's pool as `lra` does.
  from lra import cpus
  cpus.cpu_threads()
  sys.exit(main())
