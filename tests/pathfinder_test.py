"""Tests for lra.data.pathfinder and lra.tasks.pathfinder (Pathfinder and Path-X) and their
configs: a folder in the LRA release layout (PNGs + text .npy metadata, with an all-zero image),
the same packed in lra_release.gz, splits and ids, errors for missing/truncated/corrupt inputs, the
generator glue, and two training steps of Pathfinder and of Path-X."""

import io
import os
import sys
import tarfile
import types

import jax
import numpy as np
import pytest

import lra.data
import task_helpers
from configs import pathfinder as pathfinder_config, pathx as pathx_config
from lra.data import archives, pathfinder, png
from lra.tasks import pathfinder as pathfinder_task

pathx = pathfinder_task.PATHX   # the Task object of Path-X: pathfinder's functions at 128x128

jax.config.update("jax_disable_most_optimizations", True)

BATCHES = (2, 10)     # numeric order differs from text order ("10" < "2")
PER_BATCH = 10
EMPTY = (10, 3)       # (batch, sample) of the all-zero image


def write_release(folder, *, resolution=32, seed=0):
  """imgs/<batch>/sample_<i>.png and text metadata/<batch>.npy as in the LRA release; returns
  {(batch, i): (image uint8 [R, R], label)}."""
  rng = np.random.default_rng(seed)
  rows = {}
  os.makedirs(os.path.join(folder, "metadata"), exist_ok=True)
  for b in BATCHES:
    os.makedirs(os.path.join(folder, "imgs", str(b)), exist_ok=True)
    lines = []
    for i in range(PER_BATCH):
      lit = rng.random((resolution, resolution)) < 0.2         # mostly black, like Pathfinder
      image = (lit * rng.integers(1, 256, (resolution, resolution))).astype(np.uint8)
      if (b, i) == EMPTY:
        image[:] = 0
      label = int(rng.integers(0, 2))
      png.write(os.path.join(folder, "imgs", str(b), f"sample_{i}.png"), image)
      lines.append(f"imgs/{b} sample_{i}.png {i} {label} 2 1.5 14 7\n")
      rows[(b, i)] = (image, label)
    order = rng.permutation(len(lines))                        # rows need not be in order
    with open(os.path.join(folder, "metadata", f"{b}.npy"), "w") as f:
      f.writelines(lines[j] for j in order)
  return rows


def release_dir(manual, resolution=32, difficulty="curv_contour_length_14"):
  return os.path.join(str(manual), "lra_release", f"pathfinder{resolution}", difficulty)


def write_release_tarball(path, folder, relpath):
  with tarfile.open(path, "w:gz") as tar:
    tar.add(folder, arcname=f"lra_release/{relpath}")
    info = tarfile.TarInfo("lra_release/listops-1000/basic_test.tsv")
    data = b"Source\tTarget\n"
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def expected_splits(rows):
  """The documented rule: rows by (batch, index), permuted with SPLIT_SEED, cut 80/10/10, then
  empty images dropped."""
  keys = sorted(rows)
  perm = np.random.default_rng(pathfinder.SPLIT_SEED).permutation(len(keys))
  n = len(keys)
  parts = {"train": perm[:n * 8 // 10], "validation": perm[n * 8 // 10:n * 9 // 10],
           "test": perm[n * 9 // 10:]}
  return {s: [rows[keys[j]] for j in idx if rows[keys[j]][0].any()] for s, idx in parts.items()}


def _cfg(tmp_path, module=pathfinder, **kw):
  cfg = (pathfinder_config.data_config("pathx", 128) if module is pathx
         else pathfinder_config.data_config())
  return task_helpers.local_data(cfg, tmp_path, kw)


def check_dataset(cfg, rows, module=pathfinder):
  res = int(cfg.resolution)
  want = expected_splits(rows)
  assert [len(want[s]) for s in want] == [15, 2, 2]  # 16/2/2 of 20, one empty image dropped
  for split, examples in want.items():
    src = module.get_source(cfg, split)
    assert len(src) == len(examples)
    for i, (image, label) in enumerate(examples):
      ex = src[i]
      assert ex["inputs"].shape == (res * res,) and ex["inputs"].dtype == np.int32
      np.testing.assert_array_equal(ex["inputs"], image.reshape(-1).astype(np.int32) + 1)
      assert int(ex["targets"]) == label
      assert ex["inputs"].min() == 1  # black pixels are id 1, not padding


# ----------------------------------------------------------------------------------------------


def test_release_folder(tmp_path, capfd, monkeypatch):
  rows = write_release(release_dir(tmp_path / "manual"))
  cfg = _cfg(tmp_path)
  before = pathfinder_task.TASK.status(cfg)
  assert not before.ready and release_dir(tmp_path / "manual") in before.detail
  pathfinder_task.TASK.prepare(cfg)
  err = capfd.readouterr().err
  assert "pathfinder: reading images" in err and "20/20" in err
  assert "dropped 1 empty (all-zero) image(s)" in err
  after = pathfinder_task.TASK.status(cfg)
  assert after.ready and "release32_hard" in after.detail
  check_dataset(cfg, rows)
  batch = pathfinder.get_source(cfg, "train").__getitems__([3, 1])
  np.testing.assert_array_equal(batch[1]["inputs"],
                                pathfinder.get_source(cfg, "train")[1]["inputs"])
  cfg.max_length = 100
  with pytest.raises(ValueError, match="max_length=1024"):
    pathfinder.get_source(cfg, "test")


def test_extracted_from_lra_release_gz(tmp_path):
  rows = write_release(str(tmp_path / "src"))
  os.makedirs(tmp_path / "manual")
  tarball = str(tmp_path / "manual" / "lra_release.gz")
  write_release_tarball(tarball, str(tmp_path / "src"), "pathfinder32/curv_contour_length_14")
  cfg = _cfg(tmp_path)
  status = pathfinder_task.TASK.status(cfg)
  assert not status.ready and "input files are in place" in status.detail
  check_dataset(cfg, rows)
  assert os.path.isdir(release_dir(tmp_path / "manual"))
  assert not os.path.exists(os.path.join(str(tmp_path / "manual"), "lra_release", "listops-1000"))


def test_truncated_lra_release_leaves_nothing(tmp_path):
  write_release(str(tmp_path / "src"))
  cfg = _cfg(tmp_path)
  task_helpers.check_truncated_archive(
      pathfinder_task.TASK, cfg, str(tmp_path / "manual" / "lra_release.gz"),
      lambda path: write_release_tarball(path, str(tmp_path / "src"),
                                         "pathfinder32/curv_contour_length_14"),
      match="truncated or corrupt", keep=2 / 3)
  assert not os.path.exists(release_dir(tmp_path / "manual"))
  assert not os.path.exists(os.path.join(cfg.data_dir, "lra_pathfinder", "release32_hard",
                                         "1.0.0"))


def test_missing_release_names_url_file_and_directory(tmp_path):
  cfg = _cfg(tmp_path)
  status = pathfinder_task.TASK.status(cfg)
  assert not status.ready and archives.LRA_RELEASE.url in status.detail
  msg = task_helpers.missing_data_message(pathfinder_task.TASK, cfg, "dev")
  for part in (archives.LRA_RELEASE.url, "lra_release.gz", str(tmp_path / "manual"),
               "pathfinder32/curv_contour_length_14", "data.generate=True"):
    assert part in msg
  xcfg = _cfg(tmp_path, pathx)
  with pytest.raises(archives.DataMissingError, match="pathfinder128/curv_contour_length_14"):
    pathx.get_source(xcfg, "train")
  with pytest.raises(ValueError, match="valid: easy, intermediate, hard"):
    pathfinder_task.TASK.status(_cfg(tmp_path, difficulty="medium"))


def test_difficulty_picks_the_folder(tmp_path):
  rows = write_release(release_dir(tmp_path / "manual", difficulty="curv_baseline"), seed=3)
  cfg = _cfg(tmp_path, difficulty="easy")
  check_dataset(cfg, rows)
  assert "release32_easy" in pathfinder_task.TASK.status(cfg).detail


def test_bad_images_and_metadata_name_the_file(tmp_path):
  folder = release_dir(tmp_path / "manual")
  write_release(folder)
  bad = os.path.join(folder, "imgs", "2", "sample_4.png")
  png.write(bad, np.ones((16, 32), np.uint8))
  with pytest.raises(ValueError, match=r"sample_4.png is 32x16 pixels .*data.resolution is 32"):
    pathfinder_task.TASK.prepare(_cfg(tmp_path))
  with open(bad, "wb") as f:
    f.write(b"\x89PNG\r\n\x1a\nbroken")
  with pytest.raises(archives.CorruptArchiveError, match="sample_4.png"):
    pathfinder_task.TASK.prepare(_cfg(tmp_path))
  os.remove(bad)
  with pytest.raises(archives.CorruptArchiveError, match="sample_4.png is listed"):
    pathfinder_task.TASK.prepare(_cfg(tmp_path))
  with open(os.path.join(folder, "metadata", "2.npy"), "a") as f:
    f.write("imgs/2 sample_11.png 11 7 0\n")
  with pytest.raises(archives.CorruptArchiveError, match=r"2.npy:11: label 7"):
    pathfinder_task.TASK.prepare(_cfg(tmp_path))
  assert not pathfinder_task.TASK.status(_cfg(tmp_path)).ready


def test_generate_writes_the_release_layout_then_builds(tmp_path, monkeypatch):
  calls = []

  def write_dataset(output_dir, *, resolution=32, num_images, seed=0, contour_length=14):
    calls.append((resolution, num_images, seed, contour_length))
    assert not os.path.exists(os.path.join(str(tmp_path / "data"), "generated",
                                           "generated32_intermediate_n20_seed5"))
    rows.update(write_release(output_dir, resolution=resolution, seed=seed))

  rows = {}
  fake = types.ModuleType("lra.data.pathfinder_generator")
  fake.write_dataset = write_dataset
  monkeypatch.setitem(sys.modules, "lra.data.pathfinder_generator", fake)
  monkeypatch.setattr(lra.data, "pathfinder_generator", fake, raising=False)
  cfg = _cfg(tmp_path, generate=True, num_generated=20, generator_seed=5,
             difficulty="intermediate")
  assert "generated32_intermediate_n20_seed5" in pathfinder_task.TASK.status(cfg).detail
  pathfinder_task.TASK.prepare(cfg)
  check_dataset(cfg, rows)
  assert calls == [(32, 20, 5, 9)]
  assert os.path.isdir(os.path.join(cfg.data_dir, "generated",
                                    "generated32_intermediate_n20_seed5", "imgs"))
  assert pathfinder_task.TASK.status(cfg).ready
  pathfinder.get_source(cfg, "test")
  assert len(calls) == 1  # built once


def test_real_generator(tmp_path):
  cfg = _cfg(tmp_path, generate=True, num_generated=20, generator_seed=1)
  src = {s: pathfinder.get_source(cfg, s) for s in ("train", "validation", "test")}
  assert sum(len(s) for s in src.values()) <= 20 and len(src["train"]) >= 14
  ex = src["train"][0]
  assert ex["inputs"].shape == (1024,) and ex["inputs"].min() >= 1
  labels = [int(s[i]["targets"]) for s in src.values() for i in range(len(s))]
  assert set(labels) <= {0, 1}


def test_configs_and_max_length_follows_resolution():
  base = pathfinder_config.get_config("size=base")
  m = base.model
  assert (m.num_layers, m.emb_dim, m.num_heads, m.qkv_dim, m.mlp_dim) == (4, 32, 4, 16, 32)
  assert (m.dropout, m.pos_emb, m.pool, base.batch_size) == (0.2, "sinusoidal", "mean", 512)
  assert (base.learning_rate, base.warmup_steps, base.num_train_steps, base.weight_decay) == \
      (1e-3, 312, 62_400, 0.0)
  assert base.data.max_length == 1024 and not base.data.generate
  assert pathfinder_config.get_config("size=small").data.generate
  x = pathx_config.get_config("size=base")
  m = x.model
  assert (m.num_layers, m.emb_dim, m.num_heads, m.qkv_dim, m.mlp_dim) == (1, 32, 2, 16, 32)
  assert (m.dropout, m.pos_emb, m.pool, x.batch_size, x.grad_clip) == \
      (0.1, "learned", "mean", 64, 1.0)
  assert (x.learning_rate, x.warmup_steps, x.num_train_steps) == (1e-3, 2500, 500_000)
  assert x.data.max_length == 16384 and x.model.attention.kind == "band"
  x.data.resolution = 16
  assert x.data.max_length == 256
  runs = []
  pathx_config.sweep(lambda **kw: runs.append(kw))
  assert not any("dot_product" in r["config_arg"] for r in runs) and runs
  small = pathx_config.get_config("size=small")
  assert small.data.generate and small.data.resolution == 128
  for module in (pathfinder_config, pathx_config):
    assert f"lra run {module.__name__.split('.')[-1]}" in module.__doc__


def _tiny(c, data_cfg):
  for key in ("data_dir", "manual_dir", "download", "generate", "resolution"):
    c.data[key] = data_cfg[key]
  return task_helpers.tiny(c, kind="band", window=4, num_layers=1)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["pathfinder", "pathx"])
def test_two_training_steps(task, tmp_path):
  module, config = {"pathfinder": (pathfinder, pathfinder_config),
                    "pathx": (pathx, pathx_config)}[task]
  resolution = 32 if task == "pathfinder" else 16  # Path-X at a fixture resolution
  write_release(release_dir(tmp_path / "manual", resolution), resolution=resolution)
  data_cfg = _cfg(tmp_path, module, resolution=resolution)
  c = _tiny(config.get_config("size=small"), data_cfg)
  assert c.data.max_length == resolution ** 2
  results = task_helpers.train_two_steps(c, str(tmp_path / "work"))
  assert results["task"] == task and results["test_examples"] == 2
