"""Test code shared by the task tests (text, retrieval, image, pathfinder, charlm) and the archive
fault tests: data settings in a test folder, tiny archives written in the published formats
(aclImdb, CIFAR-10 python, the LRA release), the status and error checks of a task's data, a tiny
model for two training steps (and `override`, which train_test uses too), and the checks every
task config passes.

The test files import it as `import task_helpers`: pytest puts this folder (which has no
`__init__.py`) on sys.path to import the test files and conftest.py, so it is found there too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import struct
import tarfile
from typing import Any, Callable, Iterator, Mapping

import ml_collections
import numpy as np
import pytest

from configs import common
from lra import metrics, tasks, train
from lra.data import archives
from lra.data.builders import Status
from lra.tasks.base import Task


# ----------------------------------------------------------------------------------------------
# Tiny archives in the published formats.


@contextlib.contextmanager
def unpublished(module, name: str) -> Iterator[archives.Archive]:
  """While inside, `module.<name>` (an Archive) has no published SHA-256, so the tiny test
  archive written under its file name is accepted. Yields the Archive as published."""
  archive = getattr(module, name)
  setattr(module, name, dataclasses.replace(archive, sha256=None))
  try:
    yield archive
  finally:
    setattr(module, name, archive)


def add_member(tar: tarfile.TarFile, name: str, data: bytes | None = None) -> None:
  """Adds a regular file `name` holding `data` to `tar`, or a directory when data is None."""
  info = tarfile.TarInfo(name)
  if data is None:
    info.type = tarfile.DIRTYPE
    tar.addfile(info)
  else:
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path: str, members: Mapping[str, bytes | None]) -> None:
  """A tar.gz of `members` (name -> contents, None for a directory), in that order."""
  with tarfile.open(path, "w:gz") as tar:
    for name, data in members.items():
      add_member(tar, name, data)


def write_imdb(path: str, reviews: Mapping[tuple, bytes], extra: Mapping[str, bytes] = ()
               ) -> None:
  """aclImdb_v1.tar.gz: directories, then `reviews` {(split, pos|neg, id, rating): bytes} as
  aclImdb/<split>/<pos|neg>/<id>_<rating>.txt, then the `extra` members."""
  dirs = sorted({"aclImdb"} | {f"aclImdb/{s}" for s in ("train", "test")} |
                {f"aclImdb/{s}/{f}" for s in ("train", "test") for f in ("pos", "neg")} |
                {"aclImdb/train/unsup"})
  members = dict.fromkeys(dirs)
  members.update({f"aclImdb/{s}/{f}/{i}_{r}.txt": data for (s, f, i, r), data in reviews.items()})
  members.update(dict(extra))
  write_tar(path, members)


def _py2(obj) -> bytes:
  """`obj` pickled the way Python 2 cPickle (protocol 2) wrote the CIFAR-10 batches: str as
  SHORT_BINSTRING/BINSTRING, numpy arrays through numpy.core.multiarray._reconstruct."""
  if isinstance(obj, bytes):
    if len(obj) < 256:
      return b"U" + bytes([len(obj)]) + obj
    return b"T" + struct.pack("<i", len(obj)) + obj
  if isinstance(obj, bool):
    return b"\x88" if obj else b"\x89"
  if isinstance(obj, int):
    if 0 <= obj < 256:
      return b"K" + bytes([obj])
    return b"J" + struct.pack("<i", obj)
  if obj is None:
    return b"N"
  if isinstance(obj, tuple):
    return b"(" + b"".join(_py2(x) for x in obj) + b"t"
  if isinstance(obj, list):
    return b"](" + b"".join(_py2(x) for x in obj) + b"e"
  if isinstance(obj, dict):
    return b"}(" + b"".join(_py2(k) + _py2(v) for k, v in obj.items()) + b"u"
  if isinstance(obj, np.ndarray):
    assert obj.dtype == np.uint8
    dtype = (b"cnumpy\ndtype\n" + _py2((b"u1", 0, 1)) + b"R"
             + _py2((3, b"|", None, None, None, -1, -1, 0)) + b"b")
    # _reconstruct(ndarray, (0,), 'b'), then BUILD with (1, shape, dtype, False, raw bytes)
    return (b"cnumpy.core.multiarray\n_reconstruct\n(cnumpy\nndarray\n" + _py2((0,))
            + _py2(b"b") + b"tR(" + _py2(1) + _py2(tuple(obj.shape)) + dtype + _py2(False)
            + _py2(obj.tobytes()) + b"tb")
  raise TypeError(type(obj))


def py2_pickle(obj) -> bytes:
  return b"\x80\x02" + _py2(obj) + b"."


def write_cifar(path: str, *, seed: int = 0, test_batch: bytes | None = None,
                per_batch: int = 4) -> dict:
  """A cifar-10-python.tar.gz with `per_batch` images per batch; returns {batch: (rgb, labels)}
  with rgb uint8 [N, 32, 32, 3]. Image 0 of data_batch_1 is black, image 1 white."""
  rng = np.random.default_rng(seed)
  content = {}
  with tarfile.open(path, "w:gz") as tar:
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
      rgb = rng.integers(0, 256, (per_batch, 32, 32, 3), dtype=np.uint8)
      if i == 0:
        rgb[0], rgb[1] = 0, 255
      labels = [int(x) for x in rng.integers(0, 10, per_batch)]
      content[name] = (rgb, np.array(labels))
      data = rgb.transpose(0, 3, 1, 2).reshape(per_batch, 3072)  # R plane, G plane, B plane
      batch = {b"batch_label": f"batch {name}".encode(), b"labels": labels, b"data": data,
               b"filenames": [f"img_{j}.png".encode() for j in range(per_batch)]}
      blob = py2_pickle(batch)
      if name == "test_batch" and test_batch is not None:
        blob = test_batch
      add_member(tar, f"cifar-10-batches-py/{name}", blob)
    meta = {b"num_cases_per_batch": per_batch, b"num_vis": 3072,
            b"label_names": [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog",
                             b"frog", b"horse", b"ship", b"truck"]}
    add_member(tar, "cifar-10-batches-py/batches.meta", py2_pickle(meta))
    add_member(tar, "cifar-10-batches-py/readme.html", b"<html></html>")
  return content


# ----------------------------------------------------------------------------------------------
# Data: settings, status, missing and damaged inputs.


def local_data(cfg: ml_collections.ConfigDict, root: pathlib.Path,
               overrides: Mapping[str, Any] = ()) -> ml_collections.ConfigDict:
  """A task's data settings `cfg` with the dataset in root/data, the original files in
  root/manual, no download, and `overrides` applied; returns `cfg`."""
  cfg.data_dir = str(root / "data")
  cfg.manual_dir = str(root / "manual")
  cfg.download = False
  cfg.update(dict(overrides))
  return cfg


def prepare_with_status(task: Task, cfg: ml_collections.ConfigDict) -> tuple[Status, str]:
  """(the status before preparing, the dataset folder) of preparing `task` for cfg."""
  before = task.status(cfg)
  return before, task.prepare(cfg)


def check_status(task: Task, cfg: ml_collections.ConfigDict, before: Status, folder: str, *,
                 missing_cfg: ml_collections.ConfigDict, url: str) -> None:
  """Before preparing, the status said the inputs were in place; after, ready in `folder`; with
  no inputs (`missing_cfg`) it is not ready and names the address to get them from."""
  assert not before.ready and "the input files are in place" in before.detail
  after = task.status(cfg)
  assert after.ready and after.detail == folder and os.path.isdir(folder)
  missing = task.status(missing_cfg)
  assert not missing.ready and url in missing.detail


def missing_data_message(task: Task, cfg: ml_collections.ConfigDict, bad_split: str) -> str:
  """The DataMissingError message of reading `train` with no input in place; also checks that
  the unknown split `bad_split` is refused with the valid split names."""
  with pytest.raises(archives.DataMissingError) as err:
    task.get_source(cfg, "train")
  with pytest.raises(ValueError, match="valid splits: train, validation, test"):
    task.get_source(cfg, bad_split)
  return str(err.value)


def truncate(path: str, keep: float = 0.5) -> None:
  """Cuts the file at `path` to its first `keep` share (a download that stopped midway)."""
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[:int(len(data) * keep)])


def assert_nothing_built(task: Task, cfg: ml_collections.ConfigDict) -> None:
  """After a failed build: the task is not ready and no dataset folder (finished or temporary,
  both ending in the version) was left under cfg.data_dir."""
  assert not task.status(cfg).ready
  assert not [d for d, _, _ in os.walk(cfg.data_dir) if d.endswith("1.0.0")]


def check_truncated_archive(task: Task, cfg: ml_collections.ConfigDict, path: str,
                            write: Callable[[str], object], *, match: str,
                            keep: float = 0.5) -> None:
  """An archive written by `write(path)` and then truncated: preparing raises
  CorruptArchiveError matching `match`, and leaves no dataset."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  write(path)
  truncate(path, keep)
  with pytest.raises(archives.CorruptArchiveError, match=match):
    task.prepare(cfg)
  assert_nothing_built(task, cfg)


# ----------------------------------------------------------------------------------------------
# The Task object, training and configs.


def check_task(module, family: type, num_classes: int, vocab_size: int) -> None:
  """The task registered as `module.NAME` is `module.TASK`, exactly a `family`, with these
  sizes and padding id 0."""
  task = tasks.get_task(module.NAME)
  assert task is module.TASK and type(task) is family
  assert (task.name, task.num_classes, task.vocab_size, task.pad_id) == \
      (module.NAME, num_classes, vocab_size, 0)



def short_run(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Config `c` trained 2 steps of batch 8, with no evaluation or checkpoint before the end and
  no progress bar; returns `c`."""
  c.batch_size, c.eval_batch_size = 8, 8
  c.num_train_steps, c.warmup_steps = 2, 1
  c.log_every, c.eval_every, c.checkpoint_every = 1, 100, 100
  c.progress = False
  return c


def override(c: ml_collections.ConfigDict, overrides: Mapping[str, Any]
             ) -> ml_collections.ConfigDict:
  """Config `c` with each dotted key of `overrides` ("model.num_layers") set; returns `c`."""
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def tiny(c: ml_collections.ConfigDict, *, kind: str = "dot_product", window: int = 4,
         num_layers: int | None = None) -> ml_collections.ConfigDict:
  """Config `c` with a tiny model (width 16, 2 heads; `num_layers` when given) of attention
  `kind`, as a `short_run`; returns `c`."""
  c.model.emb_dim, c.model.qkv_dim, c.model.mlp_dim, c.model.classifier_dim = 16, 16, 32, 16
  c.model.num_heads = 2
  if num_layers is not None:
    c.model.num_layers = num_layers
  c.model.attention = dict(kind=kind, **common.attention_defaults(
      kind, window=window, max_length=int(c.data.max_length)))
  return short_run(c)


def train_two_steps(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains the tiny config `c` in `workdir`: the train step is traced once, 2 steps are taken
  with finite losses and the test loss is finite. Returns the results."""
  results = train.train_and_evaluate(c, workdir)
  assert results["train_step_traces"] == 1 and int(results["state"]["step"]) == 2
  losses = [r["loss"] for r in metrics.read_metrics(workdir) if r["split"] == "train"]
  assert len(losses) == 2 and np.all(np.isfinite(losses))
  assert np.isfinite(results["test_loss"])
  return results


def two_training_steps(module, data: ml_collections.ConfigDict, workdir: str, **tiny_kw
                       ) -> dict:
  """`train_two_steps` of `module`'s `size=small` config on `data`, made `tiny(**tiny_kw)`."""
  c = module.get_config("size=small")
  c.data = data
  return train_two_steps(tiny(c, **tiny_kw), workdir)


def settings(c: ml_collections.ConfigDict, keys) -> dict[str, Any]:
  """{dotted key: its value in config c} for each of `keys` ("model.num_layers")."""
  out = {}
  for key in keys:
    node = c
    for part in key.split("."):
      node = node[part]
    out[key] = node
  return out


def check_config_module(module, task: str, base_settings: Mapping[str, Any], *, bad_arg: str,
                        error: str) -> list[dict]:
  """The checks of a task's config file: `size=base` has `base_settings` (dotted keys), and
  `size=small` is shorter and narrower, the band window reaches the attention record, `bad_arg`
  raises ValueError matching `error`, the sweep adds runs, all at `size=base`, and the docstring
  gives the `lra run` command. Returns the sweep's runs."""
  base = module.get_config("size=base")
  assert settings(base, base_settings) == dict(base_settings)
  small = module.get_config("size=small,attention=band,window=8")
  assert small.data.max_length < base.data.max_length
  assert small.model.emb_dim < base.model.emb_dim
  assert small.model.attention.window == 8 and small.task == task
  with pytest.raises(ValueError, match=error):
    module.get_config(bad_arg)
  runs = []
  module.sweep(lambda **kw: runs.append(kw))
  assert runs and all("size=base" in r["config_arg"] for r in runs)
  assert f"lra run {task}" in module.__doc__
  return runs
