"""Tests for the TensorBoard side of lra/metrics.py (`MetricWriter` on tensorboardX): the event
files under `<workdir>/tensorboard/` read back with TensorBoard 2.x's own reader, next to
metrics.jsonl, from a writer, from two writers, at interpreter exit without `close()`, and from
a tiny training run."""

import os
import re
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from lra import metrics


def _event_files(logdir: str) -> list[str]:
  return sorted(name for name in os.listdir(logdir) if name.startswith("events.out.tfevents."))


def _scalars(logdir: str) -> list[tuple[int, str, float]]:
  """(step, tag, value) of every scalar TensorBoard reads from the event files of logdir."""
  acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return sorted((e.step, tag, e.value) for tag in acc.Tags()["scalars"]
                for e in acc.Scalars(tag))


def test_metric_writer_writes_the_jsonl_records_as_scalars(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path))
  assert writer.tensorboard_dir == str(tmp_path / "tensorboard")
  assert not os.path.exists(writer.tensorboard_dir)  # nothing until the first write
  writer.write(1, "train", {"loss": 1.5, "accuracy": 0.25, "examples": 16.0})
  writer.write(2, "validation", {"loss": 1.25, "accuracy": 0.5, "examples": 8.0,
                                 "note": "not a number", "flag": True})
  writer.close()
  writer.close()  # closing twice is fine
  (name,) = _event_files(writer.tensorboard_dir)
  assert re.fullmatch(rf"events\.out\.tfevents\.\d{{10}}\..+\.{os.getpid()}\.\d+", name), name
  assert _scalars(writer.tensorboard_dir) == sorted([
      (1, "train/loss", 1.5), (1, "train/accuracy", 0.25), (1, "train/examples", 16.0),
      (2, "validation/loss", 1.25), (2, "validation/accuracy", 0.5),
      (2, "validation/examples", 8.0)])
  records = metrics.read_metrics(str(tmp_path))
  assert [(r["step"], r["split"], r["loss"]) for r in records] == [
      (1, "train", 1.5), (2, "validation", 1.25)]


def test_scalars_reach_the_file_before_close(tmp_path, monkeypatch):
  monkeypatch.setattr(metrics, "FLUSH_SECONDS", 0.1)
  writer = metrics.MetricWriter(str(tmp_path))
  writer.write(3, "train", {"loss": 0.75})
  deadline = time.monotonic() + metrics.FLUSH_SECONDS + 5
  while not _scalars(writer.tensorboard_dir) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _scalars(writer.tensorboard_dir) == [(3, "train/loss", 0.75)]
  writer.close()


def test_each_writer_has_its_own_file_and_tensorboard_reads_them_all(tmp_path):
  first, second = metrics.MetricWriter(str(tmp_path)), metrics.MetricWriter(str(tmp_path))
  first.write(1, "train", {"loss": 2.0})
  second.write(2, "train", {"loss": 1.0})    # a resumed run, in the same second
  first.close()
  second.close()
  assert len(_event_files(first.tensorboard_dir)) == 2
  assert _scalars(first.tensorboard_dir) == [(1, "train/loss", 2.0), (2, "train/loss", 1.0)]


def test_only_process_zero_writes_and_divergence_raises(tmp_path, monkeypatch):
  with pytest.raises(FloatingPointError, match="train loss is nan at step 4"):
    metrics.MetricWriter(str(tmp_path)).write(4, "train", {"loss": float("nan")})
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  writer = metrics.MetricWriter(str(tmp_path))
  writer.write(1, "train", {"loss": 1.0})
  writer.close()
  assert os.listdir(tmp_path) == []


def test_scalars_are_written_at_exit_without_close(tmp_path):
  script = textwrap.dedent(f"""
      from lra import metrics
      writer = metrics.MetricWriter({str(tmp_path)!r})
      for step in range(1, 41):
        writer.write(step, "train", {{"loss": 1.0 / step}})
  """)
  subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
  got = _scalars(str(tmp_path / "tensorboard"))
  assert [(s, t) for s, t, _ in got] == [(s, "train/loss") for s in range(1, 41)]
  np.testing.assert_allclose([v for *_, v in got], 1.0 / np.arange(1, 41), rtol=1e-7)


@pytest.mark.slow
def test_training_run_writes_the_event_file(tmp_path_factory, tmp_path):
  from lra import train
  from train_test import tiny_config
  data_dir = str(tmp_path_factory.mktemp("listops_data_tb"))
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(tiny_config(data_dir), workdir)
  logdir = os.path.join(workdir, "tensorboard")
  assert len(_event_files(logdir)) == 1
  scalars = _scalars(logdir)
  tags = {tag for _, tag, _ in scalars}
  assert {"train/loss", "train/accuracy", "train/learning_rate", "train/steps_per_second",
          "validation/loss", "validation/accuracy", "test/loss", "test/accuracy"} <= tags
  # Every metrics.jsonl number is there, at float32 precision.
  by_key = {(step, tag): value for step, tag, value in scalars}
  records = metrics.read_metrics(workdir)
  assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
  for r in records:
    for name, value in r.items():
      if name not in ("step", "split", "time"):
        np.testing.assert_allclose(by_key[(r["step"], f"{r['split']}/{name}")], value, rtol=1e-6)
  assert len(scalars) == sum(len(r) - 3 for r in records)
