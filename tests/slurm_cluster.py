"""A real one-node SLURM cluster for tests: Debian's munged, slurmctld and slurmd, started as
root in a private folder in a few seconds.

  with SlurmCluster(tmp_path) as cluster:     # or the `slurm_cluster` fixtures built on it
    subprocess.run(["sbatch", ...], env=cluster.env)

`SlurmCluster(folder)` writes a munge key and a `slurm.conf` for this host (its short host name,
`nproc` CPUs, no GPUs, one partition `debug` whose CPUs jobs may share, so that a test can run a
second job beside a first one on a two-core machine), starts munged on its own socket, then
slurmctld and slurmd on free ports, and waits until the node is idle. Nothing outside the folder
is touched: the daemons' state, spool, logs and pid files live in it, and the client commands
(sbatch, srun, scontrol, squeue, scancel) find the cluster through `SLURM_CONF` in
`cluster.env`. `stop()` (or leaving the `with`) cancels what is still queued and stops the three
daemons by their pids.

`unavailable()` says why such a cluster cannot run here (not root, the packages missing: CI's
`.ci/run` installs them with `apt-get install slurmctld slurmd munge`), or None; tests skip with
that reason. Run `python tests/slurm_cluster.py` to start one by hand (Ctrl-C stops it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
PARTITION = "debug"
START_TIMEOUT_S = 30.0


def _program(name: str) -> str | None:
  return shutil.which(name) or next(
      (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None)


def unavailable() -> str | None:
  """Why a SLURM cluster cannot be started here, or None."""
  if not hasattr(os, "geteuid") or os.geteuid() != 0:
    return "a SLURM cluster needs root (the daemons run as root); CI runs these tests as root"
  missing = [p for p in (*DAEMONS, "sbatch", "scontrol") if _program(p) is None]
  if missing:
    return (f"{', '.join(missing)} not installed; `apt-get install slurmctld slurmd munge` "
            f"(what .ci/run does)")
  return None


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("", 0))
    return s.getsockname()[1]


class SlurmCluster:
  """One node (this host) with `nproc` CPUs in partition `debug`; see the module docstring."""

  def __init__(self, folder: str | os.PathLike):
    self.folder = os.path.abspath(os.fspath(folder))
    self.host = socket.gethostname().split(".")[0]
    self.cpus = os.cpu_count() or 1
    self.conf = os.path.join(self.folder, "slurm.conf")
    self.munge_socket = os.path.join(self.folder, "munge", "munge.socket")
    self.env = {**os.environ, "SLURM_CONF": self.conf}
    self._pids: dict[str, int] = {}

  def _path(self, *parts: str) -> str:
    return os.path.join(self.folder, *parts)

  def _write_config(self) -> None:
    for sub in ("munge", "state", "spool", "log"):
      os.makedirs(self._path(sub), exist_ok=True)
    os.chmod(self._path("munge"), 0o700)
    with open(self._path("munge", "munge.key"), "wb") as f:
      f.write(os.urandom(1024))
    os.chmod(self._path("munge", "munge.key"), 0o400)
    lines = [
        "ClusterName=lratest",
        f"SlurmctldHost={self.host}",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={self.munge_socket}",
        f"StateSaveLocation={self._path('state')}",
        f"SlurmdSpoolDir={self._path('spool')}",
        f"SlurmctldPidFile={self._path('slurmctld.pid')}",
        f"SlurmdPidFile={self._path('slurmd.pid')}",
        f"SlurmctldLogFile={self._path('log', 'slurmctld.log')}",
        f"SlurmdLogFile={self._path('log', 'slurmd.log')}",
        "ProctrackType=proctrack/linuxproc",   # no cgroups: runs in containers too
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "LaunchParameters=use_interactive_step",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "KillWait=5",             # seconds from a cancel's SIGTERM to its SIGKILL
        "MinJobAge=600",          # finished jobs stay visible to `scontrol show job`
        "InactiveLimit=0",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "SchedulerParameters=sched_interval=1",
        f"NodeName={self.host} CPUs={self.cpus} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP "
        f"OverSubscribe=FORCE:4",
    ]
    with open(self.conf, "w") as f:
      f.write("\n".join(lines) + "\n")

  def _start(self, name: str, argv: list[str]) -> None:
    log = open(self._path("log", f"{name}.out"), "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                            start_new_session=True)
    log.close()
    self._pids[name] = proc.pid
    self._procs = getattr(self, "_procs", []) + [proc]

  def start(self) -> "SlurmCluster":
    """Starts munged, slurmctld and slurmd and waits for the node to be idle (RuntimeError with
    the daemons' logs when it is not within START_TIMEOUT_S)."""
    reason = unavailable()
    if reason:
      raise RuntimeError(reason)
    self._write_config()
    self._start("munged", [_program("munged"), "--foreground", "--force",
                           f"--socket={self.munge_socket}",
                           f"--key-file={self._path('munge', 'munge.key')}",
                           f"--pid-file={self._path('munge', 'munged.pid')}",
                           f"--log-file={self._path('log', 'munged.log')}",
                           f"--seed-file={self._path('munge', 'munged.seed')}"])
    self._wait(lambda: os.path.exists(self.munge_socket), "munged")
    self._start("slurmctld", [_program("slurmctld"), "-D", "-i", "-f", self.conf])
    self._start("slurmd", [_program("slurmd"), "-D", "-f", self.conf, "-N", self.host])
    self._wait(self._node_idle, "slurmctld and slurmd")
    return self

  def _node_idle(self) -> bool:
    p = subprocess.run(["scontrol", "show", "node", self.host, "-o"], env=self.env,
                       capture_output=True, text=True)
    return p.returncode == 0 and "State=IDLE" in p.stdout

  def _wait(self, ready, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
      if ready():
        return
      dead = [p for p in self._procs if p.poll() is not None]
      if dead:
        break
      time.sleep(0.2)
    logs = "\n".join(f"--- {name}:\n{self.log_tail(name)}" for name in self._pids)
    self.stop()
    raise RuntimeError(f"{what} did not start in {START_TIMEOUT_S:.0f} s:\n{logs}")

  def log_tail(self, name: str, chars: int = 2000) -> str:
    text = ""
    for path in (self._path("log", f"{name}.out"), self._path("log", f"{name}.log")):
      if os.path.exists(path):
        with open(path, errors="replace") as f:
          text += f.read()[-chars:]
    return text

  def run(self, *argv: str, timeout: float = 60, check: bool = True
          ) -> subprocess.CompletedProcess:
    """A client command (`scontrol ...`) against this cluster."""
    p = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
      raise RuntimeError(f"{' '.join(argv)} failed (exit {p.returncode}): {p.stderr.strip()}")
    return p

  def job(self, job_id: str | int) -> dict[str, str]:
    """`scontrol show job` as {field: value} ({} once the job is forgotten)."""
    p = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
    if p.returncode:
      return {}
    return dict(item.partition("=")[::2] for item in p.stdout.split() if "=" in item)

  def wait_job(self, job_id: str | int, timeout: float = 300) -> dict[str, str]:
    """Waits for the job to end; returns its `scontrol show job` fields."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      fields = self.job(job_id)
      if fields.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING",
                                        "REQUEUED", "SUSPENDED", None):
        return fields
      time.sleep(0.5)
    raise TimeoutError(f"job {job_id} did not end in {timeout:.0f} s: {self.job(job_id)}")

  def stop(self) -> None:
    """Cancels the queued jobs, stops the daemons (SIGTERM, then SIGKILL after 10 s)."""
    if "slurmctld" in self._pids:
      subprocess.run(["scancel", "--full", "--quiet", f"--partition={PARTITION}"],
                     env=self.env, capture_output=True, timeout=30)
    for proc in reversed(getattr(self, "_procs", [])):
      if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    for proc in reversed(getattr(self, "_procs", [])):
      try:
        proc.wait(10)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    self._procs, self._pids = [], {}

  def __enter__(self) -> "SlurmCluster":
    return self.start()

  def __exit__(self, *exc) -> bool:
    self.stop()
    return False


if __name__ == "__main__":
  import tempfile
  why = unavailable()
  if why:
    sys.exit(f"error: {why}.")
  folder = tempfile.mkdtemp(prefix="slurm-")
  t0 = time.monotonic()
  with SlurmCluster(folder) as cluster:
    print(f"SLURM cluster up in {time.monotonic() - t0:.1f} s: export SLURM_CONF={cluster.conf}"
          f" (Ctrl-C stops it)", flush=True)
    try:
      signal.pause()
    except KeyboardInterrupt:
      pass
