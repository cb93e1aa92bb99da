"""Leftovers never block a resume (lra/leftovers.py `move_leftovers`).

One tiny ListOps run is trained in this process and stopped by a Ctrl-C at step 3 of 4
(checkpoints 2 and 3, best 2), and copied for each case. In a copy, a file, another tool's folder
(a README, no orbax file) or a broken symbolic link takes the place of `checkpoints`, of `best`
or of the newest step `checkpoints/3`; the resume must then succeed, print one line naming the
leftover and where it went, keep the leftover unchanged under `<workdir>/leftovers/<time>/`,
resume from the newest complete checkpoint left (step 3, step 2, or none), and end with the
final train state, the train losses and (with `best/` intact) the results of an undisturbed
resume. In a bucket (the GCS emulator of tests/gcs_server.py): a file object in place of `best`
(the reported case: every save failed with NotADirectoryError) and another tool's folder in
place of `checkpoints/3` (which the removal of unfinished saves would otherwise delete).
The training tests are marked slow (about 2 minutes together on 2 busy cores); the refusals and
the folder naming are checked without training.
"""

import glob
import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from configs import common, listops as listops_config
from gcs_server import gcs_server  # noqa: F401 - the session fixture of the bucket test
from lra import metrics, train

STEPS = 4
STOP = 3   # the Ctrl-C's step: checkpoints 2 (periodic) and 3 (on stopping), best 2


def tiny_config(data_dir):
  c = listops_config.get_config("size=small,attention=dot_product")
  c.data.data_dir = data_dir
  c.data.num_train, c.data.num_val, c.data.num_test = 64, 16, 16
  c.data.max_length, c.data.gen_min_length, c.data.gen_max_length = 24, 4, 25
  c.data.max_depth = 8   # the deepest tree of at most 25 tokens
  c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim, c.model.classifier_dim = 16, 16, 32, 16
  c.model.num_heads, c.model.num_layers = 2, 1
  c.model.attention = dict(kind="dot_product", **common.attention_defaults(
      "dot_product", window=4, max_length=25))
  c.batch_size, c.eval_batch_size = 16, 16
  c.num_train_steps, c.warmup_steps = STEPS, 1
  c.log_every, c.eval_every, c.checkpoint_every = 1, 2, 2
  c.progress = False
  return c


def train_losses(workdir):
  return [(r["step"], r["loss"]) for r in metrics.read_metrics(workdir) if r["split"] == "train"]


RESULT_FIELDS = ("test_accuracy", "test_loss", "final_test_accuracy", "final_test_loss",
                 "best_validation_accuracy", "best_validation_step")


def result_fields(results):
  return {k: results.get(k) for k in RESULT_FIELDS}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
  """(config, the workdir of a run stopped at step STOP)."""
  config = tiny_config(str(tmp_path_factory.mktemp("data")))
  workdir = str(tmp_path_factory.mktemp("stopped") / "run")

  def ctrl_c(step):
    if step == STOP:
      os.kill(os.getpid(), signal.SIGINT)

  first = train.train_and_evaluate(config, workdir, hooks=[ctrl_c])
  assert first["interrupted"] and first["step"] == STOP
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", str(STOP)]
  assert os.listdir(os.path.join(workdir, "best")) == ["2"]
  return config, workdir


@pytest.fixture(scope="module")
def undisturbed(stopped, tmp_path_factory):
  """The undisturbed resume of a copy: (its results, its workdir)."""
  config, workdir = stopped
  copy = str(tmp_path_factory.mktemp("undisturbed") / "run")
  shutil.copytree(workdir, copy, symlinks=True)
  results = train.train_and_evaluate(config, copy)
  assert not results["interrupted"]
  return results, copy


def assert_same_training(results, workdir, undisturbed, *, same_best=True):
  reference, reference_dir = undisturbed
  assert not results["interrupted"]
  for a, b in zip(jax.tree.leaves(results["state"]), jax.tree.leaves(reference["state"]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert train_losses(workdir) == train_losses(reference_dir)
  if same_best:
    assert result_fields(results) == result_fields(reference)


def put_leftover(path, kind, tmp_path):
  """Replaces whatever is at `path` by a leftover of `kind` (file, foreign, dangling)."""
  if os.path.islink(path) or os.path.isfile(path):
    os.remove(path)
  elif os.path.isdir(path):
    shutil.rmtree(path)
  if kind == "file":
    with open(path, "w") as f:
      f.write("not a checkpoint\n")
  elif kind == "foreign":
    os.makedirs(path)
    with open(os.path.join(path, "README"), "w") as f:
      f.write("another tool's folder\n")
  else:
    os.symlink(str(tmp_path / "gone"), path)


def assert_kept(moved, kind, tmp_path):
  """The leftover at `moved`, unchanged."""
  if kind == "file":
    assert not os.path.islink(moved) and open(moved).read() == "not a checkpoint\n"
  elif kind == "foreign":
    assert os.listdir(moved) == ["README"]
    assert open(os.path.join(moved, "README")).read() == "another tool's folder\n"
  else:
    assert os.path.islink(moved) and os.readlink(moved) == str(tmp_path / "gone")


# where -> (the step the resume starts from, None: from scratch; whether best/ is untouched)
PLACES = {"checkpoints": (None, True), "best": (STOP, False),
          f"checkpoints/{STOP}": (2, True)}


@pytest.mark.slow   # trains (in this process), as tests/train_test.py's runs
@pytest.mark.parametrize("kind", ["file", "foreign", "dangling"])
@pytest.mark.parametrize("where", list(PLACES))
def test_a_leftover_is_moved_aside_and_the_resume_trains_as_undisturbed(
    stopped, undisturbed, tmp_path, capsys, where, kind):
  config, stopped_dir = stopped
  workdir = str(tmp_path / "run")
  shutil.copytree(stopped_dir, workdir, symlinks=True)
  put_leftover(os.path.join(workdir, where), kind, tmp_path)
  capsys.readouterr()
  results = train.train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  start, same_best = PLACES[where]
  assert_same_training(results, workdir, undisturbed, same_best=same_best)

  # Kept, unchanged, under leftovers/<time>/ at its own path; nothing else was moved (of
  # another tool's folder in place of `checkpoints` or `best`, its README: the folder stays).
  leftovers = os.path.join(workdir, "leftovers")
  kept = sorted(os.path.relpath(os.path.join(base, n), leftovers)
                for base, dirs, files in os.walk(leftovers)
                for n in files + [d for d in dirs if os.path.islink(os.path.join(base, d))])
  assert len(kept) == 1, kept
  stamp, path = kept[0].split(os.sep, 1)
  assert path == (os.path.join(where, "README") if kind == "foreign" else where)
  assert_kept(os.path.join(leftovers, stamp, where), kind, tmp_path)

  # One line names the leftover and where it went; no warning, no failed step.
  lines = [line for line in out.splitlines() if "Moved" in line]
  if kind != "foreign" and "/" not in where:   # the checkpoint folder itself
    assert len(lines) == 1 and lines[0].startswith(
        f"Moved {workdir}/{where} aside to {leftovers}/{stamp}/{where}: it is a "), out
  else:
    folder, name = (where, "README") if "/" not in where else where.split("/")
    assert lines == [f"Moved aside from {workdir}/{folder} what is not a checkpoint: {name} "
                     f"(kept unchanged in {leftovers}/{stamp}/{folder})."], out
  assert "WARNING" not in out and "cannot be used" not in out, out
  resumed = [line for line in out.splitlines() if line.startswith("Resumed from ")]
  assert resumed == ([] if start is None else
                     [f"Resumed from {workdir}/checkpoints at step {start}."]), out

  # A second resume finds nothing to move.
  again = train.train_and_evaluate(config, workdir)
  assert "Moved" not in capsys.readouterr().out and not again["interrupted"]


def test_a_folder_of_this_second_is_not_overwritten(tmp_path, capsys):
  """Two leftovers of one name within one second go to two folders."""
  from lra import checkpoint
  run = tmp_path / "run"
  run.mkdir()
  for text in ("first", "second"):
    (run / "best").write_text(text)
    checkpoint.Checkpointer(str(run / "best"), every=0, keep=1).close()
    (run / "best").rmdir()
  moved = sorted(glob.glob(str(run / "leftovers" / "*" / "best")))
  assert len(moved) == 2 and sorted(open(m).read() for m in moved) == ["first", "second"]
  assert len([x for x in capsys.readouterr().out.splitlines() if "Moved" in x]) == 2


def test_a_leftover_that_cannot_be_moved_is_one_line_saying_what_to_do(tmp_path):
  from lra import checkpoint
  run = tmp_path / "run"
  run.mkdir()
  (run / "best").write_text("x")
  (run / "leftovers").write_text("a file where the leftovers folder goes")
  with pytest.raises(checkpoint.CheckpointError) as e:
    checkpoint.Checkpointer(str(run / "best"), every=0, keep=1)
  message = str(e.value)
  assert len(message.splitlines()) == 1 and message.startswith(f"{run / 'best'} is not a ")
  assert "move it out of the checkpoint folder by hand" in message
  assert (run / "best").read_text() == "x"


# --- in a bucket (the GCS emulator) ------------------------------------------------------------


@pytest.mark.slow
def test_leftovers_in_a_bucket_are_moved_aside_and_the_resume_trains_as_undisturbed(
    gcs_server, stopped, undisturbed, tmp_path, capsys):
  config, stopped_dir = stopped
  local = tmp_path / "run"   # the stopped run with the leftovers, uploaded
  shutil.copytree(stopped_dir, local)
  shutil.rmtree(local / "best")   # (the emulator keeps objects as files: no object and
  (local / "best").write_text("not a checkpoint\n")   # folder of one name)
  shutil.rmtree(local / "checkpoints" / str(STOP))
  (local / "checkpoints" / str(STOP)).mkdir()
  (local / "checkpoints" / str(STOP) / "README").write_text("another tool's folder\n")
  bucket = gcs_server.new_bucket()
  fs = gcs_server.fs
  fs.put(str(local), f"{bucket}/run", recursive=True)
  assert fs.isfile(f"{bucket}/run/best")
  workdir = f"gs://{bucket}/run"
  capsys.readouterr()
  results = train.train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  lines = [line for line in out.splitlines() if "Moved" in line]
  assert len(lines) == 2, out   # one per checkpoint folder
  assert any(line.startswith(f"Moved {workdir}/best aside to {workdir}/leftovers/")
             for line in lines), lines
  assert any(line.startswith(f"Moved aside from {workdir}/checkpoints what is not a "
                             f"checkpoint: {STOP} (") for line in lines), lines
  assert f"Resumed from {workdir}/checkpoints at step 2." in out
  assert "Removed unfinished" not in out and "WARNING" not in out, out
  kept = sorted(p[len(f"{bucket}/run/leftovers/"):].split("/", 1)[1]
                for p in fs.find(f"{bucket}/run/leftovers"))
  assert kept == ["best", f"checkpoints/{STOP}/README"]
  (best,) = fs.glob(f"{bucket}/run/leftovers/*/best")
  (readme,) = fs.glob(f"{bucket}/run/leftovers/*/checkpoints/{STOP}/README")
  assert fs.cat(best) == b"not a checkpoint\n"
  assert fs.cat(readme) == b"another tool's folder\n"
  reference, _ = undisturbed
  assert not results["interrupted"]
  for a, b in zip(jax.tree.leaves(results["state"]), jax.tree.leaves(reference["state"]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert json.loads(fs.cat(f"{bucket}/run/results.json"))["steps"] == STEPS
