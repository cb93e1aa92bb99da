"""Tests for lra.data.image, lra.tasks.image and configs/image.py: a CIFAR-10 python archive in the
original format (Python 2 pickles in a tar.gz), the LRA grayscale formula, splits, ids (black = 1,
not padding), missing/corrupt archive errors, the restricted unpickler, and two training steps."""

import os
import pickle

import jax
import numpy as np
import pytest

import task_helpers
from configs import image as image_config
from lra.data import archives, image
from lra.tasks import image as image_task
from task_helpers import py2_pickle

jax.config.update("jax_disable_most_optimizations", True)

PER_BATCH = 4  # images per fixture batch: 20 training images -> 18 train, 2 validation


def write_cifar(path, *, seed=0, test_batch=None):
  """A cifar-10-python.tar.gz (Python 2 pickles, task_helpers.write_cifar) with PER_BATCH images
  per batch; returns {batch: (rgb, labels)}."""
  return task_helpers.write_cifar(path, seed=seed, test_batch=test_batch, per_batch=PER_BATCH)


def reference_gray(rgb):
  """The TF formula in float64: (gray value, mask of values within 1e-4 of an integer, where
  float32 rounding may land on either side)."""
  v = rgb.astype(np.float64) / 255.0 @ np.array([0.2989, 0.5870, 0.1140]) * 255.5
  near = np.abs(v - np.rint(v)) < 1e-4
  return np.floor(np.clip(v, 0, 255)).astype(np.int64), near


def assert_gray(got, rgb):
  want, near = reference_gray(rgb)
  diff = np.asarray(got, np.int64) - want
  assert np.all(diff[~near] == 0)
  assert np.all(np.abs(diff[near]) <= 1)


def _cfg(tmp_path, **kw):
  return task_helpers.local_data(image_config.get_config("size=base").data, tmp_path, kw)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  root = tmp_path_factory.mktemp("image")
  os.makedirs(root / "manual")
  content = write_cifar(str(root / "manual" / image.CIFAR10.filename))
  cfg = _cfg(root)
  before, _ = task_helpers.prepare_with_status(image_task.TASK, cfg)
  return cfg, content, before


# ----------------------------------------------------------------------------------------------


def test_grayscale_is_the_tf_formula_for_every_colour():
  v = np.arange(256, dtype=np.uint8)
  rgb = np.stack(np.meshgrid(v, v, v, indexing="ij"), -1).reshape(-1, 3)  # [2^24, 3]
  got = image.rgb_to_grayscale(rgb)
  assert got.dtype == np.uint8
  assert_gray(got, rgb)
  want, _ = reference_gray(rgb)
  # float32 rounding moves a few colours that sit exactly on an integer boundary, no more.
  assert 0 < np.count_nonzero(got != want) < 1000
  assert image.rgb_to_grayscale(np.array([255, 255, 255], np.uint8)) == 255  # 0.9999 * 255.5
  assert image.rgb_to_grayscale(np.array([255, 0, 0], np.uint8)) == 76      # 0.2989 * 255.5


def test_dataset_from_the_archive(prepared):
  cfg, content, before = prepared
  assert not before.ready and "prepare image" in before.detail
  after = image_task.TASK.status(cfg)
  assert after.ready and after.detail.startswith(cfg.data_dir)
  src = {s: image.get_source(cfg, s) for s in ("train", "validation", "test")}
  assert [len(src[s]) for s in src] == [18, 2, PER_BATCH]
  rgb = np.concatenate([content[f"data_batch_{k}"][0] for k in range(1, 6)])
  labels = np.concatenate([content[f"data_batch_{k}"][1] for k in range(1, 6)])
  expected = {"train": (rgb[:18], labels[:18]), "validation": (rgb[18:], labels[18:]),
              "test": content["test_batch"]}
  for split, (images, targets) in expected.items():
    for i in range(len(targets)):
      ex = src[split][i]
      assert ex["inputs"].shape == (1024,) and ex["inputs"].dtype == np.int32
      assert int(ex["targets"]) == targets[i]
      assert ex["inputs"].min() >= 1  # no padding: every pixel is data
      assert_gray(ex["inputs"] - 1, images[i].reshape(1024, 3))  # row-major, id = gray + 1
  black, white = src["train"][0]["inputs"], src["train"][1]["inputs"]
  assert np.all(black == 1) and np.all(white == 256)
  batch = src["test"].__getitems__([2, 0])
  np.testing.assert_array_equal(batch[0]["inputs"], src["test"][2]["inputs"])
  cfg2 = cfg.copy_and_resolve_references()
  cfg2.max_length = 512
  with pytest.raises(ValueError, match="max_length=1024"):
    image.get_source(cfg2, "train")


def test_missing_archive_names_url_file_and_directory(tmp_path):
  cfg = _cfg(tmp_path)
  status = image_task.TASK.status(cfg)
  assert not status.ready and image.CIFAR10.url in status.detail
  msg = task_helpers.missing_data_message(image_task.TASK, cfg, "val")
  assert image.CIFAR10.url in msg and "cifar-10-python.tar.gz" in msg
  assert os.path.join(str(tmp_path), "manual") in msg


def test_truncated_archive_leaves_no_dataset(tmp_path):
  cfg = _cfg(tmp_path)
  task_helpers.check_truncated_archive(
      image_task.TASK, cfg, os.path.join(cfg.manual_dir, image.CIFAR10.filename), write_cifar,
      match="truncated or corrupt")
  assert not os.path.exists(os.path.join(cfg.data_dir, "lra_image", "grayscale", "1.0.0"))


def test_pickle_with_other_globals_is_refused(tmp_path):
  class Evil:
    def __reduce__(self):
      return (os.system, ("echo pwned",))
  os.makedirs(tmp_path / "manual")
  write_cifar(str(tmp_path / "manual" / image.CIFAR10.filename),
              test_batch=pickle.dumps({b"data": Evil()}, protocol=2))
  cfg = _cfg(tmp_path)
  with pytest.raises(archives.CorruptArchiveError, match="refusing to load the global"):
    image_task.TASK.prepare(cfg)
  task_helpers.assert_nothing_built(image_task.TASK, cfg)
  with pytest.raises(pickle.UnpicklingError):
    image.load_pickle(pickle.dumps(Evil(), protocol=4))
  # numpy arrays pickled by numpy 2 (numpy._core) load too.
  arr = np.arange(6, dtype=np.uint8).reshape(2, 3)
  np.testing.assert_array_equal(image.load_pickle(pickle.dumps(arr, protocol=4)), arr)


def test_wrong_batch_structure_is_reported(tmp_path):
  os.makedirs(tmp_path / "manual")
  write_cifar(str(tmp_path / "manual" / image.CIFAR10.filename),
              test_batch=py2_pickle({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
  with pytest.raises(archives.CorruptArchiveError, match=r"uint8 \[N, 3072\]"):
    image_task.TASK.prepare(_cfg(tmp_path))


def test_configs():
  base = image_config.get_config("size=base")
  m = base.model
  assert (m.num_layers, m.emb_dim, m.num_heads, m.qkv_dim, m.mlp_dim) == (1, 128, 8, 64, 128)
  assert (m.dropout, m.pos_emb, m.pool) == (0.3, "learned", "cls")
  assert (base.batch_size, base.learning_rate, base.schedule, base.warmup_steps) == \
      (256, 5e-4, "cosine", 175)
  assert (base.weight_decay, base.num_train_steps, base.eval_every) == (0.0, 35_000, 175)
  assert base.data.max_length == 1024 and base.task == "image"
  band = image_config.get_config("size=small,attention=band,window=9")
  assert band.model.attention.window == 9 and band.batch_size % 8 == 0
  runs = []
  image_config.sweep(lambda **kw: runs.append(kw))
  assert len(runs) == 3 * len({r["config_arg"] for r in runs})
  assert "lra run image" in image_config.__doc__


@pytest.mark.slow
def test_two_training_steps(prepared, tmp_path):
  assert prepared[0].max_length == 1024
  results = task_helpers.two_training_steps(image_config, prepared[0], str(tmp_path),
                                            kind="band", window=8)
  assert results["test_examples"] == PER_BATCH
