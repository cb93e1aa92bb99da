"""Workdirs in a bucket (lra/storage.py): every file the trainer writes besides the orbax
checkpoints goes through etils.epath, tested here on a stand-in `gs://` filesystem (an fsspec
filesystem that keeps `gs://BUCKET/...` in a local folder, registered as epath's gcs backend),
and the local atomic writes with the process stopped between writing and renaming."""

import json
import os
import sys

import ml_collections
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.local import LocalFileSystem
from tensorboard.backend.event_processing import event_accumulator

import fsspec
from launch import train as train_launcher
from lra import checkpoint, metrics, phases, storage
from lra import train as train_lib


@pytest.fixture
def bucket(tmp_path):
  """`gs://` paths stored under tmp_path/gcs; yields that folder."""
  root = tmp_path / "gcs"
  root.mkdir()

  class StandInGCS(LocalFileSystem):
    protocol = ("gs", "gcs")

    def __init__(self, *args, finalize_on_close=False, **kwargs):
      del finalize_on_close
      super().__init__(*args, auto_mkdir=True, **kwargs)   # a bucket has no folders to make

    @classmethod
    def _strip_protocol(cls, path):
      path = os.fspath(path)
      for prefix in ("gs://", "gcs://"):
        if path.startswith(prefix):
          path = f"{root}/{path[len(prefix):]}"
      return super()._strip_protocol(path)

  registry = sys.modules["fsspec.registry"]._registry   # noqa: SLF001 - undone below
  saved = {name: registry.get(name) for name in ("gs", "gcs")}
  for name in ("gs", "gcs"):
    fsspec.register_implementation(name, StandInGCS, clobber=True)
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  yield root
  for name, implementation in saved.items():
    if implementation is None:
      registry.pop(name, None)
    else:
      registry[name] = implementation
  epath_backend.fsspec_backend._get_filesystem.cache_clear()


def test_paths_local_and_remote(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert storage.resolve("runs/x") == str(tmp_path / "runs" / "x")
  assert storage.resolve("gs://b/runs/x") == "gs://b/runs/x"
  assert storage.join("gs://b/runs", "x", "results.json") == "gs://b/runs/x/results.json"
  assert storage.is_remote("s3://b/x") and not storage.is_remote("/gs/b")


@pytest.mark.parametrize("where", ["local", "remote"])
def test_files_in_a_workdir(where, tmp_path, bucket):
  base = str(tmp_path / "w") if where == "local" else "gs://b/w"
  disk = tmp_path / "w" if where == "local" else bucket / "b" / "w"
  storage.makedirs(base)
  path = storage.join(base, "results.json")
  assert storage.read_json(path) is None and not storage.exists(path)
  storage.write_json(path, {"a": 1})
  assert json.loads((disk / "results.json").read_text()) == {"a": 1}
  assert storage.read_json(path) == {"a": 1}
  storage.append_text(storage.join(base, "log"), "one\n")
  storage.append_text(storage.join(base, "log"), "two\n")
  assert (disk / "log").read_text() == "one\ntwo\n"
  storage.replace(path, storage.join(base, "old.json"))
  assert not (disk / "results.json").exists() and (disk / "old.json").exists()
  storage.makedirs(storage.join(base, "sub", "deeper"))
  assert storage.listdir(base) == ["log", "old.json", "sub"]
  storage.rmtree(storage.join(base, "sub"))
  assert storage.listdir(base) == ["log", "old.json"]
  assert storage.listdir(storage.join(base, "nothing")) == []

  lines = storage.LineFile(storage.join(base, "metrics.jsonl"))
  lines.append("1")
  (disk / "metrics.jsonl").write_text((disk / "metrics.jsonl").read_text() + "2\n")
  if where == "remote":   # one writer per file: a remote LineFile keeps the lines it read
    lines = storage.LineFile(storage.join(base, "metrics.jsonl"))
  lines.append("3")
  assert (disk / "metrics.jsonl").read_text() == "1\n2\n3\n"
  lines.rewrite(["1", "3"])
  lines.append("4")
  assert (disk / "metrics.jsonl").read_text() == "1\n3\n4\n"


def test_a_remote_line_file_drops_a_line_cut_short(bucket):
  (bucket / "b").mkdir()
  (bucket / "b" / "m.jsonl").write_text('{"step": 1}\n{"ste')
  lines = storage.LineFile("gs://b/m.jsonl")
  lines.append('{"step": 2}')
  assert (bucket / "b" / "m.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_stop_between_writing_and_renaming_keeps_the_old_file(tmp_path, monkeypatch):
  path = tmp_path / "results.json"
  storage.write_json(str(path), {"old": True})

  def killed(src, dst):
    raise KeyboardInterrupt   # the process stops after writing the new file, before the rename

  monkeypatch.setattr(os, "replace", killed)
  with pytest.raises(KeyboardInterrupt):
    storage.write_json(str(path), {"new": True})
  assert json.loads(path.read_text()) == {"old": True}


def test_metrics_and_tensorboard_in_a_bucket(bucket):
  writer = metrics.MetricWriter("gs://b/run")
  for step in (1, 2, 3):
    writer.write(step, "train", {"loss": 1.0 / step, "examples": 8.0})
  writer.write(3, "validation", {"loss": 0.5, "accuracy": 0.75})
  assert writer.keep_only(lambda r: r["step"] <= 2) == 2
  writer.write(3, "train", {"loss": 0.25, "examples": 8.0})
  writer.close()
  records = metrics.read_metrics("gs://b/run")
  assert [(r["step"], r["split"], r["loss"]) for r in records] == [
      (1, "train", 1.0), (2, "train", 0.5), (3, "train", 0.25)]
  assert metrics.read_metrics(str(bucket / "b" / "run")) == records   # the same file
  events = os.listdir(bucket / "b" / "run" / "tensorboard")
  assert len(events) == 1 and events[0].startswith("events.out.tfevents.")
  acc = event_accumulator.EventAccumulator(str(bucket / "b" / "run" / "tensorboard"),
                                           size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 3]   # it shows the last
  assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([1.0, 0.5, 1 / 3, 0.25])
  assert [(e.step, e.value) for e in acc.Scalars("validation/accuracy")] == [(3, 0.75)]


def test_config_results_and_phases_in_a_bucket(bucket):
  config = ml_collections.ConfigDict({"seed": 0, "task": "listops"})
  storage.makedirs("gs://b/run")
  train_lib._save_config(config, "gs://b/run")   # noqa: SLF001
  assert json.loads((bucket / "b" / "run" / "config.json").read_text()) == config.to_dict()
  config.seed = 1
  train_lib._save_config(config, "gs://b/run")   # noqa: SLF001
  assert json.loads((bucket / "b" / "run" / "config.previous.json").read_text())["seed"] == 0
  assert json.loads((bucket / "b" / "run" / "config.json").read_text())["seed"] == 1

  assert phases.finished_results("gs://b/run/phase1") is None
  train_lib._write_json("gs://b/run/phase1/results.json", {"test_accuracy": 0.5})  # noqa: SLF001
  assert phases.finished_results("gs://b/run/phase1") == {"test_accuracy": 0.5,
                                                          "interrupted": False}
  assert phases.results_path("gs://b/run", {"phases": [{}, {}]}) == \
      "gs://b/run/phase2/results.json"


def test_a_failure_traceback_goes_to_the_bucket(bucket):
  try:
    raise RuntimeError("the device fell over")
  except RuntimeError as e:
    line = train_launcher.failure_line(e, "gs://b/run")
  assert line.startswith("RuntimeError: the device fell over (the traceback is in "
                         "gs://b/run/error.log;")
  text = (bucket / "b" / "run" / "error.log").read_text()
  assert "Traceback" in text and "the device fell over" in text


def test_unfinished_checkpoint_saves_in_a_bucket_are_removed(bucket):
  # In a bucket orbax writes a step in place and finishes it with commit_success.txt.
  steps = bucket / "b" / "run" / "checkpoints"
  (steps / "4").mkdir(parents=True)
  (steps / "4" / "commit_success.txt").write_text("done")
  (steps / "6" / "state").mkdir(parents=True)
  (steps / "6" / "state" / "part").write_text("x")
  assert checkpoint.remove_unfinished("gs://b/run/checkpoints") == ["6"]
  assert os.listdir(steps) == ["4"]
