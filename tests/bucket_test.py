"""Workdirs and data in a bucket, against a real GCS emulator (fake-gcs-server, started once per
session by tests/gcs_server.py; the tests skip when it cannot start).

gcsfs (lra.storage, epath), tensorstore (orbax's array writes) and the `lra` commands started
here all reach the emulator through the JSON API, as they reach GCS. End to end (marked slow):
  * a SIGKILL inside the first checkpoint save of a bucket run (orbax writes a step in place on
    GCS and `commit_success.txt` last; the kill comes before that file) leaves an unfinished step
    folder; the rerun removes it and finishes identical to an uninterrupted run (checksums of
    the final checkpoint, every metrics record, results.json);
  * a save that fails in a bucket run (its own error, or a full disk whose abandoned writes
    print after the run's last line), started in an empty folder: the traceback or the late
    output is in the bucket's `error.log`, and nothing is written in the folder;
  * a second `lra run` on a bucket workdir another run holds is refused in one line, in seconds;
  * `LRA_DATA=gs://...`: a run before the data is there ends in one line; `lra data prepare`
    uploads the dataset, and a run reading it from the bucket equals the reference;
  * `lra data status` names the bucket's manual/ folder, and `lra data prepare` builds from the
    released ListOps TSVs put there (copied to a local folder first);
  * `lra sweep --workdir gs://...` writes its files into the bucket and finds its runs finished;
    `lra results gs://...` lists them with where they ran.
The uninterrupted reference runs on the local disk, so that path shares no bucket code. In this
process (fast): the bucket lock's refusal, takeovers and preconditions, `lra results` over a
bucket, and the one-line errors (no gcsfs, no bucket, no credentials).
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
# writes commit_success.txt); fail_in_save and full_in_save (that save raises instead: an
# error of its own, or a full disk's OSError); sleep (the run waits `step` seconds after its
# first train step).
DRIVER = textwrap.dedent("""
    import errno, os, signal, sys, time
    fault, at = sys.argv[1], int(sys.argv[2])
    from orbax.checkpoint._src.path import atomicity
    from lra import train
    finalize = atomicity.CommitFileTemporaryPath.finalize

    async def faulty_finalize(self):
      final = str(self._final_path)
      if fault == "kill_in_save" and final.endswith(f"/checkpoints/{at}"):
        os.kill(os.getpid(), signal.SIGKILL)
      if fault == "fail_in_save" and final.endswith(f"/checkpoints/{at}"):
        raise RuntimeError("planted save failure")
      if fault == "full_in_save" and final.endswith(f"/checkpoints/{at}"):
        import threading   # a write abandoned by the failure that reports after the line
        late = lambda: (time.sleep(2), os.write(2, b"planted abandoned write\\n"))
        threading.Thread(target=late).start()
        raise OSError(errno.ENOSPC, "No space left on device")
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


def lra(args, data_dir, fault="none", at=0, timeout=300, popen=False, cwd=ROOT):
  env = {**os.environ, "LRA_DATA": data_dir, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  cmd = [sys.executable, "-c", DRIVER, fault, str(at), *args]
  if popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


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


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["fail_in_save", "full_in_save"])
def test_a_failed_save_in_a_bucket_writes_its_error_log_there(gcs_server, data_dir, tmp_path,
                                                                fault):
  """Started in an empty folder: the failure's traceback (a save's own error) or what the
  abandoned writes print after the line (a full disk) lands in the bucket's `error.log`, and
  nothing in the folder the command was typed in."""
  bucket = gcs_server.new_bucket()
  workdir = f"gs://{bucket}/run"
  cwd = tmp_path / "typed_here"
  cwd.mkdir()
  failed = lra(run_args(workdir), data_dir, fault, 4, cwd=cwd)
  lines = failed.stderr.strip().splitlines()
  assert failed.returncode == 2 and lines[-1].startswith("error: "), failed.stderr[-3000:]
  assert "planted abandoned write" not in failed.stderr   # it went to the log
  assert os.listdir(cwd) == [] and not os.path.exists(os.path.join(ROOT, "error.log"))
  log = gcs_server.fs.cat(f"{bucket}/run/error.log").decode()
  if fault == "fail_in_save":
    assert lines[-1].startswith("error: RuntimeError: planted save failure (the traceback is in "
                                f"{workdir}/error.log; rerun"), lines
    assert "Traceback (most recent call last)" in log and "planted save failure" in log
  else:
    assert lines[-1].startswith(f"error: no space left on device while writing in {workdir} ")
    assert "planted abandoned write" in log


# --- the workdir lock in a bucket (lra/lock.py), in this process --------------------------------


def test_bucket_lock_refuses_a_live_holder_and_takes_over_a_dead_one(gcs_server):
  from lra import lock
  workdir = f"gs://{gcs_server.new_bucket()}/run"
  holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    other = lock.WorkdirLock(workdir)
    other.record["pid"] = holder.pid   # a live process of this host holds it
    other.acquire()
    assert lock.read_holder(workdir)["pid"] == holder.pid
    with pytest.raises(lock.WorkdirBusy, match=f"is in use by another run \\(pid {holder.pid}"):
      lock.WorkdirLock(workdir).acquire()
    assert lock.refusal(workdir).startswith(f"{workdir} is in use by another run")
  finally:
    holder.kill()
    holder.wait()
  with lock.WorkdirLock(workdir) as mine:   # its holder is gone: taken over
    assert lock.read_holder(workdir) == mine.record
  assert lock.read_holder(workdir) is None   # released: the object is deleted
  other._beating and other._beating.set()


def test_bucket_lock_of_another_host_is_taken_over_once_its_heartbeat_stops(gcs_server):
  from lra import lock
  workdir = f"gs://{gcs_server.new_bucket()}/run"
  beating = lock.WorkdirLock(workdir, heartbeat_s=0.2)
  beating.record["host"] = "another-host"
  beating.acquire()   # its heartbeat thread rewrites the object every 0.2 s
  try:
    time.sleep(1.5)
    with pytest.raises(lock.WorkdirBusy, match="on another-host"):
      lock.WorkdirLock(workdir, stale_after=1.0).acquire()
  finally:
    beating._beating.set()   # the holder dies: its beats stop  # noqa: SLF001
  with pytest.raises(lock.WorkdirBusy):   # the last beat is fresh
    lock.WorkdirLock(workdir, stale_after=1.0).acquire()
  time.sleep(1.5)
  with lock.WorkdirLock(workdir, stale_after=1.0) as mine:
    assert lock.read_holder(workdir)["token"] == mine.record["token"]
    beating.heartbeat()   # a late beat of the old holder fails its precondition: no effect
    assert lock.read_holder(workdir)["token"] == mine.record["token"]
    beating.release()     # nor does its release delete the new holder's lock
    assert lock.read_holder(workdir)["token"] == mine.record["token"]


def test_two_takeovers_of_one_stale_bucket_lock_one_wins(gcs_server):
  from lra import lock
  workdir = f"gs://{gcs_server.new_bucket()}/run"
  assert lock.lock_file(workdir).create({"host": "gone", "pid": 1})
  a, b = lock.lock_file(workdir), lock.lock_file(workdir)
  assert a.read()[0] == b.read()[0] == {"host": "gone", "pid": 1}   # both saw one generation
  won = [a.take_over({"host": "a", "pid": 2}), b.take_over({"host": "b", "pid": 3})]
  assert won == [True, False]
  assert lock.read_holder(workdir) == {"host": "a", "pid": 2}
  assert not lock.lock_file(workdir).create({"host": "c", "pid": 4})   # only if absent


# --- one-line errors ------------------------------------------------------------------------


def test_a_missing_bucket_and_missing_credentials_are_one_line_errors(gcs_server, monkeypatch):
  from gcsfs.retry import HttpError
  from lra import storage
  with pytest.raises(storage.BucketError, match=r"^bucket gs://no-such-bucket-x does not exist"):
    storage.exists("gs://no-such-bucket-x/run/results.json")
  assert not gcs_server.fs.exists("no-such-bucket-x")   # not created by the attempt

  fs = storage.remote_filesystem("gs://b")
  def unauthorised(*args, **kwargs):
    raise HttpError({"code": 401, "message": "Anonymous caller does not have access"})
  monkeypatch.setattr(fs, "call", unauthorised)
  with pytest.raises(storage.BucketError, match=r"^no credentials for gs://locked-x .*gcloud "
                                                r"auth application-default login"):
    storage.exists("gs://locked-x/run")


def test_lra_run_without_gcsfs_or_on_a_missing_bucket_ends_in_one_line(gcs_server, tmp_path):
  no_gcsfs = ("import sys; sys.modules['gcsfs'] = None; from launch import cli; "
              "sys.exit(cli.main(sys.argv[1:]))")
  env = {**os.environ, "LRA_DATA": str(tmp_path), "JAX_PLATFORMS": "cpu"}
  for prefix, bucket, expected in [
      ([sys.executable, "-c", no_gcsfs], gcs_server.new_bucket(),
       "is in Google Cloud Storage, which needs gcsfs: pip install -e '.[gcs]'."),
      ([sys.executable, "-m", "launch.cli"], "no-such-bucket-y",
       "bucket gs://no-such-bucket-y does not exist (a typo?)")]:
    done = subprocess.run([*prefix, *run_args(f"gs://{bucket}/run")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("error: ") and expected in lines[0]


@pytest.mark.slow
def test_a_second_run_on_a_busy_bucket_workdir_is_refused_in_one_line(gcs_server, data_dir):
  workdir = f"gs://{gcs_server.new_bucket()}/run"
  first = lra(run_args(workdir), data_dir, "sleep", 120, popen=True)
  try:
    deadline = time.time() + 120
    while "sleeping" not in (first.stdout.readline() or ""):
      assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
    started = time.time()
    second = lra(run_args(workdir), data_dir)
    took = time.time() - started
  finally:
    first.kill()
    first.wait()
  lines = second.stderr.strip().splitlines()
  assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
  assert lines[0].startswith(f"error: {workdir} is in use by another run (pid {first.pid} on ")
  assert took < 30, took


def test_results_of_runs_in_a_bucket_with_where_they_ran(gcs_server):
  from launch import results as results_lib
  bucket = gcs_server.new_bucket()
  config = {"task": "listops", "config_arg": "attention=band,size=small", "num_train_steps": 10,
            "seed": 1}
  where = [({"process_count": 2, "device_count": 8, "platform": "gpu", "attention_backend":
             "cudnn", "mesh": {"data": 4, "fsdp": 1, "tensor": 2}}, "data=4,tensor=2"),
           ({"process_count": 1, "device_count": 1, "platform": "cpu", "attention_backend":
             "xla", "mesh": {"data": 1, "fsdp": 1}}, "1"),
           ({"mesh": "not a mesh"}, None)]
  for k, (fields, _) in enumerate(where):
    run = f"{bucket}/sweep/a/run{k}"
    gcs_server.fs.pipe(f"{run}/config.json", json.dumps(config).encode())
    gcs_server.fs.pipe(f"{run}/results.json", json.dumps(
        {"steps": 10, "test_accuracy": 0.5, **fields}).encode())
    gcs_server.fs.pipe(f"{run}/checkpoints/10/commit_success.txt", b"")   # not a run
  gcs_server.fs.pipe(f"{bucket}/sweep/b/config.json", json.dumps(config).encode())
  gcs_server.fs.pipe(f"{bucket}/sweep/b/checkpoints/4/commit_success.txt", b"")
  gcs_server.fs.pipe(f"{bucket}/sweep/b/error.log", b"Traceback ...\nOSError: disk gone\n")
  rows = results_lib.collect(f"gs://{bucket}/sweep")
  assert [r["run"] for r in rows] == ["a/run0", "a/run1", "a/run2", "b"]
  for row, (fields, mesh) in zip(rows, where):
    assert row["status"] == "finished" and row["test"] == 0.5
    assert (row["processes"], row["devices"], row["platform"], row["mesh"], row["backend"]) == (
        fields.get("process_count"), fields.get("device_count"), fields.get("platform", ""),
        mesh, fields.get("attention_backend", ""))
  assert rows[3]["status"] == "failed" and rows[3]["steps"] == 4
  assert rows[3]["reason"] == f"OSError: disk gone (see gs://{bucket}/sweep/b/error.log)"
  table = results_lib.markdown(rows).splitlines()
  assert table[2].endswith("| 2 | 8 gpu | data=4,tensor=2 | cudnn | 0 s | finished |")
  assert table[3].endswith("| 1 | 1 cpu | 1 | xla | 0 s | finished |")
  assert table[4].endswith("| - | - | - | - | 0 s | finished |")


# --- data, sweeps and results in a bucket (end to end) ----------------------------------------

DATA = [a for a in TINY if a.startswith("--config.data.")]


@pytest.mark.slow
def test_data_prepared_into_a_bucket_trains_as_local_data(gcs_server, reference, tmp_path):
  bucket = gcs_server.new_bucket()
  data_root = f"gs://{bucket}/lra_data"
  workdir = str(tmp_path / "run")
  early = lra(run_args(workdir), data_root)   # not prepared yet: one line naming the way
  lines = early.stderr.strip().splitlines()
  assert early.returncode == 2 and len(lines) == 1, early.stderr[-3000:]
  assert lines[0].startswith("error: the listops dataset is not in gs://") and \
      "run `lra data prepare`" in lines[0]
  prepared = lra(["data", "prepare", "listops", "--size", "small", *DATA], data_root)
  assert prepared.returncode == 0, prepared.stderr[-3000:]
  folder = prepared.stdout.strip().splitlines()[-1].split("dataset ready in ")[1]
  assert folder.startswith(f"{data_root}/listops/lra_listops/generated_")
  names = sorted(p.rsplit("/", 1)[1] for p in gcs_server.fs.find(folder[len("gs://"):]))
  assert "dataset_info.json" in names and len([n for n in names if ".array_record-" in n]) == 3
  again = lra(["data", "prepare", "listops", "--size", "small", *DATA], data_root)
  assert again.returncode == 0 and f"dataset ready in {folder}" in again.stdout
  assert "copied" not in again.stderr   # already there: nothing built or uploaded
  # Training reads the bucket's files (array_record through the emulator): the run equals the
  # reference, whose data was generated locally with the same settings.
  trained = lra(run_args(workdir), data_root)
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert "preparing" not in trained.stderr   # it found the bucket's dataset
  assert_same_as_reference(workdir, reference)


def test_prepare_reads_the_files_status_names_in_the_bucket_manual_folder(gcs_server, tmp_path):
  """`lra data status` names the bucket's manual/ folder; the released ListOps TSVs put there
  are what `lra data prepare` builds the dataset from (copied to a local folder first)."""
  from lra.data import listops_generator as gen
  bucket = gcs_server.new_bucket()
  data_root = f"gs://{bucket}/lra_data"
  status = lra(["data", "status", "--size", "small"], data_root)
  assert status.returncode == 0, status.stderr[-3000:]
  assert f"manual folder: {data_root}/manual (in a bucket: `lra data prepare` copies" in \
      status.stdout
  assert f"{data_root}/manual/" in status.stdout   # where the archives go (imdb, cifar10, ...)
  release = tmp_path / "lra_release" / "listops-1000"
  release.mkdir(parents=True)
  rows = gen.generate(21, min_length=10, max_length=24, seed=9)
  counts = {"basic_train.tsv": 11, "basic_val.tsv": 6, "basic_test.tsv": 4}
  start = 0
  for name, n in counts.items():
    gen.write_tsv(str(release / name), rows[start:start + n])
    start += n
  gcs_server.fs.put(str(tmp_path / "lra_release"), f"{bucket}/lra_data/manual/",
                    recursive=True)
  prepared = lra(["data", "prepare", "listops", "--size", "small", "--no_download",
                  "--config.data.generate=False", "--config.data.max_length=24"], data_root)
  assert prepared.returncode == 0, prepared.stderr[-3000:]
  assert f"listops: copied 3 files from {data_root}/manual to a local" in prepared.stderr
  folder = prepared.stdout.strip().splitlines()[-1].split("dataset ready in ")[1]
  assert folder.startswith(f"{data_root}/listops/lra_listops/released/")
  info = json.loads(gcs_server.fs.cat(f"{folder[len('gs://'):]}/dataset_info.json"))
  assert {s["name"]: sum(int(n) for n in s["shardLengths"]) for s in info["splits"]} == {
      "train": 11, "validation": 6, "test": 4}
  # Without the files there, the refusal names the bucket's folder, not the local copy.
  empty = gcs_server.new_bucket()
  missing = lra(["data", "prepare", "listops", "--size", "small", "--no_download",
                 "--config.data.generate=False"], f"gs://{empty}/lra_data")
  assert missing.returncode == 2 and f"gs://{empty}/lra_data/manual/lra_release.gz" in \
      missing.stderr and "lra-data-" not in missing.stderr, missing.stderr[-3000:]


@pytest.mark.slow
def test_sweep_and_results_in_a_bucket(gcs_server, data_dir, tmp_path):
  bucket = gcs_server.new_bucket()
  workdir = f"gs://{bucket}/sweeps/kinds"
  sweep = ["sweep", "listops", "--sweep", "kinds_small", "--workdir", workdir, "--parallel", "2",
           *[a for a in TINY if "num_train_steps" not in a], "--config.num_train_steps=4",
           "--config.eval_every=4", "--config.checkpoint_every=4"]
  names = [f"attention={k},size=small,seed={s}" for k in ("dot_product", "band") for s in (0, 1)]
  done = lra(sweep, data_dir, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "Summary: 4 runs: 4 finished now, 0 finished earlier" in done.stdout
  assert not os.path.exists(os.path.join(ROOT, "gs:"))   # nothing written to a local "gs:/"
  for name in names:
    run = f"{bucket}/sweeps/kinds/{name}"
    record = json.loads(gcs_server.fs.cat(f"{run}/sweep.json"))
    assert [a["exit_code"] for a in record["attempts"]] == [0]
    log = gcs_server.fs.cat(f"{run}/log.txt").decode()
    assert "[sweep " in log and "test accuracy" in log   # the notes and the run's own output
  again = lra(sweep, data_dir)
  assert again.returncode == 0 and "4 finished earlier (skipped)" in again.stdout, again.stdout

  table = lra(["results", workdir], data_dir)
  assert table.returncode == 0, table.stderr[-3000:]
  lines = table.stdout.splitlines()
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  assert header[-7:] == ["params", "procs", "devices", "mesh", "backend", "wall", "status"]
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
  assert [r[0] for r in rows] == sorted(names)
  for row in rows:
    stored = json.loads(gcs_server.fs.cat(f"{bucket}/sweeps/kinds/{row[0]}/results.json"))
    mesh = ",".join(f"{a}={n}" for a, n in stored["mesh"].items() if n > 1) or "1"
    assert row[-6:-2] == [str(stored["process_count"]),
                          f"{stored['device_count']} {stored['platform']}", mesh,
                          stored["attention_backend"]]
    assert row[-6:-2] == ["1", "2 cpu", "data=2", "xla"] and row[-1] == "finished"
  as_json = json.loads(lra(["results", workdir, "--format", "json"], data_dir).stdout)
  assert {(r["processes"], r["devices"], r["platform"], r["mesh"], r["backend"], r["status"])
          for r in as_json} == {(1, 2, "cpu", "data=2", "xla", "finished")}
  missing = lra(["results", f"gs://no-such-bucket-z/runs"], data_dir)
  assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
      "error: bucket gs://no-such-bucket-z does not exist (a typo?); create it (gcloud storage "
      "buckets create gs://no-such-bucket-z) or name another."]
