"""`lra launch tpu`: one `lra run` on every worker of a Cloud TPU VM (a pod slice), through gcloud.

  lra launch tpu --tpu NAME --zone ZONE [--project P] [--workers N]
                 [--create --accelerator v4-32 --runtime VERSION [--spot]] [--retries N]
                 [--env NAME=VALUE ...] [--launch_dir DIR] [--dry_run] -- run TASK [flags]

One attempt is these gcloud calls, in this order (`--dry_run` prints them, one per line):
  1. `describe --format=value(state)`: the TPU must be READY. Other states are waited out; with
     --create a missing TPU is created, and a PREEMPTED, TERMINATED or STOPPED one is deleted
     and created again.
  2. `describe --flatten=networkEndpoints[]`: its workers, one line each (as MaxText's
     multihost_runner.py counts them).
  3. `scp --worker=all`: the tracked files of this checkout (`git ls-files`), packed once per
     launch into `<launch_dir>/src.tar.gz`, to `~/lra-src.tar.gz` on every worker.
  4. `ssh --worker=all`: on every worker, kill the processes holding the TPU (`lsof` of its
     device files) and remove /tmp/libtpu_lockfile (as multihost_runner.py does), unpack the code
     into ~/lra/src, and bootstrap ~/lra/venv: python3.11, jax[tpu] at the version setup.py
     pins, then the project with its `gcs` extra. The bootstrap runs once: the marker file
     ~/lra/bootstrapped-<hash of setup.py> makes later launches skip it (delete it to redo it).
  5. `ssh --worker=I` for every worker I, all at once: `cd ~/lra && LRA_DISTRIBUTED=1
     PYTHONPATH=~/lra/src ~/lra/venv/bin/python -m launch.cli run ...` (the command after `--`;
     on Cloud TPU, jax.distributed.initialize() needs no arguments).

One ssh per worker rather than one `--worker=all`, so that each worker's output goes to its own
log file (`<launch_dir>/<time>/attempt<k>/worker<I>.log`; worker 0's is also printed here) and
the launcher knows which worker failed first. It then stops the other workers (their ssh
clients, then the kill of step 4 on every worker, since a remote process can outlive its client)
and says in one line which worker failed and where its log is. With `--retries N` it waits for
the TPU to be READY again (recreating it with --create) and runs the attempt again: `lra run`
resumes from the last checkpoint in the workdir, which must be a bucket the workers share.
Exit status: 0 when every worker finished, 1 when the launch failed, 2 for bad input (nothing is
called), 130 when interrupted (the workers are stopped).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from typing import IO

from launch import remote
from launch.tpu_worker import (TARBALL, jax_version, prepare_script, stop_script,
                                worker_script)

GONE = ("PREEMPTED", "TERMINATED", "STOPPED")  # states a TPU does not leave by itself
TIMEOUTS = {"describe": 120, "create": 1800, "delete": 1800, "scp": 900, "prepare": 3600,
            "stop": 300}


@dataclasses.dataclass
class Options:
  tpu: str
  zone: str
  project: str | None = None
  workers: int | None = None
  create: bool = False
  accelerator: str | None = None
  runtime: str | None = None
  spot: bool = False
  retries: int = 0
  env: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  poll_seconds: float = 30.0
  wait_seconds: float = 3600.0    # how long to wait for READY before giving up


FLAGS = {"tpu": "--tpu", "zone": "--zone", "project": "--project", "workers": "--workers",
         "create": "--create", "accelerator": "--accelerator", "runtime": "--runtime",
         "spot": "--spot", "retries": "--retries", "poll_seconds": "--poll_seconds"}


def add_options(parser: argparse.ArgumentParser) -> None:
  g = parser.add_argument_group("TPU (lra launch tpu, lra sweep --runner tpu)")
  g.add_argument("--tpu", default=None, help="the TPU VM's name (required)")
  g.add_argument("--zone", default=None, help="its zone, e.g. us-central2-b (required)")
  g.add_argument("--project", default=None, help="its project (default: gcloud's)")
  g.add_argument("--workers", type=int, default=None,
                 help="the worker count: checked against the TPU's; lets --dry_run list the "
                      "per-worker commands")
  g.add_argument("--create", action="store_true", default=None,
                 help="create the TPU when absent, and recreate it after a preemption")
  g.add_argument("--accelerator", default=None, help="with --create: e.g. v4-32")
  g.add_argument("--runtime", default=None,
                 help="with --create: the TPU software version, e.g. tpu-ubuntu2204-base")
  g.add_argument("--spot", action="store_true", default=None, help="with --create: a spot TPU")
  g.add_argument("--retries", type=int, default=None,
                 help="after a preemption or a worker failure, wait for READY and rerun (it "
                      "resumes) up to N times (default 0)")
  g.add_argument("--poll_seconds", type=float, default=None,
                 help="seconds between state checks while waiting for READY (default 30)")


def given_options(args: argparse.Namespace) -> list[str]:
  """The TPU flags set on the command line (for `lra sweep`, which refuses them elsewhere)."""
  return [flag for dest, flag in FLAGS.items() if getattr(args, dest, None) not in (None, False)]


def options(args: argparse.Namespace) -> Options:
  """The checked TPU options; raises remote.LaunchError (one line)."""
  if not args.tpu or not args.zone:
    missing = " and ".join(f for f, v in (("--tpu NAME", args.tpu), ("--zone ZONE", args.zone))
                           if not v)
    raise remote.LaunchError(f"the TPU launcher needs {missing}.")
  if args.create and not (args.accelerator and args.runtime):
    raise remote.LaunchError("--create needs --accelerator TYPE (e.g. v4-32) and --runtime "
                             "VERSION (e.g. tpu-ubuntu2204-base).")
  if not args.create and (args.accelerator or args.runtime or args.spot):
    raise remote.LaunchError("--accelerator, --runtime and --spot apply with --create only.")
  if args.retries is not None and args.retries < 0:
    raise remote.LaunchError(f"--retries must be 0 or more, got {args.retries}.")
  if args.workers is not None and args.workers < 1:
    raise remote.LaunchError(f"--workers must be at least 1, got {args.workers}.")
  if args.poll_seconds is not None and args.poll_seconds <= 0:
    raise remote.LaunchError(f"--poll_seconds must be positive, got {args.poll_seconds}.")
  return Options(args.tpu, args.zone, args.project, args.workers, bool(args.create),
                 args.accelerator, args.runtime, bool(args.spot), args.retries or 0,
                 remote.env_items(args.env),
                 30.0 if args.poll_seconds is None else args.poll_seconds)


class Commands:
  """The gcloud command lines of a launch."""

  def __init__(self, o: Options, tarball: str):
    self.o, self.tarball = o, tarball
    self.where = [f"--zone={o.zone}", *([f"--project={o.project}"] if o.project else [])]

  def _tpu(self, verb: str, *args: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", verb, self.o.tpu, *self.where, *args]

  def state(self) -> list[str]:
    return self._tpu("describe", "--format=value(state)")

  def endpoints(self) -> list[str]:
    return self._tpu("describe", "--flatten=networkEndpoints[]",
                     "--format=csv[no-heading](networkEndpoints.ipAddress)")

  def create(self) -> list[str]:
    return self._tpu("create", f"--accelerator-type={self.o.accelerator}",
                     f"--version={self.o.runtime}", *(["--spot"] if self.o.spot else []))

  def delete(self) -> list[str]:
    return self._tpu("delete", "--quiet")

  def scp(self) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "scp", self.tarball, f"{self.o.tpu}:{TARBALL}",
            *self.where, "--worker=all", "--strict-host-key-checking=no"]

  def ssh(self, worker: int | str, script: str) -> list[str]:
    return self._tpu("ssh", f"--worker={worker}", "--strict-host-key-checking=no",
                     f"--command={script}")

  def attempt(self, workers: int | None, command: remote.RunCommand) -> list[list[str]]:
    """One attempt's calls once the TPU is READY (without the per-worker ones when the worker
    count is not known)."""
    runs = [self.ssh(i, worker_script(self.o.env, command)) for i in range(workers or 0)]
    return [self.state(), self.endpoints(), self.scp(), self.ssh("all", prepare_script()), *runs]


def default_launch_dir(o: Options) -> str:
  return os.path.join(remote.DEFAULT_LAUNCH_DIR, f"tpu-{o.tpu}")


def plan(o: Options, command: remote.RunCommand, launch_dir: str) -> list[str]:
  """The dry run: `# ` notes (with the config's difference from its default) and the exact
  gcloud commands of the first attempt, one per line."""
  c = Commands(o, os.path.join(launch_dir, "src.tar.gz"))
  workers = f"{o.workers} workers" if o.workers else "its workers"
  lines = [f"# lra launch tpu: `{command.text()}` on {workers} of TPU {o.tpu} (zone {o.zone}), "
           f"retries {o.retries}", *remote.config_lines(command)]
  note = remote.workdir_note(command, "the workers of a pod")
  if note:
    lines.append(f"# {note}")
  if o.create:
    lines.append(f"# when describe finds no TPU: {shlex.join(c.create())}; when it is "
                 f"{'/'.join(GONE)}: {shlex.join(c.delete())}, then the create")
  lines.append(f"# first, the tracked files of {remote.ROOT} are packed into {c.tarball}")
  lines += [shlex.join(x) for x in c.attempt(o.workers, command)]
  if not o.workers:
    lines.append(f"# then for each worker I = 0 .. N-1 (N: the lines of the second describe; "
                 f"--workers N lists them): {shlex.join(c.ssh('I', worker_script(o.env, command)))}")
  lines.append(f"# when a worker fails: its ssh clients are stopped, then "
               f"{shlex.join(c.ssh('all', stop_script()))}")
  if o.retries:
    lines.append(f"# then, up to {o.retries} time(s): describe until READY, and the commands "
                 f"above again (the run resumes from its last checkpoint)")
  return lines


def pack(tarball: str) -> int:
  """Packs the tracked files of the checkout (working-tree contents); returns their count."""
  try:
    out = subprocess.run(["git", "-C", remote.ROOT, "ls-files", "-z"], capture_output=True,
                         check=True, timeout=120)
  except (OSError, subprocess.SubprocessError) as e:
    raise remote.LaunchError(f"cannot list the tracked files of {remote.ROOT} with git ({e}); "
                             f"lra launch tpu copies a git checkout to the workers.") from None
  names = [n for n in out.stdout.decode().split("\0") if n]
  os.makedirs(os.path.dirname(tarball) or ".", exist_ok=True)
  count = 0
  with tarfile.open(tarball + ".tmp", "w:gz") as tar:
    for name in names:
      path = os.path.join(remote.ROOT, name)
      if os.path.isfile(path):   # a tracked file deleted in the working tree is left out
        tar.add(path, arcname=name, recursive=False)
        count += 1
  os.replace(tarball + ".tmp", tarball)
  return count


class _Failed(Exception):
  """An attempt failed; the message is the one line to print."""

  def __init__(self, message: str, retry: bool = True):
    super().__init__(message)
    self.retry = retry


def _tee(source: IO[bytes], log: IO[bytes], out: IO[str]) -> None:
  for line in iter(source.readline, b""):
    log.write(line)
    log.flush()
    out.write(line.decode("utf-8", "replace"))
    out.flush()


def _last_line(folder: str, name: str) -> str:
  """`<last line of the log> (log <path>)`."""
  path = os.path.join(folder, name)
  try:
    with open(path, "rb") as f:
      lines = [x.strip() for x in f.read()[-4000:].decode("utf-8", "replace").splitlines()]
  except OSError:
    lines = []
  last = next((x for x in reversed(lines) if x), "no output")
  return f"{last[:300]} (log {path})"


class Launch:
  """One `lra launch tpu`: packs the code, then runs attempts until one succeeds."""

  def __init__(self, o: Options, command: remote.RunCommand, launch_dir: str):
    self.o, self.command, self.launch_dir = o, command, launch_dir
    self.c = Commands(o, os.path.join(launch_dir, "src.tar.gz"))
    self.logs = os.path.join(launch_dir, time.strftime("%Y%m%d-%H%M%S"))
    self.clients: list[subprocess.Popen] = []
    self.started = False   # whether this attempt's prepare step began (so workers may run)

  def say(self, text: str) -> None:
    print(f"[launch {time.strftime('%H:%M:%S')}] {text}", flush=True)

  def call(self, argv: list[str], log: str | None, timeout: float) -> tuple[int, str]:
    """Runs one gcloud command: output to `log` (or returned when log is None)."""
    with open(os.path.join(self.logs, "commands.txt"), "a") as f:
      f.write(shlex.join(argv) + "\n")
    try:
      if log is None:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout + ("\n" + p.stderr if p.returncode else "")
      with open(log, "ab") as f:
        p = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                           stdin=subprocess.DEVNULL)
      return p.returncode, ""
    except subprocess.TimeoutExpired:
      return 124, f"timed out after {timeout:.0f} s"

  def ensure_ready(self) -> None:
    """Waits until the TPU is READY, creating or recreating it with --create."""
    deadline = time.monotonic() + self.o.wait_seconds
    name = f"TPU {self.o.tpu}"
    while True:
      rc, out = self.call(self.c.state(), None, TIMEOUTS["describe"])
      state = out.strip().splitlines()[0].strip() if rc == 0 and out.strip() else None
      if state == "READY":
        return
      absent = rc != 0 and ("NOT_FOUND" in out or "not found" in out.lower())
      if rc != 0 and not absent:
        last = (out.strip().splitlines() or ["no output"])[-1]
        raise _Failed(f"gcloud could not describe {name} (exit {rc}): {last}")
      if absent or state in GONE:
        what = "does not exist" if absent else f"is {state}"
        if not self.o.create:
          raise _Failed(f"{name} {what}; create it (or launch with --create --accelerator "
                        f"TYPE --runtime VERSION) and run the same command again.", retry=False)
        if not absent:
          self.say(f"{name} {what}: deleting it to create it again.")
          rc, out = self.call(self.c.delete(), None, TIMEOUTS["delete"])
          if rc:
            raise _Failed(f"could not delete {name} (exit {rc}): {out.strip()[-300:]}")
        self.say(f"creating {name} ({self.o.accelerator}, {self.o.runtime}).")
        rc, out = self.call(self.c.create(), None, TIMEOUTS["create"])
        if rc:
          raise _Failed(f"could not create {name} (exit {rc}): {out.strip()[-300:]}")
        continue
      if time.monotonic() > deadline:
        raise _Failed(f"{name} is still {state} after {self.o.wait_seconds:.0f} s.",
                      retry=False)
      self.say(f"{name} is {state}; waiting for READY (every {self.o.poll_seconds:g} s).")
      time.sleep(self.o.poll_seconds)

  def worker_count(self) -> int:
    rc, out = self.call(self.c.endpoints(), None, TIMEOUTS["describe"])
    count = len([x for x in out.splitlines() if x.strip()]) if rc == 0 else 0
    if rc or not count:
      raise _Failed(f"could not list the workers of TPU {self.o.tpu} (exit {rc}).")
    if self.o.workers and count != self.o.workers:
      raise _Failed(f"TPU {self.o.tpu} has {count} workers, not {self.o.workers} (--workers).",
                    retry=False)
    return count

  def stop_workers(self, logs: str) -> None:
    """Ends the ssh clients, then kills what holds the TPU on every worker."""
    for p in self.clients:
      if p.poll() is None:
        p.terminate()
    for p in self.clients:
      try:
        p.wait(10)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    self.clients = []
    self.call(self.c.ssh("all", stop_script()), os.path.join(logs, "stop.log"),
              TIMEOUTS["stop"])

  def run_workers(self, workers: int, logs: str) -> None:
    script = worker_script(self.o.env, self.command)
    exits: queue.Queue = queue.Queue()
    tee = None
    for i in range(workers):
      cmd = self.c.ssh(i, script)
      with open(os.path.join(self.logs, "commands.txt"), "a") as f:
        f.write(shlex.join(cmd) + "\n")
      log = open(os.path.join(logs, f"worker{i}.log"), "wb")
      p = subprocess.Popen(cmd, stdout=subprocess.PIPE if i == 0 else log,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
      if i == 0:
        tee = threading.Thread(target=_tee, args=(p.stdout, log, sys.stdout), daemon=True)
        tee.start()
      else:
        log.close()
      self.clients.append(p)
      threading.Thread(target=lambda i=i, p=p: exits.put((i, p.wait())), daemon=True).start()
    failed, done = None, 0
    while done < workers:
      try:
        i, rc = exits.get(timeout=1)   # a timeout keeps Ctrl-C and SIGTERM responsive
      except queue.Empty:
        continue
      done += 1
      if rc != 0:
        failed = (i, rc)
        break
    if failed is None:
      tee.join(30)
      self.clients = []
      return
    self.say(f"worker {failed[0]} failed (exit {failed[1]}): stopping the other workers.")
    self.stop_workers(logs)
    tee.join(30)
    raise _Failed(f"worker {failed[0]} of {workers} failed (exit {failed[1]}); its log: "
                  f"{os.path.join(logs, f'worker{failed[0]}.log')}")

  def attempt(self, k: int) -> None:
    logs = os.path.join(self.logs, f"attempt{k}")
    os.makedirs(logs, exist_ok=True)
    self.ensure_ready()
    workers = self.worker_count()
    self.say(f"copying the code to the {workers} workers of TPU {self.o.tpu}.")
    rc, _ = self.call(self.c.scp(), os.path.join(logs, "scp.log"), TIMEOUTS["scp"])
    if rc:
      raise _Failed(f"copying the code failed (exit {rc}): {_last_line(logs, 'scp.log')}")
    self.started = True
    self.say(f"preparing the workers (stopping what holds the TPU, unpacking, the venv); log "
             f"{os.path.join(logs, 'prepare.log')}")
    rc, _ = self.call(self.c.ssh("all", prepare_script()), os.path.join(logs, "prepare.log"),
                      TIMEOUTS["prepare"])
    if rc:
      raise _Failed(f"preparing the workers failed (exit {rc}): "
                    f"{_last_line(logs, 'prepare.log')}")
    self.say(f"running `{self.command.text()}` on {workers} workers; worker 0's output "
             f"follows, every worker's log is in {logs}")
    self.run_workers(workers, logs)

  def run(self) -> int:
    os.makedirs(self.logs, exist_ok=True)
    count = pack(self.c.tarball)
    self.say(f"packed {count} tracked files of {remote.ROOT} into {self.c.tarball}")
    note = remote.workdir_note(self.command, "the workers of a pod")
    if note:
      self.say(note)
    for k in range(1, self.o.retries + 2):
      try:
        self.attempt(k)
      except _Failed as e:
        if not e.retry or k > self.o.retries:
          print(f"error: {e}", file=sys.stderr, flush=True)
          return 1
        self.say(f"{e}; retry {k} of {self.o.retries} once TPU {self.o.tpu} is READY.")
        continue
      except KeyboardInterrupt:
        if self.started:
          self.say("interrupted: stopping the workers.")
          self.stop_workers(os.path.join(self.logs, f"attempt{k}"))
        print("error: interrupted; nothing runs on the TPU now. Run the same command again to "
              "resume from the last checkpoint.", file=sys.stderr, flush=True)
        return 130
      self.say(f"finished: every worker exited 0 (attempt {k}); logs in {self.logs}")
      return 0
    return 1


def parser() -> remote.OneLineParser:
  p = remote.OneLineParser(prog="lra launch tpu", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
  add_options(p)
  remote.add_common_options(p)
  p.add_argument("--dry_run", action="store_true",
                 help="print the gcloud commands and the config's changes; call nothing")
  return p


def _sigterm(signum, frame):
  raise KeyboardInterrupt


def launch(o: Options, command: remote.RunCommand, launch_dir: str) -> int:
  """Runs the launch (gcloud must be on PATH); returns the exit status."""
  previous = signal.signal(signal.SIGTERM, _sigterm) if \
      threading.current_thread() is threading.main_thread() else None
  try:
    return Launch(o, command, launch_dir).run()
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, command: remote.RunCommand) -> int:
  """`lra launch tpu`: prints the plan (--dry_run) or launches."""
  o = options(args)
  launch_dir = args.launch_dir or default_launch_dir(o)
  if args.dry_run:
    print("\n".join(plan(o, command, launch_dir)))
    return 0
  remote.require_program("gcloud", "install the Google Cloud SDK and run `gcloud auth login`")
  jax_version()
  return launch(o, command, launch_dir)

