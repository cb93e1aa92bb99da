"""Ctrl-C and SIGTERM while `lra run` starts up (issue 36, F1-F3).

A tiny ListOps run is started through the console command's own entry point
(`launch/entry.py`) with the compile cache off, so that its preflight compiles; a signal is sent
at a chosen moment: while Python imports the command, at 1.5 s and at 4 s (the imports, then
the preflight's compiles on this machine), twice in a row, and SIGTERM once and twice (timed
from the end of the imports, which a busy machine can stretch past the signal) and during the
imports. Each must end with one
`error: ` line on stderr and exit status 130, no traceback and no abort (a KeyboardInterrupt used
to land in jax's gc callback, where it was lost and the run trained to the end, or to abort the
interpreter while a compile thread was inside XLA), and write nothing into the workdir. A rerun
afterwards trains exactly as a run that was never interrupted.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

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

# The entry point, started after the command's modules are imported and a line says so: the
# offsets of the signals of the cases timed `after_imports` count from that line, so that they
# land in the run's start-up (StartUp), not in the imports, however busy the machine is.
AFTER_IMPORTS = ("import sys; import launch.cli; from launch import entry; "
                 f"print({IMPORTED!r}, flush=True); sys.exit(entry.main())")


def start(workdir: str, data_dir: str, after_imports: bool = False) -> subprocess.Popen:
  env = {**os.environ, "LRA_DATA": data_dir, "JAX_PLATFORMS": "cpu"}
  env.pop("LRA_DISTRIBUTED", None)
  args = ["run", "listops", "--size", "small", "--workdir", workdir, "--no_compile_cache", *TINY]
  command = ["-c", AFTER_IMPORTS] if after_imports else ["-m", "launch.entry"]
  return subprocess.Popen([sys.executable, *command, *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def interrupted(workdir: str, data_dir: str, signals: list[tuple[float, int]],
                after_imports: bool = False):
  """Starts the run, sends each (seconds after the start, or after the imports, signal);
  (exit status, out, err)."""
  proc = start(workdir, data_dir, after_imports)
  if after_imports:
    assert proc.stdout.readline().strip() == IMPORTED
  t0 = time.monotonic()
  for at, signum in signals:
    time.sleep(max(0.0, at - (time.monotonic() - t0)))
    proc.send_signal(signum)
  out, err = proc.communicate(timeout=300)
  return proc.returncode, out, err


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


CASES = {
    "imports": ([(0.15, signal.SIGINT)], "error: interrupted"),
    "1.5s": ([(1.5, signal.SIGINT)], "error: interrupted"),
    "4s": ([(4.0, signal.SIGINT)], "error: interrupted"),
    "twice": ([(2.0, signal.SIGINT), (2.4, signal.SIGINT)], "error: interrupted"),
    "sigterm": ([(1.0, signal.SIGTERM)], "error: interrupted by SIGTERM before training "
                "started; nothing was trained: rerun the same command to start."),
    "sigterm twice": ([(1.0, signal.SIGTERM), (1.4, signal.SIGTERM)],
                      "error: interrupted twice before training started"),
}
AFTER_IMPORTS_CASES = {"sigterm", "sigterm twice"}   # SIGINT is held from the first line on


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_signal_during_start_up_is_one_line_exit_130_and_writes_nothing(case, tmp_path,
                                                                          data_dir):
  signals, line = CASES[case]
  workdir = str(tmp_path / "run")
  status, out, err = interrupted(workdir, data_dir, signals, case in AFTER_IMPORTS_CASES)
  assert status == 130, (out, err)
  assert err.count("\n") == 1 and err.startswith(line), err
  assert "Traceback" not in out + err and "terminate called" not in err
  assert not os.path.exists(os.path.join(workdir, "checkpoints")), os.listdir(workdir)
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))


def test_the_rerun_after_an_interrupted_start_up_equals_an_uninterrupted_run(tmp_path, data_dir,
                                                                             uninterrupted):
  workdir = str(tmp_path / "run")
  status, _, err = interrupted(workdir, data_dir, [(4.0, signal.SIGINT)])
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
