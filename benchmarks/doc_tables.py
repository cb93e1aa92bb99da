"""The results tables of the docs, generated from the JSON the runs recorded beside them.

    .venv/bin/python benchmarks/doc_tables.py            # rewrite every table from its JSON
    .venv/bin/python benchmarks/doc_tables.py --check    # exit 1 naming the tables that differ

A doc holds a generated table between two marker lines (`<!-- NAME: begin -->` and
`<!-- NAME: end -->`, or the `<!-- longest_sequence: MODEL -->` ... `<!-- end -->` pair that
benchmarks/longest_sequence.py has always written); everything outside the markers is prose and
is left alone. Each `Table` names its doc, its markers, the recorded files it reads and the
function that renders it, so a rerun that rewrites the JSON updates the doc with this one
command, and tests/doc_tables_test.py fails when a doc's table is not what its JSON gives (a
hand edit, or a JSON rewritten without the doc).

The tables:
  - `listops kinds` (docs/efficiency.md): every attention kind's ListOps small test accuracy per
    seed and its mean, from `lra results workdirs/every-kind --format json`
    (docs/listops_small_kinds.json), beside its training steps/s at 1K and 4K from
    docs/efficiency.jsonl (benchmarks/lra_speed.py); dot_product first, the others by mean;
  - `lra_speed tables` (docs/efficiency.md): the tables `benchmarks/lra_speed.py --render`
    prints from docs/efficiency.jsonl;
  - `paired run 1` and `paired run 2` (docs/efficiency.md): the rows
    `benchmarks/lra_interleaved.py` prints for each of its two runs in
    docs/efficiency-paired.jsonl;
  - `longest_sequence: band` and `longest_sequence: band_small` (docs/long_context.md): the
    tables `benchmarks/longest_sequence.py --render` prints from docs/longest_sequence.jsonl,
    for the models of each block;
  - `gpu machine`, `gpu tests`, `gpu speed`, `gpu overtaking` and `gpu targets` (docs/gpu.md):
    the sections `benchmarks/gpu_report.py docs/gpu/h100-2026-11-27` prints from that records
    folder.
Rendering imports no jax and runs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

DOCS = os.path.join(ROOT, "docs")
REFERENCE = "dot_product"
KIND_LENGTHS = (1024, 4096)


@dataclasses.dataclass(frozen=True)
class Table:
  name: str
  doc: str                     # relative to the repository
  begin: str
  end: str
  sources: tuple[str, ...]     # the recorded files, relative to the repository
  render: Callable[..., str]   # called with the sources' paths


def _length(n: int) -> str:
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def listops_kinds(runs_path: str, speed_path: str) -> str:
  """One row per attention kind: test accuracy (percent) per seed and the mean, steps/s of the
  Text base training step at each of KIND_LENGTHS (`OOM` where it did not fit)."""
  from benchmarks import lra_speed
  with open(runs_path) as f:
    runs = [r for r in json.load(f) if r.get("status") == "finished" and r.get("test") is not None]
  speed = list(lra_speed.latest(lra_speed.read_records(speed_path)).values())
  seeds = sorted({r["seed"] for r in runs})
  by_kind: dict[str, dict[int, float]] = {}
  for r in runs:
    by_kind.setdefault(r["attention"], {})[r["seed"]] = 100.0 * float(r["test"])
  mean = {k: statistics.fmean(v.values()) for k, v in by_kind.items()}
  order = sorted(by_kind, key=lambda k: (k != REFERENCE, -mean[k], k))
  task = runs[0]["task"] if runs else "?"
  size = runs[0]["size"] if runs else "?"
  head = (f"| kind | {lra_speed_task_name(task)} {size} test accuracy, seeds "
          f"{' / '.join(map(str, seeds))} (mean) | "
          + " | ".join(f"steps/s at {_length(n)}" for n in KIND_LENGTHS) + " |")
  lines = [head, "|---|---:|" + "---:|" * len(KIND_LENGTHS)]
  for kind in order:
    accs = " / ".join(f"{by_kind[kind][s]:.2f}" if s in by_kind[kind] else "-" for s in seeds)
    cells = []
    for n in KIND_LENGTHS:
      r = next((x for x in speed if x["kind"] == kind and x["length"] == n), None)
      cells.append("-" if r is None else f"{r['steps_per_s']:.3f}" if r["status"] == "ok"
                   else r["status"].upper())
    lines.append(f"| {kind} | {accs} ({mean[kind]:.2f}) | {' | '.join(cells)} |")
  return "\n".join(lines)


def lra_speed_task_name(task: str) -> str:
  from benchmarks.lra_speed_plot import TASK_NAMES
  return TASK_NAMES.get(task, task)


def lra_speed_tables(speed_path: str) -> str:
  """What `benchmarks/lra_speed.py --render --out PATH` prints (and writes between its markers)."""
  from benchmarks import lra_speed
  from benchmarks import lra_speed_plot as report
  records = list(lra_speed.latest(lra_speed.read_records(speed_path)).values())
  done = {lra_speed.key(r): r for r in records}
  for r in records:
    lra_speed.add_ratios(r, done)
  return "\n\n".join(x for x in (report.describe(records), report.render_table(records),
                                 report.render_lra_layout(records),
                                 report.render_growth(records)) if x)


def longest_sequence_tables(path: str, small: bool) -> str:
  """What `benchmarks/longest_sequence.py --render` prints for the band_small model (`small`)
  or for every other model."""
  from benchmarks import longest_sequence
  records = [r for r in longest_sequence.read_records(path)
             if (r.get("model", "band_small") == "band_small") == small]
  return longest_sequence.table(records) + "\n\n" + longest_sequence.longest(records)


def paired_tables(path: str, run: int) -> str:
  """The rows `benchmarks/lra_interleaved.py` prints for its `run`-th run (0: the first) in
  `path`, a run being the records of one date."""
  from benchmarks import lra_interleaved
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  dates = list(dict.fromkeys(r["date"] for r in records))
  rows = [r for r in records if r["date"] == dates[run]]
  return "\n".join(lra_interleaved.table(rows, rows[0]["length"], rows[0]["batch"])
                   .splitlines()[2:])   # the table, without the line that says what it is


TABLES = (
    Table("listops kinds", "docs/efficiency.md", "<!-- listops kinds: begin -->",
          "<!-- listops kinds: end -->", ("docs/listops_small_kinds.json", "docs/efficiency.jsonl"),
          listops_kinds),
    Table("lra_speed tables", "docs/efficiency.md", "<!-- lra_speed tables: begin -->",
          "<!-- lra_speed tables: end -->", ("docs/efficiency.jsonl",), lra_speed_tables),
    *(Table(f"paired run {k + 1}", "docs/efficiency.md", f"<!-- paired run {k + 1}: begin -->",
            f"<!-- paired run {k + 1}: end -->", ("docs/efficiency-paired.jsonl",),
            lambda path, k=k: paired_tables(path, k)) for k in range(2)),
    Table("longest_sequence: band", "docs/long_context.md", "<!-- longest_sequence: band -->",
          "<!-- end -->", ("docs/longest_sequence.jsonl",),
          lambda path: longest_sequence_tables(path, small=False)),
    Table("longest_sequence: band_small", "docs/long_context.md",
          "<!-- longest_sequence: band_small -->", "<!-- end -->",
          ("docs/longest_sequence.jsonl",), lambda path: longest_sequence_tables(path, small=True)),
)


GPU_RECORDS = "docs/gpu/h100-2026-11-27"
GPU_SOURCES = tuple(f"{GPU_RECORDS}/{name}" for name in ("env.jsonl", "tests.jsonl", "tests.log",
                                                         "speed.jsonl"))


def gpu_table(section: str) -> Callable[..., str]:
  """A section of benchmarks/gpu_report.py, rendered from the folder of the GPU_SOURCES."""
  def render(*paths: str) -> str:
    from benchmarks import gpu_report
    folder = os.path.dirname(paths[0])
    records = gpu_report.load(folder)
    if section == "tests":
      return gpu_report.tests_table(records, folder)
    return getattr(gpu_report, f"{section}_table" if section != "speed" else "speed_tables")(
        records)
  return render


TABLES += tuple(Table(f"gpu {s}", "docs/gpu.md", f"<!-- gpu {s}: begin -->",
                      f"<!-- gpu {s}: end -->", GPU_SOURCES, gpu_table(s))
                for s in ("machine", "tests", "speed", "overtaking", "targets"))


def generated(table: Table, root: str = ROOT) -> str:
  return table.render(*(os.path.join(root, s) for s in table.sources))


def in_doc(text: str, table: Table) -> str:
  """The text between the table's marker lines in a doc (ValueError when they are missing)."""
  if table.begin not in text:
    raise ValueError(f"{table.doc} has no line {table.begin}")
  rest = text.split(table.begin + "\n", 1)[1]
  if table.end not in rest:
    raise ValueError(f"{table.doc} has no {table.end} after {table.begin}")
  return rest.split("\n" + table.end, 1)[0]


def replace(text: str, table: Table, body: str) -> str:
  head, rest = text.split(table.begin + "\n", 1)
  return f"{head}{table.begin}\n{body}\n{table.end}{rest.split(chr(10) + table.end, 1)[1]}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 naming each table that differs from its JSON")
  parser.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  stale = []
  for table in TABLES:
    path = os.path.join(args.root, table.doc)
    with open(path) as f:
      text = f.read()
    body = generated(table, args.root)
    if in_doc(text, table) == body:
      continue
    stale.append(table)
    if not args.check:
      new = replace(text, table, body)   # before the file is opened: a failure keeps the doc
      with open(path, "w") as f:
        f.write(new)
  for table in stale:
    verb = "differs from" if args.check else "rewritten from"
    print(f"{table.doc}: {table.name} {verb} {', '.join(table.sources)}")
  if not stale:
    print(f"{len(TABLES)} tables are what their JSON gives.")
  return 1 if stale and args.check else 0


if __name__ == "__main__":
  sys.exit(main())
