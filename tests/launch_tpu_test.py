"""`lra launch tpu` end to end against a stand-in `gcloud` (launch/tpu.py, launch/remote.py).

The stand-in, written into a temporary folder put first on PATH, records every call and plays a
two-worker TPU VM on this machine: `describe` answers READY and two endpoints; `scp` copies into
each worker's home folder; `ssh --worker=... --command CMD` runs CMD with bash as each worker's
process, in that home, with the environment a TPU worker's login shell has (HOME, PATH, LANG)
plus what jax.distributed needs on one machine instead of Cloud TPU's own discovery
(JAX_COORDINATOR_ADDRESS=localhost:PORT, JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=i,
JAX_PLATFORMS=cpu, JAX_NUM_CPU_DEVICES=2). A worker's processes outlive the ssh client that
started them, as on a real VM. Machine-level things are simulated: a fake `sudo` answers `lsof`
with the worker's processes that hold its "TPU" (a stale `sleep` started at first contact, and
the training processes) and removes the worker's own stand-in for /tmp/libtpu_lockfile. The
bootstrap (venv and pip) is the one step not run: the stand-in checks its text (the pinned
jax[tpu] version), then puts the marker file in place and links ~/lra/venv to this
environment, so the prepare command's own test of the marker skips the bootstrap.

The first launch trains a tiny ListOps config on the two workers as one jax.distributed job:
its final checkpoint holds the parameters of a one-process run, and the recorded calls are the
`--dry_run` lines. The second launch has the stand-in SIGKILL worker 1 once checkpoint 4 exists:
the launcher names worker 1 and its log, stops worker 0, waits for READY, runs again with
--retries 1, and the resumed run ends with the first launch's parameters.
"""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import configs
from launch import cli, tpu
from launch import train as train_launcher
from lra import checkpoint, tasks, train

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

jax.config.update("jax_disable_most_optimizations", True)  # compiles faster (as the workers)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Parameters agree within rtol 1e-5, and atol 1e-7 for elements near 0 (the two processes sum the
# gradients in another order than one process does).
RTOL, ATOL = 1e-5, 1e-7
# A tiny ListOps config (tests/distributed_test.py's, run longer so that a worker killed at
# checkpoint 4 dies well before the end).
OVERRIDES = {
    "data.num_train": 64, "data.num_val": 20, "data.num_test": 20, "data.max_length": 24,
    "data.gen_min_length": 4, "data.gen_max_length": 25,
    "model.emb_dim": 16, "model.qkv_dim": 16, "model.mlp_dim": 32, "model.classifier_dim": 16,
    "model.num_heads": 2, "model.num_layers": 1, "mesh.data": 4,
    "batch_size": 16, "eval_batch_size": 8, "num_train_steps": 12, "warmup_steps": 1,
    "learning_rate": 0.01, "log_every": 4, "eval_every": 12, "checkpoint_every": 4,
    "progress": False,
}
FLAGS = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]

STANDIN = r'''
import os, re, shlex, shutil, signal, subprocess, sys, threading, time

ME = os.path.abspath(__file__)


def reap(argv):
  """`--reap PIDFILE CMD...`: the worker-side parent of CMD (an sshd's session), in its own
  session; records CMD's pid (PIDFILE '-': not a process holding the TPU) and reaps it."""
  pidfile, cmd = argv[0], argv[1:]
  child = subprocess.Popen(cmd)
  if pidfile != "-":
    with open(pidfile, "w") as f:
      f.write(str(child.pid))
  rc = child.wait()
  sys.exit(128 - rc if rc < 0 else rc)


if sys.argv[1:2] == ["--reap"]:
  reap(sys.argv[2:])

CLOUD = os.environ["STANDIN_DIR"]
argv = sys.argv[1:]
with open(os.path.join(CLOUD, "calls.txt"), "a") as f:
  f.write(shlex.join(["gcloud", *argv]) + "\n")
WORKERS = int(os.environ.get("STANDIN_WORKERS", "2"))


def flag(name):
  return next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")), None)


def start(i, cmd, pidfile="-", env=None, out=None):
  home = os.path.join(CLOUD, f"worker{i}", "home")
  return subprocess.Popen([sys.executable, ME, "--reap", pidfile, *cmd], cwd=home, env=env,
                          start_new_session=True, stdin=subprocess.DEVNULL, stdout=out,
                          stderr=subprocess.STDOUT if out is not None else None)


def worker(i):
  """Worker i's folder; at first contact, a home, a stale process holding the TPU (as a
  crashed earlier run leaves) and libtpu's lock file."""
  d = os.path.join(CLOUD, f"worker{i}")
  if not os.path.isdir(d):
    os.makedirs(os.path.join(d, "home"))
    open(os.path.join(d, "libtpu_lockfile"), "w").close()
    start(i, ["sleep", "600"], os.path.join(d, "stale.pid"), out=subprocess.DEVNULL)
    while not os.path.exists(os.path.join(d, "stale.pid")):
      time.sleep(0.01)
  return d


def environment(i, generation):
  d = worker(i)
  return {"HOME": os.path.join(d, "home"), "LANG": "C.UTF-8", "USER": "tpu",
          "PATH": os.environ["STANDIN_BIN"] + ":/usr/local/bin:/usr/bin:/bin",
          "STANDIN_WORKER_DIR": d,
          # what one machine needs instead of Cloud TPU's own discovery:
          "JAX_COORDINATOR_ADDRESS": f"localhost:{int(os.environ['STANDIN_PORT']) + generation}",
          "JAX_NUM_PROCESSES": str(WORKERS), "JAX_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu",
          "JAX_NUM_CPU_DEVICES": "2"}


def kill_when(i, pidfile, path):
  while not os.path.exists(path) or not os.path.exists(pidfile):
    time.sleep(0.02)
  os.kill(int(open(pidfile).read()), signal.SIGKILL)
  with open(os.path.join(CLOUD, "killed.txt"), "a") as f:
    f.write(f"worker {i} at {path}\n")


verb = argv[3]
workers = [worker(i) for i in range(WORKERS)]
if verb == "describe":
  if flag("format") == "value(state)":
    print(os.environ.get("STANDIN_STATE", "READY"))
  else:
    print("\n".join(f"10.0.0.{i + 2}" for i in range(WORKERS)))
elif verb == "scp":
  source, target = [a for a in argv[4:] if not a.startswith("--")]
  for d in workers:
    shutil.copy(source, os.path.join(d, "home", target.split(":", 1)[1]))
elif verb == "ssh":
  command = flag("command")
  chosen = range(WORKERS) if flag("worker") == "all" else [int(flag("worker"))]
  if "pip install" in command:   # the bootstrap: checked, then stood in for
    marker = re.search(r"\$HOME/(lra/bootstrapped-[0-9a-f]+) ", command).group(1)
    assert f'"jax[tpu]=={os.environ["STANDIN_JAX"]}"' in command, command
    for i in chosen:
      lra = os.path.join(workers[i], "home", "lra")
      os.makedirs(lra, exist_ok=True)
      open(os.path.join(lra, marker.split("/")[1]), "w").close()
      if not os.path.islink(os.path.join(lra, "venv")):
        os.symlink(os.environ["STANDIN_VENV"], os.path.join(lra, "venv"))
  run = "launch.cli run" in command
  procs = []
  for i in chosen:
    generation = 0
    if run:
      runs = len([n for n in os.listdir(workers[i]) if n.startswith("run")]) + 1
      generation, pidfile = runs, os.path.join(workers[i], f"run{runs}.pid")
    procs.append(start(i, ["bash", "-c", command], pidfile if run else "-",
                       environment(i, generation)))
    kill = os.environ.get("STANDIN_KILL", "")
    if run and kill and int(kill.split(":")[0]) == i and generation == 1:
      threading.Thread(target=kill_when, args=(i, pidfile, kill.split(":", 1)[1]),
                       daemon=True).start()
  codes = [p.wait() for p in procs]
  sys.exit(next((c for c in codes if c), 0))
'''

SUDO = r'''
import os, sys
d = os.environ["STANDIN_WORKER_DIR"]
with open(os.path.join(d, "sudo.log"), "a") as f:
  f.write(" ".join(sys.argv[1:]) + "\n")


def holding():
  """Live processes holding this worker's TPU: its training processes and the stale one."""
  for name in os.listdir(d):
    if name.endswith(".pid"):
      pid = int(open(os.path.join(d, name)).read())
      try:
        state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
      except OSError:
        continue
      if state != "Z":
        yield pid


if sys.argv[1] == "lsof":
  print("\n".join(str(p) for p in holding()))
elif sys.argv[1:] == ["rm", "-f", "/tmp/libtpu_lockfile"]:
  if os.path.exists(os.path.join(d, "libtpu_lockfile")):
    os.remove(os.path.join(d, "libtpu_lockfile"))
else:
  sys.exit(f"stand-in sudo: unexpected {sys.argv[1:]}")
'''


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
  """The folder with the stand-in `gcloud` and `sudo`."""
  bin_dir = tmp_path_factory.mktemp("bin")
  for name, text in (("gcloud", STANDIN), ("sudo", SUDO)):
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\n{textwrap.dedent(text)}")
    path.chmod(0o755)
  return bin_dir


def cloud_env(standin, cloud, **extra) -> dict:
  cloud.mkdir(exist_ok=True)
  return {**os.environ, "PATH": f"{standin}:{os.environ['PATH']}", "STANDIN_DIR": str(cloud),
          "STANDIN_BIN": str(standin), "STANDIN_VENV": sys.prefix,
          "STANDIN_JAX": tpu.jax_version(), "STANDIN_PORT": str(_free_port()), **extra}


def launch_args(workdir, launch_dir, *extra) -> list[str]:
  return ["launch", "tpu", "--tpu", "pod", "--zone", "us-central2-b", "--workers", "2",
          "--launch_dir", str(launch_dir), "--env", f"LRA_DATA={os.environ['LRA_DATA']}",
          "--env", "JAX_DISABLE_MOST_OPTIMIZATIONS=1",
          "--env", "JAX_DEFAULT_MATMUL_PRECISION=highest", *extra,
          "--", "run", "listops", "--size", "small", "--workdir", str(workdir), *FLAGS]


def lra(args, env, timeout=240) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def calls(cloud) -> list[str]:
  return (cloud / "calls.txt").read_text().splitlines()


def in_order(lines: list[str]) -> list[str]:
  """`lines` with each run of per-worker ssh calls sorted: the launcher starts them at once, so
  the stand-ins record them in any order."""
  out, block = [], []
  for line in [*lines, None]:
    if line is not None and re.search(r" --worker=\d+ ", line):
      block.append(line)
      continue
    out += sorted(block) + ([line] if line is not None else [])
    block = []
  return out


def kill_leftovers(cloud) -> None:
  for pidfile in cloud.glob("worker*/*.pid"):
    try:
      os.kill(int(pidfile.read_text()), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
      pass


@pytest.fixture(scope="module")
def config():
  c = configs.build_config("listops", size="small",
                           overrides=[(k, str(v)) for k, v in OVERRIDES.items()])
  tasks.get_task("listops").prepare(c.data)  # once, before any worker starts: they share it
  return c


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory):
  """The one-process run on 4 of this process's devices: its final state."""
  return train.train_and_evaluate(config, str(tmp_path_factory.mktemp("one")))["state"]


def final_params(workdir, reference):
  params, step = checkpoint.load_params(str(workdir), checkpoint.abstract_like(
      reference["params"]))
  assert step == OVERRIDES["num_train_steps"]
  return params


def assert_same(got, want) -> None:
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def launched(standin, config, tmp_path_factory):
  """One launch on the stand-in pod: (process, cloud folder, workdir, dry-run output, s)."""
  base = tmp_path_factory.mktemp("launch")
  cloud, workdir = base / "cloud", base / "workdir"
  env = cloud_env(standin, cloud)
  dry = lra(launch_args(workdir, base / "launches", "--dry_run"), env)
  assert dry.returncode == 0 and dry.stderr == "", dry.stderr
  assert not (cloud / "calls.txt").exists()   # a dry run calls nothing
  t0 = time.time()
  try:
    proc = lra(launch_args(workdir, base / "launches"), env)
  finally:
    kill_leftovers(cloud)
  return proc, cloud, workdir, dry.stdout, time.time() - t0


def test_two_workers_train_as_one_job_like_one_process(launched, reference):
  proc, cloud, workdir, _, seconds = launched
  print(f"two-worker launch: {seconds:.1f} s")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert_same(final_params(workdir, reference), reference["params"])
  # Worker 0's output is streamed; every worker's output is in its own log.
  assert "Training listops" in proc.stdout and "test accuracy" in proc.stdout
  assert "finished: every worker exited 0 (attempt 1)" in proc.stdout
  logs = sorted(cloud.parent.glob("launches/*/attempt1/worker*.log"))
  assert [p.name for p in logs] == ["worker0.log", "worker1.log"]
  assert "test accuracy" in logs[0].read_text()
  assert "Traceback" not in logs[1].read_text()
  # The workers ran the unpacked copy of the tracked files, with the bootstrap skipped.
  for i in (0, 1):
    home = cloud / f"worker{i}" / "home"
    assert (home / "lra" / "src" / "launch" / "tpu.py").is_file()
    assert not (home / "lra" / "src" / ".venv").exists()


def test_the_recorded_commands_are_the_dry_run_lines(launched):
  proc, cloud, workdir, dry, _ = launched
  commands = [line for line in dry.splitlines() if not line.startswith("#")]
  assert in_order(calls(cloud)) == commands
  assert [shlex.split(c)[4] for c in commands] == ["describe", "describe", "scp", "ssh", "ssh",
                                                   "ssh"]
  assert "LRA_DISTRIBUTED=1" in commands[-1] and "--worker=1" in commands[-1]
  assert "pip install" in commands[3] and '"jax[tpu]==0.10.2"' in commands[3]
  # The dry run shows the config's changes as `lra run --dry_run` computes them.
  _, changes = train_launcher.config_changes(configs.build_config(
      "listops", size="small", overrides=[(k, str(v)) for k, v in OVERRIDES.items()]))
  assert [line[1:] for line in dry.splitlines() if line.startswith("#  ")] == changes


def test_stale_processes_and_the_lock_file_were_cleared(launched):
  _, cloud, _, _, _ = launched
  for i in (0, 1):
    d = cloud / f"worker{i}"
    assert not (d / "libtpu_lockfile").exists()
    stale = int((d / "stale.pid").read_text())
    assert not os.path.exists(f"/proc/{stale}") or \
        open(f"/proc/{stale}/stat").read().rpartition(")")[2].split()[0] == "Z"
    sudo = (d / "sudo.log").read_text().splitlines()
    assert sudo[0].startswith("lsof -t /dev/") and sudo[1] == "rm -f /tmp/libtpu_lockfile"


def test_a_killed_worker_is_named_and_the_retry_resumes_to_the_same_end(
    standin, launched, reference, tmp_path):
  first, _, uninterrupted, dry, _ = launched
  assert first.returncode == 0
  cloud, workdir = tmp_path / "cloud", tmp_path / "workdir"
  env = cloud_env(standin, cloud, STANDIN_KILL=f"1:{workdir}/checkpoints/4")
  t0 = time.time()
  try:
    proc = lra(launch_args(workdir, tmp_path / "launches", "--retries", "1"), env)
  finally:
    kill_leftovers(cloud)
  print(f"launch with a killed worker and one retry: {time.time() - t0:.1f} s")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert (cloud / "killed.txt").read_text() == f"worker 1 at {workdir}/checkpoints/4\n"
  log = next(tmp_path.glob("launches/*/attempt1/worker1.log"))
  assert (f"worker 1 of 2 failed (exit 137); its log: {log}; retry 1 of 1 once TPU pod is "
          f"READY.") in proc.stdout
  assert "finished: every worker exited 0 (attempt 2)" in proc.stdout
  # Two attempts, the workers stopped in between; the second resumed from checkpoint 4 or later.
  commands = [line.replace(str(tmp_path / "launches"), "L") for line in calls(cloud)]
  attempt = [c for c in dry.splitlines() if not c.startswith("#")]
  attempt = [c.replace(str(uninterrupted.parent / "launches"), "L").replace(
      str(uninterrupted), str(workdir)) for c in attempt]
  stop = tpu.Commands(tpu.Options("pod", "us-central2-b"), "").ssh("all", tpu.stop_script())
  assert in_order(commands) == attempt + [shlex.join(stop)] + attempt
  resumed = (tmp_path / "launches").glob("*/attempt2/worker0.log")
  assert "Resumed from " in next(resumed).read_text()
  assert_same(final_params(workdir, reference), final_params(uninterrupted, reference))


@pytest.mark.parametrize("argv, message", [
    (["--tpu", "pod", "--zone", "z", "--bogus", "--", "run", "listops"],
     "error: lra launch tpu: unrecognized arguments: --bogus"),
    (["--zone", "z", "--", "run", "listops"], "error: the TPU launcher needs --tpu NAME."),
    (["--tpu", "pod", "--", "run", "listops"], "error: the TPU launcher needs --zone ZONE."),
    (["--tpu", "pod", "--zone", "z"], "error: nothing after `--`: "),
    (["--tpu", "pod", "--zone", "z", "--"], "error: nothing after `--`: "),
    (["--tpu", "pod", "--zone", "z", "--", "train", "listops"],
     "error: the command after `--` must be `run TASK ...`"),
    (["--tpu", "pod", "--zone", "z", "--", "run", "listop"],
     "error: the run command after `--`: unknown task 'listop'; valid tasks: "),
    (["--tpu", "pod", "--zone", "z", "--", "run", "listops", "--config.model.dropuot=0.1"],
     "error: the run command after `--`: unknown config field 'model.dropuot'"),
    (["--tpu", "pod", "--zone", "z", "--", "run", "listops", "--config.batch_size=-3"],
     "error: the run command after `--`: "),
    (["--tpu", "pod", "--zone", "z", "--", "run", "listops", "--sized", "small"],
     "error: lra run: unrecognized arguments: --sized small"),
    (["--tpu", "pod", "--zone", "z", "--create", "--", "run", "listops"],
     "error: --create needs --accelerator TYPE"),
    (["--tpu", "pod", "--zone", "z", "--retries", "-1", "--", "run", "listops"],
     "error: --retries must be 0 or more, got -1."),
    (["--tpu", "pod", "--zone", "z", "--env", "A B=1", "--", "run", "listops"],
     "error: --env takes NAME=VALUE"),
])
def test_bad_input_is_one_line_and_calls_nothing(argv, message, standin, tmp_path, capsys,
                                                 monkeypatch):
  for key, value in cloud_env(standin, tmp_path / "cloud").items():
    monkeypatch.setenv(key, value)
  assert cli.main(["launch", "tpu", *argv]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.startswith(message) and err.count("\n") == 1, err
  assert not (tmp_path / "cloud" / "calls.txt").exists()


def test_without_gcloud_on_path_nothing_starts(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))
  argv = ["launch", "tpu", "--tpu", "pod", "--zone", "z", "--launch_dir", str(tmp_path / "l"),
          "--", "run", "listops"]
  assert cli.main(argv) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.startswith("error: `gcloud` is not on PATH; install the Google "
                                      "Cloud SDK") and err.count("\n") == 1
  assert not (tmp_path / "l").exists()
  assert cli.main([*argv[:-3], "--dry_run", *argv[-3:]]) == 0  # a dry run needs no gcloud
  assert "gcloud compute tpus tpu-vm describe pod --zone=z" in capsys.readouterr().out
