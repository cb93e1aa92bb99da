"""Mutation testing of one module with the tests that cover it (cosmic-ray), in a private copy.

    python benchmarks/mutation.py attention/band.py            # or: make mutation MODULE=...
    python benchmarks/mutation.py attention/band.py --report   # the last run's summary again

Design:
* The tool rewrites the module on disk, one mutant at a time, and runs a test command. So the
  run happens in a copy of the work tree (the files git tracks or would track, under
  `--workdir`, default `$TMPDIR/mutation/<module>`): the repository is never touched, and
  several modules can run at once in their own copies. The test command imports the copy (the
  copy's root is first on `sys.path`), which the baseline checks before any mutant runs.
* Each module is tested with its own, fast tests (`TESTS` below: `-m "not slow"`, `-x`, and a
  `-k` selection of the larger files), so that a module takes minutes; a killed mutant usually
  stops at its first failing test.
* Operators: one or two meaningful replacements per site rather than every one cosmic-ray has
  (`KEPT`): + and - swapped, * and / swapped, boundaries of comparisons moved (< and <=) and
  flipped, == and !=, & and |, `and` and `or`, `not` and `~` and unary minus dropped, booleans
  flipped, numbers moved by one, loops run zero times, exceptions replaced. Shifts, xor, powers
  of every operator and the removal of decorators (`jax.jit`: equivalent by design) are left out.
* The summary (`summary.json` and the printed table) counts killed, survived, timeouts and
  incompetent mutants (those that raise before the tests run count as killed by cosmic-ray), and
  lists every survivor with its line and diff. docs/testing.md records the scores and explains
  the equivalent survivors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Module -> pytest arguments (files and selections) run against each of its mutants.
_CORRECTNESS = "tests/correctness_test.py"
TESTS: dict[str, list[str]] = {
    "attention/band.py": ["tests/mutation_band_test.py", "tests/band_test.py"],
    "attention/relative.py": ["tests/mutation_relative_test.py", "tests/relative_test.py",
                              _CORRECTNESS, "-k",
                              "relative or sinusoid or compressive_layer or not correctness"],
    "models/memory.py": ["tests/mutation_memory_test.py", "tests/recurrence_test.py",
                         _CORRECTNESS, "-k",
                         "memory or compress or reconstruction or same_length or sublayers "
                         "or not correctness"],
    "lra/tasks/pretraining.py": ["tests/mutation_pretraining_test.py", "tests/pretraining_test.py",
                                 _CORRECTNESS, "-k", "(bert or mpnet or not correctness) "
                                 "and not cli_refuses"],
    "attention/dot_product.py": ["tests/mutation_dot_product_test.py", "tests/models_test.py",
                                 "tests/band_test.py"],
    "attention/masks.py": ["tests/band_test.py", "tests/sparse_patterns_test.py",
                           "tests/lsh_test.py", "tests/pretraining_test.py", _CORRECTNESS, "-k",
                           "mpnet or not correctness"],
    "attention/rotary.py": ["tests/positions_test.py", _CORRECTNESS, "-k",
                            "rotary or interleaved or not correctness"],
    "attention/linear.py": ["tests/linear_test.py"],
    "attention/favor.py": ["tests/favor_test.py"],
    "attention/linformer.py": ["tests/linformer_test.py"],
    "attention/lsh.py": ["tests/lsh_test.py"],
    "attention/synthesizer.py": ["tests/synthesizer_test.py"],
    "attention/flash.py": ["tests/flash_test.py"],
    "attention/block_sparse.py": ["tests/block_sparse_test.py"],
    "attention/sparse_patterns.py": ["tests/sparse_patterns_test.py"],
    "attention/band_kernel.py": ["tests/band_test.py"],
    "lra/data/mqar_generator.py": ["tests/mqar_test.py", "-k", "definition or slip or limits "
                                   "or disjoint or power_law or noise or deterministic or "
                                   "refused"],
    "lra/tasks/mqar.py": ["tests/mqar_test.py", "-k", "objective or answers or model_example or "
                          "cannot_be_causal or clipped or output_rows or first_most"],
    "lra/data/needle_generator.py": ["tests/needle_test.py", "-k", "definition or slip or "
                                     "distance or independent or filler or deterministic or "
                                     "refused or distractors or spread or limits or "
                                     "sequential"],
}

# The operators kept (cosmic-ray names without the "core/" prefix); every other one is filtered.
_BIN = ["Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Mul", "Mod_FloorDiv", "Pow_Mul",
        "BitAnd_BitOr", "BitOr_BitAnd"]
_CMP = ["Eq_NotEq", "NotEq_Eq", "Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt", "Lt_Gt", "Gt_Lt",
        "LtE_GtE", "GtE_LtE", "Is_IsNot", "IsNot_Is"]
KEPT = ([f"ReplaceBinaryOperator_{x}" for x in _BIN]
        + [f"ReplaceComparisonOperator_{x}" for x in _CMP]
        + ["ReplaceUnaryOperator_USub_UAdd", "ReplaceUnaryOperator_Delete_USub",
           "ReplaceUnaryOperator_Delete_Invert", "ReplaceUnaryOperator_Delete_Not",
           "AddNot", "ReplaceTrueWithFalse", "ReplaceFalseWithTrue", "ReplaceAndWithOr",
           "ReplaceOrWithAnd", "ReplaceBreakWithContinue", "ReplaceContinueWithBreak",
           "ExceptionReplacer", "NumberReplacer", "ZeroIterationForLoop"])

PYTEST_FLAGS = ["-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider", "-m", "not slow"]


def _quote(arg: str) -> str:
  return shlex.quote(arg)


def test_command(module: str, python: str) -> str:
  """The shell command cosmic-ray runs for each mutant of `module`, in the copy's root."""
  if module not in TESTS:
    raise ValueError(f"no tests are mapped to {module!r}: add it to TESTS in "
                     f"benchmarks/mutation.py (known: {', '.join(sorted(TESTS))}).")
  # Files not written yet (a module's tests/mutation_*_test.py) are left out.
  selected = [a for i, a in enumerate(TESTS[module])
              if not (a.startswith("tests/") and a.endswith(".py") and not (ROOT / a).exists()
                      and TESTS[module][i - 1] != "-k")]
  # The module's tests/mutation_*_test.py run first and whole (their heavier tests are marked
  # slow for `make test-fast`, not here); then the other files without their slow tests.
  own = [a for a in selected if a.startswith("tests/mutation_")]
  rest = [a for a in selected if a not in own]
  flags = [f for f in PYTEST_FLAGS if f not in ("-m", "not slow")]
  commands = [[python, "-m", "pytest", *flags, *own]] if own else []
  commands.append([python, "-m", "pytest", *PYTEST_FLAGS, *rest])
  inner = " && ".join(" ".join(_quote(a) for a in c) for c in commands)
  return "sh -c " + _quote(inner) if own else inner


def all_operators(python: str) -> list[str]:
  out = subprocess.run([python, "-m", "cosmic_ray.cli", "operators"], check=True, text=True,
                       capture_output=True).stdout
  return [line.strip() for line in out.splitlines() if line.strip().startswith("core/")]


def config_text(module: str, python: str, timeout: float) -> str:
  excluded = [f"^{re.escape(op)}$" for op in all_operators(python)
              if op.split("/", 1)[1] not in KEPT]
  lines = ["[cosmic-ray]", f'module-path = "{module}"', f"timeout = {timeout}",
           "excluded-modules = []", f"test-command = {json.dumps(test_command(module, python))}",
           "", "[cosmic-ray.distributor]", 'name = "local"', "",
           "[cosmic-ray.filters.operators-filter]",
           "exclude-operators = [" + ", ".join(json.dumps(e) for e in excluded) + "]", ""]
  return "\n".join(lines)


def copy_tree(dest: Path) -> None:
  """The files of the work tree that git tracks or would track, into `dest` (fresh)."""
  if dest.exists():
    shutil.rmtree(dest)
  files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode().split("\0")
  for name in filter(None, files):
    src = ROOT / name
    if src.is_file():
      (dest / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, dest / name)


def _run(cmd: list[str], cwd: Path, log) -> None:
  log.write("$ " + " ".join(cmd) + "\n")
  log.flush()
  subprocess.run(cmd, cwd=cwd, check=True, stdout=log, stderr=subprocess.STDOUT)


def skip_number_decrements(session: Path) -> int:
  """Marks the pending n - 1 mutants of every number (cosmic-ray's odd NumberReplacer
  occurrences; the even ones are n + 1) as skipped, so each literal is mutated once."""
  with sqlite3.connect(session) as db:
    jobs = [j for (j,) in db.execute(
        "SELECT m.job_id FROM mutation_specs m LEFT JOIN work_results r ON m.job_id = r.job_id "
        "WHERE r.job_id IS NULL AND m.operator_name = 'core/NumberReplacer' "
        "AND m.occurrence % 2 = 1")]
    db.executemany("INSERT INTO work_results (job_id, worker_outcome) VALUES (?, 'SKIPPED')",
                   [(j,) for j in jobs])
  return len(jobs)


SAMPLED_OUT = "sampled out"


def sample_pending(session: Path, keep: int) -> int:
  """Leaves `keep` pending mutants (a seeded draw over all of them) and marks the others as not
  run; with `keep` 0, first returns every mutant left out by an earlier sample to pending."""
  with sqlite3.connect(session) as db:
    db.execute("DELETE FROM work_results WHERE output = ?", (SAMPLED_OUT,))
    if not keep:
      return 0
    pending = sorted(j for (j,) in db.execute(
        "SELECT w.job_id FROM work_items w LEFT JOIN work_results r ON w.job_id = r.job_id "
        "WHERE r.job_id IS NULL"))
    out = [] if keep >= len(pending) else sorted(
        set(pending) - set(random.Random(0).sample(pending, keep)))
    db.executemany("INSERT INTO work_results (job_id, worker_outcome, output) "
                   "VALUES (?, 'NO_TEST', ?)", [(j, SAMPLED_OUT) for j in out])
  return len(out)


def summarize(session: Path, module: str, python: str) -> dict:
  """Counts and survivors of a finished (or partial) session, from `cosmic-ray dump`."""
  dump = subprocess.run([python, "-m", "cosmic_ray.cli", "dump", str(session)], check=True,
                        text=True, capture_output=True).stdout
  counts = {"killed": 0, "survived": 0, "timeout": 0, "incompetent": 0, "pending": 0,
            "not run": 0}
  survivors = []
  for line in filter(None, dump.splitlines()):
    item, result = json.loads(line)
    if result is None:
      counts["pending"] += 1
      continue
    outcome = result.get("test_outcome")
    if result.get("worker_outcome") == "skipped":     # an operator filtered out
      continue
    if result.get("output") == SAMPLED_OUT:
      counts["not run"] += 1
      continue
    if result.get("worker_outcome") == "timeout":
      counts["timeout"] += 1
    elif result.get("worker_outcome") == "exception" or outcome == "incompetent":
      counts["incompetent"] += 1
    elif outcome == "survived":
      counts["survived"] += 1
      mutation = item["mutations"][0]
      survivors.append({"line": mutation["start_pos"][0], "operator": mutation["operator_name"],
                        "occurrence": mutation["occurrence"], "job": item["job_id"],
                        "diff": "\n".join(l for l in (result.get("diff") or "").splitlines()
                                          if l[:1] in "+-" and l[:3] not in ("+++", "---"))})
    else:
      counts["killed"] += 1
  done = counts["killed"] + counts["survived"] + counts["timeout"]
  score = (counts["killed"] + counts["timeout"]) / done if done else float("nan")
  survivors.sort(key=lambda s: (s["line"], s["operator"], s["occurrence"]))
  return {"module": module, "counts": counts, "score": score, "survivors": survivors,
          "command": test_command(module, "python")}


def print_summary(summary: dict) -> None:
  c = summary["counts"]
  print(f"{summary['module']}: score {summary['score']:.1%} ({c['killed']} killed, "
        f"{c['timeout']} timeouts, {c['survived']} survived, {c['incompetent']} incompetent, "
        f"{c['pending']} pending, {c['not run']} not run)")
  for s in summary["survivors"]:
    print(f"  survived line {s['line']} {s['operator']} #{s['occurrence']}: "
          f"{' | '.join(s['diff'].splitlines())}")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("module", help="a path such as attention/band.py")
  parser.add_argument("--workdir", type=Path, default=None,
                      help="where the copy and the session live (default "
                           "$TMPDIR/mutation/<module>)")
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
  parser.add_argument("--report", action="store_true", help="only summarize the last run")
  parser.add_argument("--resume", action="store_true",
                      help="continue the pending mutants of the last run (same copy)")
  parser.add_argument("--numbers", choices=("both", "one"), default="both",
                      help="NumberReplacer mutants per literal: both (n + 1 and n - 1) or one "
                           "(n + 1 only: half the count, for the larger modules)")
  parser.add_argument("--sample", type=int, default=0,
                      help="run at most this many of the pending mutants, drawn evenly with a "
                           "fixed seed over the whole module (0: all); the rest are reported as "
                           "not run and a later run without --sample runs them")
  parser.add_argument("--survivors", action="store_true",
                      help="rerun only the last run's survivors, with a fresh copy of the work "
                           "tree and test list (after adding tests)")
  args = parser.parse_args(argv)
  module = args.module.removeprefix("./")
  if module not in TESTS:
    raise SystemExit(f"no tests are mapped to {module!r}: add it to TESTS in "
                     f"benchmarks/mutation.py (known: {', '.join(sorted(TESTS))}).")
  try:
    import cosmic_ray  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise SystemExit("cosmic-ray is not installed: pip install -e '.[mutation]' "
                     "(or make mutation, which installs it).") from None
  python = sys.executable
  # XLA compilations are cached on disk across mutants: a mutant changes one function, and the
  # tests' other compilations (references, unchanged layers) are reused (about 5x faster).
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        str(Path(os.environ.get("TMPDIR", "/tmp")) / "mutation" / "jax-cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  base = args.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / "mutation" / \
      module.replace("/", "_").removesuffix(".py")
  copy, session, config = base / "repo", base / "session.sqlite", base / "config.toml"
  if not args.report:
    started = time.time()
    base.mkdir(parents=True, exist_ok=True)
    with open(base / "log.txt", "a", encoding="utf-8") as log:
      if args.survivors or args.resume:   # a fresh copy (new tests), the same session
        copy_tree(copy)
        config.write_text(config_text(module, python, args.timeout), encoding="utf-8")
      if args.survivors:
        with sqlite3.connect(session) as db:
          gone = db.execute("DELETE FROM work_results WHERE lower(test_outcome) = 'survived'")
          log.write(f"rerunning {gone.rowcount} survivors\n")
      elif not args.resume:
        copy_tree(copy)
        config.write_text(config_text(module, python, args.timeout), encoding="utf-8")
        session.unlink(missing_ok=True)
        check = subprocess.run([python, "-c", f"import {module[:-3].replace('/', '.')} as m; "
                                "print(m.__file__)"], cwd=copy, text=True, capture_output=True)
        if not check.stdout.strip().startswith(str(copy)):
          raise SystemExit(f"the copy in {copy} does not import its own {module}: "
                           f"{check.stdout or check.stderr}")
        _run([python, "-m", "cosmic_ray.cli", "init", str(config), str(session)], copy, log)
        _run([python, "-m", "cosmic_ray.tools.filters.operators_filter", str(session),
              str(config)], copy, log)
        _run([python, "-m", "cosmic_ray.cli", "baseline", str(config)], copy, log)
      if args.numbers == "one":
        log.write(f"skipped {skip_number_decrements(session)} n - 1 mutants\n")
      log.write(f"sampled out {sample_pending(session, args.sample)} mutants\n")
      _run([python, "-m", "cosmic_ray.cli", "exec", str(config), str(session)], copy, log)
    print(f"ran in {time.time() - started:.0f} s; log {base / 'log.txt'}")
  summary = summarize(session, module, python)
  (base / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
  print_summary(summary)
  return 0


if __name__ == "__main__":
  sys.exit(main())
