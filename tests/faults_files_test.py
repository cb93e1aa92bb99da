"""Faults in a run's files and command line that end in one line (issue 36), without training:

F6  a metrics.jsonl whose last line was cut short: the next record starts on its own line;
F9  a byte that is not UTF-8 (or text that is not JSON) in config.json or metrics.jsonl: the
    message names the file and what to do;
F10 a train state holding NaN or infinity is never saved (checked at every save);
F12 `--attention ""`, `--size ""` and step counts beyond int32 are refused in one line;
F13 `lra results` lists any results.json (wrong shapes, strings, lists, damaged) and agrees with
    `lra sweep` on what counts as finished;
F14 a `--workdir` that is a file or cannot be written is refused in one line, exit 2.
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch import results as results_lib
from launch import run_state
from launch import train as train_launcher
from lra import checkpoint, metrics, schema, storage


# F6: a last line cut short.

def test_a_cut_short_last_line_is_dropped_before_the_next_record(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 3, "split": "train", "loss": 1.0}\n{"step": 6, "split": "tr')
  writer = metrics.MetricWriter(str(tmp_path))
  writer.write(6, "train", {"loss": 0.5})
  writer.write(9, "train", {"loss": 0.25})
  writer.close()
  lines = path.read_text().splitlines()
  assert [json.loads(x)["step"] for x in lines] == [3, 6, 9]      # every line a record
  assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [3, 6, 9]


def test_a_file_without_a_newline_at_all_is_a_cut_short_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 3, "spl')
  storage.LineFile(str(path)).append('{"step": 3}')
  assert path.read_text() == '{"step": 3}\n'


def test_whole_lines_are_kept(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 3}\n')
  f = storage.LineFile(str(path))
  f.append('{"step": 6}')
  f.append('{"step": 9}')
  assert path.read_text() == '{"step": 3}\n{"step": 6}\n{"step": 9}\n'


# F9: bytes that are not UTF-8, text that is not JSON.

def test_a_non_utf8_byte_names_the_file_and_the_line(tmp_path):
  path = tmp_path / "config.json"
  path.write_bytes(b'{\n  "seed": 0,\n  "task": "list\xffops"\n}\n')
  with pytest.raises(ValueError) as e:
    storage.read_text(str(path))
  message = str(e.value)
  assert str(path) in message and "line 3" in message and "0xff" in message
  assert "move the file away" in message and len(message.splitlines()) == 1


def test_non_utf8_metrics_name_the_file(tmp_path):
  (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 3, "split": "train\x80"}\n')
  with pytest.raises(ValueError, match="metrics.jsonl is not UTF-8 text"):
    metrics.read_metrics(str(tmp_path))


def test_text_that_is_not_json_names_the_file(tmp_path):
  path = tmp_path / "config.json"
  path.write_text('{"seed": 0,')
  with pytest.raises(ValueError, match=r"config.json is not valid JSON \(line 1"):
    storage.read_json(str(path))


def test_a_finished_run_with_a_damaged_config_names_it(tmp_path):
  (tmp_path / "results.json").write_text(json.dumps({"steps": 10}))
  (tmp_path / "config.json").write_bytes(b'{"num_train_steps": 10, "x": "\xfe"}')
  with pytest.raises(ValueError, match="config.json is not UTF-8 text"):
    run_state.rerun_of_finished(json.dumps({"num_train_steps": 10}), str(tmp_path))


# F10: no save of a non-finite state.

def _state(value: float):
  return {"params": {"w": jnp.full((3, 4), 1.0).at[1, 2].set(value),
                     "b": jnp.zeros((4,), jnp.bfloat16)},
          "step": jnp.asarray(5, jnp.int32)}


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_state_is_not_saved(tmp_path, value):
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), every=2, keep=3)
  assert ckpt.save(2, _state(1.0), {"train_iterator": {}, "train_sums": None})
  with pytest.raises(FloatingPointError) as e:
    ckpt.save(4, _state(value), {"train_iterator": {}, "train_sums": None})
  assert "step 4" in str(e.value) and "last checkpoint, step 2" in str(e.value)
  assert "learning_rate" in str(e.value)
  assert ckpt.steps() == [2]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
  ckpt.close()


def test_non_finite_metric_sums_are_not_saved(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), every=2, keep=3)
  with pytest.raises(FloatingPointError, match="starts from step 0"):
    ckpt.save(2, _state(1.0), {"train_iterator": {}, "train_sums": {"loss_sum": float("nan")}})
  assert ckpt.steps() == []
  ckpt.close()


def test_non_finite_finds_one_value_in_any_float_leaf():
  assert not checkpoint.non_finite(_state(2.0))
  tree = {"a": jnp.ones((5,), jnp.bfloat16).at[4].set(jnp.inf), "b": jnp.arange(3)}
  assert checkpoint.non_finite(tree)
  assert not checkpoint.non_finite({"key": jax.random.key(0), "n": jnp.arange(3)})


# F12: empty names and step counts beyond int32.

def _args(**kw):
  base = dict(task="listops", attention=None, size="small", arg="", workdir=None,
              dry_run=None, no_preflight=True, yes=False, no_compile_cache=True)
  return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("flag", ["attention", "size"])
@pytest.mark.parametrize("value", ["", "  "])
def test_empty_names_are_refused(flag, value, tmp_path, capsys):
  status = train_launcher.run(_args(**{flag: value, "workdir": str(tmp_path / "w")}), [])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1 and err[0].startswith(f"error: --{flag} is empty")
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("field", ["num_train_steps", "warmup_steps", "log_every",
                                   "eval_every", "checkpoint_every"])
def test_step_counts_beyond_int32_are_refused(field):
  import configs
  config = configs.build_config("listops", size="small")
  with config.unlocked():
    config[field] = 2**31
  with pytest.raises(ValueError, match=f"config.{field} = 2147483648: .*int32"):
    schema.check(config)
  config[field] = 2**31 - 1
  schema.check(config)


# F13: `lra results` over any results.json.

@pytest.mark.parametrize("text", [
    '{"steps": 10, "test_accuracy": "0.5", "best_validation_accuracy": [1, 2], '
    '"best_validation_step": "x", "param_count": 1.5, "wall_seconds_this_run": "fast"}',
    '{"steps": "ten", "test_accuracy": null, "majority_class_rate": {"a": 1}}',
    '{"steps": 10, "test_accuracy": NaN, "test_bpc": true}',
    '{}',
])
def test_results_of_the_wrong_shape_are_listed(tmp_path, text):
  run = tmp_path / "r"
  run.mkdir()
  (run / "results.json").write_text(text)
  (run / "config.json").write_text(json.dumps({"task": "listops", "num_train_steps": 10,
                                               "model": "not a dict", "seed": "s"}))
  (row,) = results_lib.collect(str(tmp_path))
  assert row["status"] == "finished"
  table = results_lib.markdown([row])
  assert "| r |" in table
  results_lib.to_csv(results_lib._public([row]))
  json.dumps(results_lib._public([row]))
  assert run_state.finished(str(run))


def test_what_a_resume_moved_aside_is_not_listed_as_a_run(tmp_path):
  """A leftover moved into `leftovers/` (lra.leftovers) may hold another run's files."""
  from lra import leftovers
  (tmp_path / "config.json").write_text(json.dumps({"task": "listops"}))
  (tmp_path / "results.json").write_text(json.dumps({"steps": 10}))
  # runs/b has no record of its own (its config.json lost), only what was moved aside
  for folder in ("runs/a", f"runs/b/{leftovers.LEFTOVERS}/20260101-000000/other-tool",
                 f"{leftovers.LEFTOVERS}/1/y"):
    (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / folder / "config.json").write_text(json.dumps({"task": "listops"}))
  assert results_lib.find_runs(str(tmp_path / "runs")) == [str(tmp_path / "runs" / "a")]
  assert results_lib.find_runs(str(tmp_path)) == [str(tmp_path)]


@pytest.mark.parametrize("content", [b'["a", "list"]', b'"text"', b'{"steps": 1', b'',
                                     b'{"steps": "\xff"}', b'42'])
def test_damaged_results_are_unfinished_for_results_and_sweep_alike(tmp_path, content):
  run = tmp_path / "r"
  run.mkdir()
  (run / "results.json").write_bytes(content)
  (run / "metrics.jsonl").write_bytes(b'{"step": 2, "split": "validation", "accuracy": 0.25}\n'
                                      b'\xff\xfe garbage\n[1, 2]\n')
  (run / "sweep.json").write_text('{"attempts": "not a list", "overrides": 3}')
  (row,) = results_lib.collect(str(tmp_path))
  assert row["status"] == "interrupted" and "results.json is damaged" in row["reason"]
  assert row["best_validation"] == 0.25 and row["best_step"] == 2
  assert not run_state.finished(str(run))           # `lra sweep` reruns it, which rewrites it
  assert "interrupted: r: " in results_lib.markdown([row])


def test_damaged_config_and_sweep_record_are_listed(tmp_path):
  run = tmp_path / "r"
  run.mkdir()
  (run / "config.json").write_bytes(b'\x00\xff not json')
  (run / "sweep.json").write_text('[1, 2]')
  (row,) = results_lib.collect(str(tmp_path))
  assert row["run"] == "r"
  results_lib.markdown([row])


# F14: a workdir that is a file or cannot be written.

@pytest.mark.parametrize("where", ["file", "under_file", "proc"])
def test_a_workdir_that_cannot_be_written_is_refused(where, tmp_path, capsys):
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  workdir = {"file": str(a_file), "under_file": str(a_file / "run"),
             "proc": "/proc/lra-run"}[where]
  status = train_launcher.run(_args(workdir=workdir), [])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, err
  assert err[0].startswith(f"error: --workdir {workdir} ")
  assert ("is a file" in err[0]) if where == "file" else ("cannot be written" in err[0])
  assert "rerun" not in err[0]
  assert a_file.read_text() == "x"
