"""Multi-process training (lra/mesh.py, lra/train.py) on a real two-process `jax.distributed`
cluster: two local CPU processes with 2 devices each (a 4-device global mesh), started the way
docs/training.md says (`LRA_DISTRIBUTED=1`, JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID, JAX_NUM_CPU_DEVICES, `python -m launch.train`).

One test (the cluster start is the expensive part): the two-process run of a tiny ListOps config
gives the losses, metrics and parameters of a one-process run on 4 devices; evaluation weighs
every validation and test example once (the splits do not divide into the eval batch, so the
last batch has weight-0 fillers, all on process 1); only process 0 writes results.json and
metrics.jsonl; and the two-process orbax checkpoint of step 2 is resumed by one process, which
then ends where the one-process run does.

A second test stops a two-process run with SIGTERM delivered to the processes 3 s apart (both
save the same step, once) after a second run on its busy workdir was refused in both of its
processes within seconds.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import configs
from lra import checkpoint, metrics, tasks, train

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

jax.config.update("jax_disable_most_optimizations", True)  # as in train_test.py: compiles faster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300  # a hung cluster fails the test instead of blocking the suite
RTOL = 1e-5
# A tiny ListOps config (as train_test.tiny_config): 20 validation and test examples in eval
# batches of 8, so the last global batch holds 4 real examples (process 0) and 4 fillers
# (process 1).
OVERRIDES = {
    "data.num_train": 64, "data.num_val": 20, "data.num_test": 20, "data.max_length": 24,
    "data.gen_min_length": 4, "data.gen_max_length": 25,
    "model.emb_dim": 16, "model.qkv_dim": 16, "model.mlp_dim": 32, "model.classifier_dim": 16,
    "model.num_heads": 2, "model.num_layers": 1, "mesh.data": 4,
    "batch_size": 16, "eval_batch_size": 8, "num_train_steps": 4, "warmup_steps": 1,
    "learning_rate": 0.01, "log_every": 1, "eval_every": 2, "checkpoint_every": 2,
    "progress": False,
}
FLAGS = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]

# Each child runs the `lra run` entry point, noting which files it renamed into place (results
# and config are written to a temporary file and renamed), then reports its view of the cluster.
CHILD = """
import json, os, sys
renamed = []
_replace = os.replace
def replace(src, dst, *args, **kwargs):
  renamed.append(os.path.basename(os.fspath(dst)))
  return _replace(src, dst, *args, **kwargs)
os.replace = replace
if os.environ.get("LRA_TEST_PAUSE") == os.environ["JAX_PROCESS_ID"]:
  # Stops itself after the preflight's compile, right before the first collective (the
  # preflight's memory agreement), until the test continues it.
  import signal
  from lra import preflight
  _available = preflight.available_memory
  def available_memory(*args, **kwargs):
    print("PAUSED", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    return _available(*args, **kwargs)
  preflight.available_memory = available_memory
from launch import train
rc = train.main(sys.argv[1:])
import jax
print("REPORT " + json.dumps({
    "rc": rc, "process_index": jax.process_index(), "process_count": jax.process_count(),
    "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
    "renamed": renamed, "precision": jax.config.jax_default_matmul_precision}), flush=True)
sys.exit(rc)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_two_processes(workdir: str, logdir, flags=FLAGS, tag: str = "process",
                        pause: int | None = None):
  """Starts the two processes of one cluster on `flags`; (the processes, their log files).
  Process `pause` stops itself right before its first collective (`continue_after`)."""
  port = _free_port()
  env = dict(os.environ)
  if pause is not None:
    env["LRA_TEST_PAUSE"] = str(pause)
  env.pop("XLA_FLAGS", None)  # conftest's 8 devices; each child gets 2 (JAX_NUM_CPU_DEVICES)
  env.update(LRA_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
             JAX_NUM_PROCESSES="2", JAX_NUM_CPU_DEVICES="2",
             JAX_DEFAULT_MATMUL_PRECISION="highest", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
             LRA_DATA=os.environ["LRA_DATA"])  # the same data root as this process
  argv = [sys.executable, "-c", CHILD, "listops", "--size", "small", "--workdir", workdir,
          *flags]
  procs, logs = [], []
  for i in range(2):
    logs.append(open(logdir / f"{tag}{i}.log", "w+"))
    procs.append(subprocess.Popen(argv, cwd=REPO, env={**env, "JAX_PROCESS_ID": str(i)},
                                  stdout=logs[i], stderr=subprocess.STDOUT))
  return procs, logs


def wait_two(procs, logs, timeout: float = TIMEOUT_S, stop_at_failure: bool = True) -> list[str]:
  """Waits for both (killing the other at the first failure when `stop_at_failure`, both at
  the timeout); their outputs."""
  deadline = time.monotonic() + timeout
  try:
    # A process that fails leaves the other waiting in a collective: stop at the first failure.
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if stop_at_failure and any(p.poll() not in (None, 0, 130) for p in procs):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read())
    log.close()
  return outputs


def continue_after(procs, logs, i: int, seconds: float) -> None:
  """Once process `i` has stopped itself (its PAUSED line), continues it `seconds` later."""
  deadline = time.monotonic() + TIMEOUT_S
  while "PAUSED" not in open(logs[i].name).read():
    assert time.monotonic() < deadline and procs[i].poll() is None, "process did not pause"
    time.sleep(0.1)
  time.sleep(seconds)   # the stop's length is what is tested; the moment is the child's own
  procs[i].send_signal(signal.SIGCONT)


def run_two_processes(workdir: str, logdir, pause_s: float = 0.0) -> list[dict]:
  """Runs the config in two processes of one cluster, process 1 stopped for `pause_s` seconds
  before its first collective when given; returns each process's report."""
  procs, logs = start_two_processes(workdir, logdir, pause=1 if pause_s else None)
  if pause_s:
    continue_after(procs, logs, 1, pause_s)
  outputs = wait_two(procs, logs)
  tails = "\n".join(f"--- process {i} (exit {p.returncode}):\n{out[-3000:]}"
                    for i, (p, out) in enumerate(zip(procs, outputs)))
  assert all(p.returncode == 0 for p in procs), f"the two-process run failed or hung:\n{tails}"
  reports = [json.loads(line[len("REPORT "):]) for out in outputs
             for line in out.splitlines() if line.startswith("REPORT ")]
  assert len(reports) == 2, tails
  return sorted(reports, key=lambda r: r["process_index"])


def records(workdir: str) -> dict[tuple[int, str], dict]:
  """metrics.jsonl as {(step, split): record}; a record written twice is an error."""
  out = {}
  for r in metrics.read_metrics(workdir):
    key = (r["step"], r["split"])
    assert key not in out, f"{key} written twice to {workdir}/metrics.jsonl"
    out[key] = r
  return out


def assert_same_metrics(got: dict, want: dict, keys) -> None:
  for key in keys:
    for name in ("loss", "accuracy", "examples"):
      np.testing.assert_allclose(got[key][name], want[key][name], rtol=RTOL,
                                 err_msg=f"{name} at {key}")


def assert_same_params(got, want) -> None:
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_two_processes_train_like_one_and_share_checkpoints(tmp_path):
  config = configs.build_config(
      "listops", size="small", overrides=[(k, str(v)) for k, v in OVERRIDES.items()])
  tasks.get_task("listops").prepare(config.data)  # before the processes start, not in both
  two, one, resumed = (str(tmp_path / name) for name in ("two", "one", "resumed"))

  # Process 1 stops for 40 s before the first collective, longer than the 30 s jax's CPU
  # collectives wait for a peer: process 0 waits for it (config.peer_timeout_s) instead.
  reports = run_two_processes(two, tmp_path, pause_s=40)
  for i, r in enumerate(reports):
    assert (r["process_index"], r["process_count"]) == (i, 2)
    assert (r["device_count"], r["local_device_count"]) == (4, 2)
    assert r["precision"] == "highest"
  assert reports[0]["renamed"].count("results.json") == 1
  assert reports[1]["renamed"] == []  # neither results.json nor config.json

  # The same config and global batch in this one process, on 4 of its devices.
  reference = train.train_and_evaluate(config, one)
  assert {len(x.sharding.device_set) for x in jax.tree.leaves(reference["state"])} == {4}
  got, want = records(two), records(one)
  assert sorted(got) == sorted(want)
  assert [s for s, split in sorted(got) if split == "train"] == [1, 2, 3, 4]
  assert_same_metrics(got, want, sorted(want))
  # Every example once: the weights add up to the split (and the losses equal one process's).
  assert all(r["examples"] == 20 for (_, split), r in got.items() if split != "train")

  with open(os.path.join(two, "results.json")) as f:
    results = json.load(f)
  assert not os.path.exists(os.path.join(two, "results.json.tmp"))
  assert results["test_examples"] == 20 and results["train_step_traces"] == 1
  for name in ("test_accuracy", "test_loss", "final_test_accuracy", "majority_class_rate",
               "best_validation_accuracy"):
    np.testing.assert_allclose(results[name], reference[name], rtol=RTOL, err_msg=name)
  assert results["best_validation_step"] == reference["best_validation_step"]

  # The two-process checkpoints are orbax checkpoints this process restores: the final one
  # holds the reference's state ...
  abstract = checkpoint.abstract_like(reference["state"])
  ckpt = checkpoint.Checkpointer(os.path.join(two, "checkpoints"), every=0, keep=3)
  assert ckpt.steps() == [2, 4]
  state, data_state, step = ckpt.restore_latest(abstract)
  ckpt.close()
  assert step == 4 and int(state["step"]) == 4 and data_state["train_iterator"]
  assert_same_params(state["params"], reference["state"]["params"])
  # ... and a one-process run resumes from step 2 (state and data position) and ends there too.
  shutil.copytree(os.path.join(two, "checkpoints"), os.path.join(resumed, "checkpoints"))
  shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
  finished = train.train_and_evaluate(config, resumed)
  assert not finished["interrupted"]
  got = records(resumed)
  assert [s for s, split in sorted(got) if split == "train"] == [3, 4]
  assert_same_metrics(got, want, [(3, "train"), (4, "train"), (4, "validation"), (4, "test")])
  np.testing.assert_allclose(finished["final_test_accuracy"], reference["final_test_accuracy"],
                             rtol=RTOL)
  assert_same_params(finished["state"]["params"], reference["state"]["params"])


LONG_FLAGS = [f"--config.{k}={v}" for k, v in {
    **OVERRIDES, "num_train_steps": 400, "eval_every": 10**6, "checkpoint_every": 10**6}.items()]


def _train_records(workdir: str) -> int:
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return sum('"train"' in line for line in f)
  except OSError:
    return 0


def test_sigterm_apart_stops_both_at_one_step_and_a_busy_workdir_is_refused_in_both(tmp_path):
  """SIGTERM reaches process 1, and process 0 only as it exits: both stop after the same step
  and save it once (lra/mesh.py StopVote), and the late signal does not kill process 0 in its
  teardown (lra/signals.py: ignored at exit). Before that, a second two-process run on the busy
  workdir ends in both of its processes with the lock's one line, in seconds."""
  config = configs.build_config(
      "listops", size="small", overrides=[(k, str(v)) for k, v in OVERRIDES.items()])
  tasks.get_task("listops").prepare(config.data)
  workdir = str(tmp_path / "wd")
  procs, logs = start_two_processes(workdir, tmp_path, LONG_FLAGS)
  try:
    deadline = time.monotonic() + TIMEOUT_S
    while _train_records(workdir) < 5:
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
          "the run did not start training"
      time.sleep(0.1)
    t0 = time.monotonic()
    busy = wait_two(*start_two_processes(workdir, tmp_path, LONG_FLAGS, tag="busy"), timeout=60,
                    stop_at_failure=False)
    took = time.monotonic() - t0
    for out in busy:
      errors = [x for x in out.splitlines() if x.startswith("error:")]
      assert len(errors) == 1 and "is in use by another run" in errors[0], out[-3000:]
      assert "Traceback" not in out, out[-3000:]
    assert took < 30, f"the refused run took {took:.1f} s"
    procs[1].send_signal(signal.SIGTERM)
    # Process 0, asked by the vote, stops and saves; its own SIGTERM reaches it late, as it
    # exits: sent every 10 ms from its report line on (jax.distributed's shutdown, the
    # runtime's teardown after Python put back the default handlers) until it has ended.
    wait = time.monotonic() + TIMEOUT_S
    while procs[0].poll() is None and "REPORT " not in open(logs[0].name).read():
      assert time.monotonic() < wait, "process 0 did not stop"
      time.sleep(0.01)
    while procs[0].poll() is None and time.monotonic() < wait:
      procs[0].send_signal(signal.SIGTERM)
      time.sleep(0.01)
  finally:
    outputs = wait_two(procs, logs)
  tails = "\n".join(f"--- process {i} (exit {p.returncode}):\n{out[-3000:]}"
                    for i, (p, out) in enumerate(zip(procs, outputs)))
  assert [p.returncode for p in procs] == [130, 130], tails
  saved = [int(x.split("at step ")[1].split()[0]) for out in outputs
           for x in out.splitlines() if x.startswith("Saved a checkpoint at step")]
  assert len(saved) == 2 and saved[0] == saved[1] and 5 <= saved[0] < 400, tails
  steps = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())
  assert steps == [saved[0]]


def test_a_peer_later_than_the_timeout_ends_both_with_one_line_and_a_rerun_trains(tmp_path):
  """With config.peer_timeout_s = 10 and process 1 stopped for 20 s before the first
  collective, both processes end with one line naming the wait and the setting, exit 2, no
  traceback and no abort by the distributed service; nothing is trained; the same command
  then trains from the start."""
  config = configs.build_config(
      "listops", size="small", overrides=[(k, str(v)) for k, v in OVERRIDES.items()])
  tasks.get_task("listops").prepare(config.data)
  workdir = str(tmp_path / "wd")
  flags = [*FLAGS, "--config.peer_timeout_s=10"]
  procs, logs = start_two_processes(workdir, tmp_path, flags, tag="late", pause=1)
  try:
    continue_after(procs, logs, 1, 20)
  finally:
    outputs = wait_two(procs, logs, stop_at_failure=False)
  tails = "\n".join(f"--- process {i} (exit {p.returncode}):\n{out[-3000:]}"
                    for i, (p, out) in enumerate(zip(procs, outputs)))
  assert [p.returncode for p in procs] == [2, 2], tails
  for out in outputs:
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "config.peer_timeout_s = 10 s" in errors[0], tails
    assert "Traceback" not in out and "Terminating process" not in out, tails
  assert not os.path.exists(os.path.join(workdir, "checkpoints")) or not [
      n for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()]
  reports = run_two_processes(workdir, tmp_path)
  assert [r["rc"] for r in reports] == [0, 0]
  assert [s for s, split in sorted(records(workdir)) if split == "train"] == [1, 2, 3, 4]
