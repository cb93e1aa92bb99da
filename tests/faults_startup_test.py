"""Ctrl-C and SIGTERM while `lra run` starts up (issue 36, F1-F3).

A tiny ListOps run is started through the console command's own entry point
(`launch/entry.py`) with the compile cache off, so that its preflight compiles; a signal is sent
at a chosen moment, each marked by a line the process prints as it gets there (never a fixed
clock, which a busy machine stretches): while Python imports the command, once the command's
modules are imported (its checks), while the preflight compiles (its `Preflight: compiling`
line), and twice in a row: the second once the first one's message is out, while the run waits
after its preflight, where it cannot yet have reached the stage that ends it. Each must end
with one `error: ` line on stderr and exit status 130, no traceback and no abort (a
KeyboardInterrupt used to land in jax's gc callback, where it was lost and the run trained to
the end, or to abort the interpreter while a compile thread was inside XLA), and write nothing
into the workdir. A rerun afterwards trains exactly as a run that was never interrupted.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from lra.signals import signal_label

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

TINY = ["--config.data.num_train=64", "--config.data.num_val=16", "--config.data.num_test=16",
        "--config.data.max_length=24", "--config.data.gen_min_length=4",
        "--config.data.gen_max_length=25", "--config.model.emb_dim=16",
        "--config.model.qkv_dim=16", "--config.model.mlp_dim=32",
        "--config.model.classifier_dim=16", "--config.model.num_layers=1",
        "--config.num_train_steps=4", "--config.batch_size=16", "--config.eval_batch_size=8",
        "--config.log_every=1", "--config.progress=false"]


IMPORTED = "(the command's modules are imported)"
IMPORTING = "(importing the command)"
HELD = "(the preflight is done; waiting)"
COMPILING = "Preflight: compiling"   # the run's own line as its preflight starts to compile

# The entry point with the moments the tests signal at marked by a line on stdout (the run's
# own lines mark the others): IMPORTING as `launch.entry` starts to import the command, which
# then waits there for the signal; IMPORTED once the command's modules are imported, as the
# command starts (inside entry.main, which handles a Ctrl-C there); at "compiling" the run's
# own note that its preflight compiles is printed as the compile starts (it waits 10 s, longer
# than this compile takes on a fast machine); HELD after
# the preflight, where the run then waits for good, so that a first signal's stop is still
# pending (the run would end on it only at its next stage) when the second one is sent.
WRAPPER = f"""
import builtins, sys, time
IMPORTING, IMPORTED, HELD = {IMPORTING!r}, {IMPORTED!r}, {HELD!r}
moment = sys.argv.pop(1)
from launch import entry
if moment == "imports":
  real_import = builtins.__import__
  def importing(name, globals=None, locals=None, fromlist=(), level=0):
    if name == "launch" and fromlist and "cli" in fromlist:
      print(IMPORTING, flush=True)
      time.sleep(120)   # the test's signal ends this
    return real_import(name, globals, locals, fromlist, level)
  builtins.__import__ = importing
else:
  from launch import cli, train
  command = cli.main
  def main():   # within entry.main's handling of Ctrl-C, like the command itself
    print(IMPORTED, flush=True)
    return command()
  cli.main = main
  if moment == "compiling":   # the run's own note as its preflight starts to compile, at once
    train.COMPILE_NOTE_SECONDS = 0.0
  if moment == "held":
    preflight = train.run_preflight
    def held(*args, **kwargs):
      result = preflight(*args, **kwargs)
      print(HELD, flush=True)
      # Until a second signal ends the process. Short sleeps, not one blocking call: a signal
      # the kernel hands to another of the process's threads does not interrupt the main
      # thread's call, and Python runs its handler only when the main thread runs Python code.
      while True:
        time.sleep(0.05)
      return result
    train.run_preflight = held
sys.exit(entry.main())
"""


def start(workdir: str, data_dir: str, moment: str | None = None) -> subprocess.Popen:
  """`lra run` of the tiny config; through WRAPPER with its `moment` (imports, imported,
  compiling, held) unless None."""
  env = {**os.environ, "LRA_DATA": data_dir, "JAX_PLATFORMS": "cpu"}
  env.pop("LRA_DISTRIBUTED", None)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)   # nor the suite's (tests/conftest.py): it compiles
  args = ["run", "listops", "--size", "small", "--workdir", workdir, "--no_compile_cache", *TINY]
  command = ["-m", "launch.entry"] if moment is None else ["-c", WRAPPER, moment]
  return subprocess.Popen([sys.executable, *command, *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen, prefix: str, lines: list[str]) -> None:
  """Reads the process's stdout into `lines` up to a line that starts with `prefix` (after
  the leading newline of a signal's message)."""
  while True:
    line = proc.stdout.readline()
    assert line, f"the run ended before printing {prefix!r}: {''.join(lines)}"
    lines.append(line)
    if line.strip().startswith(prefix):
      return


# How each case reaches its moment: the WRAPPER moment it starts with, the line it waits for
# before its first signal, and whether a second signal follows once the first one's message
# (`SIGNAL: stopping before training starts`) is out.
MOMENTS = {"imports": ("imports", IMPORTING), "imported": ("imported", IMPORTED),
           "compiling": ("compiling", COMPILING), "held": ("held", HELD)}


def interrupted(workdir: str, data_dir: str, at: str, signals: list[int]):
  """Starts the run, sends the first of `signals` at the moment `at` (MOMENTS), each later one
  once the run's message about the first is out; (exit status, out, err)."""
  moment, line = MOMENTS[at]
  proc = start(workdir, data_dir, moment)
  lines: list[str] = []
  try:
    read_until(proc, line, lines)
    proc.send_signal(signals[0])
    for signum in signals[1:]:
      read_until(proc, f"{signal_label(signals[0])}:", lines)
      proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc.returncode, "".join(lines) + out, err


def train_records(workdir: str) -> list[tuple[int, float]]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_dir):
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  proc = start(workdir, data_dir)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  with open(os.path.join(workdir, "results.json")) as f:
    return train_records(workdir), json.load(f)


STOPPED = ("error: interrupted by {} before training started; nothing was trained: rerun the "
           "same command to start.")
TWICE = ("error: interrupted twice before training started; nothing was trained: rerun the same "
         "command to start.")
# case: (moment, signals, the one line on stderr). SIGTERM before `lra run`'s first line (after
# the imports) has its default action, so the SIGTERM cases start in the preflight.
CASES = {
    "imports": ("imports", [signal.SIGINT], "error: interrupted (Ctrl-C)."),
    # Ctrl-C before `lra run` holds it ends in entry.py's line, after it in the run's
    "checks": ("imported", [signal.SIGINT], "error: interrupted"),
    "compiling": ("compiling", [signal.SIGINT], STOPPED.format("Ctrl-C")),
    "twice": ("held", [signal.SIGINT, signal.SIGINT], TWICE),
    "sigterm": ("compiling", [signal.SIGTERM], STOPPED.format("SIGTERM")),
    "sigterm twice": ("held", [signal.SIGTERM, signal.SIGTERM], TWICE),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_signal_during_start_up_is_one_line_exit_130_and_writes_nothing(case, tmp_path,
                                                                          data_dir):
  at, signals, line = CASES[case]
  workdir = str(tmp_path / "run")
  status, out, err = interrupted(workdir, data_dir, at, signals)
  assert status == 130, (out, err)
  assert err.count("\n") == 1 and err.startswith(line), err
  assert "Traceback" not in out + err and "terminate called" not in err
  assert not os.path.exists(os.path.join(workdir, "checkpoints")), os.listdir(workdir)
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))


def test_the_rerun_after_an_interrupted_start_up_equals_an_uninterrupted_run(tmp_path, data_dir,
                                                                             uninterrupted):
  workdir = str(tmp_path / "run")
  status, _, err = interrupted(workdir, data_dir, "compiling", [signal.SIGINT])
  assert status == 130, err
  proc = start(workdir, data_dir)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  records, results = uninterrupted
  assert train_records(workdir) == records
  with open(os.path.join(workdir, "results.json")) as f:
    again = json.load(f)
  for key in ("test_accuracy", "test_loss", "best_validation_accuracy", "steps"):
    assert again[key] == results[key], key


# Runs the entry point with `from launch import cli` sending the process a SIGTERM (and then
# waiting for it) before the module loads: a SIGTERM while a busy machine imports the command.
SIGTERM_IN_IMPORT = """
import builtins, os, signal, sys, time
real_import = builtins.__import__
def importing(name, globals=None, locals=None, fromlist=(), level=0):
  if name == "launch" and fromlist and "cli" in fromlist:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
  return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = importing
from launch import entry
sys.exit(entry.main())
"""


def test_a_sigterm_while_the_command_imports_is_one_line_and_exit_130(tmp_path):
  from launch import entry
  proc = subprocess.run([sys.executable, "-c", SIGTERM_IN_IMPORT, "run", "listops", "--workdir",
                         str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                        timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 130, (proc.stdout, proc.stderr)
  assert proc.stderr == entry.IMPORT_SIGTERM + "\n"
  assert not os.path.exists(tmp_path / "run")


def test_after_the_imports_sigterm_has_its_previous_action_again():
  """The import-time handler is not left in place for the command: `lra run` installs its own,
  and a command that does not stays killable by SIGTERM as before; an ignored SIGTERM stays
  ignored throughout."""
  probe = ("import signal, sys; from launch import cli, entry; "
           "cli.main = lambda: print(signal.getsignal(signal.SIGTERM).name) or 0; "
           "sys.exit(entry.main())")
  for before, expected in (("", "SIG_DFL"), ("signal.signal(signal.SIGTERM, signal.SIG_IGN); ",
                                             "SIG_IGN")):
    proc = subprocess.run([sys.executable, "-c", "import signal; " + before + probe], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected
