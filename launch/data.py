"""`lra data status` and `lra data prepare TASK`: which datasets are ready, and building one.

  lra data status [--size base|small] [--manual_dir DIR]
  lra data prepare TASK [--size base|small] [--manual_dir DIR] [--no_download] [--config.data.x=y]

`status` prints one line per task: `ready` with the dataset folder, or `missing` with the file to
get, its address and the directory to put it in (or how the dataset will be generated).
`prepare` builds one task's dataset from the archives in the manual directory (default
`$LRA_DATA/manual`, `$LRA_DATA` defaulting to `~/lra_data`), downloading them first when they are
absent and the machine is online (unless `--no_download`). The data settings are those of the
task's config for `--size` (default base), with `--config.data.*` overrides.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import configs
from lra import schema
from lra import tasks


def add_arguments(parser: argparse.ArgumentParser) -> None:
  sub = parser.add_subparsers(dest="data_command", required=True)
  status = sub.add_parser("status", help="which tasks have their data, and what the rest need")
  prepare = sub.add_parser("prepare", help="build one task's dataset")
  prepare.add_argument("task", help=f"one of: {', '.join(sorted(tasks.TASKS))}")
  prepare.add_argument("--no_download", dest="download", action="store_false",
                       help="never download; fail with the file to get instead")
  for p in (status, prepare):
    p.add_argument("--size", default="base", help="the config size whose data settings to use")
    p.add_argument("--manual_dir", default=None,
                   help="directory holding the original archives (default $LRA_DATA/manual)")


def data_config(task: str, size: str, manual_dir: str | None,
                overrides: Sequence[tuple[str, str]] = ()):
  """The data settings of `task`'s config for `size`, with the manual dir and overrides."""
  config = configs.build_config(task, size=size, overrides=overrides)
  schema.check_data(config)  # the data settings only: nothing else is used here
  if manual_dir:
    config.data.manual_dir = manual_dir
  return config.data


def status_lines(size: str = "base", manual_dir: str | None = None) -> list[str]:
  """One line per task: `<task> ready <folder>` or `<task> missing <what to do>`."""
  lines = []
  width = max(len(t) for t in tasks.TASKS)
  for name in sorted(tasks.TASKS):
    try:
      task = tasks.get_task(name)
      st = task.status(data_config(name, size, manual_dir))
      state, detail = ("ready" if st.ready else "missing"), st.detail
    except (ImportError, AttributeError) as e:
      state, detail = "n/a", f"this task is not available in this checkout ({e})."
    except ValueError as e:
      state, detail = "error", str(e)
    lines.append(f"{name:<{width}}  {state:<7}  {detail}")
  return lines


def run(args: argparse.Namespace, overrides: Sequence[tuple[str, str]]) -> int:
  from lra.data import archives
  if args.data_command == "status":
    if overrides:
      print("error: --config.* overrides apply to `lra data prepare` only.", file=sys.stderr)
      return 2
    print(f"data root: {archives.data_root()} (set ${archives.DATA_ROOT_ENV} to move it)")
    print("\n".join(status_lines(args.size, args.manual_dir)))
    return 0
  try:
    task = tasks.get_task(args.task)
    data = data_config(args.task, args.size, args.manual_dir, overrides)
    if not args.download and "download" in data:
      data.download = False
    folder = task.prepare(data)
  except (archives.DataMissingError, archives.CorruptArchiveError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{args.task}: dataset ready in {folder}")
  return 0
