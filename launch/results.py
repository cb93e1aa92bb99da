"""`lra results DIR`: every run under DIR as one table, or in the Long Range Arena's layout.

  lra results DIR [--format markdown|csv|json] [--sort COLUMN] [--lra]

A run is a folder holding `config.json`, `results.json` or a sweep's `sweep.json`; a staged run
is the folder holding `phase1/`, `phase2/`, ... and counts as finished when its last phase has
its `results.json`. Each row: the run's path under DIR, task, attention kind, size, overrides
(the run's `config.json` against the task's default config for the same `get_config` argument,
or a staged run's current phase against that phase's default, leaving out the seed and where
files live), seed, steps done and in all, the best validation metric and its step, the test
metric (bits per character when the run has them, else accuracy), the parameter count (the
`param_count` the trainer writes into `results.json`, a staged run's from its last phase; blank
while there is none), where it ran (from the same results.json: the process count, the device
count and platform, the mesh axes larger than 1, the attention backend), the wall time of the
invocations that finished each part, and the status: `finished`; `pending` (a sweep point
not started yet); `running` (a live process on this host holds the run's lock, or the sweep
started it and it is still alive); `failed` (its last sweep attempt exited with an error or,
without a sweep record, an `error.log`), with the reason; `interrupted` otherwise.

`--lra` prints Table 1 of the LRA paper from the finished runs: the attention kinds as rows, the
six tasks as columns, test accuracy in percent as mean ± std over seeds, FAIL when the mean is
within one point of the majority-class rate, and the average over the tasks but Path-X; settings
shared by every run are printed once above it, and a second table gives the parameter counts.

Everything comes from the runs' files and their configs: no model is built and jax is never
imported, so the table is instant. DIR may be a bucket (`gs://...`): the folders are listed and
the files read through lra.storage, and a bucket that cannot be used is refused in one line.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import statistics
import sys
from typing import Any, Iterable, Sequence

import configs
from launch import run_state
from launch.values import flatten, value_text
from lra import identity, phases, rundir, storage
from lra.rundir import RunDir

# (name, test field, best-validation field, validation-record field, higher is better): a run's
# metric is the first whose test field its results.json has.
METRICS = (("bpc", "test_bpc", "best_validation_bpc", "bpc", False),
           ("accuracy", "test_accuracy", "best_validation_accuracy", "accuracy", True))
# Config fields that say where files are or how a run reports, not what it trained.
NOT_OVERRIDES = ("config_arg", "size", "seed", "data.data_dir", "data.manual_dir", "data.download",
                 "progress", "init_from", "init_from_hf", "distributed", "peer_timeout_s")
LRA_TASKS = (("listops", "ListOps"), ("text", "Text"), ("retrieval", "Retrieval"),
             ("image", "Image"), ("pathfinder", "Pathfinder"), ("pathx", "Path-X"))
COLUMNS = ("run", "task", "attention", "size", "overrides", "seed", "steps", "total_steps",
           "metric", "best_validation", "best_step", "test", "majority_class_rate", "params",
           "processes", "devices", "platform", "mesh", "backend", "wall_seconds", "status",
           "reason")
FORMATS = ("markdown", "csv", "json")
_HIGHER = {m[0]: m[4] for m in METRICS}


def find_runs(root: str) -> list[str]:
  """The run folders under `root` (itself included), sorted by path."""
  runs = []
  for base, dirs, files in storage.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in rundir.PARTS)
    marks = (rundir.MARKS | {run_state.RECORD}) & set(files)
    if marks or run_state.phase_dirs(base):
      runs.append(base)
      dirs[:] = []      # a run holds no other runs (its phases belong to it)
  return sorted(runs)


_DEFAULTS: dict[tuple[str, str, int], dict[str, Any] | None] = {}


def default_config(task: str, arg: str, phase: int = 0,
                   staged: bool = False) -> dict[str, Any] | None:
  """The flattened default config of `task` for the `get_config` argument `arg` (phase `phase`,
  0-based, of a staged one) as `config.json` holds it; None when it no longer resolves."""
  key = (task, arg, phase if staged else -1)
  if key not in _DEFAULTS:
    try:
      c = configs.build_config(task, arg=arg)
      if staged:
        c = phases.phase_config(c, phase)
      _DEFAULTS[key] = flatten(json.loads(c.to_json_best_effort()))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
      _DEFAULTS[key] = None
  return _DEFAULTS[key]


def overrides_of(config: dict[str, Any], phase: int = 0, staged: bool = False) -> list[str]:
  """`key=value` for each field of a run's config.json that differs from the default."""
  base = default_config(config.get("task", ""), identity.arg(config), phase, staged)
  if base is None:
    return ["(default config unavailable)"]
  mine = flatten(config)
  out = []
  for key in sorted(set(mine) | set(base)):
    if key in NOT_OVERRIDES or any(key.startswith(k + ".") for k in NOT_OVERRIDES):
      continue
    if key not in mine:
      out.append(f"{key}=(unset)")
    elif key not in base or mine[key] != base[key]:
      out.append(f"{key}={value_text(mine[key])}")
  return out


def _metric_of(results: dict[str, Any] | None):
  for m in METRICS:
    if results is not None and results.get(m[1]) is not None:
      return m
  return METRICS[-1]


def _number(v: Any) -> float | int | None:
  """`v` when it is a number (not a bool, not NaN or infinite), else None: a field of a
  results.json or metrics record of any shape is shown as missing rather than failing."""
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    return None
  return v if v == v and abs(v) != float("inf") else None


def _integer(v: Any) -> int | None:
  return v if isinstance(v, int) and not isinstance(v, bool) else None


def _text(v: Any) -> str:
  return v if isinstance(v, str) else ""


def _text_of(path: str) -> str | None:
  """A file's text, undecodable bytes replaced; None when it is missing or unreadable."""
  try:
    data = storage.read_bytes(path)
  except (OSError, ValueError):
    return None
  return None if data is None else data.decode("utf-8", "replace")


def _last_line(path: str) -> str:
  text = _text_of(path) or ""
  lines = [x.strip() for x in re.split(r"[\r\n]", text[-8192:]) if x.strip()]
  return lines[-1] if lines else ""


def _best_so_far(part: str, metric) -> tuple[float | None, int | None]:
  """The best validation value and step in a run's metrics.jsonl (for unfinished runs); lines
  that are not records (damaged, cut short, not UTF-8) are passed over."""
  best, step = None, None
  for line in (_text_of(RunDir(part).metrics) or "").splitlines():
    try:
      r = json.loads(line)
    except ValueError:
      continue
    if not isinstance(r, dict) or r.get("split") != "validation":
      continue
    v = _number(r.get(metric[3]))
    if v is not None and (best is None or (v > best if metric[4] else v < best)):
      best, step = v, _integer(r.get("step"))
  return best, step


def _mesh(v: Any) -> str | None:
  """A results.json mesh ({axis: size}) as its axes larger than 1 (`data=2,tensor=4`), or `1`
  (one device); None when it is not such a record."""
  if not isinstance(v, dict) or not all(_integer(n) is not None for n in v.values()):
    return None
  return ",".join(f"{axis}={n}" for axis, n in v.items() if n > 1) or "1"


def _damaged(paths: Sequence[str]) -> str:
  """The reason a run's results are not shown when one of `paths` (results.json files) exists
  but holds no JSON object: '' when none does."""
  for path in paths:
    if storage.exists(path) and run_state.read_dict(path) is None:
      return (f"{path} is damaged (not a JSON object); rerun the same command to write it "
              f"again")
  return ""


def read_run(root: str, run_dir: str) -> dict[str, Any]:
  """One row of the table for the run in `run_dir`; any file that is damaged or of another
  shape than the trainer writes is shown as missing (`run_state.read_dict`, `_number`)."""
  try:
    return _read_run(root, run_dir)
  except Exception as e:  # noqa: BLE001 - a listing never fails on one run's files
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return {**{c: None for c in COLUMNS}, "_overrides": [], "overrides": "", "metric":
            "accuracy", "steps": 0, "task": "", "attention": "", "size": "",
            "run": os.path.relpath(run_dir, root) if run_dir != root else
            os.path.basename(os.path.abspath(root)), "status": "failed",
            "reason": f"its files could not be read ({type(e).__name__}: {first})"}


def _read_run(root: str, run_dir: str) -> dict[str, Any]:
  record = run_state.read_record(run_dir)
  phase_names = run_state.phase_dirs(run_dir)
  staged = bool(phase_names) or bool(record.get("staged_phases"))
  any_config = RunDir(rundir.join(run_dir, phase_names[0]) if phase_names else run_dir
                      ).read_config() or {}
  task = _text(any_config.get("task")) or _text(record.get("task"))
  # the sweep's point as its file gave it (`add(config_arg=...)`), else the run's own identity
  arg = _text(record.get("config_arg")) or (identity.arg(any_config) if any_config else "")
  try:   # the config the sweep asked for (else the default one), for what has not run yet
    planned = configs.build_config(task, arg=arg, overrides=[
        tuple(o) for o in record.get("overrides", [])])
  except (ValueError, KeyError, TypeError):
    planned = None
  schedule = (planned.get("phases") or ()) if planned is not None else ()
  staged = staged or bool(schedule)
  count = max(len(schedule), len(phase_names), 1) if staged else 1
  parts = [RunDir(run_dir).phase(k).path for k in range(1, count + 1)] if staged else \
      [run_dir]
  results = [RunDir(p).read_results() for p in parts]
  cfgs = [RunDir(p).read_config() for p in parts]
  current = max([i for i, c in enumerate(cfgs) if c] + [i for i, r in enumerate(results) if r]
                + [0])
  config = cfgs[current] or {}
  if not config and planned is not None and task:
    config = json.loads((phases.phase_config(planned, current) if staged else planned)
                        .to_json_best_effort())
  final = results[-1]
  metric = _metric_of(final or next((r for r in reversed(results) if r), None))
  overrides = overrides_of(config, current, staged) if config else []
  done_steps = sum(_integer(r.get("steps")) or 0 for r in results if r)
  if results[current] is None:
    done_steps += (RunDir(parts[current]).steps() or [0])[-1]
  totals = [int(p["steps"]) for p in schedule] if staged else \
      [_integer(config.get("num_train_steps")) or 0]
  row = {"run": os.path.relpath(run_dir, root) if run_dir != root else
         os.path.basename(os.path.abspath(root)),
         "task": task, "attention": identity.kind(config) or identity.kind(any_config),
         "size": identity.size(config) or identity.size(any_config),
         "overrides": " ".join(overrides),
         "seed": _integer(config.get("seed")), "steps": done_steps, "total_steps": sum(totals) or None,
         "metric": metric[0], "best_validation": None, "best_step": None, "test": None,
         "majority_class_rate": None, "params": None, "processes": None, "devices": None,
         "platform": "", "mesh": None, "backend": "", "wall_seconds": None, "status": "",
         "reason": "", "_overrides": overrides}
  last = final or results[current]
  if last:
    row.update(best_validation=_number(last.get(metric[2])),
               best_step=_integer(last.get("best_validation_step")),
               majority_class_rate=_number(last.get("majority_class_rate")),
               params=_integer(last.get("param_count")),
               processes=_integer(last.get("process_count")),
               devices=_integer(last.get("device_count")), platform=_text(last.get("platform")),
               mesh=_mesh(last.get("mesh")), backend=_text(last.get("attention_backend")))
  else:
    row["best_validation"], row["best_step"] = _best_so_far(parts[current], metric)
  attempts = [a for a in record.get("attempts") or [] if isinstance(a, dict)] \
      if isinstance(record.get("attempts"), list) else []
  exit_code = _integer(attempts[-1].get("exit_code")) if attempts else None
  damaged = _damaged([RunDir(p).results for p in parts])
  if final is not None:
    row.update(status="finished", test=_number(final.get(metric[1])), total_steps=done_steps,
               wall_seconds=round(sum(_number(r.get("wall_seconds_this_run")) or 0.0
                                      for r in results if r), 1))
  elif run_state.live_pid(run_dir) is not None:
    row["status"] = "running"
  elif record and not attempts and not any(cfgs) and not damaged:
    row["status"] = "pending"
  elif exit_code is not None:
    row["status"] = "failed" if exit_code > 0 and exit_code != 130 else "interrupted"
    if row["status"] == "failed":
      row["reason"] = _text(attempts[-1].get("last_line")) or f"exit status {exit_code}"
  elif damaged:   # as `lra sweep` sees it: not finished, so its rerun writes it again
    row.update(status="interrupted", reason=damaged)
  else:
    logs = [RunDir(p).error_log for p in (run_dir, *parts)]
    failed = [p for p in logs if storage.exists(p)]
    row["status"] = "failed" if failed else "interrupted"
    if failed:
      row["reason"] = f"{_last_line(failed[-1])} (see {failed[-1]})"
  return row


def collect(root: str) -> list[dict[str, Any]]:
  return [read_run(root, d) for d in find_runs(root)]


def sort_rows(rows: list[dict[str, Any]], column: str) -> list[dict[str, Any]]:
  """Rows sorted by `column`: metrics best first (by each row's metric), numbers ascending,
  text alphabetically; rows without a value last."""
  def key(row):
    v = row.get(column)
    if v is None or v == "":
      return (1, 0, "")
    if isinstance(v, (int, float)):
      higher = column in ("test", "best_validation") and _HIGHER.get(row["metric"], True)
      return (0, -v if higher else v, "")
    return (0, 0, str(v))
  return sorted(rows, key=key)


def _seconds(s: float | None) -> str:
  if s is None:
    return "-"
  return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _value(v: Any, metric: str) -> str:
  if v is None:
    return "-"
  return f"{v:.4f}" + (" bpc" if metric == "bpc" else "")


def _md(cells: Iterable[Any]) -> str:
  return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
  header = ("run", "task", "attention", "size", "overrides", "seed", "steps",
            "best validation (step)", "test", "params", "procs", "devices", "mesh", "backend",
            "wall", "status")
  lines = [_md(header), _md("---" for _ in header)]
  for r in rows:
    best = "-" if r["best_validation"] is None else \
        f"{_value(r['best_validation'], r['metric'])} ({r['best_step']})"
    steps = f"{r['steps']}/{r['total_steps']}" if r["total_steps"] else str(r["steps"])
    lines.append(_md((r["run"], r["task"], r["attention"], r["size"], r["overrides"] or "-",
                      "-" if r["seed"] is None else r["seed"], steps, best,
                      _value(r["test"], r["metric"]),
                      "-" if r["params"] is None else f"{r['params']:,}",
                      "-" if r["processes"] is None else r["processes"],
                      "-" if r["devices"] is None else
                      f"{r['devices']} {r['platform']}".strip(),
                      r["mesh"] or "-", r["backend"] or "-",
                      _seconds(r["wall_seconds"]), r["status"])))
  lines += [f"{r['status']}: {r['run']}: {r['reason']}" for r in rows if r["reason"]]
  return "\n".join(lines)


def _public(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  return [{c: r[c] for c in COLUMNS} for r in rows]


def to_csv(records: Sequence[dict[str, Any]]) -> str:
  out = io.StringIO()
  writer = csv.DictWriter(out, fieldnames=list(records[0]) if records else list(COLUMNS),
                          lineterminator="\n")
  writer.writeheader()
  writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in records)
  return out.getvalue().rstrip("\n")


def lra_cells(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
  """The LRA table's cells from the finished accuracy runs of LRA tasks: (settings shared by
  every run, one record per (row, task) with mean, std and count over seeds, FAIL, params)."""
  names = dict(LRA_TASKS)
  runs = [r for r in rows if r["status"] == "finished" and r["task"] in names
          and r["metric"] == "accuracy" and r["test"] is not None]
  items = {id(r): [f"size={r['size']}", *r["_overrides"]] for r in runs}
  common = [x for x in (items[id(runs[0])] if runs else [])
            if all(x in items[id(r)] for r in runs)]
  groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
  for r in runs:
    label = " ".join([r["attention"], *(x for x in items[id(r)] if x not in common)])
    groups.setdefault((label, r["task"]), []).append(r)
  cells = []
  for (label, task), group in groups.items():
    accs = [100 * r["test"] for r in group]
    majority = [100 * r["majority_class_rate"] for r in group
                if r["majority_class_rate"] is not None]
    mean = statistics.fmean(accs)
    cells.append({"row": label, "task": task, "mean": round(mean, 2),
                  "std": round(statistics.stdev(accs), 2) if len(accs) > 1 else None,
                  "seeds": len(accs), "majority": round(statistics.fmean(majority), 2)
                  if majority else None,
                  "fail": bool(majority) and mean <= statistics.fmean(majority) + 1.0,
                  "params": max((r["params"] for r in group if r["params"]), default=None)})
  return common, cells


def _short(n: int | None) -> str:
  if n is None:
    return "-"
  return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def lra_markdown(common: Sequence[str], cells: Sequence[dict[str, Any]]) -> str:
  """The LRA layout: accuracy (mean ± std over seeds, FAIL) and the parameter counts."""
  row_labels = sorted({c["row"] for c in cells})
  at = {(c["row"], c["task"]): c for c in cells}
  header = ("attention", *(name for _, name in LRA_TASKS), "Avg")
  acc, par = [_md(header), _md("---" for _ in header)], [_md(header[:-1]), _md("---" for _ in
                                                                                header[:-1])]
  for label in row_labels:
    line, params, means = [label], [label], []
    for task, _ in LRA_TASKS:
      c = at.get((label, task))
      if c is None:
        line.append("-")
        params.append("-")
        continue
      text = f"{c['mean']:.2f}" + (f" ± {c['std']:.2f}" if c["std"] is not None else "")
      line.append(f"FAIL ({text})" if c["fail"] else text)
      params.append(_short(c["params"]))
      if task != "pathx":
        means.append(c["mean"])
    avg = "-" if not means else f"{statistics.fmean(means):.2f}" + (
        f" ({len(means)}/5 tasks)" if len(means) < 5 else "")
    acc.append(_md([*line, avg]))
    par.append(_md(params))
  seeds = sorted({c["seeds"] for c in cells})
  head = [f"Test accuracy (%), mean ± std over {'/'.join(map(str, seeds))} seed(s); FAIL: "
          f"within 1 point of the majority class; Avg leaves out Path-X."]
  if common:
    head.append("All runs: " + " ".join(common))
  return "\n".join([*head, "", *acc, "", "Parameters:", "", *par])


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("dir", help="a folder of runs (a sweep's --workdir, or any folder)")
  parser.add_argument("--format", default="markdown", choices=FORMATS)
  parser.add_argument("--sort", default="run", metavar="COLUMN",
                      help=f"one of: {', '.join(COLUMNS[:-1])} (default run)")
  parser.add_argument("--lra", action="store_true",
                      help="the LRA layout: tasks as columns, attention kinds as rows")


def run(args: argparse.Namespace) -> int:
  """`lra results`: prints the table; 0 when there are runs, 1 when none, 2 on bad input."""
  try:
    is_folder = storage.isdir(args.dir)
  except ValueError as e:   # a bucket that cannot be used (storage.BucketError)
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not is_folder:
    print(f"error: {args.dir} is not a folder.", file=sys.stderr)
    return 2
  if args.sort not in COLUMNS:
    print(f"error: unknown column {args.sort!r} for --sort; valid: {', '.join(COLUMNS)}.",
          file=sys.stderr)
    return 2
  rows = sort_rows(collect(args.dir), args.sort)
  if not rows:
    print(f"no runs under {args.dir} (a run folder holds config.json or results.json).",
          file=sys.stderr)
    return 1
  if args.lra:
    common, cells = lra_cells(rows)
    if not cells:
      print(f"no finished LRA runs under {args.dir}.", file=sys.stderr)
      return 1
    if args.format == "markdown":
      print(lra_markdown(common, cells))
    elif args.format == "csv":
      print(to_csv(cells))
    else:
      print(json.dumps({"common": common, "cells": cells}, indent=2))
    return 0
  if args.format == "markdown":
    print(markdown(rows))
  elif args.format == "csv":
    print(to_csv(_public(rows)))
  else:
    print(json.dumps(_public(rows), indent=2))
  return 0
