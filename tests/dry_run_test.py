"""`lra run ... --dry_run` against what a real run would do.

A dry run refuses the values a run refuses, with the same line (tests/bad_values_test.py checks
every row of its table both ways); the checks here are the ones added for that: `init_from`
that does not exist, `config.task` another task's, path fields that are not strings, and the
ListOps generator's sizes (checked against the generator itself). In a workdir that holds a
finished run or another run's lock, a dry run does not fail: it says what a real run would do
there and goes on (exit 0), writing nothing. The finished workdir is a tiny one written by hand
(`config.json` and `results.json`, as a finished run leaves them).
"""

import json
import os
import socket
import time

import numpy as np
import pytest

import configs
from launch import cli
from lra import listops_limits, schema
from lra.data import listops_generator as gen

TINY = ["--size", "small", "--config.data.max_length=24", "--config.data.gen_min_length=4",
        "--config.data.gen_max_length=25", "--config.model.emb_dim=16",
        "--config.model.qkv_dim=16", "--config.model.mlp_dim=32",
        "--config.model.classifier_dim=16", "--config.model.num_layers=1",
        "--config.batch_size=16", "--config.eval_batch_size=32", "--config.num_train_steps=12"]
RESULTS = {"steps": 12, "test_accuracy": 0.25, "majority_class_rate": 0.2,
           "best_validation_accuracy": 0.3, "best_validation_step": 6}


def _config(*overrides: tuple[str, str], size: str = "small"):
  return configs.build_config("listops", size=size, overrides=list(overrides))


def _refusal(*overrides: tuple[str, str], size: str = "small") -> str:
  with pytest.raises(ValueError) as e:
    schema.check(_config(*overrides, size=size))
  assert "\n" not in str(e.value)
  return str(e.value)


# ----------------------------------------------------------------------------------------------
# The checks the dry run and the run now share.


def test_init_from_must_be_an_existing_folder(tmp_path):
  assert "config.init_from = '/nonexistent': does not exist" in _refusal(
      ("init_from", "/nonexistent"))
  (tmp_path / "afile").write_text("x")
  assert "is a file" in _refusal(("init_from", str(tmp_path / "afile")))
  schema.check(_config(("init_from", str(tmp_path))))       # a folder: the run reads it later
  schema.check(_config(("init_from", "gs://bucket/run")))   # a bucket: left to the run


def test_path_fields_must_be_strings():
  c = _config()
  with c.ignore_type():          # a config built in Python; the command line gives text
    c.data.data_dir = 5
  with pytest.raises(ValueError, match=r"config.data.data_dir = 5: must be a string"):
    schema.check(c)
  c = _config(("data.data_dir", "5"))   # the command line's text: the folder 5
  assert c.data.data_dir == "5"
  schema.check(c)


def test_config_task_is_the_config_files_task():
  schema.check_task(_config(), "listops")
  with pytest.raises(ValueError, match=r"config.task = 'text': configs/listops.py is the config "
                                       r"of task 'listops'; run `lra run text`"):
    schema.check_task(_config(("task", "text")), "listops")


@pytest.mark.parametrize("depth, args", [(1, 10), (2, 2), (2, 10), (3, 2), (3, 3)])
def test_the_longest_tree_is_the_generators(depth, args):
  """`listops_longest`: the generator makes a tree of exactly that many tokens, never longer."""
  longest = listops_limits.listops_longest(depth, args)
  rows = gen.generate(1, min_length=longest - 1, max_length=longest + 5, max_depth=depth,
                      max_args=args, seed=0) if longest > 1 else [(np.zeros(1), 0)]
  assert len(rows[0][0]) == longest
  if longest > 1:
    assert "must be below" in _refusal(("data.max_depth", str(depth)),
                                       ("data.max_args", str(args)),
                                       ("data.gen_min_length", str(longest)),
                                       ("data.gen_max_length", str(longest + 5)),
                                       ("data.max_length", str(longest + 5)))


def test_the_kept_fraction_is_the_generators():
  """`listops_kept` against the generator's own draws (the trees of 2048 draws per round)."""
  rng = np.random.default_rng(0)
  for low, high, depth in ((16, 129, 10), (4, 25, 10), (30, 200, 6), (20, 129, 40)):
    kept = drawn = 0
    for _ in range(40):
      _, length = gen._draw_levels(rng, gen.ROOTS_PER_ROUND, high, depth, 10)
      kept += int(np.count_nonzero((length > low) & (length < high)))
      drawn += length.size
    p = listops_limits.listops_kept(low, high, depth, 10)[-1]
    sigma = (p * (1 - p) / drawn) ** 0.5
    assert abs(kept / drawn - p) < 5 * sigma + 1e-6, (low, high, depth, kept / drawn, p)


def test_a_max_depth_the_generator_finds_nothing_at_is_refused():
  """LRA's lengths (500, 2000): at max_depth 10 a twelfth of the draws are kept; far deeper,
  trees keep growing past 2000 tokens and the generator gives up (it does: checked)."""
  message = _refusal(("data.max_depth", "1000"), size="base")
  assert message.startswith("config.data.max_depth = 1000: the ListOps generator would find "
                            "almost no tree")
  assert "max_depth = 10 keeps the most (0.083 of the draws)" in message
  schema.check(_config(size="base"))
  schema.check(_config(("data.max_depth", "20"), size="base"))
  with pytest.raises(RuntimeError, match="found only 0 of 1"):
    gen.generate(1, min_length=500, max_length=2000, max_depth=60, max_args=10)
  assert "would find almost no tree" in _refusal(("data.max_depth", "60"), size="base")


def test_gen_max_length_where_the_int32_count_could_overflow():
  assert listops_limits.GENERATOR_COUNT_MAX == np.iinfo(np.int32).max
  _, length = gen._draw_levels(np.random.default_rng(0), 4, 100, 5, 10)
  assert length.dtype == np.int32    # the count the bound protects
  message = _refusal(("data.max_depth", "12"), ("data.gen_max_length", "2147483647"),
                     size="base")
  assert "config.data.gen_max_length = 2147483647: must be at most 195,225,787" in message
  # At max_depth 10 no tree has more than 1,222,222,222 tokens: any bound is safe, and a run
  # with --config.data.gen_max_length=100000000 trains (its trees are the same).
  schema.check(_config(("data.gen_max_length", "100000000")))
  schema.check(_config(("data.gen_max_length", "2147483647"), size="base"))


# ----------------------------------------------------------------------------------------------
# A dry run in a finished or busy workdir.


def _finished(workdir, **changes) -> None:
  """A finished run's files in `workdir`: the TINY config's config.json and results.json."""
  config = configs.build_config("listops", size="small", overrides=[
      (a[len("--config."):].split("=")[0], a.split("=", 1)[1]) for a in TINY
      if a.startswith("--config.")])
  with config.unlocked():
    for key, value in changes.items():
      config[key] = value
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(RESULTS, f)


def _files(folder) -> dict[str, float]:
  return {os.path.join(b, n): os.path.getmtime(os.path.join(b, n))
          for b, _, names in os.walk(folder) for n in names}


def _dry(workdir, capsys, *extra) -> tuple[int, list[str], str]:
  capsys.readouterr()
  status = cli.main(["run", "listops", *TINY, "--workdir", str(workdir), "--dry_run", *extra])
  out, err = capsys.readouterr()
  return status, out.splitlines(), err


def _workdir_lines(lines: list[str]) -> list[str]:
  return [x for x in lines if x.startswith("workdir:")]


def test_a_dry_run_in_a_finished_workdir_says_what_a_run_would_do(tmp_path, capsys):
  workdir = tmp_path / "run"
  _finished(str(workdir))
  before = _files(workdir)
  results = workdir / "results.json"
  # The same config: a run prints the stored result and changes nothing.
  status, lines, err = _dry(workdir, capsys)
  assert status == 0 and err == "", err
  assert _workdir_lines(lines) == [
      f"workdir: holds this run finished ({results}); a real run would change nothing and "
      f"print its result: test accuracy 0.2500 (majority class 0.2000), best validation "
      f"accuracy 0.3000 at step 6; results in {results}"]
  assert any(x.startswith("parameters: ") for x in lines)   # and the dry run itself
  # More steps: a run continues it.
  status, lines, err = _dry(workdir, capsys, "--config.num_train_steps=20")
  assert status == 0 and err == "", err
  assert _workdir_lines(lines) == [
      f"workdir: holds this run finished at step 12 ({results}); a real run would continue it "
      f"from its last checkpoint to step 20."]
  # Another field (the docs' example after `make demo`): a run is refused, the dry run is not.
  status, lines, err = _dry(workdir, capsys, "--config.batch_size=64")
  assert status == 0 and err == "", err
  assert _workdir_lines(lines) == [
      f"workdir: holds a finished run; a real run would stop with: error: {workdir} holds a "
      f"finished run ({results}) whose config differs: batch_size: 16 -> 64. A finished run is "
      f"not rewritten: pass a new --workdir for this config (only num_train_steps may be "
      f"raised, to continue it)."]
  assert _files(workdir) == before
  # The real run: that very refusal, exit 2.
  status = cli.main(["run", "listops", *TINY, "--workdir", str(workdir),
                     "--config.batch_size=64"])
  assert status == 2
  assert capsys.readouterr().err == _workdir_lines(lines)[0].split("would stop with: ")[1] + "\n"
  assert _files(workdir) == before


def test_a_dry_run_in_a_busy_workdir_says_a_run_would_be_refused(tmp_path, capsys):
  workdir = tmp_path / "busy"
  workdir.mkdir()
  holder = {"host": socket.gethostname(), "pid": os.getppid(), "started": "2024-01-01 00:00:00",
            "token": "t"}
  (workdir / "lock").write_text(json.dumps(holder))   # a live process on this host holds it
  before = _files(workdir)
  status, lines, err = _dry(workdir, capsys)
  assert status == 0 and err == "", err
  assert _workdir_lines(lines) == [
      f"workdir: another run holds it; a real run started now would stop before its "
      f"preflight with: error: {workdir} is in use by another run (pid "
      f"{os.getppid()} on {socket.gethostname()}, started 2024-01-01 00:00:00); wait for it to "
      f"finish, stop it, or use another --workdir (delete {workdir}/lock only if that run is "
      f"gone)."]
  assert _files(workdir) == before
  # The real run: that refusal, exit 2, before its preflight compiles anything.
  status = cli.main(["run", "listops", *TINY, "--workdir", str(workdir)])
  out, err = capsys.readouterr()
  assert status == 2 and "Preflight" not in out, out
  assert err == "error: " + _workdir_lines(lines)[0].split(" with: error: ")[1] + "\n"
  assert _files(workdir) == before
  # A lock whose holder is gone is taken over by a run: nothing to say.
  holder["pid"] = 2**22 + 12345
  (workdir / "lock").write_text(json.dumps(holder))
  os.utime(workdir / "lock", (time.time(), time.time()))
  status, lines, err = _dry(workdir, capsys)
  assert status == 0 and _workdir_lines(lines) == [], (lines, err)
