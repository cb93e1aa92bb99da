"""Tests for lra.data.listops and lra.tasks.listops: grammar, labels, released format, vocabulary,
tfds dataset."""

import collections
import csv
import os
import shutil

import numpy as np
import pytest

from lra import tasks
from configs import listops as listops_config
from lra.data import archives, listops, listops_generator as gen
from lra.tasks import listops as listops_task
from lra.tasks.classification import ClassificationTask

# The LRA generator's own definitions, used as an independent reference: a tree is written as
# left-nested pairs (((op, c1), c2), ..., END) and evaluated pairwise.
_OPS = ("[MIN", "[MAX", "[MED", "[SM")


def _parse_pairs(source: str):
  """Parses a released `Source` string back into the LRA generator's nested tuples."""
  stack = [[]]
  for tok in source.split():
    if tok == "(":
      stack.append([])
    elif tok == ")":
      a, b = stack.pop()
      stack[-1].append((a, b))
    else:
      stack[-1].append(int(tok) if tok.isdigit() else tok)
  (tree,) = stack[0]
  return tree


def _lra_to_string(t) -> str:
  if isinstance(t, str):
    return t
  if isinstance(t, int):
    return str(t)
  return "( " + _lra_to_string(t[0]) + " " + _lra_to_string(t[1]) + " )"


def _lra_to_value(t):
  if not isinstance(t, tuple):
    return t
  left, right = _lra_to_value(t[0]), _lra_to_value(t[1])
  if left in _OPS:
    return (left, [right])
  if right == "]":
    op, vals = left
    return {"[MIN": min, "[MAX": max, "[MED": lambda v: int(np.median(v)),
            "[SM": lambda v: int(np.sum(v) % 10)}[op](vals)
  return (left[0], left[1] + [right])


def _depth_and_arities(ids):
  depth, max_depth, arities, stack = 0, 0, [], []
  for t in ids:
    if t in (11, 12, 13, 14):
      depth += 1
      stack.append(0)
    elif t == gen.END_ID:
      arities.append(stack.pop())
      depth -= 1
      if stack:
        stack[-1] += 1
    else:
      max_depth = max(max_depth, depth + 1)  # a digit is one level below its operator
      stack[-1] += 1
  return max_depth, arities


def test_vocabulary_is_fixed_and_documented():
  assert gen.VOCAB_SIZE == 17 and gen.PAD_ID == 0 and gen.UNK_ID == 16
  expected = {str(d): d + 1 for d in range(10)}
  expected.update({"[MIN": 11, "[MAX": 12, "[MED": 13, "[SM": 14, "]": 15})
  assert gen.TOKEN_TO_ID == expected
  ids = gen.encode("( ( ( [MAX 2 ) ( ( ( [FIRST 7 ) 1 ) ] ) ) ] )")
  np.testing.assert_array_equal(ids, [12, 3, gen.UNK_ID, 8, 2, 15, 15])


def test_released_string_matches_the_lra_writer_and_values():
  rows = gen.generate(300, min_length=10, max_length=120, seed=3)
  for ids, label in rows:
    source = gen.to_released_string(ids)
    tree = _parse_pairs(source)
    assert _lra_to_string(tree) == source
    assert _lra_to_value(tree) == label == gen.evaluate(ids)
    np.testing.assert_array_equal(gen.encode(source), ids)
  assert gen.to_released_string([12, 3, 10, 15]) == "( ( ( [MAX 2 ) 9 ) ] )"


@pytest.mark.parametrize("source, value", [
    ("[MED 1 2 3 4 ]", 2), ("[MED 9 8 ]", 8), ("[SM 7 8 ]", 5), ("[MIN 3 [MAX 1 9 ] 4 ]", 3),
    ("[MAX 0 [SM 9 9 [MED 0 9 5 ] ] 2 ]", 3)])
def test_evaluate_semantics(source, value):
  assert gen.evaluate(gen.encode(source)) == value


def test_evaluate_rejects_malformed_input():
  for bad in ("[MAX 1 2", "1 2", "[MIN ]", "]"):
    with pytest.raises(ValueError):
      gen.evaluate(gen.encode(bad))


def test_generator_respects_the_grammar_and_bounds():
  rows = gen.generate(2000, min_length=20, max_length=300, max_depth=10, max_args=10, seed=0)
  keys = {bytes(ids) for ids, _ in rows}
  assert len(keys) == len(rows)
  arity_counts = collections.Counter()
  ops = collections.Counter()
  for ids, _ in rows:
    assert 20 < len(ids) < 300 and ids.dtype == np.uint8
    depth, arities = _depth_and_arities(ids)
    assert depth <= 10
    arity_counts.update(arities)
    ops.update(int(t) for t in ids if 11 <= t <= 14)
  assert set(arity_counts) == set(range(2, 11))
  total = sum(ops.values())
  assert all(abs(c / total - 0.25) < 0.02 for c in ops.values())
  labels = np.bincount([label for _, label in rows], minlength=10) / len(rows)
  # MIN and MAX over many arguments push mass to 0 and 9 (LRA ~16% each, 1-8 ~8-9%).
  assert labels[0] > 0.12 and labels[9] > 0.12 and labels[1:9].max() < 0.12


def test_generator_depth_limit_and_operator_probability():
  rows = gen.generate(400, min_length=4, max_length=60, max_depth=3, max_args=4, seed=1)
  for ids, _ in rows:
    depth, arities = _depth_and_arities(ids)
    assert depth <= 3 and max(arities) <= 4
  # With max_depth 2 only the root may be an operator: each tree is one flat operator.
  for ids, _ in gen.generate(50, min_length=3, max_length=20, max_depth=2, seed=2):
    assert np.count_nonzero(ids == gen.END_ID) == 1


def test_generator_is_seeded_and_excludes():
  a = gen.generate(50, min_length=10, max_length=80, seed=5)
  b = gen.generate(50, min_length=10, max_length=80, seed=5)
  c = gen.generate(50, min_length=10, max_length=80, seed=6)
  assert [bytes(x) for x, _ in a] == [bytes(x) for x, _ in b]
  assert [bytes(x) for x, _ in a] != [bytes(x) for x, _ in c]
  seen = {bytes(x) for x, _ in a}
  d = gen.generate(50, min_length=10, max_length=80, seed=5, exclude=seen)
  assert not {bytes(x) for x, _ in a} & {bytes(x) for x, _ in d} and len(seen) == 100
  with pytest.raises(ValueError, match="min_length < length < max_length"):
    gen.generate(5, min_length=10, max_length=11)
  with pytest.raises(RuntimeError, match="found only 400 of 401"):  # 4 ops x 10 x 10 digits
    gen.generate(401, min_length=3, max_length=5, max_depth=2, max_args=2)


def _small_cfg(tmp_path, **kw):
  cfg = listops_config.data_config()
  cfg.data_dir = str(tmp_path)
  cfg.manual_dir = str(tmp_path / "manual")
  settings = dict(num_train=60, num_val=12, num_test=12, gen_min_length=10, gen_max_length=50,
                  max_length=64, seed=0)
  settings.update(kw)
  cfg.update(settings)
  return cfg


def _rows(source):
  return sorted((tuple(r["inputs"].tolist()), int(r["targets"])) for r in
                (source[i] for i in range(len(source))))


def test_generated_dataset_through_tfds(tmp_path):
  cfg = _small_cfg(tmp_path)
  splits = {s: listops.get_source(cfg, s) for s in listops.SPLITS}
  assert [len(splits[s]) for s in listops.SPLITS] == [60, 12, 12]
  seen = set()
  for name, src in splits.items():
    for i in range(len(src)):
      ex = src[i]
      assert ex["inputs"].shape == (64,) and ex["inputs"].dtype == np.int32
      assert ex["targets"].dtype == np.int32 and ex["targets"].shape == ()
      n = int(np.count_nonzero(ex["inputs"]))
      assert 10 < n < 50 and not ex["inputs"][n:].any()
      assert gen.evaluate(ex["inputs"][:n]) == ex["targets"]
      seen.add(bytes(ex["inputs"][:n].astype(np.uint8)))
  assert len(seen) == 84  # disjoint splits
  batch = splits["test"].__getitems__([0, 3])
  np.testing.assert_array_equal(batch[1]["inputs"], splits["test"][3]["inputs"])
  with pytest.raises(IndexError):
    splits["test"][12]
  # Truncation keeps the first tokens.
  cfg.max_length = 8
  short = listops.get_source(cfg, "test")
  np.testing.assert_array_equal(short[0]["inputs"], splits["test"][0]["inputs"][:8])


def test_released_tsvs_are_read_in_the_release_layout(tmp_path):
  release = tmp_path / "lra_release" / "listops-1000"
  release.mkdir(parents=True)
  rows = gen.generate(30, min_length=10, max_length=40, seed=9)
  for i, name in enumerate(("basic_train.tsv", "basic_val.tsv", "basic_test.tsv")):
    gen.write_tsv(str(release / name), rows[10 * i:10 * (i + 1)])
  with open(release / "basic_val.tsv", newline="") as f:
    lines = list(csv.reader(f, delimiter="\t"))
  assert lines[0] == ["Source", "Target"] and lines[1][0].startswith("( ")
  cfg = _small_cfg(tmp_path, generate=False)
  assert listops.builder_config(cfg).name == "released"
  val = listops.get_source(cfg, "validation")
  pad = lambda ids: tuple(np.pad(ids, (0, 64 - len(ids))).tolist())
  assert _rows(val) == sorted((pad(ids), label) for ids, label in rows[10:20])


def test_cli_tsvs_equal_the_generated_dataset(tmp_path):
  out = tmp_path / "lra_release" / "listops-1000"
  gen.main(["--output_dir", str(out), "--num_train=20", "--num_val=5", "--num_test=5",
                "--gen_min_length=10", "--gen_max_length=40", "--seed=4"])
  gen_cfg = _small_cfg(tmp_path / "gen", num_train=20, num_val=5, num_test=5,
                       gen_max_length=40, seed=4)
  rel_cfg = _small_cfg(tmp_path, generate=False)
  for split in ("train", "test"):
    assert _rows(listops.get_source(gen_cfg, split)) == _rows(listops.get_source(rel_cfg, split))


def test_tsvs_under_data_dir_are_the_manual_dir_and_unneeded_once_built(tmp_path):
  folder = tmp_path / "listops-1000"   # under data_dir (tmp_path), not under manual_dir
  gen.main(["--output_dir", str(folder), "--num_train=10", "--num_val=5", "--num_test=5",
            "--gen_min_length=10", "--gen_max_length=40", "--seed=2"])
  cfg = _small_cfg(tmp_path, generate=False)
  assert listops.locate(cfg) == str(folder)
  test = _rows(listops.get_source(cfg, "test"))
  assert len(test) == 5
  shutil.rmtree(folder)   # a prepared dataset loads without its TSVs and extracts nothing
  assert listops_task.TASK.status(cfg).ready
  assert _rows(listops.get_source(cfg, "test")) == test
  assert not os.path.exists(tmp_path / "manual")


def test_missing_data_error_names_files_and_directory(tmp_path):
  cfg = _small_cfg(tmp_path, generate=False)
  with pytest.raises(FileNotFoundError) as err:
    listops.get_source(cfg, "train")
  msg = str(err.value)
  for part in ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv", "lra_release.gz",
               "https://storage.googleapis.com/long-range-arena/lra_release.gz",
               os.path.join(str(tmp_path), "manual", "lra_release"), "generate"):
    assert part in msg
  with pytest.raises(ValueError, match="valid splits: train, validation, test"):
    listops.get_source(cfg, "val")
  status = listops_task.TASK.status(cfg)
  assert not status.ready and archives.LRA_RELEASE.url in status.detail
  os.makedirs(tmp_path / "manual")
  (tmp_path / "manual" / "lra_release.gz").write_bytes(b"")
  assert "the input files are in place" in listops_task.TASK.status(cfg).detail


def test_bad_tsv_is_reported(tmp_path):
  path = tmp_path / "bad.tsv"
  path.write_text("Source\tTarget\n[MAX 1 2 ]\t12\n")
  with pytest.raises(ValueError, match="label 12"):
    list(gen.read_tsv(str(path)))
  path.write_text("src\tlabel\n")
  with pytest.raises(ValueError, match="header"):
    list(gen.read_tsv(str(path)))


def test_task_registry():
  task = tasks.get_task("listops")
  assert task is listops_task.TASK and isinstance(task, ClassificationTask)
  assert set(tasks.TASKS) == {"listops", "text", "retrieval", "image", "pathfinder", "pathx",
                              "enwik8", "text8", "sort_marked", "mqar", "needle"}
  assert (task.name, task.num_classes, task.vocab_size) == ("listops", 10, 17)
  cfg = listops_config.data_config()
  for key in ("data_dir", "max_length", "generate", "num_train", "num_val", "num_test",
              "gen_min_length", "gen_max_length", "seed"):
    assert key in cfg
  with pytest.raises(ValueError, match="valid tasks: .*listops"):
    tasks.get_task("list_ops")


def test_the_result_line_says_when_the_model_is_below_the_majority_class():
  task = tasks.get_task("listops")
  results = {"test_accuracy": 0.4325, "majority_class_rate": 0.505,
             "best_validation_accuracy": 0.45, "best_validation_step": 200}
  line = task.result_line(results, "w/results.json")
  assert line.startswith("test accuracy 0.4325 (below the majority class 0.5050: ")
  assert "train longer or at a larger --size" in line and line.endswith("w/results.json")
  above = task.result_line({**results, "test_accuracy": 0.6}, "w/results.json")
  assert above.startswith("test accuracy 0.6000 (majority class 0.5050), best validation")
