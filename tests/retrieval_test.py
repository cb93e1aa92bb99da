"""Tests for lra.data.retrieval, lra.tasks.retrieval and configs/retrieval.py on tiny AAN TSVs in
the LRA release format: extracted layouts (tsv_data/, aan/) and lra_release.gz extraction, stored
bytes and labels, first-bytes truncation, missing and truncated archives, status, two training
steps."""

import io
import os
import tarfile

import jax
import numpy as np
import pytest

import task_helpers
from configs import retrieval as retrieval_config
from lra.data import archives, retrieval
from lra.tasks import retrieval as retrieval_task
from lra.tasks.classification import MatchingTask

jax.config.update("jax_disable_most_optimizations", True)

MAX_LENGTH = 48
LONG = ("Citation network analysis. " * 500).encode()   # 13,500 bytes > doc_bytes (10,000)


def make_rows(n, seed):
  """(label text, id1, id2, text1, text2) rows like the release's: quotes, non-ASCII, long."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(n):
    label = "1.0" if i % 2 else "0.0"
    t1 = f"b'Paper {seed}-{i}: \"Parsing\" with {'x' * int(rng.integers(5, 90))}'".encode()
    t2 = f"Über “Übersetzung” — résumé {i} {'y' * int(rng.integers(0, 70))}".encode()
    rows.append((label, f"P{seed:02d}-{1000 + i}", f"W{seed:02d}-{2000 + i}", t1, t2))
  return rows


ROWS = {"train": make_rows(8, 1), "validation": make_rows(4, 2), "test": make_rows(4, 3)}
ROWS["train"][3] = ("1", "J90-1001", "J90-1002", LONG, b"'quoted' \"twice\" \"")  # int label
ROWS["test"][0] = ("0", "A00-1000", "A00-2000", b"", b"empty first document")


def tsv_bytes(rows):
  return b"".join(b"\t".join([lab.encode(), a.encode(), b.encode(), t1, t2]) + b"\n"
                  for lab, a, b, t1, t2 in rows)


def write_tsvs(folder):
  os.makedirs(folder, exist_ok=True)
  for split, name in retrieval.TSV_FILES.items():
    with open(os.path.join(folder, name), "wb") as f:
      f.write(tsv_bytes(ROWS[split]))


def write_release_tarball(path):
  """lra_release.gz: a tar.gz with lra_release/tsv_data/... among other release members."""
  members = {"lra_release/listops-1000/basic_test.tsv": b"Source\tTarget\n( [MAX 1 ] )\t1\n"}
  members.update({f"lra_release/tsv_data/{name}": tsv_bytes(ROWS[split])
                  for split, name in retrieval.TSV_FILES.items()})
  members["lra_release/pathfinder32/curv_baseline/metadata/0.npy"] = os.urandom(20000)
  with tarfile.open(path, "w:gz") as tar:
    for d in ("lra_release", "lra_release/tsv_data"):
      info = tarfile.TarInfo(d)
      info.type = tarfile.DIRTYPE
      tar.addfile(info)
    for name, data in members.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))


def data_cfg(root, **kw):
  return task_helpers.local_data(retrieval_config.data_config(), root,
                                 {"max_length": MAX_LENGTH, **kw})


def ids(data, length):
  out = np.zeros(length, np.int32)
  head = np.frombuffer(data[:length], np.uint8)
  out[:head.size] = head.astype(np.int32) + 1
  return out


def check_split(source, rows, length):
  assert len(source) == len(rows)
  for i, (label, _, _, t1, t2) in enumerate(rows):
    ex = source[i]
    assert set(ex) == {"inputs1", "inputs2", "targets"}
    assert ex["inputs1"].shape == ex["inputs2"].shape == (length,)
    assert ex["inputs1"].dtype == np.int32
    np.testing.assert_array_equal(ex["inputs1"], ids(t1, length))   # first bytes, + 1
    np.testing.assert_array_equal(ex["inputs2"], ids(t2, length))
    assert int(ex["targets"]) == int(float(label))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  root = tmp_path_factory.mktemp("retrieval")
  write_tsvs(str(root / "manual" / "lra_release" / "tsv_data"))
  cfg = data_cfg(root)
  return (root, cfg, *task_helpers.prepare_with_status(retrieval_task.TASK, cfg))


def test_examples_from_the_extracted_release(built):
  _, cfg, _, _ = built
  for split in retrieval.TSV_FILES:
    check_split(retrieval.get_source(cfg, split), ROWS[split], MAX_LENGTH)
  test = retrieval.get_source(cfg, "test")
  assert not test[0]["inputs1"].any()                                 # an empty document
  assert [int(test[i]["targets"]) for i in range(4)] == [0, 1, 0, 1]
  batch = test.__getitems__([2, 1])
  np.testing.assert_array_equal(batch[0]["inputs2"], test[2]["inputs2"])


def test_storage_keeps_lra_first_10000_bytes(built):
  root, _, _, _ = built
  wide = retrieval.get_source(data_cfg(root, max_length=12_000, doc_bytes=12_000), "train")
  row = wide[3]["inputs1"]
  assert np.count_nonzero(row) == 12_000
  stored = retrieval.DATA.build(data_cfg(root)).as_data_source(split="train")[3]
  assert stored["inputs1"].size == 10_000 and bytes(stored["inputs1"]) == LONG[:10_000]
  lra = retrieval.get_source(data_cfg(root, max_length=10_000), "train")[3]["inputs1"]
  np.testing.assert_array_equal(lra, ids(LONG, 10_000))
  with pytest.raises(ValueError, match="raise data.doc_bytes"):
    retrieval.get_source(data_cfg(root, max_length=10_001), "train")


def test_status_before_and_after_prepare(built):
  root, cfg, before, folder = built
  task_helpers.check_status(retrieval_task.TASK, cfg, before, folder,
                            missing_cfg=data_cfg(root / "elsewhere"),
                            url=archives.LRA_RELEASE.url)


def test_aan_folder_of_the_readme_is_found(tmp_path):
  write_tsvs(str(tmp_path / "manual" / "lra_release" / "aan"))
  assert retrieval.find_tsv_dir(str(tmp_path / "manual")) == \
      str(tmp_path / "manual" / "lra_release" / "aan")
  cfg = data_cfg(tmp_path, max_length=16)
  check_split(retrieval.get_source(cfg, "validation"), ROWS["validation"], 16)


def test_release_tarball_is_extracted_then_built(tmp_path):
  manual = tmp_path / "manual"
  os.makedirs(manual)
  write_release_tarball(str(manual / "lra_release.gz"))
  cfg = data_cfg(tmp_path)
  status = retrieval_task.TASK.status(cfg)
  assert not status.ready and "in place" in status.detail
  check_split(retrieval.get_source(cfg, "train"), ROWS["train"], MAX_LENGTH)
  assert sorted(os.listdir(manual / "lra_release")) == ["tsv_data"]   # nothing else extracted
  assert sorted(os.listdir(manual / "lra_release" / "tsv_data")) == sorted(
      [archives.EXTRACTED_FROM, *retrieval.TSV_FILES.values()])   # the TSVs and their origin
  assert retrieval_task.TASK.status(cfg).ready


def test_truncated_release_tarball_raises_and_leaves_nothing(tmp_path):
  manual = tmp_path / "manual"
  task_helpers.check_truncated_archive(
      retrieval_task.TASK, data_cfg(tmp_path), str(manual / "lra_release.gz"), write_release_tarball,
      match="truncated or corrupt.*download it")
  assert os.listdir(manual / "lra_release") == []     # no half-extracted tsv_data/
  assert not [d for d, _, _ in os.walk(tmp_path) if d.endswith("1.0.0")]


def test_missing_data_names_url_files_and_directory(tmp_path):
  cfg = data_cfg(tmp_path)
  msg = task_helpers.missing_data_message(retrieval_task.TASK, cfg, "eval")
  for part in (archives.LRA_RELEASE.url, "lra_release.gz", "new_aan_pairs.train.tsv",
               "new_aan_pairs.eval.tsv", "new_aan_pairs.test.tsv", str(tmp_path / "manual"),
               os.path.join(str(tmp_path / "manual"), "lra_release", "tsv_data")):
    assert part in msg
  partial = tmp_path / "manual" / "lra_release" / "tsv_data"
  os.makedirs(partial)
  (partial / "new_aan_pairs.train.tsv").write_bytes(tsv_bytes(ROWS["train"]))
  with pytest.raises(archives.DataMissingError, match="lacks new_aan_pairs.eval.tsv"):
    retrieval_task.TASK.prepare(cfg)


def test_malformed_lines_are_reported(tmp_path):
  path = tmp_path / "bad.tsv"
  path.write_bytes(b"1.0\tA\tB\tonly four fields\n")
  with pytest.raises(ValueError, match="bad.tsv:1: expected 5 tab-separated fields"):
    list(retrieval.read_tsv(str(path)))
  path.write_bytes(b"0.0\tA\tB\tx\ty\n2.0\tA\tB\tx\ty\n")
  with pytest.raises(ValueError, match="bad.tsv:2: the label"):
    list(retrieval.read_tsv(str(path)))
  path.write_bytes(b"1\tA\tB\t\"x\ty\"\r\n")   # quotes are data; CRLF endings are dropped
  assert list(retrieval.read_tsv(str(path))) == [(b"\"x", b"y\"", 1)]


@pytest.mark.slow
def test_two_training_steps(built, tmp_path):
  results = task_helpers.two_training_steps(retrieval_config, data_cfg(built[0]),
                                            str(tmp_path / "run"), num_layers=1)
  assert results["test_examples"] == 4 and results["majority_class_rate"] == 0.5


def test_configs_base_is_lra_and_small_is_smaller():
  lra = {"data.max_length": 4000, "model.num_layers": 4, "model.emb_dim": 128,
         "model.num_heads": 4, "model.qkv_dim": 128, "model.mlp_dim": 512,
         "model.classifier_dim": 512, "model.dropout": 0.1, "batch_size": 32,
         "learning_rate": 0.05, "schedule": "rsqrt", "warmup_steps": 8000, "weight_decay": 0.1,
         "num_train_steps": 5000}
  task_helpers.check_config_module(retrieval_config, "retrieval", lra, bad_arg="layers=2",
                                   error="valid arguments")


def test_task_interface():
  task_helpers.check_task(retrieval_task, MatchingTask, num_classes=2, vocab_size=257)
