"""Fault injection through the real `lra run` command in child processes: SIGKILL inside the
first and a later checkpoint save, SIGKILL mid-window, SIGTERM, Ctrl-C during start-up, a full
disk during a save, a damaged checkpoint, and a second run on the same workdir.

Each faulty run is followed by the same command again, which must end bit-identical to an
uninterrupted run (the checksums saved with the final checkpoint cover every array of the train
state), with a metrics.jsonl of exactly one record per logged step; or the faulty run must end
with one readable line and exit status 2, with nothing lost.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.soak_kill import DRIVER, records  # noqa: E402  (the fault-planting child)

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

STEPS = 12
TINY = ["--config.data.num_train=96", "--config.data.num_val=16", "--config.data.num_test=16",
        "--config.data.max_length=24", "--config.data.gen_min_length=4",
        "--config.data.gen_max_length=25", "--config.model.emb_dim=16",
        "--config.model.qkv_dim=16", "--config.model.mlp_dim=32",
        "--config.model.classifier_dim=16", "--config.model.num_layers=1",
        "--config.model.dropout=0.1", "--config.batch_size=16", "--config.eval_batch_size=16",
        f"--config.num_train_steps={STEPS}", "--config.warmup_steps=2",
        "--config.log_every=3", "--config.eval_every=6", "--config.checkpoint_every=4",
        "--config.progress=false"]

def run(workdir, data_dir, fault="none", at=0, timeout=240):
  env = {**os.environ, "LRA_DATA": data_dir, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  args = ["run", "listops", "--size", "small", "--workdir", workdir, *TINY]
  return subprocess.run([sys.executable, "-c", DRIVER, fault, str(at), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


def final_checksums(workdir) -> dict:
  with open(os.path.join(workdir, "checkpoints", str(STEPS), "data", "metadata")) as f:
    return json.load(f)["checksums"]


def results(workdir) -> dict:
  with open(os.path.join(workdir, "results.json")) as f:
    r = json.load(f)
  r.pop("wall_seconds_this_run")
  r.pop("train_step_traces")
  return r


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run: (workdir, data_dir)."""
  data_dir = str(tmp_path_factory.mktemp("data"))
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  done = run(workdir, data_dir)
  assert done.returncode == 0, done.stderr[-3000:]
  steps = [r["step"] for r in map(dict, records(workdir)) if r["split"] == "train"]
  assert steps == [3, 6, 9, 12]
  return workdir, data_dir


def assert_same_as_reference(workdir, reference):
  ref, _ = reference
  assert final_checksums(workdir) == final_checksums(ref)
  assert records(workdir) == records(ref)          # one record per logged step, same values
  assert results(workdir) == results(ref)
  assert not os.path.exists(os.path.join(workdir, "lock"))


@pytest.mark.parametrize("fault, at", [
    ("kill_in_save", 4),     # SIGKILL inside the first save: its temporary folder is left
    ("kill_in_save", 8),     # ... and inside a later one
    ("sigkill", 7),          # SIGKILL mid-window (logging every 3 steps, saving every 4)
])
def test_sigkill_then_rerun_is_bit_identical(fault, at, reference, tmp_path):
  workdir = str(tmp_path / "run")
  killed = run(workdir, reference[1], fault, at)
  assert killed.returncode == -signal.SIGKILL
  again = run(workdir, reference[1])
  assert again.returncode == 0, again.stderr[-3000:]
  assert_same_as_reference(workdir, reference)


@pytest.mark.parametrize("fault", ["sigterm", "sigint"])
def test_sigterm_and_ctrl_c_save_then_rerun_is_bit_identical(fault, reference, tmp_path):
  workdir = str(tmp_path / "run")
  stopped = run(workdir, reference[1], fault, 5)
  assert stopped.returncode == 130, stopped.stderr[-3000:]
  assert "Saved a checkpoint at step 5" in stopped.stdout
  assert "Traceback" not in stopped.stdout + stopped.stderr
  again = run(workdir, reference[1])
  assert again.returncode == 0 and "Resumed from" in again.stdout
  assert_same_as_reference(workdir, reference)


def test_ctrl_c_during_start_up_stops_cleanly(reference, tmp_path):
  workdir = str(tmp_path / "run")
  stopped = run(workdir, reference[1], "sigint_at_start")
  assert stopped.returncode == 130, stopped.stderr[-3000:]
  assert "Traceback" not in stopped.stdout + stopped.stderr
  again = run(workdir, reference[1])
  assert again.returncode == 0
  assert_same_as_reference(workdir, reference)


def test_disk_full_during_a_save_is_one_line_and_loses_nothing(reference, tmp_path):
  workdir = str(tmp_path / "run")
  full = run(workdir, reference[1], "disk_full", 8)
  assert full.returncode == 2, full.stderr[-3000:]
  last = full.stderr.strip().splitlines()[-1]
  assert last.startswith("error: no space left on device") and "rerun" in last
  assert "Traceback" not in full.stderr and len(full.stderr.strip().splitlines()) <= 3
  again = run(workdir, reference[1])         # space freed: resumes from step 4
  assert again.returncode == 0 and "at step 4" in again.stdout
  assert_same_as_reference(workdir, reference)


def test_damaged_latest_checkpoint_falls_back_and_ends_identical(reference, tmp_path):
  workdir = str(tmp_path / "run")
  killed = run(workdir, reference[1], "sigkill", 9)
  assert killed.returncode == -signal.SIGKILL
  state_dir = os.path.join(workdir, "checkpoints", "8", "state")
  files = [os.path.join(d, n) for d, _, names in os.walk(state_dir) for n in names
           if os.sep + "d" in d]
  path = max(files, key=os.path.getsize)
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0x01
  open(path, "wb").write(bytes(data))
  again = run(workdir, reference[1])
  assert again.returncode == 0, again.stderr[-3000:]
  # The flipped byte is refused (step 8 reported, resumed from 4), or it was never read (a
  # byte outside what the restore reads): either way the run ends exactly as the reference.
  if "checkpoint step 8" in again.stdout:
    assert "at step 4" in again.stdout
  else:
    assert "at step 8" in again.stdout
  assert_same_as_reference(workdir, reference)


def test_a_second_run_on_a_busy_workdir_is_refused(reference, tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
  try:
    (workdir / "lock").write_text(json.dumps(
        {"host": os.uname().nodename, "pid": holder.pid, "started": "earlier"}))
    busy = run(str(workdir), reference[1])
    assert busy.returncode == 2
    err = busy.stderr.strip().splitlines()
    assert len(err) == 1 and f"pid {holder.pid}" in err[0] and "in use" in err[0]
    assert not (workdir / "metrics.jsonl").exists()
  finally:
    holder.kill()
    holder.wait()
  again = run(str(workdir), reference[1])      # the holder is gone: its lock is taken over
  assert again.returncode == 0, again.stderr[-3000:]
  assert_same_as_reference(str(workdir), reference)


@pytest.fixture
def small_disk(tmp_path):
  """A 400 KB tmpfs (root only; skipped where mounting is not allowed)."""
  mount = tmp_path / "small_disk"
  mount.mkdir()
  done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)],
                        capture_output=True)
  if done.returncode != 0:
    pytest.skip("cannot mount a small tmpfs here (needs root)")
  try:
    yield mount
  finally:
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_really_full_disk_is_one_line_then_resumes_identical(reference, small_disk):
  workdir = str(small_disk / "run")
  full = run(workdir, reference[1], timeout=240)   # the run needs about 1 MB
  assert full.returncode == 2, full.stderr[-3000:]
  lines = full.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: no space left on device"), full.stderr
  subprocess.run(["mount", "-o", "remount,size=64M", str(small_disk)], check=True)
  again = run(workdir, reference[1])
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Removed unfinished checkpoint saves" in again.stdout
  assert_same_as_reference(workdir, reference)
