"""Every command README.md and docs/*.md show a user typing at least parses, and ends as shown.

`doc_commands` reads the code blocks of the docs (fenced ones, except ```python, and indented
ones) and keeps the lines a user would type: `lra ...`, `$ lra ...`, `.venv/bin/lra ...`,
`python -m launch.cli ...`, `python -m launch.train ...` and `make ...`, with backslash
continuations joined, comments and redirections (`> file`, `&&`, `|`, `&`) cut, environment
assignments in front (`LRA_DISTRIBUTED=1 lra run ...`) dropped; `inline_commands` adds the whole
commands quoted in the text (`` `lra run listops --size small` ``). What the docs leave for the
reader to fill is filled:
  - shell variables set in the same block (`COMMON='...'`, `L="..."`) are expanded, a `for VAR
    in A B ...; do` loop's variable takes its first value A, and a `$seed` the text leaves to a
    loop around the block takes 0;
  - a synopsis's optional groups `[--flag=a|b]` are taken with their first alternative;
  - the placeholders `DIR` and `W` (a run folder) become a folder under the test's temporary
    folder, and the values `N` (steps), `LR` (a learning rate) and `S` (a seed) of a
    `--config.x=` become 100, 1e-3 and 0; `COLUMN` (`lra results --sort`) becomes test.
Other lines of a block are output and skipped, as is the generated bad-values table of
docs/training.md (tests/bad_values_test.py checks it). A command whose documented output (the
next line of its block) starts with `error:` is shown as a mistake on purpose: it must fail with
exit status 2 and that line (up to a `...` where the docs cut it), unless the line is one of
`LATER`, the refusals that come from the preflight's compilation (tests/first_hour_test.py and
tests/preflight_test.py show those): such a command must parse. A plain scan of every line
checks that no command line was missed.

Each command runs in-process through the real entry point (`launch.cli.main`, or
`launch.train.main`) in a fresh temporary folder with `$LRA_DATA` there too, parametrized by
(file, line) so that a failure names where the command is. Nothing trains and nothing is
submitted (`Stops`):
  - `lra run` goes through every check it makes before importing jax (the names, the config and
    its values, the phases' overrides, `--dry_run`'s value, the workdir and its finished run)
    and is stopped where it would import jax: at its first `_interrupted` check, which here
    reports an interruption (exit status 130). A workdir on another machine (`gs://`, or an
    absolute folder outside the temporary one, such as /data/runs) is not probed;
  - `lra launch ...` and `lra sweep ...` get `--dry_run` (the launch's before its `--`): they
    resolve and check every point and run, and print their gcloud commands or batch scripts;
  - `lra data prepare` parses and checks its data settings (`launch.data.data_config`) only;
  - `lra list` and `lra data status` run for real; `lra results DIR` too, in DIR made empty (as
    the docs' runs before it would have made it), where it finds no runs, or, for a folder on
    another machine, says that it is not a folder;
  - `make TARGET ...` must be a target of the Makefile (`make -n` succeeds), and where its
    comment names the command it runs (`make bench-demo  # .venv/bin/python ...`), `make -n`
    prints that command.
The fast tests take a few seconds and compile nothing.

`test_a_run_from_another_folder_*` check that `lra run` started in another folder resolves its
workdir (the default `workdirs/<name>`, or a relative `--workdir`) there and names it in full:
in-process up to the start, and (slow, about 20 s) the real command's `Training ... in DIR`,
result and saved-checkpoint lines.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lra import tasks as tasks_lib

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BAD_VALUES = ("<!-- bad-values: begin -->", "<!-- bad-values: end -->")

_PREFIXES = (("$ lra ", "lra"), ("lra ", "lra"), (".venv/bin/lra ", "lra"),
             ("python -m launch.cli ", "lra"), ("python -m launch.train ", "train"),
             ("make ", "make"))
_ASSIGN = re.compile(r"""^([A-Z][A-Z0-9_]*)=(?:'([^']*)'|"([^"]*)"|(\S*))\s*$""")
_FOR = re.compile(r"^\s*for (\w+) in (\S+)[^;]*; do")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
_CONFIG_PLACEHOLDER = {"N": "100", "LR": "1e-3", "S": "0"}

# Documented refusals that come from the preflight's compilation, not from the checks before jax.
LATER = ("would train for about", "GB per device but")


def _blocks(text: str) -> list[list[tuple[int, str]]]:
  """The code blocks of a markdown text, as [(line number, line)]: fenced ones (not ```python)
  and indented ones (4 spaces after a blank line), the bad-values table left out."""
  blocks, current, fence, lines = [], None, None, text.split("\n")
  skipping = False
  for number, line in enumerate(lines, 1):
    stripped = line.strip()
    if stripped == BAD_VALUES[0]:
      skipping = True
    elif stripped == BAD_VALUES[1]:
      skipping = False
    if skipping:
      continue
    if fence is not None:   # inside a fenced block
      if stripped.startswith("```"):
        if fence:
          blocks.append(current)
        fence, current = None, None
      else:
        current.append((number, line))
      continue
    if stripped.startswith("```"):
      if current:   # an indented block just before
        blocks.append(current)
      fence, current = not stripped[3:].strip().startswith("python"), []
      continue
    if line.startswith("    ") and stripped:
      if current is None and (number == 1 or not lines[number - 2].strip()):
        current = []
      if current is not None:
        current.append((number, line[4:]))
      continue
    if current is not None and stripped:   # an indented block ends at a text line
      blocks.append(current)
      current = None
  if current:
    blocks.append(current)
  return blocks


def _expand(line: str, variables: dict[str, str]) -> str:
  line = re.sub(r"\[(\$\w+)\]", r"\1", line)   # `[$XL]`: an optional variable, taken
  for _ in range(3):   # variables may name variables
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), line)
  return line


def _optional_groups(line: str) -> str:
  """A synopsis's `[--flag=a|b]` groups, taken with their first alternative."""
  def first(m):
    return " ".join(w.split("|")[0] for w in m.group(1).split())
  return re.sub(r"\[(-[^\]]*)\]", first, line)


def _cut(words: list[str]) -> list[str]:
  """The first command of a shell line: up to `&&`, `;`, `|`, `&` or a redirection."""
  out = []
  for w in words:
    if w in ("&&", "||", ";", "|", "&", ">", ">>", "2>", "2>&1") or w.startswith((">", "2>")):
      break
    out.append(w)
  return out


def doc_commands() -> list[tuple[str, int, str, list[str], str | None]]:
  """[(file relative to the repo, line number, kind, argv after the program, the documented
  `error:` line, or for `make` the command its comment says the target runs, or None)] for
  every command the docs show."""
  found = []
  for path in DOCS:
    name = str(path.relative_to(REPO))
    for block in _blocks(path.read_text()):
      variables: dict[str, str] = {}
      joined, i = [], 0
      while i < len(block):   # backslash continuations joined, at the first line's number
        number, line = block[i]
        while line.rstrip().endswith("\\") and i + 1 < len(block):
          i += 1
          line = line.rstrip()[:-1] + " " + block[i][1].strip()
        joined.append((number, line))
        i += 1
      for k, (number, line) in enumerate(joined):
        stripped = line.strip()
        assign = _ASSIGN.match(stripped)
        if assign:
          variables[assign.group(1)] = next(g for g in assign.groups()[1:] if g is not None)
          continue
        loop = _FOR.match(stripped)
        if loop:
          variables[loop.group(1)] = loop.group(2)
          continue
        words = stripped.split()
        while words and _ENV.match(words[0]):   # LRA_DISTRIBUTED=1 ... lra run ...
          words = words[1:]
        stripped = " ".join(words)
        kind = next((kind for prefix, kind in _PREFIXES if stripped.startswith(prefix)), None)
        if kind is None:
          continue
        text = _optional_groups(_expand(stripped, variables))
        text = text[len("$ "):] if text.startswith("$ ") else text
        argv = _cut(shlex.split(text, comments=True))
        argv = argv[3:] if argv[:2] == ["python", "-m"] else argv[1:]
        if argv and argv[-1] == "...":   # `python -m launch.train listops ...`: the same flags
          argv = argv[:-1]
        following = joined[k + 1][1].strip() if k + 1 < len(joined) else ""
        error = following if following.startswith("error:") else None
        if kind == "make":   # `make demo  # .venv/bin/python ...`: the command it runs
          note = line.partition(" #")[2].strip()
          error = note.split("  ")[0] if note.startswith(".venv") else None
        found.append((name, number, kind, argv, error))
  return found


def inline_commands() -> list[tuple[str, int, str, list[str], None]]:
  """The whole `lra` commands quoted in the docs' text (`` `lra run listops --size small` ``):
  a subcommand with its task or folder, without `...`, alternatives (`a|b`) or placeholders in
  capitals (`lra run TASK`); tables and code blocks left out."""
  found = []
  for path in DOCS:
    name = str(path.relative_to(REPO))
    text = path.read_text()
    in_blocks = {number for block in _blocks(text) for number, _ in block}
    for number, line in enumerate(text.split("\n"), 1):
      if number in in_blocks or line.lstrip().startswith("|"):
        continue
      for m in re.finditer(r"`((?:\.venv/bin/)?lra [^`]+)`", line):
        command = m.group(1).strip()
        if "..." in command or "|" in command or re.search(r"\b[A-Z]{2,}\b", command):
          continue
        words = command.split()[1:]
        if ((words[0] in ("run", "sweep") and len(words) > 1 and words[1] in tasks_lib.TASKS)
            or words == ["list"] or words[:2] == ["data", "status"]
            or (words[:2] == ["data", "prepare"] and len(words) > 2)):
          found.append((name, number, "lra", shlex.split(command)[1:], None))
  return found


COMMANDS = doc_commands() + inline_commands()


def _fill(argv: list[str], folder: Path) -> list[str]:
  """The placeholders the docs leave (see the module docstring), filled."""
  out = []
  for a in argv:
    a = a.replace("$seed", "0")   # a seed the text leaves to a loop around the block
    if a in ("DIR", "W"):
      a = str(folder / "run")
    elif a == "COLUMN":
      a = "test"
    else:
      key, eq, value = a.partition("=")
      if eq and key.startswith("--config.") and value in _CONFIG_PLACEHOLDER:
        a = f"{key}={_CONFIG_PLACEHOLDER[value]}"
    assert "$" not in a, f"an unfilled shell variable in {a!r}"
    out.append(a)
  return out


def _with_dry_run(argv: list[str]) -> list[str]:
  """`lra launch ...` with --dry_run before its `--`, `lra sweep ...` with --dry_run."""
  if "--dry_run" in argv:
    return argv
  if argv[0] == "launch":
    i = argv.index("--") if "--" in argv else len(argv)
    return [*argv[:i], "--dry_run", *argv[i:]]
  return [*argv, "--dry_run"]


def test_every_command_line_of_the_docs_is_taken():
  """Against a plain scan of every line: each that starts as a command does (after its
  indentation, a `$ ` and environment assignments), outside the bad-values table and not
  continuing the line before it, is one of the commands tested."""
  taken = {(path, line) for path, line, *_ in COMMANDS}
  missed = []
  for path in DOCS:
    name = str(path.relative_to(REPO))
    lines = path.read_text().split("\n")
    table = range(0)
    if BAD_VALUES[0] in lines:
      table = range(lines.index(BAD_VALUES[0]), lines.index(BAD_VALUES[1]) + 1)
    for number, line in enumerate(lines, 1):
      words = line.strip().removeprefix("$ ").split()
      while words and _ENV.match(words[0]):
        words = words[1:]
      text = " ".join(words) + " "
      if (any(text.startswith(prefix) for prefix, _ in _PREFIXES[1:]) and number - 1 not in table
          and not (number > 1 and lines[number - 2].rstrip().endswith("\\"))
          and (name, number) not in taken):
        missed.append(f"{name}:{number}: {line.strip()}")
  assert not missed, "\n".join(missed)
  assert len(COMMANDS) > 100


class Stops:
  """Stops `lra run` where it would import jax (`reached`), recording the workdirs it resolved;
  leaves the workdirs of other machines unprobed and `lra data prepare` at its checks."""

  def __init__(self, monkeypatch, folder: Path):
    from launch import data as data_launcher
    from launch import train as train_launcher
    from lra import storage
    self.reached, self.workdirs = False, []
    here = str(folder)

    def elsewhere(workdir: str) -> bool:
      return storage.is_remote(workdir) or not storage.resolve(workdir).startswith(here)

    def check_workdir(workdir, real=train_launcher.check_workdir):
      if not elsewhere(workdir):
        real(workdir)

    def rerun(config, workdir, real=train_launcher._rerun):
      self.workdirs.append(workdir)
      return ("new", None) if storage.is_remote(workdir) else real(config, workdir)

    def interrupted(startup, config=None):   # its first check after the workdir's, before jax
      self.reached = True
      return True

    def data_run(args, overrides, real=data_launcher.run):
      if args.data_command == "status":
        return real(args, overrides)
      try:   # `prepare`: its checks only (the task, the size, the data settings)
        data_launcher.data_config(args.task, args.size or "base", args.manual_dir, overrides)
      except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
      return 0

    monkeypatch.setattr(train_launcher, "check_workdir", check_workdir)
    monkeypatch.setattr(train_launcher, "_rerun", rerun)
    monkeypatch.setattr(train_launcher, "_interrupted", interrupted)
    monkeypatch.setattr(storage, "check_remote", lambda path: None)
    monkeypatch.setattr(data_launcher, "run", data_run)


@pytest.fixture
def place(tmp_path, monkeypatch):
  """A fresh folder as the current one, with $LRA_DATA in it, and the repository's `tests`
  folder linked in, as in the repository root where the docs' commands naming
  `tests/fixtures/...` are typed."""
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  (cwd / "tests").symlink_to(REPO / "tests")
  monkeypatch.chdir(cwd)
  monkeypatch.setenv("LRA_DATA", str(tmp_path / "lra_data"))
  return tmp_path


@pytest.mark.parametrize("path,line,kind,argv,error", COMMANDS,
                         ids=[f"{c[0]}:{c[1]}" for c in COMMANDS])
def test_doc_command(path, line, kind, argv, error, place, monkeypatch, capsys):
  where = f"{path}:{line}"
  argv = _fill(argv, place)
  if kind == "make":
    proc = subprocess.run(["make", "-n", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"{where}: make -n {' '.join(argv)}: {proc.stderr.strip()}"
    if error is not None:   # the command the docs say the target runs
      assert error in proc.stdout.splitlines(), f"{where}: make {argv[0]} runs\n{proc.stdout}"
    return
  from launch import cli
  from launch import train as train_launcher
  stops = Stops(monkeypatch, place)
  if kind == "lra" and argv[0] in ("launch", "sweep"):
    argv = _with_dry_run(argv)
  results = kind == "lra" and argv[0] == "results"
  elsewhere = results and os.path.isabs(argv[1]) and not argv[1].startswith(str(place))
  if results and not elsewhere:   # (elsewhere: a folder on the user's machine, /data/runs/...)
    Path(argv[1]).mkdir(parents=True, exist_ok=True)   # made by the docs' runs before it
  rc = (cli.main(argv) if kind == "lra" else train_launcher.main(argv))
  out, err = capsys.readouterr()
  errors = [x for x in err.splitlines() if x.startswith("error:")]
  shown = f"{where}: {kind} {shlex.join(argv)} -> exit {rc}\n{err[-2000:]}"
  if error is not None and not any(s in error for s in LATER):
    want = error.split("...")[0].rstrip()
    assert rc == 2 and errors and errors[0].startswith(want), shown
    return
  if elsewhere:
    assert rc == 2 and errors == [f"error: {argv[1]} is not a folder."], shown
    return
  assert not errors, shown
  if kind == "train" or argv[0] == "run":
    assert rc == 130 and stops.reached, f"{shown}\n(`lra run` did not reach its start)"
    assert all(os.path.isabs(w) or "://" in w for w in stops.workdirs), stops.workdirs
  elif results:   # an empty folder: read, and no runs in it
    assert rc == 1 and "no runs under" in err, shown
  else:
    assert rc == 0, shown
  if not results:   # nothing written: no run started, no launch file
    assert [p.name for p in Path.cwd().iterdir()] == ["tests"] and not list(place.glob("run*")), \
        where


def test_spt_takes_the_overrides_its_phases_are_made_from(place, monkeypatch, capsys):
  """`protocol=spt` makes its two phases from num_train_steps and the rest after the overrides
  (docs/pretraining.md's commands), while a config with phases of its own still refuses them."""
  from launch import cli
  from launch import train as train_launcher
  import configs
  Stops(monkeypatch, place)
  argv = ["run", "listops", "--size", "small", "--config.protocol=spt",
          "--config.num_train_steps=4000", "--config.pretrain.steps=1000",
          "--config.learning_rate=1e-3"]
  assert cli.main(argv) == 130, capsys.readouterr().err
  config = configs.build_config("listops", size="small", overrides=[
      ("protocol", "spt"), ("num_train_steps", "4000"), ("pretrain.steps", "1000"),
      ("learning_rate", "1e-3")])
  assert [int(p["steps"]) for p in config.phases] == [1000, 3000]
  assert float(config.phases[1]["learning_rate"]) == 1e-3
  staged = ["run", "text8", "--size", "small", "--config.num_train_steps=40"]
  assert cli.main(staged) == 2
  assert "is staged, and each of its" in capsys.readouterr().err
  assert train_launcher.check_phase_overrides(config, [("num_train_steps", "4000")]) is None


@pytest.mark.parametrize("given,where", [
    ([], "workdirs/listops-dot_product-small"),
    (["--workdir", "runs/x"], "runs/x"),
    (["--workdir", "../elsewhere/x"], "../elsewhere/x"),
])
def test_a_run_from_another_folder_resolves_its_workdir_there(given, where, place, monkeypatch,
                                                                capsys):
  """`lra run` started in a folder other than the checkout: its workdir (the default, or a
  relative --workdir) is that folder's, and what `lra run` passes on is absolute."""
  from launch import cli
  other = place / "somewhere" / "else"
  other.mkdir(parents=True)
  monkeypatch.chdir(other)
  stops = Stops(monkeypatch, place)
  assert cli.main(["run", "listops", "--size", "small", *given]) == 130, capsys.readouterr()
  assert stops.workdirs == [os.path.normpath(os.path.join(other, where))]
  assert not os.listdir(other)   # nothing written before training


def test_a_dry_run_from_another_folder_names_its_workdir_in_full(place, monkeypatch, capsys):
  """`lra run --dry_run` (its preflight stopped before it compiles) names the folder in full."""
  from launch import cli
  from launch import train as train_launcher
  other = place / "other"
  other.mkdir()
  monkeypatch.chdir(other)
  monkeypatch.setattr(train_launcher, "_preflight", lambda c, initialisers=False: "stopped here")
  assert cli.main(["run", "listops", "--size", "small", "--dry_run"]) == 2
  first = capsys.readouterr().out.splitlines()[0]
  assert first == (f"dry run: listops (attention=dot_product,size=small); nothing is written "
                   f"to {other}/workdirs/listops-dot_product-small"), first


def _lines_until(proc: subprocess.Popen, start: str, seconds: float) -> list[str]:
  import time
  lines, end = [], time.monotonic() + seconds
  while time.monotonic() < end:
    line = proc.stdout.readline()
    if not line:
      break
    lines.append(line.rstrip("\n"))
    if line.startswith(start):
      break
  return lines


@pytest.mark.slow
def test_a_run_from_another_folder_prints_absolute_paths(tmp_path):
  """The real command, started in a folder other than the checkout without --workdir: it
  trains in that folder's workdirs/, and its `Training ... in DIR`, result and saved-checkpoint
  lines name the folder in full (about 30 s: two short runs)."""
  import signal
  other = tmp_path / "other"
  other.mkdir()
  env = {**os.environ, "LRA_DATA": str(tmp_path / "data"), "PYTHONPATH": str(REPO)}
  small = ["--config.data.num_train=64", "--config.data.num_val=32", "--config.data.num_test=32",
           "--config.progress=false", "--no_preflight"]
  lra = [sys.executable, "-m", "launch.cli", "run", "listops", "--size", "small"]
  done = subprocess.run([*lra, "--config.num_train_steps=2", "--config.eval_every=2", *small],
                        cwd=other, env=env, capture_output=True, text=True, timeout=300)
  workdir = other / "workdirs" / "listops-dot_product-small"
  assert done.returncode == 0, done.stderr[-2000:]
  assert f"Training listops (attention=dot_product,size=small) in {workdir}\n" in done.stdout
  assert f"results in {workdir}/results.json" in done.stdout.splitlines()[-1]
  assert (workdir / "results.json").exists()
  # a long run stopped by SIGTERM once it trains: the checkpoint line
  stopped = other / "stopped"
  proc = subprocess.Popen([*lra, "--workdir", "stopped", "--config.num_train_steps=100000",
                           *small], cwd=other, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    lines = _lines_until(proc, "Training ", 240)
    assert lines and lines[-1] == (f"Training listops (attention=dot_product,size=small) in "
                                   f"{stopped}"), lines
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=120)[0]
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 130, rest[-2000:]
  assert "Saved a checkpoint at step " in rest and f" in {stopped}/checkpoints" in rest, rest
