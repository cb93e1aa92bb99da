"""A finished run is never rewritten: `lra run` again in its workdir (issue 36, F0).

A tiny ListOps run (`lra run listops --size small`, 12 steps) is finished once; then the same
command with FEWER steps must refuse in one line naming the field and exit 2, changing no file;
the unchanged command must print the stored result and change no file (no re-evaluation);
another field changed must refuse naming it; MORE steps must continue from the last checkpoint
to the new count. "No file changed" is checked byte for byte over the whole workdir.
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

STEPS = 12
TINY = ["--config.data.num_train=96", "--config.data.num_val=64", "--config.data.num_test=64",
        "--config.eval_batch_size=32", "--config.data.max_length=24",
        "--config.data.gen_min_length=4", "--config.data.gen_max_length=25",
        "--config.model.emb_dim=16", "--config.model.qkv_dim=16", "--config.model.mlp_dim=32",
        "--config.model.classifier_dim=16", "--config.model.num_layers=1",
        "--config.batch_size=16", "--config.warmup_steps=2", "--config.log_every=3",
        "--config.eval_every=6", "--config.checkpoint_every=4", "--config.progress=false"]


def lra_run(workdir, data_dir, *extra, steps=STEPS):
  env = {**os.environ, "LRA_DATA": data_dir, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  args = ["run", "listops", "--size", "small", "--workdir", workdir, *TINY,
          f"--config.num_train_steps={steps}", *extra]
  return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def snapshot(workdir) -> dict[str, str]:
  """Every file under `workdir` (but the compile-cache-free lock) by its bytes' digest."""
  out = {}
  for base, _, names in os.walk(workdir):
    for name in names:
      path = os.path.join(base, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, workdir)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished 12-step run: (workdir, data_dir, its files' digests, its stdout)."""
  data_dir = str(tmp_path_factory.mktemp("data"))
  workdir = str(tmp_path_factory.mktemp("finished") / "run")
  done = lra_run(workdir, data_dir)
  assert done.returncode == 0, done.stderr[-3000:]
  return workdir, data_dir, snapshot(workdir), done.stdout


def test_fewer_steps_is_refused_in_one_line_and_changes_nothing(finished):
  workdir, data_dir, files, _ = finished
  again = lra_run(workdir, data_dir, steps=5)
  assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
  err = again.stderr.strip().splitlines()
  assert len(err) == 1, again.stderr
  assert f"num_train_steps: {STEPS} -> 5" in err[0] and "--workdir" in err[0]
  assert "Traceback" not in again.stdout + again.stderr
  assert snapshot(workdir) == files


def test_unchanged_rerun_prints_the_stored_result_and_changes_nothing(finished):
  workdir, data_dir, files, first_out = finished
  again = lra_run(workdir, data_dir)
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.strip().splitlines()[-1] == first_out.strip().splitlines()[-1]
  assert "Resumed" not in again.stdout and "Preflight" not in again.stdout
  assert snapshot(workdir) == files


def test_other_fields_changed_are_refused_naming_them(finished):
  workdir, data_dir, files, _ = finished
  again = lra_run(workdir, data_dir, "--config.learning_rate=0.5", "--config.seed=3", steps=20)
  assert again.returncode == 2
  err = again.stderr.strip().splitlines()
  assert len(err) == 1, again.stderr
  assert "learning_rate" in err[0] and "seed: 0 -> 3" in err[0] and "--workdir" in err[0]
  assert snapshot(workdir) == files


def test_more_steps_continue_from_the_last_checkpoint(finished, tmp_path):
  workdir, data_dir, files, _ = finished
  longer = str(tmp_path / "longer")
  subprocess.run(["cp", "-a", workdir, longer], check=True)
  again = lra_run(longer, data_dir, steps=STEPS + 6)
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"at step {STEPS}" in again.stdout
  with open(os.path.join(longer, "results.json")) as f:
    results = json.load(f)
  assert results["steps"] == STEPS + 6
  records = [json.loads(line) for line in open(os.path.join(longer, "metrics.jsonl"))]
  steps = [r["step"] for r in records]
  assert steps == sorted(steps)                       # never back in time
  train = [r["step"] for r in records if r["split"] == "train"]
  assert train == [3, 6, 9, 12, 15, 18]
  assert sorted(int(n) for n in os.listdir(os.path.join(longer, "checkpoints"))
                if n.isdigit())[-1] == STEPS + 6
  # ... and the original is untouched.
  assert snapshot(workdir) == files


def test_edited_checkpoint_metadata_is_refused_in_one_line_and_the_run_ends_the_same(
    finished, tmp_path):
  """F5: the data position of the last checkpoint and the best record edited by hand (as a
  damaged or tampered file would be) in a run killed after its last save: each is named in one
  WARNING line, the run resumes from the checkpoint before, rebuilds the best, and ends exactly
  as the run that was never damaged."""
  workdir, data_dir, _, first_out = finished
  folder = str(tmp_path / "edited")
  subprocess.run(["cp", "-a", workdir, folder], check=True)
  os.remove(os.path.join(folder, "results.json"))   # killed after its last save
  best = os.listdir(os.path.join(folder, "best"))[0]
  for path, group, key in (
      (os.path.join(folder, "checkpoints", str(STEPS), "data", "metadata"), "train_iterator",
       "next_index"),
      (os.path.join(folder, "best", best, "data", "metadata"), "best", "accuracy")):
    with open(path) as f:
      saved = json.load(f)
    saved[group][key] = 0.99 if key == "accuracy" else saved[group][key] - 10
    with open(path, "w") as f:
      json.dump(saved, f)
  again = lra_run(folder, data_dir)
  assert again.returncode == 0, again.stderr[-3000:]
  warnings = [x for x in again.stdout.splitlines() if x.startswith("WARNING")]
  assert len(warnings) == 2, again.stdout
  assert f"checkpoint step {STEPS}" in warnings[0] and "data/metadata values" in warnings[0]
  assert "best checkpoint" in warnings[1] and "data/metadata values" in warnings[1]
  assert f"at step {STEPS - 4}" in again.stdout
  assert again.stdout.strip().splitlines()[-1].replace(folder, workdir) == \
      first_out.strip().splitlines()[-1]
  records = {}
  for name, base in (("edited", folder), ("first", workdir)):
    with open(os.path.join(base, "metrics.jsonl")) as f:
      records[name] = [{k: v for k, v in json.loads(line).items()
                        if k not in ("steps_per_second", "wall_seconds", "time")} for line in f]
    with open(os.path.join(base, "results.json")) as f:
      records[name + " results"] = json.load(f)
  assert records["edited"] == records["first"]
  for key in ("test_accuracy", "test_loss", "best_validation_accuracy", "best_validation_step"):
    assert records["edited results"][key] == records["first results"][key], key


def test_checkpoints_whose_array_files_are_cut_short_end_in_one_line(finished, tmp_path):
  """F8: when no checkpoint restores because their array files were cut short, the command ends
  with its one error line; the reads orbax abandoned, which complete into an event loop it has
  closed, print nothing ("Event loop is closed" tracebacks came after the line)."""
  workdir, data_dir, _, _ = finished
  folder = str(tmp_path / "cut")
  subprocess.run(["cp", "-a", workdir, folder], check=True)
  os.remove(os.path.join(folder, "results.json"))
  steps = sorted(n for n in os.listdir(os.path.join(folder, "checkpoints")) if n.isdigit())
  for step in steps:
    state = os.path.join(folder, "checkpoints", step, "state")
    for base, _, names in os.walk(state):
      for name in names:
        if os.path.basename(base) == "d":   # the OCDBT data files
          os.truncate(os.path.join(base, name), 50)
  again = lra_run(folder, data_dir)
  assert again.returncode == 2, again.stdout[-2000:]
  assert again.stderr.count("\n") == 1, again.stderr
  assert again.stderr.startswith("error: none of the checkpoints"), again.stderr
  warnings = [x for x in again.stdout.splitlines() if x.startswith("WARNING: checkpoint step")]
  assert len(warnings) == len(steps), again.stdout


def test_a_run_that_finishes_moves_an_earlier_error_log_aside(finished, tmp_path):
  """An error.log left by a failed attempt does not stay beside the results of a good rerun
  (`lra results` would show the error): it becomes error.previous.log."""
  workdir, data_dir, _, _ = finished
  folder = str(tmp_path / "again")
  subprocess.run(["cp", "-a", workdir, folder], check=True)
  os.remove(os.path.join(folder, "results.json"))   # the attempt failed after its last save
  with open(os.path.join(folder, "error.log"), "w") as f:
    f.write("OSError: [Errno 28] No space left on device\n")
  again = lra_run(folder, data_dir)
  assert again.returncode == 0, again.stderr[-3000:]
  assert not os.path.exists(os.path.join(folder, "error.log"))
  with open(os.path.join(folder, "error.previous.log")) as f:
    assert f.read() == "OSError: [Errno 28] No space left on device\n"
