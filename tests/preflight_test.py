"""Tests for lra/preflight.py and the preflight of `lra run`: a run that cannot fit stops in one
line before any data work, `--dry_run` prints its fields, the batches compiled for are the ones
the data pipeline yields, and the compile cache is used by the run and left as it was."""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import configs
from launch import cli
from lra import compiling, mesh as mesh_lib, preflight, tasks, train
from lra.data import pipeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB_FIGURE = re.compile(r"([\d.]+) GB")


@pytest.fixture(autouse=True)
def optimised():
  """XLA's usual optimisations (another test module may have turned most of them off)."""
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


def mem_available() -> int:
  with open("/proc/meminfo") as f:
    return int(re.search(r"MemAvailable:\s+(\d+) kB", f.read()).group(1)) * 1024


def small_config(**overrides):
  return configs.build_config("listops", size="small", overrides=[
      ("data.max_length", "32"), ("model.num_layers", "1"), ("batch_size", "16"),
      ("eval_batch_size", "32"), *((k, str(v)) for k, v in overrides.items())])


@pytest.mark.slow
@pytest.mark.usefixtures("without_suite_compile_cache")
def test_listops_base_stops_in_one_line_before_any_data(tmp_path):
  """The default `lra run listops` (base, dense, length 2,000, batch 32) on one CPU device."""
  needed = 66_080_354_688  # XLA's temporaries alone (the out-of-memory error's figure)
  if mem_available() > needed:
    pytest.skip("this machine has the memory for it")
  data = tmp_path / "data"
  data.mkdir()
  env = {**os.environ, "LRA_DATA": str(data), "XDG_CACHE_HOME": str(tmp_path / "cache"),
         "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)   # one device, as a user's machine has
  before = mem_available()      # (other processes may change it meanwhile)
  proc = subprocess.run([sys.executable, "-m", "launch.cli", "run", "listops", "--workdir",
                         str(tmp_path / "w")], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  # Nothing on stdout but, when the compile takes over 10 s (a loaded machine), the note that
  # says what is being compiled.
  assert all(x.startswith("Preflight: compiling the steps of listops (")
             for x in proc.stdout.splitlines()), proc.stdout
  line = proc.stderr
  assert line.startswith("error: listops (") and line.count("\n") == 1, line
  figures = [float(x) for x in GB_FIGURE.findall(line)]
  estimate, available = figures[:2]
  assert needed / 1e9 <= estimate < 1.2 * needed / 1e9
  assert 0 < available * 1e9 <= 1.1 * max(before, mem_available())
  assert "66.1 GB in all" in line   # the temporaries
  assert "attention scores f32[32,8,2001,2001]" in line and "batch x heads x L x L" in line
  remat = re.search(r"--config.remat=block \(about ([0-9.]+) GB\)", line)
  assert remat and float(remat.group(1)) < 0.5 * estimate, line   # measured: 25.1 of 70.3
  assert re.search(r"--attention flash \(exact, memory linear in the length: about [0-9.]+ GB\)",
                   line)
  assert re.search(r"--config.batch_size=\d+ \(about", line)   # 8 with 24 GB free
  for way_out in ("--size small", "--attention such as band or favor", "devices",
                  "--no_preflight"):
    assert way_out in line
  assert os.listdir(data) == []              # no dataset folder: nothing was generated
  assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_dry_run_of_a_base_config_field_by_field(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  workdir = tmp_path / "w"
  argv = ["run", "listops", "--dry_run", "--workdir", str(workdir),
          "--config.num_train_steps=7", "--config.mesh.data=2"]
  status = cli.main(argv)
  out = capsys.readouterr().out
  lines = out.splitlines()
  field = {l.split(":", 1)[0]: l.split(":", 1)[1].strip() for l in lines if not l[0].isspace()}
  assert field["dry run"] == ("listops (attention=dot_product,size=base); nothing is "
                              f"written to {workdir}")
  assert field["config"] == ("2 fields differ from the default listops "
                             "(attention=dot_product,size=base)")
  assert "  mesh.data: -1 -> 2" in lines and "  num_train_steps: 5000 -> 7" in lines
  assert field["mesh"] == "data 2 x fsdp 1 x sequence 1 x tensor 1 = 2 cpu devices"
  # The parameter count is the initialised model's, and the sharding table adds up to it.
  config = configs.build_config("listops", overrides=[("mesh.data", "2")])
  trainer = train.Trainer(config)
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.params))
  assert field["parameters"] == f"{count:,}"
  table = [l for l in lines if l.startswith("  params ")]
  assert sum(int(re.search(r"([\d,]+) values", l).group(1).replace(",", "")) for l in table) \
      == count
  assert "  train batch inputs   [32, 2000]       int32    split over ('data', 'fsdp'): 16 rows " \
         "per device" in lines
  assert any(l.startswith("  eval batch weights ") and "float32" in l for l in lines)
  # Memory: each program's peak is the sum of its parts; the estimate is the larger peak.
  rows = {l.split()[0]: [float(x) for x in l.split()[2:]] for l in lines
          if l.startswith(("  train step", "  eval step"))}
  for name, (args, outs, aliased, temp, code, library, peak) in rows.items():
    extra = 0.0 if name == "train" else rows["train"][0] - args   # the optimizer state
    assert peak == pytest.approx(args + outs + aliased + temp + code + library + extra,
                                 abs=0.005), name
  estimate = max(rows["train"][-1], rows["eval"][-1])
  assert rows["train"][3] == pytest.approx(66.08 / 2, rel=0.01)   # half the batch per device
  memory = next(l for l in lines if l.startswith("  estimate "))
  assert float(GB_FIGURE.search(memory).group(1)) == pytest.approx(estimate, abs=0.002)
  assert re.fullmatch(r"[\d.]+ s, programs side by side \("
                      r"train step [\d.]+ s (compiled|loaded from the cache), "
                      r"eval step [\d.]+ s (compiled|loaded from the cache)\)", field["compile"])
  # 33 GB per device does not fit half of this machine: the verdict, and exit status 2.
  if mem_available() / 2 < estimate * 1e9:
    assert status == 2 and field["verdict"].startswith("listops (") and "time" not in field
  assert not workdir.exists()


def test_dry_run_times_steps_and_writes_nothing(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  workdir = tmp_path / "w"
  assert cli.main(["run", "listops", "--size", "small", "--dry_run=steps:2", "--workdir",
                   str(workdir), "--config.num_train_steps=100"]) == 0
  out = capsys.readouterr().out
  time_line = next(l for l in out.splitlines() if l.startswith("time: "))
  assert time_line.startswith("time: 2 steps on random batches, median ")
  assert "100 steps in about" in time_line
  assert "fits" in out and "verdict" not in out
  assert not workdir.exists()
  assert cli.main(["run", "listops", "--dry_run=3"]) == 2
  assert "--dry_run takes no value or steps:N" in capsys.readouterr().err


def test_the_batches_compiled_for_are_the_pipelines(tmp_path):
  """Shapes and dtypes of real train and eval batches equal `Task.batch_spec` (so the run's
  step hits the program the preflight compiled)."""
  config = small_config()
  with config.unlocked():
    config.data.data_dir = str(tmp_path / "listops")
    config.data.num_train, config.data.num_val, config.data.num_test = 40, 8, 8
    config.data.gen_min_length, config.data.gen_max_length = 4, 33
  task = tasks.get_task("listops")
  task.prepare(config.data)
  train_batch = next(pipeline.train_iterator(task.get_source(config.data, "train"),
                                             batch_size=16, seed=0))
  eval_batch = next(iter(pipeline.eval_batches(task.get_source(config.data, "test"),
                                               batch_size=32)))
  for batch, split, size in ((train_batch, "train", 16), (eval_batch, "test", 32)):
    spec = task.batch_spec(config.data, size, split)
    assert {k: (v.shape, np.dtype(v.dtype)) for k, v in spec.items()} == \
        {k: (v.shape, v.dtype) for k, v in batch.items()}


@pytest.mark.parametrize("name, size", [("retrieval", "small"), ("text8", "small")])
def test_batch_spec_of_the_other_families(name, size):
  config = configs.build_config(name, size=size)
  spec = tasks.get_task(name).batch_spec(config.data, 8, "validation")
  L = int(config.data.max_length)
  if name == "retrieval":
    assert {k: v.shape for k, v in spec.items()} == {
        "inputs1": (8, L), "inputs2": (8, L), "targets": (8,), "weights": (8,)}
  else:
    E = int(config.data.eval_length or L)
    assert {k: v.shape for k, v in spec.items()} == {
        "inputs": (8, E), "targets": (8, E), "mask": (8, E), "weights": (8,)}


@pytest.mark.slow
@pytest.mark.usefixtures("without_suite_compile_cache")
def test_the_run_loads_the_preflights_program_and_the_cache_is_restored(tmp_path):
  config = small_config()
  before = jax.config.jax_compilation_cache_dir
  with compiling.compile_cache(directory=str(tmp_path / "cache")) as path:
    assert path == str(tmp_path / "cache")
    first = preflight.check(config)
    assert not first.train.cache_hit and first.fits
    again = preflight.check(config)
    assert again.train.cache_hit and again.eval.cache_hit
    assert again.peak == first.peak
    # The run's step, on concrete arrays, is the program the preflight compiled.
    trainer = train.Trainer(config)
    spec = trainer.task.batch_spec(config.data, 16, "train")
    batch = mesh_lib.global_batch({k: np.ones(v.shape, v.dtype) for k, v in spec.items()},
                                  trainer.mesh)
    hits = compiling.CacheHits()
    with hits:
      jax.block_until_ready(trainer.train_step(trainer.state, batch, trainer.rest))
    assert hits.count == 1
  assert jax.config.jax_compilation_cache_dir == before
  assert os.listdir(tmp_path / "cache")


@pytest.mark.slow
def test_the_run_reuses_the_preflights_compiled_steps():
  """Without any cache: the run's trainer takes the preflight's plan and never retraces."""
  config = small_config(seed=5)
  report = preflight.check(config, initialisers=True)
  later = configs.build_config("listops", size="small", overrides=[
      ("data.max_length", "32"), ("model.num_layers", "1"), ("batch_size", "16"),
      ("eval_batch_size", "32"), ("seed", "5")])
  with later.unlocked():
    later.init_from = "/elsewhere"              # initial values only: the same steps
  compiles = []
  listener = lambda name, secs, **kw: compiles.append(name)  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:   # allocates with the initialisers the preflight compiled
    trainer = train.Trainer(later, report.trainer)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert "/jax/core/compile/backend_compile_duration" not in compiles
  assert trainer.train_step is report.trainer.train_step and trainer.traces == 1
  assert trainer.config is later and not hasattr(report.trainer, "state")   # the plan stays
  spec = trainer.task.batch_spec(config.data, 16, "train")
  batch = mesh_lib.global_batch({k: np.ones(v.shape, v.dtype) for k, v in spec.items()},
                                trainer.mesh)
  jax.block_until_ready(trainer.train_step(trainer.state, batch, trainer.rest))
  assert trainer.traces == 1
  assert train.Trainer(config).train_step is not report.trainer.train_step   # plans its own


def test_refusal_names_the_ways_out():
  config = small_config(**{"mesh.data": 2})
  report = preflight.check(config)
  assert report.param_count == sum(int(np.prod(x.shape)) for x in
                                   jax.tree.leaves(report.trainer.abstract_state()["params"]))
  # Room for the state and 1 / 2.5 of what grows with the batch: the batch that fits is the
  # bigger program's batch / 2.5 rounded down to a power of two times the 2 batch shards, and
  # 3 x 2 devices would hold it.
  report.available = report.state_bytes + int((report.peak - report.state_bytes) / 2.5)
  assert not report.fits
  line = report.refusal()
  assert "\n" not in line and line.startswith("listops (attention=dot_product,size=small")
  assert "MemAvailable shared by 2 CPU devices" in line
  if report.eval_peak > report.train_peak:
    assert "--config.eval_batch_size=8 (about " in line     # 32 / 2.5 = 12.8 -> 8
  else:
    assert "--config.batch_size=4 (about " in line          # 16 / 2.5 = 6.4 -> 4
  assert "at least 6 devices" in line
  assert "--size small" not in line                      # it is small already
  assert "--attention such as band or favor" in line


def test_a_batch_the_mesh_cannot_split_is_refused_by_the_preflight(tmp_path, capsys):
  assert cli.main(["run", "listops", "--size", "small", "--workdir", str(tmp_path / "w"),
                   "--config.batch_size=12", "--config.mesh.data=8"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: config.batch_size = 12: batch size 12 must be a multiple")
  assert err.count("\n") == 1 and not (tmp_path / "w").exists()


def test_cache_directory_follows_xdg(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compiling.cache_directory() == os.path.join(str(tmp_path), "lra", "jax")
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert compiling.cache_directory() == os.path.expanduser(os.path.join("~", ".cache", "lra",
                                                                        "jax"))


@pytest.mark.usefixtures("without_suite_compile_cache")
def test_no_compile_cache_leaves_jax_alone():
  with compiling.compile_cache(False) as path:
    assert path is None and jax.config.jax_compilation_cache_dir is None


def test_no_flash_suggestion_where_flash_lacks_the_positions():
  """`flash` has no relative positions: a dense relative config gets no flash estimate (the
  variant's config check would refuse it) and its refusal line still forms."""
  config = configs.build_config("enwik8", size="small", attention="dot_product", overrides=[
      ("data.max_length", "32"), ("data.eval_length", "0"), ("model.num_layers", "1"),
      ("batch_size", "8"), ("eval_batch_size", "8"), ("phases", "()")])
  assert config.model.pos_emb == "relative"
  report = preflight.check(config)
  assert report.train_peak > report.eval_peak       # else no flash estimate for that reason
  assert report.flash_peak() is None
  report.available = report.state_bytes + 1
  line = report.refusal()
  assert "\n" not in line and "--attention flash" not in line
