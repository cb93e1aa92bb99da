"""Workdirs and data in a bucket, against a real GCS emulator (fake-gcs-server, started once per
session by tests/gcs_server.py; the tests skip when it cannot start).

gcsfs (lra.storage, epath), tensorstore (orbax's array writes) and the `lra` commands started
here all reach the emulator through the JSON API, as they reach GCS. End to end (marked slow):
  * a SIGKILL inside the first checkpoint save of a bucket run (orbax writes a step in place on
    GCS and `commit_success.txt` last; the kill comes before that file) leaves an unfinished step
    folder; the rerun removes it and finishes identical to an uninterrupted run (checksums of
    the final checkpoint, every metrics record, results.json);
The uninterrupted reference runs on the local disk, so that path shares no bucket code.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tests")):
  if path not in sys.path:
    sys.path.insert(0, path)

from benchmarks.soak_kill import final_checksums, records, results  # noqa: E402
from gcs_server import gcs_server  # noqa: E402,F401 - the session fixture

STEPS = 12
TINY = ["--config.data.num_train=96", "--config.data.num_val=32", "--config.data.num_test=32",
        "--config.data.max_length=24", "--config.data.gen_min_length=4",
        "--config.data.gen_max_length=25", "--config.model.emb_dim=16",
        "--config.model.qkv_dim=16", "--config.model.mlp_dim=32",
        "--config.model.classifier_dim=16", "--config.model.num_layers=1",
        "--config.batch_size=16", "--config.eval_batch_size=16",
        f"--config.num_train_steps={STEPS}", "--config.warmup_steps=2", "--config.log_every=3",
        "--config.eval_every=4", "--config.checkpoint_every=2", "--config.progress=false"]

# argv: fault, step, then the `lra` command line. Faults: none; kill_in_save (SIGKILL inside the
# save of training checkpoint `step` in a bucket, once its arrays are written and before orbax
# writes commit_success.txt); sleep (the run waits `step` seconds after its first train step).
DRIVER = textwrap.dedent("""
    import os, signal, sys, time
    fault, at = sys.argv[1], int(sys.argv[2])
    from orbax.checkpoint._src.path import atomicity
    from lra import train
    finalize = atomicity.CommitFileTemporaryPath.finalize

    async def faulty_finalize(self):
      final = str(self._final_path)
      if fault == "kill_in_save" and final.endswith(f"/checkpoints/{at}"):
        os.kill(os.getpid(), signal.SIGKILL)
      return await finalize(self)
    atomicity.CommitFileTemporaryPath.finalize = faulty_finalize

    init = train.Trainer.__init__
    def faulty_init(self, config, plan=None):
      init(self, config, plan)
      step_fn = self.train_step
      def step(state, batch, rest):
        state, sums = step_fn(state, batch, rest)
        if fault == "sleep" and int(state["step"]) == 1:
          print("sleeping", flush=True)
          time.sleep(at)
        return state, sums
      self.train_step = step
    train.Trainer.__init__ = faulty_init
    from launch import cli
    sys.exit(cli.main(sys.argv[3:]))
    """)


def lra(args, data_dir, fault="none", at=0, timeout=300, popen=False):
  env = {**os.environ, "LRA_DATA": data_dir, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  cmd = [sys.executable, "-c", DRIVER, fault, str(at), *args]
  if popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_args(workdir, *extra):
  return ["run", "listops", "--size", "small", "--workdir", workdir, *TINY, *extra]


def download(server, url, tmp_path):
  """A local copy of bucket folder `url` (gs://...), read through gcsfs alone."""
  local = tmp_path / "copy"
  server.fs.get(url[len("gs://"):], str(local), recursive=True)
  return str(local)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
  """An uninterrupted run on the local disk."""
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  done = lra(run_args(workdir), data_dir)
  assert done.returncode == 0, done.stderr[-3000:]
  return workdir


def assert_same_as_reference(workdir, reference):
  assert final_checksums(workdir, STEPS) == final_checksums(reference, STEPS)
  assert records(workdir) == records(reference)
  assert results(workdir) == results(reference)


@pytest.mark.slow
def test_a_sigkill_in_the_first_save_of_a_bucket_run_resumes_identical(
    gcs_server, reference, data_dir, tmp_path):
  bucket = gcs_server.new_bucket()
  workdir = f"gs://{bucket}/run"
  killed = lra(run_args(workdir), data_dir, "kill_in_save", 2)
  assert killed.returncode == -9, killed.stderr[-3000:]
  step_dir = f"{bucket}/run/checkpoints/2"
  assert gcs_server.fs.exists(f"{step_dir}/state/manifest.ocdbt")   # its arrays were written
  assert not gcs_server.fs.exists(f"{step_dir}/commit_success.txt")  # the save never finished
  rerun = lra(run_args(workdir), data_dir)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "Removed unfinished checkpoint saves" in rerun.stdout and ": 2 (" in rerun.stdout
  assert_same_as_reference(download(gcs_server, workdir, tmp_path), reference)
