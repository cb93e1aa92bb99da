"""A new researcher's first hour, scripted: the README's main job and the doc commands that state
a number, run from a fresh clone, each compared with what its doc says.

    .venv/bin/python benchmarks/first_hour.py --quick     # dry runs and short commands (~1 min)
    .venv/bin/python benchmarks/first_hour.py             # also the training runs (~25 min)
    .venv/bin/python benchmarks/first_hour.py --only demo,sweep_kinds_small

The checkout is cloned (`git clone`, so only committed files count) into a temporary folder and
every command runs there, with this interpreter and the clone's own code on `PYTHONPATH`
(`python -m launch.cli`, which is what the `lra` entry point runs) and a fresh `$LRA_DATA`, so
nothing is installed and nothing from this machine's earlier runs is reused. `--repo DIR` runs
in DIR instead of a clone (uncommitted edits count there), `--keep` keeps the folder.

Each `Check` names a doc, a pattern that finds the line stating the number (or the documented
line itself), the command, and a pattern for the same number in the command's output. The
expected value is always read from the doc (`doc_value`), never written here, so a doc whose
number went stale fails the check. The comparison (`compare`):
  - `exact`: the output rounded (half up) to the doc's own digits equals the doc's number (a
    doc's "0.39" accepts 0.3925 and 0.3895; a doc's "0.3925" accepts only 0.3925);
  - `factor F`: within a factor F either way (estimates that depend on the machine); where the
    doc states the factor itself (`tolerance_pattern`), that one is used;
  - `line`: the documented output line appears in the output (whitespace runs compared as one);
  - `text`: the same word (the kind a paper's name runs as).
The command must also end with the documented exit status. The script prints one row per
check (command, expected, got, ok) and exits with 1 if any check failed.

`--quick` takes the checks marked quick: `lra list`, the dry run with its parameter count, the
refusal of a base-size run with its hours, a 5-step run of a paper-named kind. The full mode
adds the training runs: the main job (`make demo` = `lra run listops --size small`, about
2.5 min on 2 cores), the four-run sweep of docs/launch.md (one run at a time: the accuracies do
not depend on the parallelism), the spt example of docs/pretraining.md, the float32 and
bfloat16 band runs of docs/long_context.md and the enwik8 demo of docs/character_lm.md (about
8 min). Runs are deterministic on one machine; the docs' numbers
come from the 2-core development machine, and another machine's float reductions may differ in
the last digits, which is what this script is for: it says where.
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Check:
  name: str
  doc: str                 # file relative to the repository
  pattern: str             # regex for the doc's line; group 1 is the number ('line': the line)
  command: tuple[str, ...]  # argv after `lra`
  output: str              # regex for the number in the command's output (group 1)
  compare: str = "exact"   # 'exact', 'factor', 'line' or 'text'
  factor: float = 1.0      # for 'factor', unless the doc states it
  tolerance_pattern: str = ""   # regex for the doc's own tolerance factor (group 1)
  exit_status: int = 0
  quick: bool = False
  minutes: float = 0.1     # about how long the command takes on 2 cores
  occurrence: int = -1     # which of the output's matches: the last (a staged run's final phase)


_ACC = r"test accuracy (\d+\.\d+) \(majority class"
_BPC = r"test bits per character (\d\.\d+)"
_SWEEP = r"\[{k}/4\] attention={kind},size=small,num_train_steps=200,seed={seed}: finished .*?" \
         r"test accuracy (\d+\.\d+)"

CHECKS = (
    *(Check(f"list_{kind}", "README.md", rf"^({kind}\s+{paper} \(.*)$", ("list",), "",
            compare="line", quick=True)
      for kind, paper in (("band", "Longformer"), ("favor", "Performer"), ("lsh", "Reformer"))),
    Check("dry_run_params", "docs/training.md", r"^parameters: ([\d,]+)$",
          ("run", "listops", "--size", "small", "--dry_run=steps:5", "--config.batch_size=64"),
          r"^parameters: ([\d,]+)$", exit_status=0, quick=True, minutes=0.3),
    Check("base_hours", "docs/training.md",
          r"^error: listops \(attention=band,size=base,window=128\) would train for about "
          r"(\d+) hours", ("run", "listops", "--attention", "band"),
          r"would train for about (\d+) hours", compare="factor",
          tolerance_pattern=r"the estimate is\s+good to a factor of about (\d+(?:\.\d+)?)",
          exit_status=2, quick=True, minutes=0.5),
    Check("performer_5_steps", "README.md", r"`performer` is\s+`(\w+)`",
          ("run", "listops", "--attention", "performer", "--size", "small",
           "--config.num_train_steps=5", "--config.eval_every=5"),
          r"^Training listops \(attention=(\w+),size=small\)", compare="text", quick=True,
          minutes=0.5),
    Check("demo", "README.md", r"`test accuracy (\d+\.\d+) \(majority class", ("run", "listops",
          "--size", "small"), _ACC, minutes=2.5),
    Check("demo_majority", "README.md", r"`test accuracy \d+\.\d+ \(majority class (\d+\.\d+)\)`",
          ("run", "listops", "--size", "small"), r"\(majority class (\d+\.\d+)\)", minutes=2.5),
    Check("demo_training_md", "docs/training.md",
          r"^test accuracy (\d+\.\d+) \(majority class \d+\.\d+\), best validation",
          ("run", "listops", "--size", "small"), _ACC, minutes=2.5),
    Check("demo_seed0", "docs/pretraining.md", r"^\| ListOps \| scratch \(800 steps\) \| (\d\.\d+)",
          ("run", "listops", "--size", "small"), _ACC, minutes=2.5),
    *(Check(f"sweep_kinds_small_{k}", "docs/launch.md",
            r"^" + re.escape(f"[{k}/4] attention={kind},size=small,num_train_steps=200,"
                             f"seed={seed}: finished") + r".*?test accuracy (\d\.\d+)",
            ("sweep", "listops", "--sweep", "kinds_small", "--workdir", "workdirs/listops-kinds",
             "--parallel", "1"), _SWEEP.format(k=k, kind=kind, seed=seed), minutes=4.0)
      for k, kind, seed in ((1, "dot_product", 0), (2, "dot_product", 1), (3, "band", 0),
                            (4, "band", 1))),
    Check("spt_seed0", "docs/pretraining.md",
          r"^\| ListOps \| spt, mlm \(400 \+ 400\) \| (\d\.\d+)",
          ("run", "listops", "--size", "small", "--workdir", "workdirs/spt-s0",
           "--config.protocol=spt"), _ACC, minutes=2.5),
    *(Check(f"long_context_{name}", "docs/long_context.md", rf"^\| {dtype} \| (\d\.\d+) \|",
            ("run", "listops", "--size", "small", "--attention", "band", "--workdir",
             f"runs/{name}", *extra), _ACC, minutes=2.5)
      for name, dtype, extra in (("f32", "float32", ()),
                                 ("bf16", "bfloat16", ("--config.dtype=bfloat16",)))),
    Check("enwik8_small", "docs/character_lm.md",
          r"^\| `lra run enwik8 --size small` .*?\| \*\*(\d\.\d+)\*\*",
          ("run", "enwik8", "--size", "small"), _BPC, minutes=8.5),
    Check("enwik8_small_phase1", "docs/character_lm.md",
          r"^\| `lra run enwik8 --size small` .*?\| (\d\.\d+) \| \*\*\d\.\d+\*\*",
          ("run", "enwik8", "--size", "small"), _BPC, minutes=8.5, occurrence=0),
    Check("enwik8_small_positions", "docs/positions.md",
          r"seed 0\): test BPC (\d\.\d+) with relative positions",
          ("run", "enwik8", "--size", "small"), _BPC, minutes=8.5),
)


def doc_value(text: str, pattern: str) -> str:
  """Group 1 of the one line of `text` that `pattern` matches (re.M); ValueError when no line
  or several lines match, so a doc that dropped or doubled its number is reported."""
  found = [m.group(1) for m in re.finditer(pattern, text, re.M)]
  if len(found) != 1:
    raise ValueError(f"{len(found)} lines match {pattern!r}")
  return found[0]


def _number(text: str) -> float:
  return float(text.replace(",", ""))


def _decimals(text: str) -> int:
  return len(text.partition(".")[2])


def compare(kind: str, expected: str, got: str | None, factor: float = 1.0) -> bool:
  """Whether the output's `got` matches the doc's `expected` (see the module docstring)."""
  if got is None:
    return False
  if kind == "line":
    return " ".join(expected.split()) == " ".join(got.split())
  if kind == "text":
    return got == expected
  if kind == "factor":
    a, b = _number(expected), _number(got)
    return a > 0 and b > 0 and max(a / b, b / a) <= factor
  digits = decimal.Decimal(1).scaleb(-_decimals(expected))   # the doc's last digit, half up
  rounded = decimal.Decimal(got.replace(",", "")).quantize(digits, decimal.ROUND_HALF_UP)
  return rounded == decimal.Decimal(expected.replace(",", ""))


def output_value(check: Check, out: str, expected: str) -> str | None:
  """The number (or, for 'line', the documented line) the command printed, or None."""
  if check.compare == "line":
    want = " ".join(expected.split())
    return next((line for line in out.splitlines() if " ".join(line.split()) == want), None)
  found = list(re.finditer(check.output, out, re.M))   # a staged run prints one per phase
  return found[check.occurrence].group(1) if found else None


@dataclasses.dataclass
class Row:
  check: Check
  expected: str
  got: str
  ok: bool
  note: str = ""


def evaluate(check: Check, docs: dict[str, str], status: int | None, out: str) -> Row:
  """One check's row, from the docs' texts and the command's exit status and output."""
  text = docs[check.doc]
  try:
    expected = doc_value(text, check.pattern)
    factor = check.factor
    if check.tolerance_pattern:
      factor = _number(doc_value(text, check.tolerance_pattern))
  except ValueError as e:
    return Row(check, "?", "", False, f"{check.doc}: {e}")
  got = output_value(check, out, expected)
  shown_expected = (f"{expected} (x/÷ {factor:g})" if check.compare == "factor" else
                    " ".join(expected.split()[:3]) + " ..." if check.compare == "line" else
                    expected)
  if status != check.exit_status:
    tail = out.strip().splitlines()[-1:] or [""]
    return Row(check, shown_expected, got or "", False,
               f"exit {status}, documented {check.exit_status}: {tail[0][:200]}")
  ok = compare(check.compare, expected, got, factor)
  last = (out.strip().splitlines() or [""])[-1][:200]
  return Row(check, shown_expected, "(not printed)" if got is None else
             ("the line" if check.compare == "line" else got), ok,
             f"its last line: {last}" if got is None else "")


def run_command(argv: tuple[str, ...], repo: Path, data: Path, timeout: float) -> tuple[int, str]:
  """`lra ARGV` in `repo` with its own code and `data` as $LRA_DATA: (exit status, output)."""
  env = {**os.environ, "PYTHONPATH": str(repo), "LRA_DATA": str(data), "COLUMNS": "200"}
  try:
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *argv], cwd=repo, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
  except subprocess.TimeoutExpired as e:
    return 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
  return proc.returncode, proc.stdout


def table(rows: list[Row]) -> str:
  head = ("check", "command", "expected", "got", "ok")
  body = [(r.check.name, "lra " + " ".join(r.check.command), r.expected, r.got,
           "ok" if r.ok else "MISMATCH" + (f" ({r.note})" if r.note else "")) for r in rows]
  widths = [max(len(x[i]) for x in [head, *body]) for i in range(4)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(x[:4], widths)) + "  " + x[4]
           for x in [head, *body]]
  return "\n".join([lines[0], "  ".join("-" * w for w in widths) + "  --", *lines[1:]])


def select(quick: bool, only: str) -> list[Check]:
  names = [n for n in only.split(",") if n]
  chosen = [c for c in CHECKS if (not names and (c.quick or not quick))
            or any(c.name == n or c.name.startswith(n + "_") for n in names)]
  unknown = [n for n in names if not any(c.name == n or c.name.startswith(n + "_")
                                         for c in CHECKS)]
  if unknown:
    raise SystemExit(f"error: no check named {', '.join(unknown)}; checks: "
                     f"{', '.join(c.name for c in CHECKS)}")
  return chosen


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="dry runs and the commands under about a minute only")
  parser.add_argument("--only", default="", help="comma-separated check names (or prefixes)")
  parser.add_argument("--repo", help="run in this checkout instead of a fresh clone")
  parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
  args = parser.parse_args(argv)
  checks = select(args.quick, args.only)
  folder = Path(tempfile.mkdtemp(prefix="first-hour-"))
  try:
    if args.repo:
      repo = Path(args.repo).resolve()
    else:
      repo = folder / "repo"
      subprocess.run(["git", "clone", "--quiet", str(REPO), str(repo)], check=True)
    docs = {c.doc: (repo / c.doc).read_text() for c in checks}
    outputs: dict[tuple[str, ...], tuple[int, str]] = {}
    rows = []
    for check in checks:
      if check.command not in outputs:   # a command shared by several checks runs once
        start = time.monotonic()
        print(f"$ lra {' '.join(check.command)}  (about {check.minutes:g} min)", flush=True)
        outputs[check.command] = run_command(check.command, repo, folder / "data",
                                             timeout=max(600.0, 3 * 60 * check.minutes))
        print(f"  exit {outputs[check.command][0]} after {time.monotonic() - start:.0f} s",
              flush=True)
      rows.append(evaluate(check, docs, *outputs[check.command]))
    print(table(rows))
    bad = [r.check.name for r in rows if not r.ok]
    print(f"{len(rows) - len(bad)} of {len(rows)} checks match their docs"
          + (f"; mismatched: {', '.join(bad)}" if bad else "."))
    return 1 if bad else 0
  finally:
    if args.keep:
      print(f"kept {folder}")
    else:
      shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
