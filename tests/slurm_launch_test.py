"""`lra launch slurm` against a real one-node SLURM cluster (tests/slurm_cluster.py: Debian's
munged, slurmctld and slurmd, started here as root; CPU-only, no GPUs).

Every job is the command a user types: `lra launch slurm --nodes 1 --ntasks_per_node 2 ... --
run listops ...` in a subprocess, submitted with sbatch, run by slurmd, two tasks of one
jax.distributed job on 2 CPU devices each (a 4-device mesh), with a relative --workdir.

- A two-task job trains as one process does (the parameters of a one-process run on 4 devices),
  records its process count, device count, mesh and backend in results.json, and `--follow`
  streams its log and exits with its status; `--nodes 2` on this one-node cluster is refused in
  one line by `sbatch --test-only`, and a missing `--python` before anything is submitted.
- SIGTERM delivered to the two tasks 3 s apart while they train: both stop after the same step,
  with one checkpoint at that step; the job ends COMPLETED (a clean stop, not FAILED), and the
  same command resumes it to parameters bit-identical to an uninterrupted job's. While the
  first job runs, a second job on its workdir fails in under 30 s with the lock's one line
  (`--follow` ends with it).
- SIGTERM to both tasks during start-up (as soon as each runs its first line, before jax is
  imported): the job stops cleanly at step 0 and resumes exactly too.
- `--time 1 --requeue` (one minute, SLURM's smallest) for a run that needs more (its steps
  slowed by a sitecustomize on the tasks' PYTHONPATH): the batch script stops the tasks at one
  step 15 s before the limit, requeues the job, and the next attempt (appended to the same logs)
  resumes from that step and finishes with the parameters of one uninterrupted process. About
  100 s, most of it the minute the job waits for its limit.

The tests skip (with the reason) where the daemons cannot run: not root, or the packages missing
(`.ci/run` installs them).
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import configs
from lra import checkpoint, tasks, train
import slurm_cluster

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(slurm_cluster.unavailable() is not None,
                                 reason=f"no SLURM here: {slurm_cluster.unavailable()}")]

jax.config.update("jax_disable_most_optimizations", True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {   # tests/distributed_test.py's tiny ListOps config
    "data.num_train": 64, "data.num_val": 20, "data.num_test": 20, "data.max_length": 24,
    "data.gen_min_length": 4, "data.gen_max_length": 25,
    "model.emb_dim": 16, "model.qkv_dim": 16, "model.mlp_dim": 32, "model.classifier_dim": 16,
    "model.num_heads": 2, "model.num_layers": 1, "mesh.data": 4,
    "batch_size": 16, "eval_batch_size": 8, "num_train_steps": 4, "warmup_steps": 1,
    "learning_rate": 0.01, "log_every": 1, "eval_every": 2, "checkpoint_every": 2,
    "progress": False,
}
# The long job stopped by SIGTERM: enough steps to be training 3 s later, no periodic save.
LONG = {**OVERRIDES, "num_train_steps": 400, "eval_every": 10**6, "checkpoint_every": 10**6,
        "log_every": 1}


def flags(overrides: dict) -> list[str]:
  return [f"--config.{k}={v}" for k, v in overrides.items()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  with slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
    yield c


@pytest.fixture(scope="module")
def config():
  c = configs.build_config("listops", size="small",
                           overrides=[(k, str(v)) for k, v in OVERRIDES.items()])
  tasks.get_task("listops").prepare(c.data)  # once, before the tasks start: they share it
  return c


def launch(cluster, cwd, overrides, *extra, follow=True, timeout=400):
  """`lra launch slurm` of the tiny ListOps run in `cwd` (workdir `wd`, launch files in
  `launch/`); the CompletedProcess (follow) or the Popen."""
  env = {k: v for k, v in cluster.env.items() if k != "XLA_FLAGS"}   # conftest's 8 devices
  argv = [sys.executable, "-m", "launch.cli", "launch", "slurm", "--nodes", "1",
          "--ntasks-per-node", "2", "--cpus_per_task", "1", "--launch_dir", "launch",
          "--env", "JAX_NUM_CPU_DEVICES=2", "--env", "JAX_PLATFORMS=cpu",
          "--env", "JAX_DISABLE_MOST_OPTIMIZATIONS=1",
          "--env", "JAX_DEFAULT_MATMUL_PRECISION=highest", "--env", f"PYTHONPATH={REPO}",
          *(["--follow"] if follow else []), *extra, "--",
          "run", "listops", "--size", "small", "--workdir", "wd", "--no_preflight",
          *flags(overrides)]
  return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)


def job_id(p: subprocess.CompletedProcess) -> str:
  assert p.stdout.startswith("submitted job "), p.stdout + p.stderr
  return p.stdout.split()[2].rstrip(":")


def task_pids(job: str) -> dict[int, int]:
  """{SLURM_PROCID: pid} of the job's `lra` task processes on this host."""
  out = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
      with open(f"/proc/{name}/environ", "rb") as f:
        env = dict(x.partition(b"=")[::2] for x in f.read().split(b"\0"))
    except OSError:
      continue
    if (len(argv) > 2 and argv[1] == b"-c" and b"hold_early" in argv[2]
        and env.get(b"SLURM_JOB_ID") == job.encode()):
      out[int(env[b"SLURM_PROCID"])] = int(name)
  return out


def catches_sigterm(pid: int) -> bool:
  """Whether process `pid` has a handler for SIGTERM (SigCgt in /proc/PID/status)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      caught = next(int(x.split()[1], 16) for x in f if x.startswith("SigCgt:"))
  except (OSError, StopIteration):
    return False
  return bool(caught >> (signal.SIGTERM - 1) & 1)


def logs(folder, job: str) -> str:
  return "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}"
                   for p in sorted((folder / "launch").glob(f"*{job}*")))


def train_records(workdir) -> int:
  try:
    with open(workdir / "metrics.jsonl") as f:
      return sum('"train"' in line for line in f)
  except OSError:
    return 0


def final_params(workdir, reference):
  params, step = checkpoint.load_params(str(workdir), checkpoint.abstract_like(reference))
  return params, step


def test_nodes_beyond_the_cluster_and_a_missing_python_are_one_line(cluster, tmp_path):
  t0 = time.monotonic()
  p = launch(cluster, tmp_path, OVERRIDES, "--nodes", "2")
  assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
  assert p.stderr.startswith("error: the cluster refuses the job (sbatch --test-only ")
  assert "Requested node configuration is not available" in p.stderr
  assert p.stderr.count("\n") == 1 and time.monotonic() - t0 < 30
  assert cluster.run("squeue", "-h").stdout.strip() == ""   # nothing submitted
  p = launch(cluster, tmp_path, OVERRIDES, "--python", "/nonexistent/python")
  assert p.returncode == 2 and p.stderr == (
      "error: --python /nonexistent/python: no executable there; give the Python of the "
      "environment the tasks run (on a filesystem every node reaches).\n")


def test_a_two_task_cpu_job_trains_like_one_process(cluster, config, tmp_path):
  p = launch(cluster, tmp_path, OVERRIDES)
  job = job_id(p)
  assert p.returncode == 0, p.stdout + p.stderr + logs(tmp_path, job)
  script = (tmp_path / "launch" / "job.sbatch").read_text()
  assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --cpus-per-task=1" in script
  assert "gpus" not in script.replace("no GPUs", "")
  assert f"--workdir {tmp_path}/wd" in script   # resolved where the command was typed
  assert f"[job] === job {job} attempt 1 on " in p.stdout
  assert f"job {job} ended: COMPLETED (exit 0:0)" in p.stdout.splitlines()[-1]
  for t in (0, 1):
    assert f"=== job {job} attempt 1 task {t} on " in (
        tmp_path / "launch" / f"job{job}-task{t}.log").read_text()
  results = json.loads((tmp_path / "wd" / "results.json").read_text())
  assert (results["process_count"], results["device_count"]) == (2, 4)
  assert results["mesh"]["data"] == 4 and results["attention_backend"] == "xla"

  reference = train.train_and_evaluate(config, str(tmp_path / "one"))["state"]["params"]
  params, step = final_params(tmp_path / "wd", reference)
  assert step == OVERRIDES["num_train_steps"]
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def wait_for(predicate, timeout: float, what: str):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = predicate()
    if value:
      return value
    time.sleep(0.1)
  raise AssertionError(f"timed out waiting for {what}")


def stopped_run(cluster, folder, *, when: str) -> tuple[str, int]:
  """Submits the long job in `folder`, delivers SIGTERM to its tasks (`when`: "training", 3 s
  apart, with a second job tried on the busy workdir first; or "start-up", before jax is up);
  returns (the job, the step it stopped at)."""
  job = job_id(launch(cluster, folder, LONG, follow=False))
  if when == "start-up":
    # As soon as each task runs its first line (its SIGTERM handler is installed: before that
    # the interpreter itself is starting), long before jax is imported and initialised.
    pids = wait_for(lambda: (lambda p: p if len(p) == 2 and all(map(catches_sigterm, p.values()))
                             else None)(task_pids(job)), 120, "the tasks to start")
    for t in (0, 1):
      os.kill(pids[t], signal.SIGTERM)
  else:
    wait_for(lambda: train_records(folder / "wd") >= 5, 300, "training to start")
    # A second job on the busy workdir: refused in every task within seconds.
    t0 = time.monotonic()
    busy = launch(cluster, folder, LONG, "--launch_dir", "busy")
    took = time.monotonic() - t0
    second = job_id(busy)
    assert busy.returncode != 0, busy.stdout
    # Each task refuses with the one line; srun's --kill-on-bad-exit may end the other task
    # before it writes its own. --follow ends with the line.
    errors = []
    for t in (0, 1):
      lines = (folder / "busy" / f"job{second}-task{t}.log").read_text().splitlines()
      errors += [x for x in lines if x.startswith("error:")]
      assert not any("Traceback" in x for x in lines), lines
    assert errors and all("is in use by another run" in x for x in errors), errors
    assert busy.stdout.splitlines()[-2].split(": ", 1)[1] == errors[0], busy.stdout
    assert took < 30, f"the refused job took {took:.1f} s"
    pids = task_pids(job)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGTERM)
    time.sleep(3)
    # Task 1, asked by the vote, may have saved and ended by now, or be exiting: a late SIGTERM
    # must not turn its clean stop into a failed job (lra/signals.py: ignored at exit).
    with contextlib.suppress(ProcessLookupError):
      os.kill(pids[1], signal.SIGTERM)
  fields = cluster.wait_job(job, 300)
  assert fields["JobState"] == "COMPLETED", (fields, logs(folder, job))
  out = (folder / "launch" / f"slurm-{job}.out").read_text()
  assert "=== stopped cleanly: the run saved a checkpoint" in out, logs(folder, job)
  saved = []
  for t in (0, 1):
    text = (folder / "launch" / f"job{job}-task{t}.log").read_text()
    saved += [int(x.split("at step ")[1].split()[0]) for x in text.splitlines()
              if x.startswith(("Saved a checkpoint at step", "Stopped at step"))]
  assert len(saved) == 2 and saved[0] == saved[1], logs(folder, job)
  steps = sorted(int(n) for n in os.listdir(folder / "wd" / "checkpoints") if n.isdigit())
  assert steps == [saved[0]], steps
  return job, saved[0]


@pytest.fixture(scope="module")
def uninterrupted(cluster, config, tmp_path_factory):
  folder = tmp_path_factory.mktemp("uninterrupted")
  p = launch(cluster, folder, LONG)
  assert p.returncode == 0, p.stdout + p.stderr
  reference = train.Trainer(config).state["params"]
  return final_params(folder / "wd", reference)[0]


@pytest.mark.parametrize("when", ["training", "start-up"])
def test_sigterm_stops_all_tasks_at_one_step_and_resumes_exactly(when, cluster, config,
                                                                 uninterrupted, tmp_path):
  job, step = stopped_run(cluster, tmp_path, when=when)
  if when == "start-up":
    assert step == 0
  else:
    assert 0 < step < LONG["num_train_steps"]
  p = launch(cluster, tmp_path, LONG)   # the same command again
  second = job_id(p)
  assert p.returncode == 0, p.stdout + p.stderr + logs(tmp_path, second)
  assert f"Resumed from {tmp_path}/wd/checkpoints at step {step}." in p.stdout
  params, final = final_params(tmp_path / "wd", uninterrupted)
  assert final == LONG["num_train_steps"]
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(uninterrupted), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- requeue at a real time limit --------------------------------------------------------------

# Put on the tasks' PYTHONPATH: each train step sleeps LRA_TEST_STEP_SLEEP seconds first, so that
# the run needs more than its one-minute limit whatever the machine's speed (the sleep is outside
# the step's computation: the parameters are those of a run without it).
SLOW_STEPS = """
import os
if os.environ.get("LRA_TEST_STEP_SLEEP"):
  import time
  from lra import train
  init = train.Trainer.__init__
  def slow_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    step_fn = self.train_step
    def step(state, batch, rest):
      time.sleep(float(os.environ["LRA_TEST_STEP_SLEEP"]))
      return step_fn(state, batch, rest)
    self.train_step = step
  train.Trainer.__init__ = slow_init
"""
# 80 steps of at least 0.5 s: 40 s of training after a start-up of 10 to 20 s, in a job that
# stops at 45 s (`--time 1`: the batch script's timer, a quarter of the limit before it).
REQUEUED = {**OVERRIDES, "num_train_steps": 80, "eval_every": 10**6, "checkpoint_every": 10**6,
            "log_every": 10}


def attempts(text: str) -> list[str]:
  """A log's parts, one per attempt (each starts with its `=== job ... attempt N` line)."""
  return [part for part in text.split("=== job ")[1:]]


def test_requeue_at_a_one_minute_time_limit_resumes_to_the_end(cluster, config, tmp_path):
  slow = tmp_path / "slow"
  slow.mkdir()
  (slow / "sitecustomize.py").write_text(SLOW_STEPS)
  p = launch(cluster, tmp_path, REQUEUED, "--time", "1", "--requeue",
             "--env", f"PYTHONPATH={slow}:{REPO}", "--env", "LRA_TEST_STEP_SLEEP=0.5",
             follow=False)
  job = job_id(p)
  t0 = time.monotonic()
  released, held = 0, None
  while True:
    # SLURM holds a requeued job for 2 minutes (BeginTime): released here after 5 s (at once,
    # slurmd may refuse the new attempt's credential, issued in the second the old one was
    # revoked, and the job ends FAILED: "Job credential revoked").
    fields = cluster.job(job)
    state = fields.get("JobState")
    if state == "PENDING" and fields.get("Reason") == "BeginTime" and \
        int(fields.get("Restarts", 0)) > released:
      held = held or time.monotonic()
      if time.monotonic() - held > 5:
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        released, held = int(fields["Restarts"]), None
    if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", None):
      break
    assert time.monotonic() - t0 < 400, (fields, logs(tmp_path, job))
    time.sleep(0.5)
  took = time.monotonic() - t0
  assert state == "COMPLETED" and int(fields["Restarts"]) >= 1, (fields, logs(tmp_path, job))
  out = attempts((tmp_path / "launch" / f"slurm-{job}.out").read_text())
  assert len(out) == int(fields["Restarts"]) + 1, logs(tmp_path, job)
  for n, part in enumerate(out[:-1], 1):   # each attempt but the last stopped at the limit
    assert part.startswith(f"{job} attempt {n} on ") and "=== USR1: asking the tasks" in part
    assert "=== requeued at the time limit" in part and "TERM" not in part, part
  assert out[-1].startswith(f"{job} attempt {len(out)} on ") and "requeued" not in out[-1]
  # Each task's log, appended to: every attempt's lines; each resumes where the last saved.
  saved = {}
  for t in (0, 1):
    parts = attempts((tmp_path / "launch" / f"job{job}-task{t}.log").read_text())
    assert [x.split(" task ")[0] for x in parts] == [f"{job} attempt {n}"
                                                     for n in range(1, len(out) + 1)]
    for n, part in enumerate(parts[:-1]):
      step = [int(x.split("at step ")[1].split()[0]) for x in part.splitlines()
              if x.startswith(("Saved a checkpoint at step", "Stopped at step"))]
      assert len(step) == 1 and 0 < step[0] < REQUEUED["num_train_steps"], part
      saved.setdefault(n, step[0])
      assert saved[n] == step[0]   # both tasks stopped at one step
      assert f"Resumed from {tmp_path}/wd/checkpoints at step {step[0]}." in parts[n + 1]
  assert sorted(saved.values()) == list(saved.values())   # each attempt got further
  results = json.loads((tmp_path / "wd" / "results.json").read_text())
  assert results["steps"] == REQUEUED["num_train_steps"]
  # The parameters of one uninterrupted process (4 devices, as the job's 2 x 2).
  config = configs.build_config("listops", size="small",   # the data `config` prepared
                                overrides=[(k, str(v)) for k, v in REQUEUED.items()])
  reference = train.train_and_evaluate(config, str(tmp_path / "one"))["state"]["params"]
  params, step = final_params(tmp_path / "wd", reference)
  assert step == REQUEUED["num_train_steps"]
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  print(f"requeued {fields['Restarts']} times at the one-minute limit; the job took {took:.0f} s"
        f" (steps saved per attempt: {list(saved.values())})")
