"""Tests for launch/sweep.py and launch/results.py: ListOps sweeps of 2 attention kinds x 2 seeds
(tiny data, 20 steps) run 2 at a time through the `lra` command, one killed and rerun; their
results as a table in every format and in the LRA layout; and the sweeps refused before anything
runs."""

import csv
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

import configs
from configs import listops
from launch import cli, results, sweep
from lra import phases

pytestmark = pytest.mark.slow   # end to end: `make test-fast` skips this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tiny runs (short trees, one 16-wide layer): the sweep's bookkeeping is under test.
TINY = ["--config.data.num_train=200", "--config.data.num_val=40", "--config.data.num_test=40",
        "--config.eval_batch_size=40", "--config.num_train_steps=20", "--config.eval_every=10",
        "--config.checkpoint_every=10", "--config.log_every=10", "--config.progress=false",
        "--config.data.max_length=32", "--config.data.gen_min_length=4",
        "--config.data.gen_max_length=33", "--config.batch_size=8", "--config.model.num_layers=1",
        "--config.model.num_heads=2", "--config.model.emb_dim=16", "--config.model.qkv_dim=16",
        "--config.model.mlp_dim=16", "--config.model.classifier_dim=16"]
NAMES = [f"attention={k},size=small,seed={s}" for k in ("dot_product", "band") for s in (0, 1)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  data = str(tmp_path_factory.mktemp("data"))
  return {**os.environ, "LRA_DATA": data, "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
          "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}   # tiny programs: compile fast


def sweep_argv(workdir) -> list[str]:
  return [sys.executable, "-m", "launch.cli", "sweep", "listops", "--sweep", "kinds_small",
          "--workdir", str(workdir), "--parallel", "2", *TINY]


def lra(env, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


def results_json(workdir, name):
  return os.path.join(workdir, name, "results.json")


@pytest.fixture(scope="module")
def swept(tmp_path_factory, env):
  """A 4-point sweep, 2 at a time, run to the end: (workdir, output, seconds)."""
  workdir = tmp_path_factory.mktemp("sweep")
  t0 = time.time()
  out = subprocess.run(sweep_argv(workdir), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
  seconds = time.time() - t0
  assert out.returncode == 0, out.stdout + out.stderr
  return workdir, out.stdout, seconds


@pytest.fixture(scope="module")
def killed(tmp_path_factory, env):
  """A sweep killed (SIGKILL to it and its runs) once its first run finished, then rerun."""
  workdir = tmp_path_factory.mktemp("killed")
  with open(workdir / "first.out", "w") as log:
    first = subprocess.Popen(sweep_argv(workdir), cwd=ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while not any(os.path.exists(results_json(workdir, n)) for n in NAMES):
      assert first.poll() is None and time.time() < deadline, (workdir / "first.out").read_text()
      time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
  while time.time() < deadline:  # until every killed run has exited
    try:
      os.killpg(first.pid, 0)
    except ProcessLookupError:
      break
    time.sleep(0.1)
  done = {n: os.stat(results_json(workdir, n)).st_mtime_ns for n in NAMES
          if os.path.exists(results_json(workdir, n))}
  again = subprocess.run(sweep_argv(workdir), cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
  return workdir, done, again


def test_a_sweep_of_four_points_two_at_a_time_completes(swept):
  workdir, out, seconds = swept
  print(f"4-point sweep, --parallel 2: {seconds:.1f} s")
  assert "4 runs in" in out and "2 at a time" in out
  assert "Summary: 4 runs: 4 finished now, 0 finished earlier (skipped)" in out
  slots = sweep.cpu_slots(2, pin=True)   # each run on its own CPUs (lra/cpus.py)
  if slots is not None:
    assert "2 at a time, each on its own CPUs (" + "; ".join(
        ",".join(map(str, s)) for s in slots) + ")." in out
    held = [json.load(open(os.path.join(workdir, n, "sweep.json")))["attempts"][-1]["cpus"]
            for n in NAMES]
    assert held[:2] == [list(s) for s in slots]   # the first two, started together
    assert all(h in [list(s) for s in slots] for h in held)
  assert sorted(os.listdir(workdir)) == sorted(NAMES)
  for name in NAMES:
    with open(results_json(workdir, name)) as f:
      r = json.load(f)
    assert r["steps"] == 20 and r["attention"] == name.split(",")[0].split("=")[1]
    record = json.load(open(os.path.join(workdir, name, "sweep.json")))
    assert record["attempts"][-1]["exit_code"] == 0
    assert "test accuracy" in record["attempts"][-1]["last_line"]


def test_a_killed_sweep_rerun_finishes_only_what_was_missing(killed):
  workdir, done, again = killed
  assert again.returncode == 0, again.stdout + again.stderr
  assert 1 <= len(done) < 4, done
  assert f"{4 - len(done)} finished now, {len(done)} finished earlier (skipped)" in again.stdout
  for name in NAMES:
    assert os.path.exists(results_json(workdir, name))
    log = open(os.path.join(workdir, name, "log.txt")).read()
    if name in done:  # not retrained: results untouched, the log says skipped
      assert os.stat(results_json(workdir, name)).st_mtime_ns == done[name]
      assert log.rstrip().endswith("finished earlier (results.json exists); skipped.")
      assert log.count("starting: lra run") == 1
    else:
      assert f"] {name}: finished in" in again.stdout


def test_dry_run_prints_the_exact_commands(swept, capsys, monkeypatch):
  workdir, _, _ = swept
  assert cli.main(["sweep", "listops", "--sweep", "kinds_small", "--workdir", str(workdir),
                   "--parallel", "2", "--dry_run", *TINY]) == 0
  lines = capsys.readouterr().out.splitlines()
  recorded = ["lra " + shlex.join(json.load(open(os.path.join(workdir, n, "sweep.json")))[
      "command"]) for n in NAMES]
  assert lines == recorded
  assert lines[0].startswith("lra run listops --arg attention=dot_product,size=small "
                             f"--workdir {workdir}/attention=dot_product,size=small,seed=0 "
                             "--config.seed=0 --config.data.num_train=200")


def test_results_table_lists_every_run(swept, env):
  workdir, _, _ = swept
  out = lra(env, "results", str(workdir))
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0].startswith("| run | task | attention | size | overrides | seed | steps |")
  rows = [line for line in lines[2:] if line.startswith("| ")]
  assert len(rows) == 4
  for name, row in zip(sorted(NAMES), rows):
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == name and cells[1] == "listops" and cells[3] == "small"
    assert cells[5] == name[-1] and cells[6] == "20/20" and cells[-1] == "finished"
    assert "num_train_steps=20" in cells[4] and "seed" not in cells[4]


def test_results_csv_and_json_parse_back(swept, env):
  workdir, _, _ = swept
  as_csv = list(csv.DictReader(io.StringIO(lra(env, "results", str(workdir), "--format",
                                               "csv", "--sort", "test").stdout)))
  as_json = json.loads(lra(env, "results", str(workdir), "--format", "json").stdout)
  assert [r["run"] for r in as_json] == sorted(NAMES)
  assert sorted(r["run"] for r in as_csv) == sorted(NAMES)
  tests = [float(r["test"]) for r in as_csv]
  assert tests == sorted(tests, reverse=True)  # accuracy: best first
  for r in as_json:
    assert r["status"] == "finished" and r["metric"] == "accuracy" and r["steps"] == 20
    assert 0 <= r["test"] <= 1 and 0 < r["majority_class_rate"] < 1 and r["wall_seconds"] > 0
    assert r["best_step"] in (10, 20) and r["seed"] in (0, 1)
    # the trainer's count in results.json (None from a trainer that does not write it)
    assert r["params"] == json.load(open(results_json(workdir, r["run"]))).get("param_count")
  by_run = {r["run"]: r for r in as_csv}
  assert all(by_run[r["run"]]["params"] == ("" if r["params"] is None else str(r["params"]))
             for r in as_json)


def test_results_lra_layout(swept, env):
  workdir, _, _ = swept
  out = lra(env, "results", str(workdir), "--lra")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0].startswith("Test accuracy (%), mean ± std over 2 seed(s)")
  assert lines[1].startswith("All runs: size=small ") and "num_train_steps=20" in lines[1]
  header = "| attention | ListOps | Text | Retrieval | Image | Pathfinder | Path-X | Avg |"
  assert header in lines
  accuracy = lines[:lines.index("Parameters:")]
  rows = {line.split("|")[1].strip(): line for line in accuracy if line.startswith("| b") or
          line.startswith("| d")}
  assert set(rows) == {"band", "dot_product"}
  as_json = json.loads(lra(env, "results", str(workdir), "--lra", "--format", "json").stdout)
  for cell in as_json["cells"]:
    accs = [100 * json.load(open(results_json(workdir, n)))["test_accuracy"] for n in NAMES
            if f"attention={cell['row']}," in n]
    assert cell["task"] == "listops" and cell["seeds"] == 2
    assert cell["mean"] == pytest.approx(sum(accs) / 2, abs=0.01)
    # 20 steps learn nothing: within a point of the majority class is FAIL
    assert cell["fail"] == (cell["mean"] <= cell["majority"] + 1)
    text = rows[cell["row"]].split("|")[2].strip()
    assert (f"{cell['mean']:.2f}" in text) and (text.startswith("FAIL") == cell["fail"])
  assert "Parameters:" in lines


def failing_point(index: int, empty: str) -> sweep.Point:
  overrides = [("data.generate", "false"), ("data.data_dir", f"{empty}/d{index}"),
               ("data.manual_dir", f"{empty}/m")]
  return sweep.Point(index, "attention=band,size=small", overrides, f"broken{index}")


def test_a_failed_run_does_not_stop_the_others_and_is_named(env, tmp_path, capsys,
                                                           monkeypatch):
  for key in ("LRA_DATA", "JAX_PLATFORMS", "XLA_FLAGS"):
    monkeypatch.setenv(key, env[key])
  workdir = tmp_path / "runs"
  points = [failing_point(1, str(tmp_path)), failing_point(2, str(tmp_path))]
  assert sweep.run_points(points, "listops", str(workdir), 1) == 1
  out = capsys.readouterr().out
  assert "Summary: 2 runs: 0 finished now, 0 finished earlier (skipped)" in out
  assert "0 stopped, 2 failed." in out
  for name in ("broken1", "broken2"):  # the second ran after the first failed
    assert f"  failed: {name} (exit 2): error: ListOps TSVs " in out
  table = json.loads(lra(env, "results", str(workdir), "--format", "json").stdout)
  assert [(r["run"], r["status"]) for r in table] == [("broken1", "failed"), ("broken2", "failed")]
  assert all(r["reason"].startswith("error: ListOps TSVs ") for r in table)


@pytest.mark.parametrize("pin", [True, False])
def test_runs_side_by_side_each_get_their_own_cpus_unless_no_pin(env, tmp_path, capsys,
                                                                 monkeypatch, pin):
  """Two failing runs at once (each refuses in a second): with pinning, each is started with
  its own slot of CPUs in LRA_CPUS and the record says which; with --no_pin, neither is."""
  for key in ("LRA_DATA", "JAX_PLATFORMS", "XLA_FLAGS"):
    monkeypatch.setenv(key, env[key])
  monkeypatch.delenv("LRA_CPUS", raising=False)
  monkeypatch.setattr(sweep.cpus_lib, "available", lambda: [0])   # even on a 1-CPU machine
  started = []
  real_popen = sweep.subprocess.Popen
  def popen(argv, **kwargs):
    started.append((kwargs.get("env") or {}).get("LRA_CPUS"))
    return real_popen(argv, **kwargs)
  monkeypatch.setattr(sweep.subprocess, "Popen", popen)
  points = [failing_point(i, str(tmp_path)) for i in (1, 2, 3)]
  workdir = tmp_path / "runs"
  assert sweep.run_points(points, "listops", str(workdir), 2, pin=pin) == 1
  out = capsys.readouterr().out
  records = [json.load(open(workdir / f"broken{i}" / "sweep.json"))["attempts"][-1]
             for i in (1, 2, 3)]
  if pin:   # one CPU, two runs: both slots hold CPU 0 (`lra.cpus.slots`)
    assert "3 to run, 2 at a time, each on its own CPUs (0; 0)." in out
    assert started == ["0", "0", "0"]
    assert [r["cpus"] for r in records] == [[0], [0], [0]]
    assert "broken1: started on CPU 0 (log" in out
  else:
    assert "3 to run, 2 at a time.\n" in out
    assert started == [None, None, None]
    assert all("cpus" not in r for r in records)
  assert all(r["exit_code"] == 2 for r in records)


def test_the_slots_handed_out_are_never_held_by_two_running_runs(monkeypatch, tmp_path):
  """Runs that end in any order give their slot back; a new run takes a free one."""
  monkeypatch.setattr(sweep.cpus_lib, "available", lambda: [0, 1, 2])
  holding, seen = {}, []

  class Child:
    def __init__(self, cpus):
      self.cpus, self.polls, self.returncode = cpus, 0, 0
    def poll(self):
      self.polls += 1
      if self.polls < (3 if self.cpus == (1,) else 1):   # the run on CPU 1 lasts longer
        return None
      holding.pop(id(self), None)
      return 0

  def start(point, task, workdir, total, cpus=None):
    assert cpus not in holding.values(), (cpus, holding)
    child = Child(cpus)
    holding[id(child)] = cpus
    seen.append(cpus)
    return child, 0.0

  monkeypatch.setattr(sweep, "_start", start)
  monkeypatch.setattr(sweep, "_finish", lambda *a: "done")
  monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
  points = [sweep.Point(i, "attention=band,size=small", [], f"p{i}") for i in range(1, 8)]
  assert sweep.run_points(points, "listops", str(tmp_path), 3, pin=True) == 0
  assert seen[:3] == [(0,), (1,), (2,)] and len(seen) == 7
  assert set(seen) == {(0,), (1,), (2,)}


def test_only_runs_the_matching_points_under_the_whole_sweeps_names(tmp_path, capsys):
  base = ["sweep", "listops", "--sweep", "kinds_small", "--workdir", str(tmp_path), "--dry_run"]
  whole = cli.main(base) == 0 and capsys.readouterr().out.splitlines()
  assert len(whole) == 4
  for only, expected in ((["attention=band"], [whole[2], whole[3]]),
                         (["seed=1", "attention=dot_product,seed=0"], whole[:2] + [whole[3]]),
                         (["size=small, seed=0"], [whole[0], whole[2]])):
    assert cli.main([*base, *(f for o in only for f in ("--only", o))]) == 0
    assert capsys.readouterr().out.splitlines() == expected, only
  every = sweep.expand("listops", "kinds_small")
  points = sweep.select(every, ["attention=band"], "s")
  assert [(p.index, p.name) for p in points] == [(1, every[2].name), (2, every[3].name)]
  assert [p.index for p in every] == [1, 2, 3, 4]     # the whole sweep's points are not renumbered
  for only, message in (
      ("attention", "error: --only attention: give KEY=VALUE items, e.g. --only "
                    "width=64,seed=0.\n"),
      ("=band", "error: --only =band: give KEY=VALUE items, e.g. --only width=64,seed=0.\n"),
      (",", "error: --only: give KEY=VALUE items, e.g. --only width=64,seed=0.\n"),
      ("atention=band", "error: --only atention=band: no point of sweep 'kinds_small' of "
                        "configs/listops.py has 'atention'; its keys: attention, num_train_steps, "
                        "seed, size.\n"),
      ("attention=lsh", "error: --only attention=lsh matches none of the 4 points of sweep "
                        "'kinds_small' of configs/listops.py; they are named like "
                        "attention=dot_product,size=small,num_train_steps=200,seed=0.\n")):
    assert cli.main([*base, "--only", only]) == 2
    assert capsys.readouterr() == ("", message), only
  assert not any(tmp_path.iterdir())


def test_repeated_points_and_unknown_fields_fail_before_anything_runs(tmp_path, capsys,
                                                                      monkeypatch):
  def twice(add):
    add(config_arg="attention=band,size=small", seed=0)
    add(config_arg="size=small,attention=band", seed=0)

  def typo(add):
    add(config_arg="attention=band,size=small", seed=0)
    add(config_arg="attention=band,size=small", seed=1, model={"dropuot": 0.1})

  monkeypatch.setattr(listops, "sweep_twice", twice, raising=False)
  monkeypatch.setattr(listops, "sweep_typo", typo, raising=False)
  workdir = tmp_path / "never"
  for name, message in (
      ("twice", "error: sweep point 2 (size=small,attention=band,seed=0) repeats sweep point 1: "
                "both resolve to the same config; change or remove one."),
      ("typo", "error: sweep point 2 (attention=band,size=small,model.dropuot=0.1,seed=1): "
               "unknown config field 'model.dropuot'; valid fields of model: ")):
    assert cli.main(["sweep", "listops", "--sweep", name, "--workdir", str(workdir)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and err.count("\n") == 1, err
  # --config overrides apply to every point: a fixed seed makes the seeds repeat
  assert cli.main(["sweep", "listops", "--sweep", "kinds_small", "--workdir", str(workdir),
                   "--config.seed=3"]) == 2
  assert "sweep point 2" in capsys.readouterr().err
  assert cli.main(["sweep", "listops", "--sweep", "nope", "--workdir", str(workdir)]) == 2
  assert "its sweeps: default, every_kind_small, kinds_small, twice, typo." in capsys.readouterr().err
  for flags, message in (
      (["--runner", "tpu"], "error: the TPU launcher needs --tpu NAME and --zone ZONE.\n"),
      (["--runner", "slurm", "--nodes", "0", "--gpus-per-node", "1"],
       "error: --nodes must be at least 1, got 0.\n"),
      (["--tpu", "pod"], "error: --tpu: only with --runner tpu.\n"),
      (["--runner", "tpu", "--tpu", "p", "--zone", "z", "--nodes", "2"],
       "error: --nodes: only with --runner slurm.\n"),
      (["--env", "A=1"], "error: --env: only with --runner tpu or --runner slurm.\n"),
      (["--runner", "tpu", "--tpu", "p", "--zone", "z", "--parallel", "2"],
       "error: --parallel applies to --runner local: TPU points run one after another, SLURM "
       "points are separate jobs.\n")):
    assert cli.main(["sweep", "listops", "--sweep", "kinds_small", "--workdir", str(workdir),
                     *flags]) == 2
    assert capsys.readouterr() == ("", message)
  assert not workdir.exists()


def test_every_config_sweep_expands_and_names_its_runs():
  for task in ("listops", "text", "retrieval", "image", "pathfinder", "pathx", "enwik8",
               "text8"):
    points = sweep.expand(task)
    names = [p.name for p in points]
    assert len(set(names)) == len(names) and all("/" not in n for n in names)
  small = sweep.expand("listops", arg="size=small")
  assert all(",size=small," in p.name for p in small)
  staged = sweep.expand("enwik8", arg="size=small")
  assert staged[0].staged_phases == 2
  assert sweep.run_name("attention=band", [("model.attention.dilation", "(1, 2)"),
                                           ("seed", "1"), ("data.data_dir", "/x y")]) == \
      "attention=band,model.attention.dilation=_1,2_,data.data_dir=_xy,seed=1"


def test_results_status_of_unfinished_runs(tmp_path):
  config = configs.build_config("listops", attention="band", size="small",
                                overrides=[("seed", "4"), ("model.num_layers", "3")])
  for name in ("failed", "running", "interrupted"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(config.to_json_best_effort(indent=2))
  (tmp_path / "failed" / "error.log").write_text("Traceback ...\nOSError: disk on fire\n")
  (tmp_path / "running" / "lock").write_text(json.dumps(
      {"host": os.uname().nodename, "pid": os.getpid(), "started": "now"}))
  (tmp_path / "interrupted" / "metrics.jsonl").write_text(
      '{"step": 10, "split": "validation", "accuracy": 0.3}\n'
      '{"step": 20, "split": "validation", "accuracy": 0.25}\n')
  rows = {r["run"]: r for r in results.collect(str(tmp_path))}
  assert {k: r["status"] for k, r in rows.items()} == {
      "failed": "failed", "running": "running", "interrupted": "interrupted"}
  assert rows["failed"]["reason"].startswith("OSError: disk on fire")
  assert rows["interrupted"]["best_validation"] == 0.3 and rows["interrupted"]["best_step"] == 10
  r = rows["interrupted"]
  assert r["overrides"] == "model.num_layers=3" and r["seed"] == 4 and r["test"] is None
  assert r["params"] is None   # no results.json yet


def write_runs(root) -> None:
  """A finished run with a parameter count, one without, and a staged run of two phases."""
  plain = configs.build_config("listops", attention="band", size="small",
                               overrides=[("model.attention.dilation", "(1, 2)")])
  done = {"steps": 20, "test_accuracy": 0.25, "best_validation_accuracy": 0.3,
          "best_validation_step": 10, "wall_seconds_this_run": 3.0}
  for name, extra in (("counted", {"param_count": 77_258}), ("uncounted", {})):
    (root / name).mkdir()
    (root / name / "config.json").write_text(plain.to_json_best_effort(indent=2))
    (root / name / "results.json").write_text(json.dumps({**done, **extra}))
  staged = configs.build_config("enwik8", size="small")
  for k, count in ((1, 1_000), (2, 2_000)):
    part = root / "staged" / f"phase{k}"
    part.mkdir(parents=True)
    (part / "config.json").write_text(
        phases.phase_config(staged, k - 1).to_json_best_effort(indent=2))
    (part / "results.json").write_text(json.dumps(
        {"steps": 10, "test_bpc": 3.5, "best_validation_bpc": 3.6, "best_validation_step": 10,
         "wall_seconds_this_run": 1.0, "param_count": count}))


def test_results_params_are_the_param_count_of_results_json(tmp_path, capsys):
  write_runs(tmp_path)
  rows = {r["run"]: r for r in results.collect(str(tmp_path))}
  assert {k: r["params"] for k, r in rows.items()} == {
      "counted": 77_258, "uncounted": None, "staged": 2_000}   # a staged run's last phase's
  assert rows["counted"]["overrides"] == "model.attention.dilation=(1,2)"
  assert cli.main(["results", str(tmp_path)]) == 0
  table = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
           for line in capsys.readouterr().out.splitlines()[2:]}
  assert [table[name][9] for name in ("counted", "staged", "uncounted")] == ["77,258", "2,000",
                                                                          "-"]


def test_results_never_import_jax(tmp_path):
  write_runs(tmp_path)
  code = ("import json, sys; from launch import cli; rc = cli.main(sys.argv[1:]); "
          "assert 'jax' not in sys.modules, 'jax was imported'; sys.exit(rc)")
  proc = subprocess.run([sys.executable, "-c", code, "results", str(tmp_path), "--format",
                         "json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert [r["params"] for r in json.loads(proc.stdout)] == [77_258, 2_000, None]


STANDIN = """#!/bin/sh
echo "$(basename "$0") $*" >> "$STANDIN_RECORD"
case "$(basename "$0")" in
  sbatch) echo 77 ;;
  gcloud) echo PREEMPTED ;;
esac
"""


@pytest.fixture
def standin(tmp_path, monkeypatch):
  """Stand-ins for `gcloud` (the TPU is PREEMPTED) and `sbatch` (job 77) that record calls."""
  for name in ("gcloud", "sbatch"):
    (tmp_path / "bin" / name).parent.mkdir(exist_ok=True)
    (tmp_path / "bin" / name).write_text(STANDIN)
    (tmp_path / "bin" / name).chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
  monkeypatch.setenv("STANDIN_RECORD", str(tmp_path / "calls"))
  return tmp_path / "calls"


def sweep_on(runner_flags, workdir, launches, *more) -> list[str]:
  return ["sweep", "listops", "--sweep", "kinds_small", "--workdir", str(workdir), *runner_flags,
          "--launch_dir", str(launches), *more, *TINY]


def test_tpu_runner_dry_run_prints_each_points_gcloud_commands(tmp_path, capsys, standin):
  from launch import remote, tpu
  workdir, launches = "gs://bucket/sweeps/kinds", tmp_path / "launches"
  flags = ["--runner", "tpu", "--tpu", "pod", "--zone", "us-central2-b", "--workers", "2"]
  assert cli.main(sweep_on(flags, workdir, launches, "--dry_run")) == 0
  lines = capsys.readouterr().out.splitlines()
  points = sweep.expand("listops", "kinds_small", overrides=launch_overrides())
  assert len(lines) == 4 * 7
  options = tpu.Options("pod", "us-central2-b", workers=2)
  for k, p in enumerate(points):
    block = lines[7 * k:7 * (k + 1)]
    run = "lra " + shlex.join(p.argv("listops", workdir))
    assert block[0] == f"# [{k + 1}/4] {p.name}: {run}"
    command = remote.parse_run(p.argv("listops", workdir))
    assert block[1:] == [x for x in tpu.plan(options, command, str(launches / p.name))
                         if not x.startswith("#")]
    assert block[-1].endswith(f"--workdir {workdir}/{p.name} " + " ".join(
        f"--config.{k}={v}" for k, v in p.overrides) + "'")
  assert not standin.exists() and not launches.exists()   # nothing called or written


def test_slurm_runner_dry_run_prints_each_points_srun_and_sbatch(tmp_path, capsys, standin):
  workdir, launches = tmp_path / "runs", tmp_path / "launches"
  flags = ["--runner", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--time", "2:00:00"]
  assert cli.main(sweep_on(flags, workdir, launches, "--dry_run")) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 4 * 3
  for k, name in enumerate(NAMES):
    head, srun, submit = lines[3 * k:3 * (k + 1)]
    assert head.startswith(f"# [{k + 1}/4] {name}: lra run listops --arg ")
    assert srun.startswith(f"# srun --kill-on-bad-exit=1 --open-mode=append --output="
                           f"{launches}/{name}/job%j-task%t.log bash -c ")
    assert f" lra-task {sys.executable} -c " in srun and " run listops --arg " in srun
    assert f" --workdir {workdir}/{name} " in srun
    assert submit == f"sbatch --parsable {launches}/{name}/job.sbatch"
  assert not standin.exists() and not launches.exists()


def test_slurm_runner_submits_one_job_per_unfinished_point(tmp_path, capsys, standin):
  workdir, launches = tmp_path / "runs", tmp_path / "launches"
  (workdir / NAMES[1]).mkdir(parents=True)
  (workdir / NAMES[1] / "results.json").write_text("{}")   # finished: skipped
  flags = ["--runner", "slurm", "--nodes", "1", "--gpus-per-node", "2"]
  assert cli.main(sweep_on(flags, workdir, launches)) == 0
  out = capsys.readouterr().out
  todo = [n for n in NAMES if n != NAMES[1]]
  assert standin.read_text().splitlines() == [
      line for n in todo for line in (f"sbatch --test-only {launches}/{n}/job.sbatch",
                                       f"sbatch --parsable {launches}/{n}/job.sbatch")]
  for n in todo:
    script = (launches / n / "job.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and f"--workdir {workdir}/{n} " in script
    assert f"] {n}: submitted job 77 (script {launches}/{n}/job.sbatch)" in out
  assert f"] {NAMES[1]}: finished earlier (results.json exists); skipped." in out
  assert "Summary: 4 runs: 3 submitted, 1 finished earlier (skipped), 0 failed." in out


def test_tpu_runner_launches_the_points_one_after_another(tmp_path, capsys, standin):
  # The stand-in TPU is PREEMPTED and there is no --create: each launch stops at its describe.
  workdir, launches = tmp_path / "runs", tmp_path / "launches"
  flags = ["--runner", "tpu", "--tpu", "pod", "--zone", "z"]
  assert cli.main(sweep_on(flags, workdir, launches)) == 1
  out, err = capsys.readouterr()
  assert standin.read_text().splitlines() == [
      "gcloud compute tpus tpu-vm describe pod --zone=z --format=value(state)"] * 4
  assert err.count("error: TPU pod is PREEMPTED; create it (or launch with --create") == 4
  assert "Summary: 4 runs: 0 finished now, 0 finished earlier (skipped), 4 failed: " in out
  for n in NAMES:
    assert (launches / n / "src.tar.gz").is_file()   # each point's launch files in its folder


def launch_overrides() -> list[tuple[str, str]]:
  return [tuple(flag[len("--config."):].split("=", 1)) for flag in TINY]
