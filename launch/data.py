"""`lra data status` and `lra data prepare TASK`: which datasets are ready, and building one.

  lra data status [--size SIZE] [--manual_dir DIR]
  lra data prepare TASK [--size SIZE] [--manual_dir DIR] [--no_download] [--config.data.x=y]

A task's sizes (`configs.sizes`) may differ in their data settings (ListOps `cpu` generates
shorter examples than `base`), so each size may have its own dataset. `status --size S` prints
one line per task for size S: `ready` with the dataset folder, or `missing` with the file to get,
its address and the directory to put it in (or how the dataset will be generated); a task without
size S says which sizes it has. Without `--size`, each task's line names the sizes it is for:
every size whose data is ready (sizes sharing one dataset on one line), or, when none is, the
task's first size (base) with what it needs.
`prepare` builds one task's dataset from the archives in the manual directory (default
`$LRA_DATA/manual`, `$LRA_DATA` defaulting to `~/lra_data`), downloading them first when they are
absent and the machine is online (unless `--no_download`). The data settings are those of the
task's config for `--size` (default base), with `--config.data.*` overrides.

A data folder in a bucket (`LRA_DATA=gs://BUCKET/lra_data`, or `--config.data.data_dir=gs://...`)
is prepared locally and then copied there: tfds' array_record writer writes local files only,
while training reads array_record files from a bucket directly. The dataset is built in a
temporary local folder (with a bucket manual dir, the default `gs://.../manual` that `lra data
status` names, its files are first copied to a local `manual/` there, where the build looks for
the archives, or downloads them; `--manual_dir DIR` names a local one), then its version folder is
uploaded file by file, `dataset_info.json` last: readers take a dataset for prepared when that
file is there, so an upload cut short is never used, and the next `prepare` uploads it again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Sequence

import configs
from lra import schema, storage
from lra import tasks


def add_arguments(parser: argparse.ArgumentParser) -> None:
  sub = parser.add_subparsers(dest="data_command", required=True)
  status = sub.add_parser("status", help="which tasks have their data, and what the rest need")
  prepare = sub.add_parser("prepare", help="build one task's dataset")
  prepare.add_argument("task", help=f"one of: {', '.join(sorted(tasks.TASKS))}")
  prepare.add_argument("--no_download", dest="download", action="store_false",
                       help="never download; fail with the file to get instead")
  for p in (status, prepare):
    p.add_argument("--size", default=None,
                   help="the config size whose data settings to use (prepare: default base; "
                        "status: default every size whose data is ready)")
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


def _status(name: str, size: str, manual_dir: str | None) -> tuple[str, str]:
  """(state, detail) of task `name`'s dataset for `size`."""
  try:
    st = tasks.get_task(name).status(data_config(name, size, manual_dir))
    return ("ready" if st.ready else "missing"), st.detail
  except (ImportError, AttributeError) as e:
    return "n/a", f"this task is not available in this checkout ({e})."
  except ValueError as e:
    return "error", str(e)


def task_status(name: str, size: str | None = None,
                manual_dir: str | None = None) -> list[tuple[str, str, str]]:
  """[(sizes, state, detail)] of task `name`: for `size` alone when given; else one entry per
  ready dataset (the sizes sharing it joined by commas), or the first size's when none is."""
  sizes = configs.sizes(name)
  if size is not None:
    if size not in sizes:
      return [(size, "n/a", f"{name} has no size {size!r}; its sizes: {', '.join(sizes)}.")]
    return [(size, *_status(name, size, manual_dir))]
  ready: dict[str, list[str]] = {}
  for s in sizes:
    state, detail = _status(name, s, manual_dir)
    if state == "ready":
      ready.setdefault(detail, []).append(s)
  if ready:
    return [(", ".join(names), "ready", detail) for detail, names in ready.items()]
  return [(sizes[0], *_status(name, sizes[0], manual_dir))]


def status_lines(size: str | None = None, manual_dir: str | None = None) -> list[str]:
  """One line per task (and per ready dataset without `size`):
  `<task>  ready    <sizes>  <folder>` or `<task>  missing  <size>  <what to do>`."""
  rows = [(name, *entry) for name in sorted(tasks.TASKS)
          for entry in task_status(name, size, manual_dir)]
  width = max(len(r[0]) for r in rows)
  size_width = max(len(r[1]) for r in rows)
  return [f"{name:<{width}}  {state:<7}  {sizes:<{size_width}}  {detail}"
          for name, sizes, state, detail in rows]


def run(args: argparse.Namespace, overrides: Sequence[tuple[str, str]]) -> int:
  from lra.data import archives
  if args.data_command == "status":
    if overrides:
      print("error: --config.* overrides apply to `lra data prepare` only.", file=sys.stderr)
      return 2
    print(f"data root: {archives.data_root()} (set ${archives.DATA_ROOT_ENV} to move it)")
    print(f"sizes: {args.size}" if args.size else
          "sizes: those with data ready (else the first); --size SIZE shows one size")
    manual = args.manual_dir or archives.default_manual_dir()
    if storage.is_remote(manual):
      print(f"manual folder: {manual} (in a bucket: `lra data prepare` copies its files to a "
            f"local temporary folder and builds there)")
    print("\n".join(status_lines(args.size, args.manual_dir)))
    return 0
  try:
    task = tasks.get_task(args.task)
    data = data_config(args.task, args.size or "base", args.manual_dir, overrides)
    if not args.download and "download" in data:
      data.download = False
    folder = (_prepare_into_bucket(task, data, args.task) if storage.is_remote(data.data_dir)
              else task.prepare(data))
  except (archives.DataMissingError, archives.CorruptArchiveError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{args.task}: dataset ready in {folder}")
  return 0


def _download_tree(src: str, dst: str) -> int:
  """Copies bucket folder `src` (when it exists) to local folder `dst`, file by file; returns the
  number of files copied."""
  fs = storage.remote_filesystem(src)
  top = src.rstrip("/")
  count = 0
  for folder, _, names in storage.walk(top):
    rel = folder[len(top):].strip("/")
    for name in names:
      target = os.path.join(dst, *rel.split("/"), name) if rel else os.path.join(dst, name)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      fs.get_file(f"{folder}/{name}", target)
      count += 1
  os.makedirs(dst, exist_ok=True)
  return count


def _prepare_into_bucket(task, data, name: str) -> str:
  """Builds `task`'s dataset for data settings `data` (whose data_dir is in a bucket) in a local
  temporary folder and uploads its version folder to the same place under data_dir, the
  `dataset_info.json` that marks it prepared last; returns the bucket folder."""
  from lra.data import archives
  storage.check_remote(data.data_dir)   # one line: no gcsfs, no such bucket, no credentials
  status = task.status(data)
  if status.ready:
    return status.detail
  staging = tempfile.mkdtemp(prefix="lra-data-")
  try:
    local = data.copy_and_resolve_references()
    local.data_dir = os.path.join(staging, "data")
    remote_manual = "manual_dir" in local and storage.is_remote(local.manual_dir)
    if remote_manual:
      local.manual_dir = os.path.join(staging, "manual")
      count = _download_tree(data.manual_dir, local.manual_dir)
      if count:
        print(f"{name}: copied {count} files from {data.manual_dir} to a local temporary "
              f"folder.", file=sys.stderr, flush=True)
    try:
      built = task.prepare(local)
    except (archives.DataMissingError, archives.CorruptArchiveError) as e:
      if not remote_manual:   # name the bucket's folder, where the user puts the files
        raise
      raise type(e)(str(e).replace(local.manual_dir, data.manual_dir)) from None
    rel = os.path.relpath(built, local.data_dir)
    dest = storage.join(data.data_dir, *rel.split(os.sep))
    count = storage.copy_tree(built, dest, last="dataset_info.json")
    print(f"{name}: copied {count} files to {dest}.", file=sys.stderr, flush=True)
    return dest
  finally:
    shutil.rmtree(staging, ignore_errors=True)
