"""Logs read cleanly: a piped `lra data prepare` carries no tfds noise, a data note is printed
once for all splits, `lra data status` checks the sizes asked (or names the sizes it checked),
and a staged run's own log continues the steps across its phases."""

import json
import logging
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing import event_accumulator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LRA = [sys.executable, "-m", "launch.cli"]

from launch import data as data_cli  # noqa: E402
from lra import phases  # noqa: E402
from lra.data import builders  # noqa: E402


def _lra(*args, env):
  return subprocess.run([*LRA, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """ListOps small prepared in a fresh data root, its output piped (not a terminal)."""
  root = tmp_path_factory.mktemp("data")
  env = {**os.environ, "LRA_DATA": str(root), "JAX_PLATFORMS": "cpu"}
  done = _lra("data", "prepare", "listops", "--size", "small", env=env)
  assert done.returncode == 0, done.stderr[-2000:]
  return env, done


@pytest.mark.slow   # builds a dataset in a subprocess
def test_piped_prepare_has_no_tfds_noise(prepared):
  _, done = prepared
  out = done.stdout + done.stderr
  for noise in ("Downloading and preparing dataset", "Unknown size", "downloaded",
                "\x1b[A", "\r", "Generating splits", "Shuffling"):
    assert noise not in out, f"{noise!r} in the piped output:\n{out[-2000:]}"
  notes = done.stderr.strip().splitlines()
  assert len(notes) == 2, done.stderr
  assert notes[0].startswith("listops: preparing ") and notes[1].startswith("listops: prepared")
  assert done.stdout.startswith("listops: dataset ready in ")


@pytest.mark.slow
def test_status_names_the_sizes_it_checked(prepared):
  env, _ = prepared
  every = _lra("data", "status", env=env)
  assert every.returncode == 0, every.stderr
  listops = [l.split(None, 3) for l in every.stdout.splitlines() if l.startswith("listops ")]
  # small is ready; base and cpu generate other examples, so they are not listed as ready.
  assert [l[:3] for l in listops] == [["listops", "ready", "small"]], every.stdout
  text = next(l for l in every.stdout.splitlines() if l.startswith("text "))
  assert text.split()[1:3] == ["missing", "base"]      # none ready: the first size, named
  base = _lra("data", "status", "--size", "base", env=env)
  assert next(l for l in base.stdout.splitlines() if l.startswith("listops ")).split()[1:3] \
      == ["missing", "base"]
  cpu = _lra("data", "status", "--size", "cpu", env=env)
  rows = {l.split()[0]: l for l in cpu.stdout.splitlines()[2:]}
  assert rows["listops"].split()[1:3] == ["missing", "cpu"]
  assert rows["text"].split()[1:3] == ["n/a", "cpu"] and "its sizes: base, small" in rows["text"]


def test_ready_sizes_sharing_a_dataset_share_a_line(monkeypatch):
  folders = {"base": "/d/a", "small": "/d/a", "cpu": "/d/b"}
  monkeypatch.setattr(data_cli.configs, "sizes", lambda name: ("base", "small", "cpu"))
  monkeypatch.setattr(data_cli, "_status", lambda name, size, manual: ("ready", folders[size]))
  assert data_cli.task_status("listops") == [("base, small", "ready", "/d/a"),
                                             ("cpu", "ready", "/d/b")]
  monkeypatch.setattr(data_cli, "_status", lambda name, size, manual: ("missing", "get x"))
  assert data_cli.task_status("listops") == [("base", "missing", "get x")]


def test_a_note_for_every_split_is_logged_once(caplog):
  log = logging.getLogger("lra.data.test_once")
  with caplog.at_level(logging.WARNING):
    for _ in ("train", "validation", "test"):
      builders.warn_once(log, "examples up to %d tokens, max_length %d", 2000, 1000)
    builders.warn_once(log, "examples up to %d tokens, max_length %d", 2000, 500)
  assert [r.getMessage() for r in caplog.records] == [
      "examples up to 2000 tokens, max_length 1000", "examples up to 2000 tokens, max_length 500"]


def _phase_records(workdir, k, steps, evals=()):
  folder = os.path.join(workdir, f"phase{k}")
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
    for s in steps:
      f.write(json.dumps({"step": s, "split": "train", "time": 1000.0 + s, "loss": 1.0 / s})
              + "\n")
    for s in evals:
      f.write(json.dumps({"step": s, "split": "validation", "time": 1000.0 + s,
                          "accuracy": 0.1 * s}) + "\n")


def _scalars(workdir, tag):
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"),
                                           size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_staged_run_log_continues_the_steps_across_phases(tmp_path):
  workdir = str(tmp_path)
  _phase_records(workdir, 1, [1, 2, 3], evals=[3])
  _phase_records(workdir, 2, [1])
  log = phases.RunLog(workdir, [3, 2])     # a rerun: phase 1 finished, phase 2 under way
  _phase_records(workdir, 2, [1, 2], evals=[2])
  log.sync(1)
  log.close()
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [(r["step"], r["phase"], r["phase_step"], r["split"]) for r in records] == [
      (1, 1, 1, "train"), (2, 1, 2, "train"), (3, 1, 3, "train"), (3, 1, 3, "validation"),
      (4, 2, 1, "train"), (5, 2, 2, "train"), (5, 2, 2, "validation")]
  assert [s for s, _ in _scalars(workdir, "train/loss")] == [1, 2, 3, 4, 5]
  assert _scalars(workdir, "validation/accuracy") == [(3, 0.3), (5, 0.2)]


def test_a_resumed_phase_has_the_run_log_rebuilt_once_per_step(tmp_path):
  workdir = str(tmp_path)
  _phase_records(workdir, 1, [1, 2])
  _phase_records(workdir, 2, [1, 2])
  log = phases.RunLog(workdir, [2, 4])
  _phase_records(workdir, 2, [1, 2, 3])    # resumed at step 2 would keep 1, 2 and add 3: growth
  log.sync(1)
  _phase_records(workdir, 2, [1, 2])       # a resume from step 1's checkpoint dropped step 3 ...
  _phase_records(workdir, 2, [1, 2, 3, 4])  # ... and wrote 2 to 4 again
  with open(os.path.join(workdir, "phase2", "metrics.jsonl")) as f:
    lines = f.readlines()
  lines[2] = lines[2].replace('"time": 1003.0', '"time": 2003.0')   # step 3 written anew
  with open(os.path.join(workdir, "phase2", "metrics.jsonl"), "w") as f:
    f.writelines(lines)
  log.sync(1)
  log.close()
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  assert records[4]["time"] == 2003.0, "phase 2's step 3 as written again, not as first written"
  assert [s for s, _ in _scalars(workdir, "train/loss")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow   # trains 2 steps in a subprocess
def test_a_piped_run_has_one_truncation_note_and_no_redraws(prepared, tmp_path):
  env, _ = prepared
  # max_length 64 under examples of up to 128 tokens: the note holds for every split.
  done = _lra("run", "listops", "--size", "small", "--workdir", str(tmp_path / "run"),
              "--config.num_train_steps=2", "--config.data.max_length=64",
              "--config.log_every=1", "--config.eval_every=2", env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout + done.stderr
  assert out.count("longer ones are truncated") == 1, out
  for noise in ("\r", "\x1b[", "Downloading and preparing", "downloaded"):
    assert noise not in out, f"{noise!r} in the piped output:\n{out[-3000:]}"
  assert "train: step 2/2 (100%)" in done.stderr


def test_a_fresh_staged_run_starts_its_log_in_a_new_workdir(tmp_path):
  workdir = str(tmp_path / "new" / "run")
  log = phases.RunLog(workdir, [2, 2])
  _phase_records(workdir, 1, [1, 2])
  log.sync(0)
  log.close()
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]
